"""Convert the ops of a traced train step (a TF FuncGraph) into an analysed :class:`StepGraph`.

Forward ops and the GradientTape's gradient ops sit inline in one FuncGraph. Classification:

* backward: names starting with ``gradient_tape/`` (or containing ``/gradient_tape/``) and every op downstream of
  one (gradient aggregation ``AddN``, optimizer updates ...): ``is_backward=True``, ``phase`` "backward" or
  "update";
* forward: everything else.

Keras layer of an op: the name-scope component after the model's scope, e.g. ``functional_1/conv1_conv/convolution``
and ``gradient_tape/functional_1/conv1_conv/convolution/Conv2DBackpropInput`` both belong to ``conv1_conv``
(TF uniquifies scopes, so a layer traced twice may appear as ``conv1_conv_1``; pass ``layer_names`` to map such
names back to the model's layer names).
"""
from __future__ import annotations

import functools
import math
import re
from collections import Counter
from typing import Iterable, Sequence

import tensorflow as tf

from dymem_tf import op_sets
from dymem_tf.passes import host_memory
from dymem_tf.planning import branches, loop_lists
from dymem_tf.planning.analysis import (ALIAS_OP_TYPES, FORWARDING_OP_TYPES, FRAME_SEPARATOR, METADATA_OP_TYPES,
                                       CycleError, OpInfo, StepGraph, TensorInfo, aliased_input, analyse, descendants,
                                       loop_back_edges, outer_frame)

(_GRAD_PREFIX,) = op_sets.GRADIENT_SCOPES
#: Ops whose outputs alias variable storage (persistent memory): never swapped, counted in persistent bytes.
_VARIABLE_READ_TYPES = frozenset({"ReadVariableOp", "VarHandleOp", "VariableV2"})
#: Ops whose outputs live as long as the function (constants, folded by Grappler or not): never swapped.
_SOURCE_OP_TYPES = frozenset({"Const", "HostConst", "_Arg"})
_HANDLE_DTYPES = frozenset({"resource", "variant"})
_SUFFIX = re.compile(r"_\d+$")


class UnsupportedGraphError(ValueError):
    """The ops do not form a step graph dymem can plan (no ops, or a dependency cycle)."""


def is_gradient_name(name: str) -> bool:
    return name.startswith(_GRAD_PREFIX) or "/" + _GRAD_PREFIX in name


def _strip_gradient(name: str) -> str:
    i = name.find(_GRAD_PREFIX)
    return _without_replica(name[i + len(_GRAD_PREFIX):]) if i >= 0 else name


_DEVICE_KIND = re.compile(r"(?:^|/)(?:device:)?([A-Za-z_]+):\d+$")
#: dtypes TensorFlow keeps in host memory on accelerator devices (its GPU kernels register int32 as HostMemory).
HOST_MEMORY_DTYPES_ON_ACCELERATORS = frozenset({"int32"})


@functools.lru_cache(maxsize=256)
def device_kind(device: str) -> str:
    """The device type of a TF device name, upper-case (``"GPU"``); ``"CPU"`` for an unplaced op."""
    match = _DEVICE_KIND.search(device or "")
    return match.group(1).upper() if match else "CPU"


def in_host_memory(device: str, dtype: str, op=None, index: int = 0) -> bool:
    """Whether output ``index`` of ``op``, of ``dtype``, produced on ``device`` lives in host memory (so a swap
    kernel must never see it and it takes no device memory): on an accelerator, int32 tensors, and the outputs the
    op's kernel for that device registers as ``HostMemory`` (:func:`host_memory.host_memory_outputs`; only with
    ``op``, a ``tf.Operation`` or a GraphDef view of one)."""
    kind = device_kind(device)
    if kind == "CPU":
        return False
    return dtype in HOST_MEMORY_DTYPES_ON_ACCELERATORS or (
        op is not None and index in host_memory.host_memory_outputs(op, kind))


def infer_call_prefix(names: Iterable[str]) -> str:
    """The name prefix function inlining gave the step's ops (``StatefulPartitionedCall/`` after Grappler inlined
    Keras' ``one_step_on_data``): the most common text before ``gradient_tape/`` in gradient op names, or ""."""
    prefixes = Counter(n[:n.find(_GRAD_PREFIX)] for n in names if _GRAD_PREFIX in n)
    return prefixes.most_common(1)[0][0] if prefixes else ""


