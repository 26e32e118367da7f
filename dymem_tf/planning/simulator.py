"""Discrete-event simulation of one training step with swapping: time, stalls and device memory by mobility group.

Model (the planner's view of the runtime):

* One compute stream runs the ops in dependency-layer order (:meth:`StepGraph.execution_order`), each for its
  :class:`~dymem_tf.planning.cost_model.CostModel` time.
* Two serial copy channels run concurrently with compute: D2H (swap-outs, in producer order) and H2D (swap-ins, in
  trigger order). A swap-out starts when its producer has finished and the D2H channel is free. A swap-in starts
  when its trigger op has finished, the tensor's swap-out is done and the H2D channel is free.
* A consumer of a swap-in waits (stalls the compute stream) until that copy is done.
* Memory: a tensor is allocated when its producer starts and freed when its last consumer ends (an element-wise op
  that is the last consumer of a same-sized input reuses that buffer, as TF's kernels do, and a conditional's
  ``Merge`` passes on the buffer of the branch that ran); aliases (Identity, Reshape ... outputs) allocate nothing
  and keep their source's buffer alive for their consumers. A swapped tensor's device buffer (every swap of a
  tensor in it done: a branch's value and its ``Merge`` share one) is freed when both its swap-outs and its last
  original-tensor consumer are done; a swap-in allocates
  its buffer when the copy starts and frees it after its last consumer. Persistent bytes (weights, optimizer slots)
  are constant; variable reads alias them and add nothing.
* A recomputation (:mod:`dymem_tf.planning.recompute`) copies nothing: its tensor's buffer is freed after its
  forward consumers, and its "swap-in" is the chain of ops run again on the compute stream after the trigger
  (taking their modelled time; the consumer waits for it), whose output lives until the last backward consumer;
  the chain's leaves live until it has run. Both count as transient.
* Offloaded optimizer state and weights (:mod:`dymem_tf.planning.offload`) come from host memory: a swap-in starts
  at its trigger, and the last one lives until the copy back after the last use has finished; a weight's first
  stay (its forward users) ends with them, without a copy.
* Kernel temporaries (workspaces, im2col buffers), when measured (:mod:`dymem_tf.planning.memory_model`): an op
  holds its bytes from its start to its end.
* Groups (GTBM): ``persistent``; ``transient`` (ordinary tensors); ``mobile`` (swapped tensors and swap-in buffers).
  The values the step returns are modelled as transient, freed when the step ends; GTBM keeps them in the
  persistent group (:func:`returned_values`), where their few bytes fill the group's holes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from dymem_tf.planning import branches
from dymem_tf.planning.analysis import GRAPPLER_REMOVED_OP_TYPES, METADATA_OP_TYPES, StepGraph, no_autograph
from dymem_tf.planning.cost_model import CostModel, as_cost_model
from dymem_tf.planning.device_profiles import DeviceProfile
from dymem_tf.planning.plan import Plan, Prediction, SwapDecision

GROUPS = ("persistent", "transient", "mobile")

#: Ops whose CPU/GPU kernels write their output into a dying input buffer of the same size
#: (``OpKernelContext::forward_input_or_allocate_output``): element-wise math, bias add, activation gradients.
FORWARDING_OP_TYPES = frozenset({
    "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Ceil", "Cos", "Div", "DivNoNan", "Elu", "EluGrad", "Exp", "Floor",
    "FloorDiv", "Log", "Log1p", "LeakyRelu", "LeakyReluGrad", "Maximum", "Minimum", "Mul", "MulNoNan", "Neg",
    "Pow", "RealDiv", "Reciprocal", "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Round", "Rsqrt", "RsqrtGrad",
    "Selu", "SeluGrad", "Sigmoid", "SigmoidGrad", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "SqrtGrad",
    "Square", "SquaredDifference", "Sub", "Tanh", "TanhGrad",
})
_TRANSIENT, _MOBILE = 0, 1
#: Ops that adopt their input's buffer as the variable's new value (the buffer outlives the step); the in-place
#: AssignAdd/AssignSub variants copy into the existing buffer instead.
VARIABLE_WRITE_OP_TYPES = frozenset({"AssignVariableOp"})
#: ``SimResult.allocations`` group of a buffer that becomes a variable's storage at its last use (GTBM's persistent
#: group: the variable's previous buffer is freed then, so the group's buffers move every step)
ADOPTED = 3
#: Ops through which a function returns its values (the step's outputs)
RETURN_OP_TYPES = frozenset({"_Retval", "_DeviceRetval"})
#: Ops whose output holds references to all their inputs' buffers (the analysis aliases it to the first only)
WRAPPING_OP_TYPES = frozenset({"OptionalFromValue"})


def adopted_values(sg: StepGraph) -> dict[str, str]:
    """Producer op -> variable resource tensor, for every op whose output buffer becomes a variable's new storage.

    An optimizer's update (``m = momentum * m - lr * g``) is computed inside the step and written by
    ``AssignVariableOp``, which adopts its input's buffer: the op producing it, and the element-wise ops forwarding
    their buffer into it, allocate the variable's next buffer, and the previous one is freed."""
    out: dict[str, str] = {}
    for op in sg.ops.values():
        if op.type in VARIABLE_WRITE_OP_TYPES and len(op.inputs) >= 2:
            resource = sg.buffer_of(op.inputs[0]) if op.inputs[0] in sg.tensors else op.inputs[0]
            _mark_allocating_ops(sg, op.inputs[1:], resource, out)
    return out


