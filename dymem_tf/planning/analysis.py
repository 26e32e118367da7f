"""Dataflow analysis of one training step: a networkx DAG of its ops, tensor sizes, lifetimes and dependency layers.

Pure Python + networkx (no TensorFlow import): a :class:`StepGraph` can be built from a traced train step
(:mod:`dymem_tf.passes.graph_capture`), by hand for tests (:meth:`StepGraph.from_spec`) or from JSON
(:meth:`StepGraph.from_dict`).

Dependency layers (Dymem, HPDC'20, Sec. 3): the layer of an op is the length of the longest path from any source
op to it, so an op's inputs all live in strictly earlier layers and the ops of one layer are mutually independent.
It is the "as soon as possible" level of the op, the same notion as TFLMS' topological levels.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal, Mapping

import networkx as nx

#: Ops that only read a tensor's metadata (shape, size, rank), never its data. A swapped tensor's original device
#: buffer keeps serving them, so they never force a swap-in.
METADATA_OP_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})

#: Alias ops a rewrite may copy for backward consumers that read a swapped or recomputed tensor through them.
COPYABLE_ALIAS_OP_TYPES = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims", "EnsureShape"})

#: Ops whose outputs share their inputs' buffers (output k aliases input k): they allocate nothing and keep the
#: input buffer alive for their own consumers.
ALIAS_OP_TYPES = frozenset({"Identity", "IdentityN", "StopGradient", "PreventGradient", "Reshape", "Squeeze",
                            "ExpandDims", "EnsureShape"})

#: Ops that forward input 0's buffer to each output: a lowered conditional's ``Switch`` (to the taken branch), an
#: ``OptionalFromValue`` (the optional holds the buffer, as ``cond``'s gradient keeps a branch's intermediates) and
#: ``OptionalGetValue`` (returns it).
FORWARDING_OP_TYPES = frozenset({"Switch", "OptionalFromValue", "OptionalGetValue"})

#: Ops that pass a lowered conditional's optional (a branch's intermediate kept for the gradient) on unchanged, from
#: the ``OptionalFromValue`` in the branch to the ``OptionalGetValue`` in the gradient's branch.
OPTIONAL_CHAIN_OP_TYPES = frozenset({"OptionalFromValue", "Merge", "Switch", "Identity", "OptionalGetValue"})


def aliased_input(op_type: str, k: int, num_inputs: int) -> int | None:
    """The input whose buffer output ``k`` of an ``op_type`` op shares, or None when the output has its own."""
    if op_type in ALIAS_OP_TYPES:
        return k if k < num_inputs else None
    if op_type in FORWARDING_OP_TYPES:
        return 0 if num_inputs else None
    return None


#: Op types that cost nothing to run (graph inputs, constants, no-ops).
FREE_OP_TYPES = frozenset({"Placeholder", "_Arg", "_Retval", "Const", "NoOp", "VarHandleOp"})


def no_autograph(fn):
    """Mark ``fn`` so that AutoGraph calls it as plain Python when code inside a traced ``tf.function`` calls it.

    The analysis and planning run while Keras traces ``train_step``; if AutoGraph converted them it would also try
    to convert networkx. This sets AutoGraph's artifact marker (the attribute ``tf.autograph.experimental.
    do_not_convert`` sets), so no TensorFlow import is needed here.
    """
    fn.autograph_info__ = frozenset()
    return fn


class CycleError(ValueError):
    """The step graph has a cycle, so it has no dependency layers."""


#: The phase of an op in the step: the forward pass, the gradient computation, or the optimizer's update.
Phase = Literal["forward", "backward", "update"]


@dataclass
class TensorInfo:
    """One op output. ``bytes`` is 0 when the static shape is not fully known (``shape_known`` is then False)."""

    name: str  # "op_name:idx"
    producer: str
    index: int
    dtype: str
    shape: tuple
    bytes: int
    consumers: list[str] = field(default_factory=list)
    persistent: bool = False  # variable reads/handles: aliases of persistent memory, never swapped
    shape_known: bool = True
    alias_of: str | None = None  # tensor whose buffer this one shares (Identity, Reshape ...): allocates nothing
    #: a resource variable's storage modelled as a tensor (:mod:`dymem_tf.planning.offload`): on the device for the
    #: whole step unless swapped, when it is there only from its swap-in until its last use (it lives in host memory
    #: between steps); ``producer`` is the op giving the resource
    variable: bool = False


@dataclass
class OpInfo:
    """One op of the step. ``layer`` is its dependency layer (-1 until :func:`analyse` ran)."""

    name: str
    type: str
    inputs: list[str]  # tensor names, in input order
    outputs: list[str]  # tensor names, in output order
    control_inputs: list[str]  # op names
    is_backward: bool  # gradient computation or optimizer update (anything downstream of the gradients)
    keras_layer: str | None
    flops: float
    bytes_accessed: int
    layer: int = -1
    phase: Phase | Literal[""] = ""  # informational; is_backward covers "backward" and "update"
    conditional: bool = False  # inside a lowered conditional branch: may not run (dead), so never a trigger
    frame: str = ""  # lowered loop frame ("" outside loops; "outer|inner" when nested, see FRAME_SEPARATOR)
    device: str = ""  # the device the op is placed on ("" when unplaced)


#: Joins nested lowered loop frames in :attr:`OpInfo.frame`: TF's frame names (a While op's name) contain "/".
FRAME_SEPARATOR = "|"


def frame_depth(frame: str) -> int:
    """How many lowered loops ``frame`` is nested in (0: the step's own frame)."""
    return frame.count(FRAME_SEPARATOR) + 1 if frame else 0


def outer_frame(frame: str) -> str:
    """The frame around ``frame`` ("" around a loop of the step's own frame)."""
    return frame.rpartition(FRAME_SEPARATOR)[0]


def step_frame_depth(ops: Iterable[OpInfo]) -> int:
    """The loop depth of the step's own frame, its shallowest backward op's (Keras' steps_per_execution runs the
    whole step inside a loop; a loop deeper than this runs inside the step)."""
    return min((frame_depth(op.frame) for op in ops if op.phase == "backward"), default=0)


def input_frame(op: OpInfo) -> str:
    """The frame in which ``op`` reads its inputs: an ``Enter`` takes a tensor of the frame around its loop into it,
    every other op reads in its own frame (a swap-in may feed an op only in that frame)."""
    return outer_frame(op.frame) if op.type == "Enter" else op.frame


class StepGraph:
    """The ops and tensors of one training step, with their dataflow DAG and dependency layers."""

    def __init__(self, ops: Iterable[OpInfo], tensors: Iterable[TensorInfo], meta: Mapping[str, Any] | None = None):
        self.ops: dict[str, OpInfo] = {op.name: op for op in ops}
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in tensors}
        self.meta: dict[str, Any] = dict(meta or {})
        self.layers: list[list[str]] = []
        self.graph = nx.DiGraph()
        self._order: list[str] | None = None
        self._position: dict[str, int] | None = None
        self._aliases: dict[str, list[str]] | None = None
        self._generations: list[list[str]] | None = None  # of ``graph`` (not the layers' run-time order)
        self._paths: Reachability | None = None
        #: the simulator's preparation of this graph (:func:`dymem_tf.planning.simulator.prepared`)
        self._simulator: tuple | None = None
        self._build_graph()

    # ----------------------------------------------------------------------------------------------- construction
    def _build_graph(self) -> None:
        """The DAG: an edge per (producer, consumer) pair of a tensor (``kind="data"``) and per control input not
        doubling a data edge (``kind="control"``); fills every tensor's consumers."""
        for t in self.tensors.values():
            t.consumers = []
        for t in self.tensors.values():
            if t.alias_of is not None and t.alias_of not in self.tensors:
                raise ValueError(f"tensor {t.name!r} aliases unknown tensor {t.alias_of!r}")
        # edges in the order the ops list them: each node's successors keep that order (the topological order, and
        # so ties between equal candidates in the planning stages, depend on it)
        succ, pred = _empty_adjacency(self.graph, self.ops)
        data, control = {"kind": "data"}, {"kind": "control"}
        for op in self.ops.values():
            name, preds = op.name, pred[op.name]
            for tname in op.inputs:
                t = self.tensors.get(tname)
                if t is None:
                    raise ValueError(f"op {name!r} reads unknown tensor {tname!r}")
                if t.producer not in self.ops:
                    raise ValueError(f"tensor {tname!r} has unknown producer {t.producer!r}")
                if name not in t.consumers:
                    t.consumers.append(name)
                if t.producer not in preds:
                    preds[t.producer] = succ[t.producer][name] = dict(data)
            for src in op.control_inputs:
                if src not in self.ops:
                    raise ValueError(f"op {name!r} has unknown control input {src!r}")
                if src not in preds:
                    preds[src] = succ[src][name] = dict(control)

    def copy(self) -> "StepGraph":
        """An independent copy (ops, tensors, edges, layers) to plan the same step again: the planning stages add
        edges and mark tensors in place. Much faster than a round trip through :meth:`to_dict`."""
        new = StepGraph.__new__(StepGraph)
        new.ops = {n: _replaced(op, inputs=list(op.inputs), outputs=list(op.outputs),
                                control_inputs=list(op.control_inputs)) for n, op in self.ops.items()}
        new.tensors = {n: _replaced(t, consumers=list(t.consumers)) for n, t in self.tensors.items()}
        new.meta = dict(self.meta)
        new.layers = [list(layer) for layer in self.layers]
        new.graph = _copied(self.graph)
        new._order = new._position = new._aliases = new._generations = new._paths = new._simulator = None
        return new

    @classmethod
    def from_spec(cls, spec: Mapping[str, Mapping[str, Any]], analysed: bool = True) -> "StepGraph":
        """Build a hand-made graph (tests, examples).

        ``spec`` maps op names, in program order, to dicts with optional keys: ``inputs`` (op names, meaning output
        0, or ``"op:k"``), ``control`` (op names), ``bytes`` (int or list of ints: one output each; default one
        output of 0 bytes, ``[]`` for none), ``shape`` (output 0's shape; default ``(bytes // 4,)``), ``dtype``,
        ``backward`` (bool), ``phase`` (``"update"`` for optimizer ops; default from ``backward``), ``type``,
        ``keras_layer``, ``flops``, ``bytes_accessed`` (default: bytes of inputs and outputs), ``persistent``
        (outputs are variable reads) and ``alias`` (output k shares input k's buffer, like Identity; default:
        :func:`aliased_input` of the type).
        """
        ops: list[OpInfo] = []
        tensors: dict[str, TensorInfo] = {}
        for name, d in spec.items():
            sizes = d.get("bytes", 0)
            sizes = [int(sizes)] if isinstance(sizes, (int, float)) else [int(s) for s in sizes]
            outs = []
            for k, b in enumerate(sizes):
                tname = f"{name}:{k}"
                shape = tuple(d["shape"]) if (k == 0 and "shape" in d) else (max(b // 4, 0),)
                tensors[tname] = TensorInfo(tname, name, k, d.get("dtype", "float32"), shape, b,
                                            persistent=bool(d.get("persistent", False)))
                outs.append(tname)
            inputs = [i if ":" in i else f"{i}:0" for i in d.get("inputs", [])]
            for k, tname in enumerate(outs):
                src = aliased_input(d.get("type", "Op"), k, len(inputs))
                if d.get("alias", src is not None):
                    tensors[tname].alias_of = inputs[k if src is None else src] if k < len(inputs) else None
            ops.append(OpInfo(
                name=name, type=d.get("type", "Op"), inputs=inputs, outputs=outs,
                control_inputs=list(d.get("control", [])),
                is_backward=bool(d.get("backward", False)) or d.get("phase") == "update",
                keras_layer=d.get("keras_layer"), flops=float(d.get("flops", 0.0)),
                bytes_accessed=int(d.get("bytes_accessed", -1)),
                phase=d.get("phase", "backward" if d.get("backward") else "forward")))
        sg = cls(ops, tensors.values())
        for op in sg.ops.values():
            if op.bytes_accessed < 0:
                op.bytes_accessed = 0 if op.type in ALIAS_OP_TYPES | FORWARDING_OP_TYPES | METADATA_OP_TYPES else sum(
                    sg.tensors[t].bytes for t in op.inputs + op.outputs)
        return analyse(sg) if analysed else sg

    # ------------------------------------------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _require_layers(self) -> None:
        if not self.layers and self.ops:
            raise RuntimeError("dependency layers are not computed yet: call "
                               "dymem_tf.planning.analysis.analyse(step_graph)")

    def execution_order(self) -> list[str]:
        """Ops layer by layer; inside a layer in program (insertion) order. The simulator's compute order."""
        self._require_layers()
        if self._order is None:
            self._order = [name for layer in self.layers for name in layer]
            self._position = {name: i for i, name in enumerate(self._order)}
        return self._order

    def position(self, op: str) -> int:
        """Index of ``op`` in :meth:`execution_order`."""
        self.execution_order()
        assert self._position is not None
        return self._position[op]

    def topological_order(self) -> list[str]:
        """The ops in ``nx.topological_sort(self.graph)``'s order (kept until :func:`analyse` runs again, which
        every change of the graph's edges must be followed by)."""
        if self._generations is None:
            self._generations = topological_generations(self.graph)
        return [name for gen in self._generations for name in gen]

    def reachability(self) -> "Reachability":
        """Path queries on the graph (kept until :func:`analyse` runs again)."""
        if self._paths is None:
            self.topological_order()
            self._paths = Reachability(self.graph, self._generations)
        return self._paths

    def forward_ops(self) -> list[str]:
        """Forward ops in execution order."""
        return [n for n in self.execution_order() if not self.ops[n].is_backward]

    def backward_ops(self) -> list[str]:
        """Backward and update ops in execution order."""
        return [n for n in self.execution_order() if self.ops[n].is_backward]

    def producer_layer(self, tensor: str) -> int:
        """Dependency layer of the op producing ``tensor``."""
        self._require_layers()
        return self.ops[self.tensors[tensor].producer].layer

    def consumer_layers(self, tensor: str) -> list[int]:
        """Sorted dependency layers of the ops reading ``tensor``."""
        self._require_layers()
        return sorted(self.ops[c].layer for c in self.tensors[tensor].consumers)

    def lifetime(self, tensor: str) -> tuple[int, int]:
        """``(first, last)`` dependency layer during which ``tensor`` is alive (producer to last consumer)."""
        first = self.producer_layer(tensor)
        cl = self.consumer_layers(tensor)
        return first, (cl[-1] if cl else first)

    def buffer_of(self, tensor: str) -> str:
        """The tensor owning ``tensor``'s buffer (itself unless it is an alias)."""
        seen = 0
        while (src := self.tensors[tensor].alias_of) is not None:
            tensor = src
            seen += 1
            if seen > len(self.tensors):
                raise ValueError(f"alias cycle at {tensor!r}")
        return tensor

    def aliases(self) -> dict[str, list[str]]:
        """Buffer-owning tensor -> tensors aliasing it (transitively), for buffers that have aliases."""
        if self._aliases is None:
            out: dict[str, list[str]] = {}
            for t in self.tensors.values():
                if t.alias_of is not None:
                    out.setdefault(self.buffer_of(t.name), []).append(t.name)
            self._aliases = out
        return self._aliases

    def buffer_consumers(self, tensor: str) -> list[str]:
        """Consumers of ``tensor`` and of every tensor aliasing it: the ops that keep its buffer alive."""
        out = list(self.tensors[tensor].consumers)
        for a in self.aliases().get(tensor, ()):
            out.extend(c for c in self.tensors[a].consumers if c not in out)
        return out

    def alias_readers(self, tensor: str) -> dict[str, str] | None:
        """Backward data consumers that read ``tensor`` only through one forward alias op of it (a ``Reshape`` of
        a feature map that a gradient ``MatMul`` reads ...), each mapped to that alias op: a swap of ``tensor`` can
        serve them by a copy of the alias op reading the swap-in. None when some backward op reads the buffer in
        a way a copy cannot serve (an alias of an alias, an alias op of another type, one reading the tensor both
        directly and through an alias)."""
        direct = set(self.tensors[tensor].consumers)
        out: dict[str, str] = {}
        for c in self.tensors[tensor].consumers:
            op = self.ops[c]
            alias = [o for o in op.outputs if self.tensors[o].alias_of == tensor]
            if op.is_backward or not alias:
                continue
            if any(self.tensors[o].alias_of is not None and any(self.ops[x].is_backward
                                                                  for x in self.buffer_consumers(o))
                   for a in alias for u in self.tensors[a].consumers if not self.ops[u].is_backward
                   for o in self.ops[u].outputs):
                return None  # a backward read through an alias of the alias
            readers = [u for a in alias for u in self.tensors[a].consumers if self.ops[u].is_backward]
            if not readers:
                continue
            if (op.type not in COPYABLE_ALIAS_OP_TYPES or alias != op.outputs[:1] or op.inputs[:1] != [tensor]
                    or any(u in direct or u in out for u in readers)):
                return None
            out.update((u, c) for u in readers if self.is_data_consumer(u))
        return out

    def optional_readers(self, tensor: str) -> tuple[str, dict[str, str]] | None:
        """A branch's intermediate that a lowered ``cond`` keeps for its gradient in an optional: ``(wrap,
        readers)``, the ``OptionalFromValue`` op holding ``tensor`` and the backward data consumers of the
        optional's value, each mapped to the ``OptionalGetValue`` op it reads. A swap can put the host copy in the
        optional and feed those readers from its swap-in. None when no optional holds the tensor alone, the
        optional reaches another op than :data:`OPTIONAL_CHAIN_OP_TYPES`, a ``Merge`` gives it one output with the
        other branch's value, or a backward op reads the buffer otherwise."""
        wraps = [c for c in self.tensors[tensor].consumers if self.ops[c].type == "OptionalFromValue"]
        if len(wraps) != 1 or self.ops[wraps[0]].inputs != [tensor]:
            return None
        chain = self.optional_chain(wraps[0])
        readers: dict[str, str] = {}
        for name in sorted(chain):  # a set: sorted, so that a reader of two of its values maps the same way each run
            op = self.ops[name]
            if op.type == "OptionalGetValue":
                for c in self.tensors[op.outputs[0]].consumers:
                    if not self.ops[c].is_backward or self.ops[c].type in ALIAS_OP_TYPES:
                        return None
                    readers.setdefault(c, name)
            elif op.type not in OPTIONAL_CHAIN_OP_TYPES or (op.type == "Merge" and not self._merges_none(op, tensor)):
                return None
        others = set(self.buffer_consumers(tensor)) - chain - set(readers)
        if not readers or any(self.ops[c].is_backward for c in others):
            return None
        return wraps[0], readers

    def _merges_none(self, merge: OpInfo, tensor: str) -> bool:
        """Whether each input of ``merge`` holds ``tensor`` or comes from an ``OptionalNone``: the other branch keeps
        nothing in this output. (cond_v2 gives intermediates of both branches that match in type one output; then the
        gradient's branches read each other's value from it, and a swap of one branch's would feed both.)"""
        return all(self.buffer_of(i) == tensor or self.ops[self.tensors[i].producer].type == "OptionalNone"
                   for i in merge.inputs)

    def optional_chain(self, wrap: str) -> set[str]:
        """``wrap`` (an ``OptionalFromValue``) and the ops its optional reaches through the tensors aliasing it: the
        ``Merge`` and ``Switch`` of lowered conditionals and the ``OptionalGetValue`` that returns the value."""
        head = self.ops[wrap].outputs[0]
        chain, todo = {wrap}, [head]
        while todo:
            t = todo.pop()
            for c in self.tensors[t].consumers:
                if c in chain:
                    continue
                chain.add(c)
                if self.ops[c].type != "OptionalGetValue":  # its value is the reader's, not the optional
                    todo.extend(o for o in self.ops[c].outputs if self.tensors[o].alias_of == t)
        return chain

    def is_data_consumer(self, op: str) -> bool:
        """False for ops that only read metadata (``Shape`` ...)."""
        return self.ops[op].type not in METADATA_OP_TYPES

    def total_bytes(self, persistent: bool | None = None) -> int:
        """Sum of tensor bytes (all, only persistent, or only non-persistent)."""
        return sum(t.bytes for t in self.tensors.values() if persistent is None or t.persistent == persistent)

    # ------------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (layers included)."""
        return {
            "ops": [asdict(op) for op in self.ops.values()],
            "tensors": [{**asdict(t), "shape": list(t.shape)} for t in self.tensors.values()],
            "layers": self.layers,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StepGraph":
        """Inverse of :meth:`to_dict`; re-runs :func:`analyse` when the dict had layers."""
        tensors = []
        for t in d["tensors"]:
            t = dict(t)
            t["shape"] = tuple(t["shape"])
            t["consumers"] = []
            tensors.append(TensorInfo(**t))
        sg = cls([OpInfo(**op) for op in d["ops"]], tensors, d.get("meta"))
        return analyse(sg) if d.get("layers") else sg

    def __repr__(self) -> str:
        return f"StepGraph({len(self.ops)} ops, {len(self.tensors)} tensors, {len(self.layers)} layers)"


def _replaced(obj, **fields):
    """A shallow copy of the dataclass instance ``obj`` with ``fields`` set (``dataclasses.replace`` without
    running ``__init__``: five times faster on the 100k records of a large step)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__, **fields)
    return new


def find_cycle_message(graph: nx.DiGraph) -> str | None:
    """``"a -> b -> a"`` for one cycle of ``graph``, or None when it is a DAG (linear time for DAGs)."""
    if nx.is_directed_acyclic_graph(graph):
        return None
    for comp in nx.strongly_connected_components(graph):
        if len(comp) > 1 or any(graph.has_edge(n, n) for n in comp):
            # a graph of its own, in the graph's order (a subgraph view walks a set): the same cycle in every run
            ring = nx.DiGraph((u, v) for u in graph if u in comp for v in graph.successors(u) if v in comp)
            cycle = nx.find_cycle(ring)
            nodes = [u for u, _ in cycle] + [cycle[0][0]]
            return " -> ".join(nodes)
    return None  # pragma: no cover  (not a DAG implies a non-trivial strongly connected component)


def successors_of(graph: nx.DiGraph) -> dict[str, dict]:
    """``graph.succ`` as networkx's own dict of dicts, for the linear walks over every node: the public view
    builds a view object for each lookup, which was a quarter of a 30k-op step's analysis."""
    return graph._succ  # noqa: SLF001  (a documented attribute of nx.DiGraph, read only)


def predecessors_of(graph: nx.DiGraph) -> dict[str, dict]:
    """``graph.pred`` as networkx's own dict of dicts (see :func:`successors_of`)."""
    return graph._pred  # noqa: SLF001


def _empty_adjacency(graph: nx.DiGraph, nodes: Iterable[str]) -> tuple[dict, dict]:
    """Adds ``nodes`` to the empty ``graph`` and returns its successor and predecessor dicts, for the caller to
    fill with one shared attribute dict per edge, as ``add_edge`` would. ``add_edges_from`` checks and merges the
    attributes of every edge: a third of capturing a 47k-op step."""
    if graph.number_of_nodes():
        raise ValueError("the graph must be empty")
    graph.add_nodes_from(nodes)
    return successors_of(graph), predecessors_of(graph)


def _copied(graph: nx.DiGraph) -> nx.DiGraph:
    """``graph.copy()`` (nodes, edges in the same order, each edge's attributes copied) without networkx's checks
    per edge (see :func:`_empty_adjacency`)."""
    new = nx.DiGraph()
    succ, pred = _empty_adjacency(new, graph)
    for u, nbrs in successors_of(graph).items():
        for v, attrs in nbrs.items():
            succ[u][v] = dict(attrs)
    for v, nbrs in predecessors_of(graph).items():  # each node's predecessors in their own order, as networkx's
        for u in nbrs:                               # copy keeps them (tie-breaks read them in order)
            pred[v][u] = succ[u][v]
    return new


def descendants(graph: nx.DiGraph, seeds: Iterable[str], reverse: bool = False,
                extra: Iterable[tuple[str, str]] = ()) -> set[str]:
    """The seeds and every node reachable from them along the edges (``reverse``: against them) and the ``extra``
    edges (a lowered loop's back edges: :func:`loop_back_edges`); one linear walk over the adjacency (networkx's
    ``edge_dfs`` yields every edge as a tuple, 50x slower on a 30k-op step)."""
    return reachable(adjacency_with(graph, extra, reverse), seeds)


def adjacency_with(graph: nx.DiGraph, extra: Iterable[tuple[str, str]] = (), reverse: bool = False
                   ) -> dict[str, list[str]]:
    """Each node's successors (``reverse``: predecessors) in ``graph``, with the ``extra`` edges added (a copy of
    the adjacency only where there are any)."""
    adjacency = predecessors_of(graph) if reverse else successors_of(graph)
    extra = list(extra)
    if extra:
        adjacency = {n: list(nbrs) for n, nbrs in adjacency.items()}
        for src, dst in extra:
            a, b = (dst, src) if reverse else (src, dst)
            if a in adjacency and b in adjacency:
                adjacency[a].append(b)
    return adjacency


def reachable(adjacency: Mapping[str, Iterable[str]], seeds: Iterable[str]) -> set[str]:
    """The seeds and every node reachable from them in ``adjacency`` (:func:`adjacency_with`)."""
    seen = set(seeds)
    stack = list(seen)
    while stack:
        for nxt in adjacency[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def loop_back_edges(sg: "StepGraph") -> list[tuple[str, str]]:
    """The back edges (``NextIteration`` -> ``Merge``) of the lowered loops that run inside the step's own frame,
    which ``sg.graph`` leaves out to stay a DAG (meta ``"loop_back_edges"``, recorded at capture): with them, such a
    loop's body reaches what the loop leads to within one step, as in the graph TF runs. The back edges of the loop
    the step itself runs in (Keras' ``steps_per_execution``) lead to the next step and are left out; so are all of
    them before the ops' frames are known (every op's frame "")."""
    step = step_frame_depth(sg.ops.values())
    return [(src, dst) for src, dst in sg.meta.get("loop_back_edges", ())
            if src in sg.ops and dst in sg.ops and frame_depth(sg.ops[src].frame) > step]


class Reachability:
    """Path queries on a DAG that stays unchanged while they are asked.

    ``nx.has_path`` searches the whole graph from both ends for every query: on a 30k-op step, a thousand queries
    took 23 s. Here every node has its topological generation (computed once), and a query from ``src`` to ``dst``
    walks forward only through nodes of a generation below ``dst``'s: a path cannot leave that band. The queries the
    planning stages ask (does this update, or this early gradient op, lead to an op that runs shortly after it?)
    stay in a narrow band."""

    def __init__(self, graph: nx.DiGraph, generations: list[list[str]] | None = None):
        self._succ = successors_of(graph)
        self._level = {node: k for k, gen in enumerate(generations or topological_generations(graph)) for node in gen}

    def has_path(self, src: str, dst: str) -> bool:
        """Whether ``dst`` is ``src`` or can be reached from it."""
        if src == dst:
            return True
        level, limit = self._level, self._level[dst]
        if level[src] >= limit:
            return False
        seen, stack = {src}, [src]
        while stack:
            for nxt in self._succ[stack.pop()]:
                if nxt == dst:
                    return True
                if nxt not in seen and level[nxt] < limit:
                    seen.add(nxt)
                    stack.append(nxt)
        return False


def topological_generations(graph: nx.DiGraph, extra: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """``nx.topological_generations(graph)`` as lists (the same generations, in the same order, so the
    concatenation is ``nx.topological_sort``'s order) over the graph's adjacency dicts, several times faster; with
    ``extra`` edges added (without changing ``graph``). Raises :class:`CycleError` when there is a cycle."""
    succ = successors_of(graph)
    indegree = {n: len(p) for n, p in predecessors_of(graph).items()}
    more: dict[str, list[str]] = {}
    for u, v in extra:
        more.setdefault(u, []).append(v)
        indegree[v] += 1
    current = [n for n, d in indegree.items() if d == 0]
    generations, placed = [], 0
    while current:
        generations.append(current)
        placed += len(current)
        following = []
        for node in current:
            for child in (succ[node] if node not in more else [*succ[node], *more[node]]):
                indegree[child] -= 1
                if indegree[child] == 0:
                    following.append(child)
        current = following
    if placed < len(indegree):
        raise CycleError("the graph has a cycle")
    return generations


def is_acyclic_with(graph: nx.DiGraph, extra: Iterable[tuple[str, str]]) -> bool:
    """Whether ``graph`` with the ``extra`` edges added is still a DAG (``graph`` is not changed)."""
    try:
        topological_generations(graph, extra)
    except CycleError:
        return False
    return True


#: Identity ops that Grappler's dependency optimizer removes before the step runs: they order nothing at run time.
GRAPPLER_REMOVED_OP_TYPES = frozenset({"Identity", "IdentityN"})


def _runtime_predecessors(step_graph: StepGraph) -> dict[str, set[str]]:
    """The ops each op waits for at run time: its predecessors in the step graph with Identity/IdentityN bypassed.

    Keras passes all gradients through one ``IdentityN`` before the optimizer; in the FuncGraph that is a barrier
    (no update before the last gradient), but Grappler removes it, and each variable's update runs as soon as its
    own gradient is ready. A consumer of an identity output waits for the producer of the matching input instead
    (a control consumer, or one reading none of its outputs, for all of the identity's inputs and control inputs),
    through chains of identities; an identity itself waits for its own inputs, bypassed the same way. Only the ops
    with a bypassed predecessor are listed; the others wait for their predecessors in the graph.
    """
    ops, tensors, pred = step_graph.ops, step_graph.tensors, step_graph.graph.pred
    bypass = {n for n, op in ops.items() if op.type in GRAPPLER_REMOVED_OP_TYPES}
    if not bypass:
        return {}
    every: dict[str, set[str]] = {}  # identity -> what a consumer reading none of its outputs waits for

    def stand_ins(p: str, reads: set[str]) -> set[str]:
        op = ops[p]
        fed = [op.inputs[k] for k, out in enumerate(op.outputs) if out in reads and k < len(op.inputs)]
        if not fed:
            if p not in every:
                every[p] = set()  # a cycle through identities cannot happen in a DAG
                every[p] = expand({tensors[t].producer for t in op.inputs} | set(op.control_inputs), set())
            return every[p]
        return expand({tensors[t].producer for t in fed}, reads)

    def expand(preds: set[str], reads: set[str]) -> set[str]:
        out: set[str] = set()
        for q in preds:
            out |= stand_ins(q, reads) if q in bypass else {q}
        return out

    runtime: dict[str, set[str]] = {}
    for name, op in ops.items():
        preds = pred[name]
        if any(p in bypass for p in preds):
            runtime[name] = expand(set(preds), set(op.inputs))
    return runtime


@no_autograph
def analyse(step_graph: StepGraph) -> StepGraph:
    """Validate that the graph is a DAG and fill dependency layers (in place; returns ``step_graph``).

    Layer ``k`` holds the ops whose longest path from a source has ``k`` edges, counted on the run-time order
    (:func:`_runtime_predecessors`: identities bypassed): networkx's topological generations of that graph, computed
    in one pass over a topological order of the step graph (which orders the run-time graph too: every bypassed
    edge comes from an ancestor). Inside a layer ops keep program order, so the result is deterministic.
    """
    g = step_graph.graph
    try:
        generations = topological_generations(g)
    except CycleError:
        raise CycleError("the step graph is not a DAG, so it has no dependency layers; cycle: "
                         f"{find_cycle_message(g)}") from None
    runtime = _runtime_predecessors(step_graph)
    pred = predecessors_of(g)
    level: dict[str, int] = {}
    for name in (n for gen in generations for n in gen):
        preds = runtime.get(name)
        if preds is None:
            preds = pred[name]
        level[name] = 1 + max(map(level.__getitem__, preds)) if preds else 0
    layers: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for name, op in step_graph.ops.items():  # program order inside each layer
        op.layer = level[name]
        layers[op.layer].append(name)
    step_graph.layers = layers
    step_graph._order = None
    step_graph._position = None
    step_graph._aliases = None
    step_graph._generations = generations
    step_graph._paths = None
    step_graph._simulator = None
    return step_graph
