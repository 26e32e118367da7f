"""A read-only view of the GraphDef the graph pass hands over, shaped like the parts of ``tf.Graph`` the pass uses.

The pass hands over the graph TensorFlow will run with every node's output types and inferred shapes, from the
runtime's own op registry (``cc/pass/graph_pass.cc``), as *output records* beside the GraphDef: per node in the
GraphDef's order, its number of outputs, then per output its dtype, its rank (-1: unknown) and that many sizes (-1:
unknown), all native 64-bit integers. This view reads them, so the graph never has to be re-imported through
Python's op registry, which rejects some graphs Grappler legitimately produces (bfloat16 ``_FusedConv2D`` under
oneDNN) and costs time on large steps.

``GraphView.get_operations()``, ``OpView`` (``name``, ``type``, ``device``, ``inputs``, ``outputs``,
``control_inputs``, ``get_attr``) and ``TensorView`` (``name``, ``op``, ``value_index``, ``dtype``, ``shape``,
``consumers()``) behave like their ``tf`` counterparts for reading.
"""
from __future__ import annotations

import array
import functools
import hashlib
import math

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from dymem_tf import compat


class TensorView:
    """Output ``value_index`` of ``op``. ``dims`` is the static shape as a tuple (None for an unknown dimension),
    or None for an unknown rank; ``shape`` is the same as a ``tf.TensorShape``, built when first asked for."""

    __slots__ = ("op", "value_index", "dtype", "dims", "name", "_shape")

    def __init__(self, op: "OpView", value_index: int, dtype, dims: tuple | None):
        self.op, self.value_index, self.dtype, self.dims = op, value_index, dtype, dims
        self.name = f"{op.name}:{value_index}"
        self._shape = None

    @property
    def shape(self) -> tf.TensorShape:
        if self._shape is None:
            self._shape = tf.TensorShape(self.dims)
        return self._shape

    @property
    def device(self) -> str:
        return self.op.device

    def consumers(self) -> list["OpView"]:
        """Ops that read this tensor as a data input."""
        return [c for c in self.op.graph.consumers_of(self.name)]

    def __repr__(self) -> str:
        return f"<TensorView {self.name} {self.dtype.name} {self.shape}>"


#: Prefixes oneDNN's layout pass (``POST_PARTITIONING``) gives the ops it takes over: ``_MklNativeConv2D`` is a
#: ``Conv2D`` run by a oneDNN kernel, with the same inputs, outputs and attributes (a max pool adds a workspace).
_ONEDNN_PREFIXES = ("_MklNative", "_Mkl")
#: oneDNN ops that merge two standard ones, by the standard op whose inputs, outputs and cost they share.
_ONEDNN_MERGED = {"Conv2DBackpropFilterWithBias": "Conv2DBackpropFilter",
                  "Conv3DBackpropFilterWithBias": "Conv3DBackpropFilter",
                  "PadWithConv2D": "Conv2D", "PadWithFusedConv2D": "_FusedConv2D"}
#: oneDNN pooling ops whose output 1 is the workspace their gradient reads: one byte per element of output 0 (the
#: index of each window's maximum), which shape inference leaves unknown.
_ONEDNN_WORKSPACE_OPS = frozenset({"_MklNativeMaxPool", "_MklNativeMaxPool3D"})


@functools.lru_cache(maxsize=None)
def standard_op_type(op_type: str) -> str:
    """The standard op a oneDNN op stands for (``_MklNativeFusedConv2D`` -> ``_FusedConv2D``, ``_MklMatMul`` ->
    ``MatMul``), so that the capture's cost model and op sets read the graph oneDNN rewrote like the one it did
    not; any other type as it is."""
    for prefix in _ONEDNN_PREFIXES:
        if not op_type.startswith(prefix):
            continue
        rest = op_type[len(prefix):]
        if rest in _ONEDNN_MERGED:
            return _ONEDNN_MERGED[rest]
        for candidate in (rest, "_" + rest):
            if compat.registered_op_def(candidate) is not None:
                return candidate
        break
    return op_type


def _with_workspace(node, outputs: list) -> list:
    """``outputs`` with a oneDNN pool's workspace (:data:`_ONEDNN_WORKSPACE_OPS`) sized from output 0: rank 2,
    leading with output 0's batch dimension, so that a batch size given later sizes it too."""
    if node.op not in _ONEDNN_WORKSPACE_OPS or len(outputs) < 2 or outputs[1][1] is not None:
        return outputs
    dims = outputs[0][1]
    if dims is None or len(dims) < 2 or any(d is None for d in dims[1:]):
        return outputs
    return [outputs[0], (outputs[1][0], (dims[0], math.prod(dims[1:])))] + outputs[2:]