def returned_values(sg: StepGraph) -> set[str]:
    """The ops that allocate the buffers the step returns to its caller (Keras's logs: the loss and the metrics'
    results). Those buffers outlive the step: the caller holds them until the next step's values replace them, so
    GTBM keeps them with the long-lived tensors, where they cannot pin a block of the next step's transient ones."""
    stack = [t for op in sg.ops.values() if op.type in RETURN_OP_TYPES for t in op.inputs]
    returned, seen = [], set()
    while stack:  # Keras returns its logs wrapped in an optional: a variant (a handle, so persistent) per step
        t = stack.pop()
        if t in seen or t not in sg.tensors:
            continue
        seen.add(t)
        producer = sg.ops[sg.tensors[t].producer]
        if producer.type in WRAPPING_OP_TYPES:  # it holds every value it wraps, not only the one it aliases
            stack.extend(producer.inputs)
        elif sg.tensors[t].alias_of is not None:
            stack.append(sg.tensors[t].alias_of)
        else:
            returned.append(t)
    out: dict[str, None] = {}
    _mark_allocating_ops(sg, returned, None, out, sole_reader=True)
    return set(out)


def _mark_allocating_ops(sg: StepGraph, tensors: Iterable[str], value, out: dict, sole_reader: bool = False) -> None:
    """Maps to ``value`` in ``out`` every op that allocates the buffer of one of ``tensors``: its producer, walking
    back through aliases and in-place element-wise chains (TF forwards the first same-sized input it may reuse;
    variable reads never; with ``sole_reader``, only an input the op alone reads, which it surely reuses). Ops
    already in ``out`` are not walked again."""
    stack = list(tensors)
    while stack:
        info = sg.tensors.get(stack.pop())
        if info is None or info.persistent or info.producer in out:
            continue
        out[info.producer] = value
        producer = sg.ops[info.producer]
        if info.alias_of is not None:
            stack.append(info.alias_of)
        elif producer.type in FORWARDING_OP_TYPES:
            stack.extend([i for i in producer.inputs if sg.tensors.get(i) is not None
                          and not sg.tensors[i].persistent and sg.tensors[i].bytes == info.bytes
                          and (not sole_reader or set(sg.buffer_consumers(sg.buffer_of(i))) == {info.producer})][:1])


@dataclass
class SwapEvent:
    """Simulated timing of one swap-in (and its tensor's swap-out)."""

    tensor: str
    swap_in: int
    bytes: int
    out_start: float
    out_end: float
    in_start: float
    in_end: float
    consumer_start: float
    stall: float


@dataclass
class PeakBuffer:
    """A device buffer live at the simulated peak: ``tensor`` owns it (aliases and tensors written into it in place
    are not separate buffers, see :meth:`Simulator.buffer_tensors`); ``swap_in`` is the index of the swap-in whose
    copy it is, or None for the original."""

    tensor: str
    bytes: int
    group: str
    swap_in: int | None = None


@dataclass
class SimResult:
    """Outcome of :func:`simulate`. ``peak_by_group`` is the breakdown at the peak instant; ``group_peaks`` holds
    each group's own maximum. ``timeline`` rows are ``(t, persistent, transient, mobile)`` after every event;
    ``peak_buffers`` (with the timeline) are the buffers live at the peak instant: their bytes add up to the peak's
    transient and mobile bytes."""

    peak_bytes: int
    peak_by_group: dict[str, int]
    group_peaks: dict[str, int]
    step_time_s: float
    compute_time_s: float
    stall_s: float
    peak_time_s: float
    peak_op: str
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    swap_events: list[SwapEvent] = field(default_factory=list)
    order: list[str] = field(default_factory=list, repr=False)
    op_start_s: np.ndarray | None = field(default=None, repr=False)
    op_end_s: np.ndarray | None = field(default=None, repr=False)
    peak_buffers: list[PeakBuffer] = field(default_factory=list, repr=False)
    #: with the timeline: one row ``(lower, upper, bytes, group)`` per device buffer of the step, its allocation and
    #: free as indices into the step's event order (a half-open lifetime, the replay engine's instance format;
    #: groups numbered as in GTBM: 0 = persistent, a variable the plan keeps; 1 = transient; 2 = mobile; and
    #: :data:`ADOPTED`, persistent too: a kept variable's next buffer, which it adopts at the row's end)
    allocations: np.ndarray | None = field(default=None, repr=False)
    #: the device bytes in use (persistent included) after each memory event, and the events' times (sorted)
    memory_curve: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def as_predicted(self) -> Prediction:
        """What a :class:`Plan` keeps of this simulation as ``predicted``."""
        return Prediction(peak_bytes=int(self.peak_bytes), peak_by_group=dict(self.peak_by_group),
                          step_time_s=float(self.step_time_s), stall_s=float(self.stall_s),
                          compute_time_s=float(self.compute_time_s), peak_op=self.peak_op)


def prepared(step_graph: StepGraph, cost: CostModel, temporaries: Mapping[str, int] | None = None) -> "Simulator":
    """A :class:`Simulator` of ``step_graph`` for ``cost`` and ``temporaries``: the one made last for this graph
    when nothing it was made of has changed since (the graph's analysis, its tensors' sizes and kinds, the cost model,
    the temporaries), else a new one, kept with the graph. The planner's search and the plan's own simulations after
    it (the sequencing's bands, the placement's prediction) then share one preparation of a large step."""
    key = (cost, dict(temporaries) if temporaries else None, _tensor_state(step_graph))
    memo = getattr(step_graph, "_simulator", None)  # kept with the graph's analysis (see StepGraph)
    if memo is not None and memo[0] is step_graph.execution_order() and memo[1] == key:
        return memo[2]
    sim = Simulator(step_graph, cost, temporaries)
    step_graph._simulator = (sim.order, key, sim)  # noqa: SLF001
    return sim