_REPLICA = re.compile(r"(^|/)replica_\d+/")


def _local(name: str, prefix: str) -> str:
    """``name`` without the inlining prefix ``prefix`` and without a strategy's replica scope (``replica_1/``)."""
    name = name[len(prefix):] if prefix and name.startswith(prefix) else name
    return _without_replica(name)


def _without_replica(name: str) -> str:
    """``name`` without its first ``replica_N/`` scope."""
    return _REPLICA.sub(r"\1", name, count=1) if "replica_" in name else name


def infer_model_scope(names: Iterable[str]) -> str | None:
    """The model's name scope, inferred from op names.

    Candidates are the leading scopes of gradient ops (``gradient_tape/<scope>/...``): the model and the loss
    (optimizer and metric ops have no gradients). Among them the model is the one whose forward ops read variables
    (``<scope>/<layer>/.../ReadVariableOp``); ties go to the scope with more gradient ops. Falls back to the most
    common scope of variable reads, then of forward ops.
    """
    grad: Counter[str] = Counter()
    reads: Counter[str] = Counter()
    fwd: Counter[str] = Counter()
    for n in names:
        parts = _strip_gradient(n).split("/")
        if len(parts) < 3:
            continue
        if is_gradient_name(n):
            grad[parts[0]] += 1
        else:
            fwd[parts[0]] += 1
            if "ReadVariableOp" in parts[-1]:
                reads[parts[0]] += 1
    if grad:
        return max(grad, key=lambda scope: (reads[scope], grad[scope]))
    counts = reads or fwd
    return counts.most_common(1)[0][0] if counts else None


def keras_layer_of(name: str, model_scope: str | None, layer_names: frozenset[str] | None = None) -> str | None:
    """Keras layer of an op name: the scope component after ``model_scope`` (gradient prefix ignored)."""
    if not model_scope:
        return None
    rest = _strip_gradient(name)
    prefix = model_scope.rstrip("/") + "/"
    if not rest.startswith(prefix):
        return None
    parts = rest[len(prefix):].split("/")
    if len(parts) < 2:  # an op directly in the model scope, not inside a layer
        return None
    comp = parts[0]
    if layer_names is not None and comp not in layer_names:
        base = _SUFFIX.sub("", comp)
        if base in layer_names:
            comp = base
    return comp


def _static_dims(t) -> tuple | None:
    """The static shape of ``t`` (a ``tf.Tensor`` or a GraphDef view's tensor) as a tuple with None for unknown
    dimensions, or None for an unknown rank."""
    dims = getattr(t, "dims", False)
    if dims is not False:
        return dims
    return None if t.shape.rank is None else tuple(t.shape.as_list())


def _shape_of(t: tf.Tensor, batch_size: int | None) -> tuple[tuple, bool]:
    dims = _static_dims(t)
    if dims is None:
        return (), False
    if dims and dims[0] is None and batch_size is not None:
        dims = (int(batch_size),) + dims[1:]
    return dims, None not in dims


@functools.lru_cache(maxsize=None)
def _dtype_info(dtype: tf.DType) -> tuple[str, int]:
    """``(name, bytes per element)`` of ``dtype``; 0 bytes for handles, strings and dtypes without a fixed size."""
    if dtype.name in _HANDLE_DTYPES or dtype == tf.string:
        return dtype.name, 0
    try:
        return dtype.name, int(dtype.size)
    except Exception:  # noqa: BLE001  (exotic dtypes without a fixed size)
        return dtype.name, 0


def _dims(t: tf.Tensor, batch_size: int | None) -> list[int]:
    """Static dims with an unknown leading dim replaced by ``batch_size``; ValueError if any stays unknown."""
    dims = _static_dims(t)
    if dims is None:
        raise ValueError("unknown rank")
    dims = list(dims)
    if dims and dims[0] is None and batch_size is not None:
        dims[0] = int(batch_size)
    if any(d is None for d in dims):
        raise ValueError("unknown dimension")
    return dims


#: Op types that access no data of their own: buffer forwarding, metadata only, or variable reads.
_NO_DATA_ACCESS_OP_TYPES = ALIAS_OP_TYPES | FORWARDING_OP_TYPES | METADATA_OP_TYPES | _VARIABLE_READ_TYPES