class OpView:
    """One node of the GraphDef; ``outputs`` as ``(dtype, dims)`` pairs (see :class:`TensorView`). ``type`` is the
    standard op's (:func:`standard_op_type`), ``node_def.op`` the node's own."""

    def __init__(self, graph: "GraphView", node, outputs: list):
        self.graph, self.node_def = graph, node
        self.name, self.type, self.device = node.name, standard_op_type(node.op), node.device
        outputs = _with_workspace(node, outputs)
        self.outputs = [TensorView(self, k, dt, dims) for k, (dt, dims) in enumerate(outputs)]
        #: data inputs, in order, and the ops this op waits for through control edges (set by the graph once
        #: every op exists)
        self.inputs: list[TensorView] = []
        self.control_inputs: list[OpView] = []

    def _link(self, by_name: dict) -> None:
        """Resolve the node's input strings into the graph's tensors and ops (``by_name``: the graph's ops)."""
        for i in self.node_def.input:
            if i[0] == "^":
                self.control_inputs.append(by_name[i[1:]])
            else:
                name, _, port = i.partition(":")
                try:
                    self.inputs.append(by_name[name].outputs[int(port) if port else 0])
                except (KeyError, IndexError):
                    raise KeyError(f"the graph has no tensor {_tensor_name(i)!r}") from None

    def get_attr(self, name: str):
        """The attribute's value, as ``tf.Operation.get_attr`` returns it for scalars and types."""
        if name not in self.node_def.attr:
            raise ValueError(f"operation {self.name!r} has no attr named {name!r}")
        value = self.node_def.attr[name]
        kind = value.WhichOneof("value")
        if kind == "type":
            return tf.dtypes.as_dtype(value.type)
        if kind == "list":
            return list(value.list.i or value.list.f or value.list.s or value.list.b
                        or [tf.dtypes.as_dtype(t) for t in value.list.type])
        return getattr(value, kind) if kind else None

    def __repr__(self) -> str:
        return f"<OpView {self.name} ({self.type})>"


#: Attributes that differ between two instantiations of one function and mean nothing to the pass (the name a
#: ``_Arg`` was traced with); the nodes' ``experimental_debug_info`` (the function each was inlined from) differs too.
INSTANCE_ATTRS = ("_user_specified_name",)


def parse(data: bytes) -> graph_pb2.GraphDef:
    """The GraphDef serialized in ``data``."""
    return graph_pb2.GraphDef.FromString(data)


def fingerprint(graph_def: graph_pb2.GraphDef, outputs: bytes = b"") -> bytes:
    """A digest equal for two instantiations of the same step, with their output records ``outputs``, whatever
    the order of their nodes (TensorFlow may list the nodes of two traces of one step in different orders);
    :data:`INSTANCE_ATTRS` and the debug information are cleared in ``graph_def``, which is otherwise unchanged."""
    for node in graph_def.node:
        node.ClearField("experimental_debug_info")
        for name in INSTANCE_ATTRS:
            if name in node.attr:
                del node.attr[name]
    nodes = list(graph_def.node)
    records = _records(graph_def, outputs) if outputs else [()] * len(nodes)
    names = [node.name for node in nodes]
    parts = []
    for i in sorted(range(len(nodes)), key=names.__getitem__):  # by name: a GraphDef's names are unique
        name, data = names[i].encode(), nodes[i].SerializeToString(deterministic=True)
        parts.append(b"%d:%s%d:%s%s" % (len(name), name, len(data), data, repr(records[i]).encode()))
    parts.append(graph_def.library.SerializeToString(deterministic=True))
    return hashlib.sha256(b"".join(parts)).digest()