def _tensor_state(step_graph: StepGraph) -> int:
    """A hash of what a simulator reads of the tensors besides the edges: which are persistent or variables, their
    sizes and their aliases (the offload stage marks tensors in place, without a new analysis)."""
    return hash(tuple((t.persistent, t.variable, t.bytes, t.alias_of) for t in step_graph.tensors.values()))


class Simulator:
    """A step graph and cost model prepared once, simulated for many swap sets (the planner's inner loop); a
    simulator is never changed after it is made (:func:`prepared` shares one)."""

    def __init__(self, step_graph: StepGraph, cost: CostModel, temporaries: Mapping[str, int] | None = None):
        """``temporaries``: bytes an op holds while it runs besides its outputs (kernel workspaces, measured by
        :mod:`dymem_tf.planning.memory_model`), allocated at its start and freed at its end."""
        self.sg = step_graph
        self.cost = cost
        self.order = step_graph.execution_order()
        self.pos = {name: i for i, name in enumerate(self.order)}
        times = cost.op_times(step_graph)
        self.dur = np.array([times[n] for n in self.order], dtype=np.float64)
        self.base_end = np.cumsum(self.dur)
        # each op starts exactly where the previous one ended (end - dur can round below it, and an op's
        # temporaries would then overlap the previous op's at the same instant)
        self.base_start = np.concatenate(([0.0], self.base_end[:-1]))
        names, prod, last, size = [], [], [], []
        for t in step_graph.tensors.values():
            if t.persistent or t.bytes <= 0 or t.alias_of is not None:
                continue  # aliases (Identity, Reshape ...) share their source's buffer
            p = self.pos[t.producer]
            names.append(t.name)
            prod.append(p)
            if t.variable:  # a variable's storage: on the device to the step's end
                last.append(len(self.order) - 1)
            else:
                last.append(max([p] + [self.pos[c] for c in self._buffer_users(t.name)]))
            size.append(t.bytes)
        self.chain: dict[str, list[str]] = {}  # buffer owner -> tensors that reuse its buffer (itself first)
        self.buffer_root: dict[str, str] = {}  # forwarded tensor -> owner of the buffer it reuses
        # of two exclusive branches of a conditional only the heavier runs in the model: the other allocates nothing
        self.uncounted, merges = branches.counted_branches(step_graph)
        names, prod, last, size = self._forward_buffers(names, prod, last, size, merges)
        if self.uncounted:
            size = [0 if step_graph.tensors[n].producer in self.uncounted else b for n, b in zip(names, size)]
        self.t_names = names
        self.t_index = {n: i for i, n in enumerate(names)}
        self.t_prod = np.array(prod, dtype=np.int64)
        self.t_last = np.array(last, dtype=np.int64)
        self.t_bytes = np.array(size, dtype=np.int64)
        self.t_resident = np.array([step_graph.tensors[n].variable for n in names], dtype=bool)
        adopted = adopted_values(step_graph)
        self.t_adopts = [adopted.get(step_graph.tensors[n].producer) for n in names]  # the variable it becomes
        held = [(self.pos[n], int(b)) for n, b in (temporaries or {}).items()
                if n in self.pos and b > 0 and n not in self.uncounted]
        self.tmp_pos = np.array([p for p, _ in held], dtype=np.int64)
        self.tmp_bytes = np.array([b for _, b in held], dtype=np.int64)
        self._optional_chains: dict[str, set[str]] = {}

    def buffer_tensors(self, owner: str) -> list[str]:
        """The tensors whose data lives in ``owner``'s buffer: ``owner``, the tensors forwarded into it and the
        aliases of each (an empty list for a tensor that owns no buffer)."""
        if owner not in self.t_index and owner not in self.chain:
            return []
        aliases = self.sg.aliases()
        return [n for name in self.chain.get(owner, [owner]) for n in [name] + aliases.get(name, [])]

    def _optional_chain(self, wrap: str) -> set[str]:
        """:meth:`StepGraph.optional_chain` of ``wrap`` ("": none), cached: every simulation of a plan that swaps
        through an optional reads it."""
        if wrap not in self._optional_chains:
            self._optional_chains[wrap] = self.sg.optional_chain(wrap) if wrap else set()
        return self._optional_chains[wrap]

    def _buffer_users(self, tensor: str) -> list[str]:
        """Ops that keep ``tensor``'s buffer alive. Shape/Size/Rank of a tensor whose shape is static do not
        (Grappler folds them into constants), nor do identities (Grappler removes them; their consumers, which
        read the same buffer, still count)."""
        static = self.sg.tensors[tensor].shape_known
        return [c for c in self.sg.buffer_consumers(tensor)
                if not (static and self.sg.ops[c].type in METADATA_OP_TYPES)
                and self.sg.ops[c].type not in GRAPPLER_REMOVED_OP_TYPES]

    def _forward_buffers(self, names, prod, last, size, merges: Mapping[str, str]):
        """Model TF's buffer forwarding: an element-wise op whose input buffer dies at that op (it is the buffer's
        last consumer) and has the output's size writes its output in place instead of allocating; a conditional's
        ``Merge`` always passes on the buffer of the branch that ran (here: the branch the model counts).

        The output then extends the input's buffer (one allocation from the first producer to the last consumer of
        the chain) and allocates nothing itself. ``merges``: :func:`branches.counted_merge_inputs`.
        """
        index = {n: i for i, n in enumerate(names)}
        root_of = list(range(len(names)))
        removed = [False] * len(names)

        def root(i: int) -> int:
            while root_of[i] != i:
                i = root_of[i]
            return i

        for p, op_name in enumerate(self.order):
            op = self.sg.ops[op_name]
            merged = merges.get(op_name)
            if op.type not in FORWARDING_OP_TYPES and merged is None:
                continue
            for out in op.outputs[:1] if merged else op.outputs:
                oi = index.get(out)
                if oi is None:
                    continue
                for inp in [merged] if merged else op.inputs:
                    src = index.get(self.sg.buffer_of(inp))
                    if src is None:
                        continue
                    ri = root(src)
                    if ri != oi and size[ri] == size[oi] and (merged or last[ri] == p):
                        last[ri] = max(last[ri], last[oi])
                        root_of[oi] = ri
                        removed[oi] = True
                        break
        for i, n in enumerate(names):
            if removed[i]:
                r = names[root(i)]
                self.buffer_root[n] = r
                self.chain.setdefault(r, [r]).append(n)
        keep = [i for i in range(len(names)) if not removed[i]]
        return ([names[i] for i in keep], [prod[i] for i in keep], [last[i] for i in keep], [size[i] for i in keep])

    def _leaves_extended(self, swaps: Sequence[SwapDecision], recomputed: list[bool]) -> np.ndarray:
        """Last positions of the buffers, the leaves of each recomputation kept until it runs."""
        if not any(recomputed):
            return self.t_last
        t_last = self.t_last.copy()
        for s, rec in zip(swaps, recomputed):
            if not rec:
                continue
            at = min(self.pos[c] for c in s.swap_ins[0].consumers)
            for leaf in s.recompute.leaves:
                owner = self.sg.buffer_of(leaf)
                li = self.t_index.get(self.buffer_root.get(owner, owner))
                if li is not None:
                    t_last[li] = max(t_last[li], at)
        return t_last

    # ----------------------------------------------------------------------------------------------- timing
    def _validate(self, swaps: Sequence[SwapDecision]) -> None:
        seen: set[str] = set()
        for s in swaps:
            if s.tensor in seen:
                raise ValueError(f"plan swaps {s.tensor!r} twice")
            seen.add(s.tensor)
            t = self.sg.tensors.get(s.tensor)
            if t is None:
                raise ValueError(f"plan swaps unknown tensor {s.tensor!r}")
            if t.persistent:
                raise ValueError(f"plan swaps persistent tensor {s.tensor!r}")
            if t.variable != (s.kind in ("variable", "weight")):
                raise ValueError(f"plan swaps {s.tensor!r} as a {s.kind}, but it is "
                                 f"{'a variable' if t.variable else 'a feature map'}")
            if (s.keep_rows or s.kept_bytes) and not _partial_ok(s, t):
                raise ValueError(f"plan keeps {s.keep_rows} rows ({s.kept_bytes} bytes) of {s.tensor!r} on the "
                                 f"device: a partial swap keeps some, not all, of a feature map's rows")
            if s.kind == "variable" and (len(s.swap_ins) != 1 or set(s.swap_ins[0].consumers) != set(t.consumers)):
                raise ValueError(f"variable {s.tensor!r} needs one swap-in before all of its uses")
            if s.kind == "weight":
                self._validate_weight(s)
                continue
            if s.kind == "recompute":
                self._validate_recompute(s)
                continue
            if t.alias_of is not None:
                raise ValueError(f"plan swaps {s.tensor!r}, an alias of {t.alias_of!r}: swap the buffer's owner")
            for si in s.swap_ins:
                if si.trigger_op and si.trigger_op not in self.pos:
                    raise ValueError(f"swap-in of {s.tensor!r} has unknown trigger op {si.trigger_op!r}")
                if not si.consumers:
                    raise ValueError(f"a swap-in of {s.tensor!r} has no consumers")
                tp = self._trigger_pos(s, si)
                if si.trigger_op and tp <= self.pos[t.producer]:
                    raise ValueError(f"swap-in of {s.tensor!r} is triggered by {si.trigger_op!r}, "
                                     f"which does not run after the producer {t.producer!r}")
                via = {c: a for c, a in s.alias_reads}
                readable = set(t.consumers) | self._optional_chain(s.optional_wrap)
                for c in si.consumers:
                    if c not in t.consumers and (c not in via or via[c] not in readable):
                        raise ValueError(f"{c!r} is not a consumer of {s.tensor!r} nor of an alias op of it")
                    if self.pos[c] <= tp:
                        raise ValueError(f"swap-in of {s.tensor!r}: trigger {si.trigger_op!r} does not run "
                                         f"before consumer {c!r}")

    def _validate_weight(self, s: SwapDecision) -> None:
        """A weight's two stays: each swap-in's trigger runs before its users, the second after the first's users."""
        if len(s.swap_ins) != 2 or s.route is None:
            raise ValueError(f"weight {s.tensor!r} needs two swap-ins (forward, backward) and a route")
        last = self.pos[s.producer]
        for si in s.swap_ins:
            if (si.trigger_op and si.trigger_op not in self.pos) or any(c not in self.pos for c in si.consumers) \
                    or not si.consumers:
                raise ValueError(f"a swap-in of weight {s.tensor!r} names unknown ops or has no users")
            tp = self.pos[si.trigger_op] if si.trigger_op else last
            if not last <= tp < min(self.pos[c] for c in si.consumers):
                raise ValueError(f"a swap-in of weight {s.tensor!r} is not triggered between its previous stay "
                                 f"and its users")
            last = max(self.pos[c] for c in si.consumers)

    def _validate_recompute(self, s: SwapDecision) -> None:
        """A recomputation: its chain's ops exist, one swap-in (the copy) triggered before the consumers it feeds,
        which its reroutes name."""
        r = s.recompute
        if r is None or len(s.swap_ins) != 1 or not r.ops or any(op not in self.pos for op, _ in r.ops):
            raise ValueError(f"recomputation of {s.tensor!r} needs its chain of ops and one swap-in")
        si = s.swap_ins[0]
        if (si.trigger_op and si.trigger_op not in self.pos) or not si.consumers \
                or any(c not in self.pos for c in si.consumers):
            raise ValueError(f"recomputation of {s.tensor!r} names unknown ops")
        if set(si.consumers) != {c for c, _ in r.reroutes}:
            raise ValueError(f"recomputation of {s.tensor!r} must feed exactly the consumers it reroutes")
        if not self.pos[s.producer] < self._trigger_pos(s, si, after=1) < min(self.pos[c] for c in si.consumers):
            raise ValueError(f"recomputation of {s.tensor!r} is not triggered between its producer and consumers")

    def _trigger_pos(self, s: SwapDecision, si, after: int = 0) -> int:
        """Position of the op whose end starts swap-in ``si``: its trigger or, for a swap-in without one (its layer
        ran only inside a conditional branch: :func:`dymem_tf.planning.pipeline.drop_conditional_triggers`), the
        producer's plus ``after``: the copy starts as soon as its input is there, as the rewrite runs it."""
        return self.pos[si.trigger_op] if si.trigger_op else self.pos[s.producer] + after

    def recompute_time(self, s: SwapDecision) -> float:
        """Modelled time of the ops a recomputation copies."""
        return float(sum(self.dur[self.pos[op]] for op, _ in s.recompute.ops))

    def run(self, swaps: Sequence[SwapDecision], persistent_bytes: int = 0, timeline: bool = True,
            validate: bool = True) -> SimResult:
        """Simulate the step with ``swaps``: its timing, its memory curve by group, and with ``timeline`` the
        dashboard's rows, the buffers live at the peak and the allocations for placement."""
        if validate:
            self._validate(swaps)
        sched = self._schedule(swaps)
        mem = self._memory_events(swaps, sched)
        curve = _MemoryCurve.of(mem, int(persistent_bytes))
        rows, live, allocations = self._timeline(swaps, sched, mem, curve) if timeline else ([], [], None)
        sw_events = [SwapEvent(swaps[i].tensor, k, nbytes, sched.out_start[i], sched.out_end[i], sched.in_start[j],
                               sched.in_end[j], sched.cons_start[j], sched.stall_of[j])
                     for j, (i, k, nbytes, _tp, _c0, _c1) in enumerate(sched.swap_ins)]
        compute = float(self.dur.sum())
        step = float(sched.end[-1]) if len(sched.end) else 0.0
        step = max([step] + [sched.out_end[i] for i in range(len(swaps)) if sched.variable[i]])  # copies back
        return SimResult(curve.peak, curve.by_group, curve.group_peaks, step, compute, float(sum(sched.stall_of)),
                         curve.peak_time, self.order[curve.peak_key] if curve.peak_key >= 0 else "", rows, sw_events,
                         self.order, sched.start, sched.end, live, allocations,
                         (curve.times, curve.total + curve.persistent))

    def _schedule(self, swaps: Sequence[SwapDecision]) -> _Schedule:
        """The step's timing with ``swaps``: the copy channels, the stalls they cause and the shifted op times."""
        cost = self.cost
        # Events on the op sequence: 0 = wait before op start, 1 = producer end (swap-out), 2 = trigger end.
        # The last field orders swap-ins sharing a trigger by their first consumer (earliest deadline first).
        events: list[tuple[int, int, int, int]] = []
        sched = _Schedule(variable=[self.sg.tensors[s.tensor].variable for s in swaps],
                          recomputed=[s.kind == "recompute" for s in swaps])
        variable, recomputed, swap_ins = sched.variable, sched.recomputed, sched.swap_ins
        for i, s in enumerate(swaps):
            # a variable goes back to host memory after its last use (it comes from there: no swap-out before)
            out_pos = max(self.pos[c] for si in s.swap_ins for c in si.consumers) if variable[i] else \
                self.pos[s.producer]
            if not recomputed[i]:  # a recomputation copies nothing to host memory
                events.append((out_pos, 1, i, i))
            for k, si in enumerate(s.swap_ins):
                cpos = [self.pos[c] for c in si.consumers]
                j = len(swap_ins)
                tp = self._trigger_pos(s, si)
                swap_ins.append((i, k, s.bytes, tp, min(cpos), max(cpos)))
                events.append((tp, 2, min(cpos), j))
                events.append((min(cpos), 0, j, j))
        events.sort()
        n_in = len(swap_ins)
        out_start, out_end = sched.out_start, sched.out_end
        out_start += [0.0] * len(swaps)
        out_end += [0.0] * len(swaps)
        in_start, in_end, stall_of, cons_start = sched.in_start, sched.in_end, sched.stall_of, sched.cons_start
        for values in (in_start, in_end, stall_of, cons_start):
            values += [0.0] * n_in
        offset = 0.0
        stall_pos: list[int] = []
        stall_cum: list[float] = []
        d2h_free = h2d_free = recompute_free = 0.0
        for pos, kind, key, j in events:
            if kind == 0:
                start = self.base_start[pos] + offset
                ready = in_end[j]
                if ready > start:
                    stall_of[j] = ready - start
                    offset += ready - start
                    stall_pos.append(pos)
                    stall_cum.append(offset)
                cons_start[j] = self.base_start[pos] + offset
            elif kind == 1:
                end = self.base_end[pos] + offset
                st = max(end, d2h_free)
                out_start[j] = st
                out_end[j] = d2h_free = st + cost.copy_time(swaps[j].moved_bytes, "d2h")
            else:
                i, _k, nbytes, _tp, _c0, _c1 = swap_ins[j]
                end = self.base_end[pos] + offset
                if recomputed[i]:  # the chain's copies run on the compute stream, after the trigger
                    in_start[j] = st = max(end, recompute_free)
                    in_end[j] = recompute_free = st + self.recompute_time(swaps[i])
                    continue
                st = max(end, h2d_free, 0.0 if variable[i] else out_end[i])
                in_start[j] = st
                in_end[j] = h2d_free = st + cost.copy_time(nbytes - swaps[i].kept_bytes, "h2d")
        # Offsets apply from each stalled op on: piecewise-constant shift of the base schedule.
        shift = np.zeros(len(self.order) + 1)
        prev = 0.0
        for p, cum in zip(stall_pos, stall_cum):
            shift[p] += cum - prev
            prev = cum
        shift = np.cumsum(shift)[:-1]
        sched.start = self.base_start + shift
        sched.end = self.base_end + shift
        return sched

    def _memory_events(self, swaps: Sequence[SwapDecision], sched: _Schedule) -> _MemoryEvents:
        """Every allocation and free of the step with ``swaps``, in (allocations, frees) pairs of parts: kept
        tensors, swapped tensors' originals, kernel temporaries, swap-in buffers."""
        start, end, out_end, recomputed, variable = sched.start, sched.end, sched.out_end, sched.recomputed, \
            sched.variable
        mem = _MemoryEvents(keep=np.ones(len(self.t_names), dtype=bool))
        rel_time, rel_key = [], []
        t_last = self._leaves_extended(swaps, recomputed)
        for ti, group in self._swapped_buffers(swaps).items():
            mem.keep[ti] = False
            group = [i for i in group if not variable[i]]
            if not group:
                continue  # in host memory from the step's start: no device buffer before its swap-in
            mem.mob_idx.append(ti)
            mem.mob_group.append(_TRANSIENT if all(recomputed[i] for i in group) else _MOBILE)
            lf = self._original_last_use(ti, [swaps[i] for i in group])
            rel_time.append(max([end[lf]] + [out_end[i] for i in group]))
            rel_key.append(lf)
        keep = mem.keep
        tp, tl, tb = self.t_prod[keep], t_last[keep], self.t_bytes[keep]
        mem.add(start[tp], end[tl], tp, tl, 1, tb, _TRANSIENT)
        if mem.mob_idx:
            mi = np.array(mem.mob_idx, dtype=np.int64)
            mem.add(start[self.t_prod[mi]], np.array(rel_time), self.t_prod[mi], np.array(rel_key, dtype=np.int64),
                    1, self.t_bytes[mi], np.array(mem.mob_group, dtype=np.int64))
        if len(self.tmp_pos):  # kernel temporaries: held from the op's start to its end
            mem.add(start[self.tmp_pos], end[self.tmp_pos], self.tmp_pos, self.tmp_pos, 1, self.tmp_bytes,
                    _TRANSIENT)
        swap_ins = sched.swap_ins
        if swap_ins:
            sw = np.array([(x[3], x[5], x[2]) for x in swap_ins], dtype=np.int64)
            # a variable's (last) swap-in lives until its swap-out after the last use has copied it back; a weight's
            # first stay ends with its forward users (it goes back without a copy)
            last_in = [variable[x[0]] and x[1] == len(swaps[x[0]].swap_ins) - 1 for x in swap_ins]
            in_free = np.array([max(end[x[5]], out_end[x[0]]) if last else end[x[5]]
                                for x, last in zip(swap_ins, last_in)])
            mem.add(np.array(sched.in_start), in_free, sw[:, 0], sw[:, 1], 3, sw[:, 2],
                    np.array([_TRANSIENT if recomputed[x[0]] else _MOBILE for x in swap_ins], dtype=np.int64))
        partial = self._kept_rows(swaps, sched)
        mem.kept_of = [i for i, *_ in partial]
        if partial:
            _i, alloc, free, key_alloc, key_free, nbytes = (np.array(v) for v in zip(*partial))
            mem.add(alloc, free, key_alloc, key_free, 1, nbytes.astype(np.int64), _MOBILE)
        return mem

    def _kept_rows(self, swaps: Sequence[SwapDecision], sched: _Schedule) -> list[tuple]:
        """``(swap index, allocated, freed, op position of each, bytes)`` of the rows each partial swap keeps on
        the device: made by its swap-out once the producer is done, read by each of its swap-ins, the last of which
        frees them once its copy is done."""
        last: dict[int, int] = {}
        for j, (i, *_rest) in enumerate(sched.swap_ins):
            if swaps[i].kept_bytes > 0:
                last[i] = j if i not in last or sched.in_end[j] > sched.in_end[last[i]] else last[i]
        return [(i, sched.out_start[i], sched.in_end[j], self.pos[swaps[i].producer], sched.swap_ins[j][3],
                 swaps[i].kept_bytes) for i, j in sorted(last.items())]

    def _swapped_buffers(self, swaps: Sequence[SwapDecision]) -> dict[int, list[int]]:
        """Buffer index -> the indices of the swaps of tensors in it (a branch's value and the ``Merge`` passing it
        on share one buffer; zero-byte tensors have none)."""
        out: dict[int, list[int]] = {}
        for i, s in enumerate(swaps):
            ti = self.t_index.get(self.buffer_root.get(s.tensor, s.tensor))
            if ti is not None:
                out.setdefault(ti, []).append(i)
        return out

    def _original_last_use(self, ti: int, swaps: list[SwapDecision]) -> int:
        """Position of the last op that reads buffer ``ti`` itself, not a swap-in of one of ``swaps`` (the swaps of
        tensors in it): the original serves every consumer that no swap-in feeds, and a forwarded buffer lives on
        for the consumers of every tensor written into it."""
        owner = self.t_names[ti]
        fed = {c for s in swaps for si in s.swap_ins for c in si.consumers}
        chain = []
        for name in self.chain.get(owner, [owner]):
            if self.sg.tensors[name].producer in fed:
                break  # written by an op that now reads the swap-in: not in the original buffer any more
            chain.append(name)
        users = [c for name in chain for c in self._buffer_users(name)]
        for s in swaps:
            fed |= self._optional_chain(s.optional_wrap)  # it holds the host copy: no longer the original
        return max([int(self.t_prod[ti])] + [self.pos[c] for c in users if c not in fed])

    def _timeline(self, swaps, sched: _Schedule, mem: _MemoryEvents, curve: _MemoryCurve):
        """The dashboard's memory rows, the buffers live at the peak, and the allocations (allocation event, free
        event, bytes, GTBM group) that :mod:`dymem_tf.memory.placement` replays."""
        persistent = curve.persistent
        rows = [(0.0, persistent, 0, 0)]
        rows += list(zip(curve.times.tolist(), [persistent] * len(curve.times), curve.trans.tolist(),
                         curve.mob.tolist()))
        if not len(curve.total):
            return rows, [], None
        keep = mem.keep
        # the buffers allocated by the events up to the peak's and freed by a later one
        buffers = [PeakBuffer(n, int(b), "transient") for n, b in
                   zip(np.array(self.t_names, dtype=object)[keep].tolist(), self.t_bytes[keep].tolist())]
        buffers += [PeakBuffer(self.t_names[i], int(self.t_bytes[i]), "mobile" if g == _MOBILE else "transient")
                    for i, g in zip(mem.mob_idx, mem.mob_group)]
        buffers += [PeakBuffer(f"{self.order[p]} (temporaries)", int(b), "transient")
                    for p, b in zip(self.tmp_pos.tolist(), self.tmp_bytes.tolist())]
        buffers += [PeakBuffer(swaps[i].tensor, int(nbytes), "transient" if sched.recomputed[i] else "mobile", k)
                    for i, k, nbytes, _tp, _c0, _c1 in sched.swap_ins]
        buffers += [PeakBuffer(f"{swaps[i].tensor} (kept rows)", swaps[i].kept_bytes, "mobile") for i in mem.kept_of]
        idx, pk, parts_d, parts_g = curve.order, curve.peak_index, mem.d, mem.g
        rank = np.empty(len(idx), dtype=np.int64)
        rank[idx] = np.arange(len(idx))
        bounds = np.cumsum([0] + [len(p) for p in parts_d])  # parts come in (allocations, frees) pairs
        alloc = np.concatenate([rank[bounds[j]:bounds[j + 1]] for j in range(0, len(parts_d), 2)])
        free = np.concatenate([rank[bounds[j]:bounds[j + 1]] for j in range(1, len(parts_d), 2)])
        live = [buffers[b] for b in np.flatnonzero((alloc <= pk) & (free > pk)).tolist()]
        groups = np.where(np.concatenate(parts_g[0::2]) == _MOBILE, 2, 1)
        kept = groups[:int(keep.sum())]
        kept[self.t_resident[keep]] = 0  # a kept variable: GTBM's persistent group
        offloaded = {s.tensor for s in swaps}
        adopts = np.array([v is not None and v not in offloaded for v in self.t_adopts], dtype=bool)
        kept[adopts[keep]] = ADOPTED  # the next buffer of a variable the device keeps
        allocations = np.stack([alloc, free, np.concatenate(parts_d[0::2]), groups], axis=1).astype(np.int64)
        return rows, live, allocations