#: The op types :func:`_flops` counts.
_FLOP_OP_TYPES = frozenset({
    "Conv2D", "_FusedConv2D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv2DBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter", "MatMul", "_FusedMatMul",
    "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def _flops(op: tf.Operation, batch_size: int | None = None) -> float:
    """FLOPs of conv/matmul-like ops from static shapes (0 when unknown or not such an op)."""
    t = op.type
    d = lambda x: _dims(x, batch_size)  # noqa: E731
    try:
        if t in ("Conv2D", "_FusedConv2D"):
            kh, kw, cin, _ = d(op.inputs[1])
            return 2.0 * math.prod(d(op.outputs[0])) * kh * kw * cin
        if t == "DepthwiseConv2dNative":
            kh, kw, _, _ = d(op.inputs[1])
            return 2.0 * math.prod(d(op.outputs[0])) * kh * kw
        if t == "Conv2DBackpropInput":  # inputs: input_sizes, filter, out_backprop
            kh, kw, cin, _ = d(op.inputs[1])
            return 2.0 * math.prod(d(op.inputs[2])) * kh * kw * cin
        if t == "Conv2DBackpropFilter":  # inputs: input, filter_sizes, out_backprop; output: filter gradient
            kh, kw, cin, _ = d(op.outputs[0])
            return 2.0 * math.prod(d(op.inputs[2])) * kh * kw * cin
        if t == "DepthwiseConv2dNativeBackpropInput":
            kh, kw = d(op.inputs[1])[:2]
            return 2.0 * math.prod(d(op.inputs[2])) * kh * kw
        if t == "DepthwiseConv2dNativeBackpropFilter":
            kh, kw = d(op.outputs[0])[:2]
            return 2.0 * math.prod(d(op.inputs[2])) * kh * kw
        if t in ("MatMul", "_FusedMatMul"):
            a = d(op.inputs[0])
            k = a[0] if op.get_attr("transpose_a") else a[1]
            return 2.0 * math.prod(d(op.outputs[0])) * k
        if t in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            a = d(op.inputs[0])
            k = a[-2] if op.get_attr("adj_x") else a[-1]
            return 2.0 * math.prod(d(op.outputs[0])) * k
    except (TypeError, ValueError, IndexError):  # unknown dims or rank
        return 0.0
    return 0.0


@tf.autograph.experimental.do_not_convert
def capture_step_graph(ops: Sequence[tf.Operation], batch_size: int | None = None, *,
                       model_scope: str | None = None, layer_names: Iterable[str] | None = None) -> StepGraph:
    """Build and analyse the :class:`StepGraph` of the given train-step ops.

    ``batch_size`` replaces an unknown leading dimension; tensors with other unknown dimensions get ``bytes=0``
    and ``shape_known=False`` (counted in ``meta["unknown_shape_tensors"]``). Inputs produced outside ``ops`` are
    ignored. ``model_scope`` is the model's name scope (inferred when None); ``layer_names`` (e.g.
    ``[l.name for l in model.layers]``) maps uniquified scope names back to layer names. Raises
    :class:`UnsupportedGraphError` for an empty op list or a cyclic graph.
    """
    ops = list(ops)
    if not ops:
        raise UnsupportedGraphError("the train step created no ops to analyse")
    ordered = list(dict.fromkeys(op.name for op in ops))  # graph order: the inferences' ties go one way each run
    names = set(ordered)
    prefix = infer_call_prefix(ordered)
    if model_scope is None:
        model_scope = infer_model_scope(_local(n, prefix) for n in ordered)
    lnames = frozenset(layer_names) if layer_names is not None else None

    tensors: dict[str, TensorInfo] = {}
    infos: list[OpInfo] = []
    unknown = 0
    for op in ops:
        outs = []
        holds_variables = op.type in _VARIABLE_READ_TYPES or op.type in _SOURCE_OP_TYPES
        may_alias = op.type in _ALIASING_OP_TYPES
        on_cpu = device_kind(op.device) == "CPU"
        for k, t in enumerate(op.outputs):
            dims, known = _shape_of(t, batch_size)
            dtype, size = _dtype_info(t.dtype)
            persistent = holds_variables or dtype in _HANDLE_DTYPES
            alias_of = _aliased_tensor(op, k, dtype, tensors) if may_alias else None
            if alias_of is not None:
                persistent = persistent or tensors[alias_of].persistent
            host = not on_cpu and in_host_memory(op.device, dtype, op, k)
            persistent = persistent or host  # never swapped: it does not occupy the device
            if not known and not persistent and alias_of is None:
                unknown += 1
            nbytes = int(size * math.prod(dims)) if known and not host else 0
            tensors[t.name] = TensorInfo(t.name, op.name, k, dtype, dims, nbytes,
                                         persistent=persistent, shape_known=known, alias_of=alias_of)
            outs.append(t.name)
        # A lowered loop's back edge (NextIteration -> Merge) is left out: the step graph stays a DAG, in which a
        # loop's body runs once; what the loop keeps across iterations leaves it as lists (loop_lists).
        inputs = [t.name for t in op.inputs if t.op.name in names
                  and not (op.type == "Merge" and t.op.type == "NextIteration")]
        infos.append(OpInfo(
            name=op.name, type=op.type, inputs=inputs, outputs=outs,
            control_inputs=[c.name for c in op.control_inputs if c.name in names],
            is_backward=is_gradient_name(op.name), keras_layer=keras_layer_of(_local(op.name, prefix), model_scope, lnames),
            flops=_flops(op, batch_size) if op.type in _FLOP_OP_TYPES else 0.0, bytes_accessed=0,
            device=op.device or ""))
    inferred = _infer_sizes_from_reshapes(infos, tensors)
    unknown -= inferred
    # bytes accessed: data inputs and outputs (metadata ops read no data)
    for info in infos:
        if info.type in _NO_DATA_ACCESS_OP_TYPES:
            info.bytes_accessed = 0  # buffer forwarding, metadata only, or a variable read (aliases the variable)
            continue
        read = sum(tensors[i].bytes for i in info.inputs)
        info.bytes_accessed = read + sum(tensors[o].bytes for o in info.outputs)
    variable_bytes = _variable_bytes(infos, tensors)
    sg = StepGraph(infos, tensors.values(), meta={
        "batch_size": batch_size, "model_scope": model_scope, "unknown_shape_tensors": unknown,
        "sizes_inferred_from_reshape": inferred,
        "variable_read_bytes": variable_bytes,
        "loop_back_edges": [(t.op.name, op.name) for op in ops if op.type == "Merge" for t in op.inputs
                            if t.op.type == "NextIteration" and t.op.name in names]})
    enter_frames = {op.name: _frame_name(op) for op in ops if op.type == "Enter"}
    _mark_backward(sg)
    _analyse(sg)
    if enter_frames:  # without loops every op runs in the step's own frame ("")
        _mark_frames(sg, enter_frames)
        if loop_back_edges(sg):  # loops inside the step: their inputs reach the gradients around their back edges
            _mark_backward(sg)
        sg.meta["loop_lists_sized"] = loop_lists.size_loop_lists(sg, _scalar_constants(ops))
        if order_loop_entries(sg):
            _analyse(sg)
    if any(op.type == "Switch" for op in infos):  # without conditionals no op is in a branch
        _mark_conditional(sg)
    return sg


def _analyse(sg: StepGraph) -> None:
    """:func:`~dymem_tf.planning.analysis.analyse`, raising :class:`UnsupportedGraphError` for a cyclic graph."""
    try:
        analyse(sg)
    except CycleError as err:
        raise UnsupportedGraphError(str(err)) from err


#: The op types whose outputs :func:`_aliased_tensor` may find sharing an input's buffer.
_ALIASING_OP_TYPES = ALIAS_OP_TYPES | FORWARDING_OP_TYPES | {"Merge"}


def _aliased_tensor(op, k: int, dtype: str, tensors: dict[str, TensorInfo]) -> str | None:
    """The captured tensor whose buffer output ``k`` of ``op`` shares, or None. A ``Merge`` of optionals (``cond``
    returning a branch's intermediate for its gradient: the value in one branch, ``OptionalNone`` in the other)
    shares the buffer of the input that holds one; a ``Merge`` of data has its own (either branch's)."""
    if op.type == "Merge" and k == 0 and dtype == "variant":
        names = [t.name for t in op.inputs]
        return next((n for n in names if n in tensors and tensors[n].alias_of is not None), None)
    if op.type not in ALIAS_OP_TYPES and op.type not in FORWARDING_OP_TYPES:
        return None
    inputs = op.inputs
    src = aliased_input(op.type, k, len(inputs))
    name = inputs[src].name if src is not None else None
    return name if name in tensors else None


def _mark_frames(sg: StepGraph, enter_frames: dict[str, str]) -> None:
    """Give every op the lowered loop frame it runs in: ``Enter`` opens a frame, ``Exit`` leaves it, other ops
    run in their inputs' frame (data inputs first, then control inputs)."""
    for name in sg.execution_order():
        op = sg.ops[name]
        sources = [sg.tensors[t].producer for t in op.inputs] + list(op.control_inputs)
        outer = next((sg.ops[p].frame for p in sources if sg.ops[p].frame), "")
        if op.type == "Enter":
            frame = enter_frames.get(name) or name
            op.frame = f"{outer}{FRAME_SEPARATOR}{frame}" if outer else frame
        elif op.type == "Exit":
            op.frame = outer_frame(outer)
        else:
            op.frame = outer


def _scalar_constants(ops) -> dict[str, int]:
    """The value of every scalar integer ``Const`` among ``ops``, by its output's name."""
    values = {}
    for op in ops:
        if op.type != "Const":
            continue
        try:
            proto = op.get_attr("value")
        except (ValueError, TypeError):
            continue
        if getattr(proto, "tensor_shape", None) is None or proto.tensor_shape.dim:
            continue
        if proto.int_val or proto.int64_val:
            values[f"{op.name}:0"] = int((proto.int_val or proto.int64_val)[0])
    return values


def order_loop_entries(sg: StepGraph) -> int:
    """Add an ordering edge (``kind="loop-start"``, in the step graph only) from the producer of the last input a
    lowered loop receives to each of the loop's other ``Enter`` ops, so that the dependency layers hold every input
    where the loop can first use it: a gradient loop's iterations wait for the incoming gradient, and the lists
    its forward loop accumulated are read there, not where they were handed over. Returns the edges added."""
    entries: dict[str, list[OpInfo]] = {}
    for op in sg.ops.values():
        if op.type == "Enter" and op.inputs:
            entries.setdefault(op.frame, []).append(op)
    added = 0
    for enters in entries.values():
        producer_of = {e.name: sg.tensors[e.inputs[0]].producer for e in enters}
        last = max(producer_of.values(), key=lambda p: (sg.ops[p].layer, sg.position(p)))
        for e in enters:
            if producer_of[e.name] != last and not sg.graph.has_edge(last, e.name):
                sg.graph.add_edge(last, e.name, kind="loop-start")
                added += 1
    return added


def _frame_name(op) -> str:
    """The ``frame_name`` attribute of an ``Enter`` op ("" when unreadable)."""
    try:
        value = op.get_attr("frame_name")
    except (ValueError, TypeError):
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _mark_conditional(sg: StepGraph) -> None:
    """Flag ops inside lowered conditional branches (between a ``Switch`` and its ``Merge``) deeper than the step.

    Such an op is *dead* when its branch is not taken, and a control edge from a dead op makes its target dead
    too: a swap-in triggered by it would never produce its tensor. Depth counting handles nested conditionals;
    depth is counted from the step's own (the shallowest gradient op's), since Keras' steps_per_execution runs the
    whole step inside one branch, where every op is live together.
    """
    depth: dict[str, int] = {}
    for name in sg.topological_order():  # every predecessor first (the execution order bypasses identities)
        op = sg.ops[name]
        preds = [depth[p] for p in sg.graph.predecessors(name)]
        d = max(preds, default=0)
        plumbing = op.type in ("Switch", "Merge") and branches.in_loop_plumbing(sg, op)
        if op.type == "Merge" and not plumbing:
            d = max(d - 1, 0)
        depth[name] = d + 1 if op.type == "Switch" and not plumbing else d
    base = min((depth[n] for n, op in sg.ops.items() if op.phase == "backward"), default=0)
    for name, op in sg.ops.items():
        op.conditional = depth[name] > base


def _infer_sizes_from_reshapes(infos: list[OpInfo], tensors: dict[str, TensorInfo]) -> int:
    """Give an unknown-shape tensor the size of a fully known Reshape of it, or of the fully known tensor it
    reshapes (same element count and dtype either way; the shape recorded is the known side's).

    Gradient code often reduces with dynamic axes and reshapes right after (``Sum`` of BroadcastGradientArgs
    followed by ``Reshape`` to the input's shape), or reshapes to a shape computed at run time (Keras 3.15's
    ``GlobalAveragePooling2D`` gradient). Returns how many tensors were sized this way.
    """
    n = 0
    for info in infos:
        if info.type != "Reshape" or not info.inputs or not info.outputs:
            continue
        src, out = tensors[info.inputs[0]], tensors[info.outputs[0]]
        for unknown, known in ((src, out), (out, src)):
            if not unknown.shape_known and unknown.alias_of is None and not unknown.persistent and known.shape_known:
                unknown.shape, unknown.bytes, unknown.shape_known = known.shape, known.bytes, True
                n += 1
    return n


def _variable_bytes(infos: list[OpInfo], tensors: dict[str, TensorInfo]) -> int:
    """Bytes of the distinct variables read in the step (a lower bound of the persistent bytes)."""
    seen: dict[str, int] = {}
    for info in infos:
        if info.type == "ReadVariableOp" and info.inputs and info.outputs:
            seen[info.inputs[0]] = max(seen.get(info.inputs[0], 0), sum(tensors[o].bytes for o in info.outputs))
    return sum(seen.values())


def _mark_backward(sg: StepGraph) -> None:
    """Label phases: backward (gradient ops), update and forward; ``is_backward`` is True for the first two.

    Update ops are everything downstream of a gradient op (aggregation, optimizer updates) plus what only feeds
    them: ancestors of update ops that feed no gradient op (the optimizer's learning-rate and slot arithmetic,
    which runs early but belongs to the update and is not a feature map).
    """
    g, back = sg.graph, loop_back_edges(sg)
    # After Grappler a gradient-named constant (or shape op) may be shared with the forward pass (constant folding
    # and CSE keep one of the merged nodes' names): only ops that compute on data seed the backward pass.
    grads = [n for n, op in sg.ops.items() if is_gradient_name(n) and op.inputs
             and op.type not in _SOURCE_OP_TYPES and op.type not in METADATA_OP_TYPES]
    shared = _shared_with_forward(sg, grads)
    grads = [n for n in grads if n not in shared]
    # with the loops' back edges: a forward loop's inputs feed the gradients through its body (without them the
    # LSTM's input transpose counted as update arithmetic, and its deferral after the update made a cycle)
    below = reach(g, grads, "down", back) - set(grads)
    feeds_grads = reach(g, grads, "up", back)
    update = below | (reach(g, list(below), "up", back) - feeds_grads - set(grads))
    grad_set = set(grads)
    for name, op in sg.ops.items():
        if name in grad_set:
            op.is_backward, op.phase = True, "backward"
        elif name in update:
            op.is_backward, op.phase = True, "update"
        else:
            op.is_backward, op.phase = False, "forward"


#: The ops of a lowered conditional's predicate that its branches take a control edge from.
_PIVOT_OP_TYPES = frozenset({"Switch", "Identity"})


def _shared_with_forward(sg: StepGraph, grads: list[str]) -> set[str]:
    """Gradient-named ops that compute a forward value: Grappler's common-subexpression elimination can merge a
    forward op with an identical gradient op and keep the gradient's name (the ``Square`` that a tanh-GELU's
    ``x**3`` and its gradient's ``3 * x**2`` share). Seeded by those whose output a Keras layer's forward op reads,
    closed over their gradient-named data inputs; without this everything after the first merged op would count as
    the update and no later feature map could be swapped. The same for a lowered conditional's predicate plumbing:
    a gradient's ``If`` branches on the forward ``cond``'s predicate, CSE merges the two ``Switch(pred, pred)`` and
    their pivot ``Identity`` ops, and the forward branch's ops then take a control edge from a gradient-named pivot."""
    g, grad_set = sg.graph, set(grads)
    todo = [n for n in grads if any(
        not is_gradient_name(s) and sg.ops[s].keras_layer is not None
        and (data.get("kind") == "data" or sg.ops[n].type in _PIVOT_OP_TYPES)
        for s, data in g.succ[n].items())]
    shared: set[str] = set()
    while todo:
        n = todo.pop()
        if n in shared:
            continue
        shared.add(n)
        todo.extend(p for p, data in g.pred[n].items() if p in grad_set and data.get("kind") == "data")
    return shared


def reach(g, seeds: list[str], direction: str, extra: Sequence[tuple[str, str]] = ()) -> set[str]:
    """The seeds and every node reachable from them: ``"down"`` along edges (and the ``extra`` ones), ``"up"``
    against them."""
    return descendants(g, seeds, reverse=direction != "down", extra=extra)