class GraphView:
    """All nodes of a GraphDef (or its serialized bytes), in file order, with their output records (see the
    module's docstring)."""

    def __init__(self, data: "bytes | graph_pb2.GraphDef", outputs: bytes):
        self.graph_def = parse(data) if isinstance(data, (bytes, bytearray)) else data
        records = _records(self.graph_def, outputs)
        self._ops = [OpView(self, node, record) for node, record in zip(self.graph_def.node, records)]
        self._by_name = {op.name: op for op in self._ops}
        self._consumers: dict[str, list[OpView]] | None = None
        for op in self._ops:
            op._link(self._by_name)

    def get_operations(self) -> list[OpView]:
        return list(self._ops)

    def op(self, name: str) -> OpView:
        return self._by_name[name]

    def get_operation_by_name(self, name: str) -> OpView:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"the graph has no operation {name!r}") from None

    def get_tensor_by_name(self, name: str) -> TensorView:
        op_name, _, port = name.rpartition(":")
        try:
            return self._by_name[op_name].outputs[int(port)]
        except (KeyError, IndexError, ValueError):
            raise KeyError(f"the graph has no tensor {name!r}") from None

    def consumers_of(self, tensor_name: str) -> list[OpView]:
        """Ops reading ``tensor_name`` as a data input."""
        if self._consumers is None:
            self._consumers = {}
            for op in self._ops:
                for i in op.node_def.input:
                    if not i.startswith("^"):
                        self._consumers.setdefault(_tensor_name(i), []).append(op)
        return self._consumers.get(tensor_name, [])


def _tensor_name(graph_def_input: str) -> str:
    """``"op:k"`` of a GraphDef input string (``"op"`` means output 0)."""
    return graph_def_input if ":" in graph_def_input else f"{graph_def_input}:0"


#: ``(outputs, node count, records)`` of the last :func:`_records`: the pass decodes one graph's records for its
#: cache key (:func:`fingerprint`) and again for its view (:class:`GraphView`), from the same bytes
_last_records: list = [None]


def _records(graph_def, outputs: bytes) -> list[list[tuple]]:
    """Each node's outputs as ``(dtype, dims)`` pairs, decoded from its output records (``dims``: a tuple with
    None for an unknown size, or None for an unknown rank); read-only (the last decoding is shared)."""
    last = _last_records[0]
    if last is not None and last[0] is outputs and last[1] == len(graph_def.node):
        return last[2]
    records = _decode_records(graph_def, outputs)
    _last_records[0] = (outputs, len(graph_def.node), records)
    return records


def _decode_records(graph_def, outputs: bytes) -> list[list[tuple]]:
    """What :func:`_records` returns, decoded."""
    values = array.array("q")
    values.frombytes(outputs)
    values = values.tolist()
    records, at = [], 0
    for _ in range(len(graph_def.node)):
        count, record = values[at], []
        at += 1
        for _ in range(count):
            dtype, rank = values[at], values[at + 1]
            at += 2
            dims = None
            if rank >= 0:
                dims = tuple(d if d >= 0 else None for d in values[at:at + rank])
                at += rank
            record.append((_dtype(dtype), dims))
        records.append(record)
    if at != len(values):
        raise ValueError(f"the output records ({len(values)} values) do not match the graph's "
                         f"{len(graph_def.node)} nodes")
    return records


class RewrittenGraph:
    """The graph TensorFlow runs after a plan was applied: the offered graph (``graph_def_bytes``, ``outputs``) and
    what the plan changed (``changed``: a GraphDef of the nodes it added and, by name and inputs only, of those
    whose inputs it changed; ``changed_outputs``: the added nodes' output records), merged when first read. The
    pass hands over only the change: serializing the whole rewritten graph took a fifth of its time on large
    steps."""

    def __init__(self, graph_def_bytes: bytes, outputs: bytes, changed: bytes, changed_outputs: bytes):
        self.graph_def_bytes, self.outputs = graph_def_bytes, outputs
        self.changed, self.changed_outputs = changed, changed_outputs
        self._view: GraphView | None = None

    def graph_def(self) -> graph_pb2.GraphDef:
        """The rewritten graph: the offered nodes (with their new inputs where the plan changed them), then the
        added ones."""
        graph_def = parse(self.graph_def_bytes)
        by_name = {node.name: node for node in graph_def.node}
        for node in parse(self.changed).node:
            if node.name in by_name:
                del by_name[node.name].input[:]
                by_name[node.name].input.extend(node.input)
            else:
                graph_def.node.add().CopyFrom(node)
        return graph_def

    def view(self) -> GraphView:
        """:meth:`graph_def` as a :class:`GraphView` (made once)."""
        if self._view is None:
            self._view = GraphView(self.graph_def(), self.outputs + self.changed_outputs)
        return self._view


@functools.lru_cache(maxsize=None)
def _dtype(enum: int) -> tf.DType:
    return tf.dtypes.as_dtype(enum)