def _partial_ok(s: SwapDecision, t) -> bool:
    """Whether ``s``'s kept rows are some, not all, of feature map ``t``'s, their bytes in proportion."""
    rows = t.shape[0] if t.shape and t.shape_known else 0
    return (s.kind == "tensor" and not s.optional_wrap and 0 < s.keep_rows < rows
            and s.kept_bytes * rows == s.keep_rows * s.bytes)


@dataclass
class _Schedule:
    """The step's timing under one set of swaps (:meth:`Simulator._schedule`)."""

    variable: list[bool]  # per swap: an offloaded variable (it starts in host memory)
    recomputed: list[bool]  # per swap: a recomputation (no copies)
    #: per swap-in: (swap index, swap-in index, bytes, trigger position, first and last consumer positions)
    swap_ins: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    out_start: list[float] = field(default_factory=list)  # per swap
    out_end: list[float] = field(default_factory=list)
    in_start: list[float] = field(default_factory=list)  # per swap-in
    in_end: list[float] = field(default_factory=list)
    stall_of: list[float] = field(default_factory=list)
    cons_start: list[float] = field(default_factory=list)
    start: np.ndarray | None = None  # per op in execution order, stalls included
    end: np.ndarray | None = None


@dataclass
class _MemoryEvents:
    """The step's allocations and frees, as parallel arrays in (allocations, frees) pairs of parts: time, sort
    keys (op position, then kind: 1 allocate, 2 free, 3 swap-in allocate), byte delta and group."""

    keep: np.ndarray  # per tensor: not swapped (its buffer lives from producer to last use)
    mob_idx: list[int] = field(default_factory=list)  # tensors swapped or recomputed, with their group
    mob_group: list[int] = field(default_factory=list)
    kept_of: list[int] = field(default_factory=list)  # the swaps whose kept rows are a part (partial swaps), in order
    t: list[np.ndarray] = field(default_factory=list)
    k1: list[np.ndarray] = field(default_factory=list)
    k2: list[np.ndarray] = field(default_factory=list)
    d: list[np.ndarray] = field(default_factory=list)
    g: list[np.ndarray] = field(default_factory=list)

    def add(self, t_alloc, t_free, key_alloc, key_free, kind_alloc: int, nbytes, group) -> None:
        """One part pair: allocations at ``t_alloc`` and frees at ``t_free`` of ``nbytes`` in ``group``."""
        n = len(key_alloc)
        groups = np.full(n, group) if np.isscalar(group) else group
        self.t += [t_alloc, t_free]
        self.k1 += [key_alloc, key_free]
        self.k2 += [np.full(n, kind_alloc), np.full(n, 2)]
        self.d += [nbytes, -nbytes]
        self.g += [groups, groups]


@dataclass
class _MemoryCurve:
    """Bytes in use after each memory event, by group, and the peak."""

    persistent: int
    order: np.ndarray  # the events' sort order (indices into the concatenated parts)
    times: np.ndarray
    trans: np.ndarray
    mob: np.ndarray
    total: np.ndarray  # transient + mobile
    peak: int
    peak_index: int  # position of the peak in the sorted events (-1 without events)
    peak_key: int  # op position of the peak's event (-1 without events)
    peak_time: float
    by_group: dict
    group_peaks: dict

    @classmethod
    def of(cls, mem: _MemoryEvents, persistent: int) -> _MemoryCurve:
        """Sort ``mem``'s events (time, op position, kind) and sum them by group."""
        ev_t = np.concatenate(mem.t) if mem.t else np.zeros(0)
        ev_k1, ev_k2 = np.concatenate(mem.k1), np.concatenate(mem.k2)
        ev_d, ev_g = np.concatenate(mem.d).astype(np.int64), np.concatenate(mem.g)
        idx = np.lexsort((ev_k2, ev_k1, ev_t))
        ev_t, ev_k1, ev_d, ev_g = ev_t[idx], ev_k1[idx], ev_d[idx], ev_g[idx]
        trans = np.cumsum(np.where(ev_g == _TRANSIENT, ev_d, 0))
        mob = np.cumsum(np.where(ev_g == _MOBILE, ev_d, 0))
        total = trans + mob
        if not len(total):
            by_group = {"persistent": persistent, "transient": 0, "mobile": 0}
            return cls(persistent, idx, ev_t, trans, mob, total, persistent, -1, -1, 0.0, by_group, dict(by_group))
        pk = int(np.argmax(total))
        by_group = {"persistent": persistent, "transient": int(trans[pk]), "mobile": int(mob[pk])}
        group_peaks = {"persistent": persistent, "transient": int(trans.max()), "mobile": int(mob.max())}
        return cls(persistent, idx, ev_t, trans, mob, total, int(total[pk]) + persistent, pk, int(ev_k1[pk]),
                   float(ev_t[pk]), by_group, group_peaks)


@no_autograph
def simulate(step_graph: StepGraph, plan: Plan | Iterable[SwapDecision] | None,
             profile: str | DeviceProfile | CostModel = "cpu", persistent_bytes: int | None = None,
             timeline: bool = True, temporaries: Mapping[str, int] | None = None) -> SimResult:
    """Simulate one step of ``step_graph`` under ``plan`` (a :class:`Plan`, a list of swaps or None).

    ``persistent_bytes`` defaults to the plan's; ``temporaries`` are the bytes ops hold while they run
    (:meth:`~dymem_tf.planning.memory_model.MeasuredMemory.held_during`). Raises ValueError for swaps that cannot
    run as planned (trigger not between producer and consumers, unknown ops, persistent tensors).
    """
    if isinstance(plan, Plan):
        swaps = plan.swaps
        if persistent_bytes is None:
            persistent_bytes = plan.persistent_bytes
    else:
        swaps = list(plan or [])
    return prepared(step_graph, as_cost_model(profile), temporaries).run(swaps, persistent_bytes or 0,
                                                                         timeline=timeline)
