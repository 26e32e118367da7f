"""The Dymem pass over an instantiated train step: analyse ▶ defer ▶ plan ▶ rewrite, after Grappler.

TensorFlow offers every instantiated function graph that holds gradient ops to a :class:`StepPass` while the
callback's train function runs (:mod:`dymem_tf.passes.graph_pass`, ``cc/pass/graph_pass.cc``). The graph is the one
TF will execute: Grappler has fused, folded and rewritten it already. The pass reads it (with the shapes TF's own shape inference gives, :mod:`dymem_tf.passes.graph_def_view`), builds the step
graph of each training device (:mod:`dymem_tf.passes.graph_capture`), defers gradient-independent optimizer arithmetic
(:mod:`dymem_tf.planning.update_deferral`), plans the swaps (:mod:`dymem_tf.planning.planner`) and hands the plan back to the C++
pass, which inserts the swap ops by node name (all or nothing). Because Grappler has finished, the inserted ops
cannot change any of its numeric rewrites: training is bit-identical by construction.

Each instantiation (first call, retrace on a new input shape) gets its own plan; under a distribution strategy
with several local replicas each replica's device gets its own plan (``TraceRecord.replica``).

Constructs the pass cannot plan leave the graph unmodified, with one warning per construct
(:class:`SkippedTrace`): a loop feeding the backward pass, forward tensors needed by the backward pass whose size
is unknown, a step without gradient ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc
import hashlib
import logging
import re
import time
from collections import Counter

import numpy as np
import tensorflow as tf

from dymem_tf import compat, op_sets
from dymem_tf.memory import placement
from dymem_tf.passes import graph_capture, graph_def_view, graph_pass
from dymem_tf.planning import first_step, pipeline, planner, simulator, stages

logger = logging.getLogger("dymem_tf")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What the next instantiation of the train step is planned for. The callback makes one per state of its
    first step (:mod:`dymem_tf.planning.first_step`) and arms the pass with it; the pass only reads it."""

    budget_bytes: int | None = None  # None: no budget (swap every tensor worth swapping)
    headroom: float = planner.DEFAULT_HEADROOM  # share of the budget the planner leaves free
    #: plan for the least device memory (the first step under a budget, measured to calibrate the next plan)
    probe: bool = False
    calibration: first_step.Calibration | None = None  # what the probe measured, for the budgeted plan
    memory: object = None  # kernel temporaries measured in the probe (a planning.memory_model.MeasuredMemory)
    persistent_bytes: int = 0  # bytes of weights and optimizer slots
    #: batch size to plan with when the graph's batch dimension is unknown (from ``fit``)
    default_batch_size: int | None = None
    #: batch size seen in the first batches of data whose adapter reports none (a Python generator): not a bound
    #: on later batches, so it is planned with only without a budget
    observed_batch_size: int | None = None

    def plans_again(self) -> bool:
        """Whether this instantiation's graph is likely planned again: under a budget the probe's step is
        instantiated anew for the calibrated plan, with the same graph."""
        return self.budget_bytes is not None


@dataclasses.dataclass
class PassOutcome:
    """What became of the instantiations offered to a listener (:meth:`StepPass.listener`): made by whoever arms
    the pass for one call of the train function, written by the pass, read after the call."""

    #: the error that made the pass cancel an instantiation (TF raises a CancelledError in its place)
    refusal: planner.BudgetTooSmallError | None = None


@dataclasses.dataclass
class RewriteReport:
    """What the pass inserted into one instantiated graph."""

    swapped_tensors: int = 0
    swap_out_ops: list = dataclasses.field(default_factory=list)
    swap_in_ops: list = dataclasses.field(default_factory=list)
    rerouted_inputs: int = 0
    deferral_edges: int = 0
    offloaded_variables: int = 0  # optimizer variables offloaded between their uses (part of swapped_tensors)
    offloaded_weights: int = 0  # weights kept in host memory between their uses (part of swapped_tensors)
    recomputed: int = 0  # feature maps computed again for the backward pass (part of swapped_tensors)

    def summary(self) -> str:
        text = (f"{self.swapped_tensors} tensors swapped: {len(self.swap_out_ops)} swap-outs, "
                f"{len(self.swap_in_ops)} swap-ins, {self.rerouted_inputs} consumer inputs rerouted")
        if self.offloaded_variables:
            text += f"; {self.offloaded_variables} of them optimizer variables offloaded between their uses"
        if self.offloaded_weights:
            text += f"; {self.offloaded_weights} of them weights kept in host memory between their uses"
        if self.recomputed:
            text += f"; {self.recomputed} of them recomputed instead"
        return text


@dataclasses.dataclass
class TraceRecord:
    """One application of the pass to one instantiated graph (one replica's part of it under a strategy)."""

    function_name: str
    batch_size: int | None
    step_graph: object
    plan: object
    report: RewriteReport
    replica: int | None = None
    #: the graph TF runs, swap ops included (None: not rewritten)
    rewritten: graph_def_view.RewrittenGraph | None = None
    #: wall seconds the pass took on this instantiation: reading the graph, capturing, planning (calibrated plans:
    #: every placement re-plan) and the C++ rewrite, for all replicas together
    pass_seconds: float = 0.0
    #: the pass's exclusive seconds per stage (:mod:`dymem_tf.planning.stages`; printed with ``verbose=2``)
    stage_times: stages.StageTimes = stages.StageTimes()

    @property
    def graph(self) -> graph_def_view.GraphView:
        """The graph TF runs (after Grappler, with the swap ops), as a read-only ``tf.Graph``-like view (one view
        for all replicas' records of an instantiation)."""
        return self.rewritten.view()


class SkipKind(str, enum.Enum):
    """Why the pass left a graph unmodified."""

    UNSUPPORTED_GRAPH = "unsupported-graph"  # no ops, a cycle, a plan that did not fit the graph
    CONTROL_FLOW = "control-flow"  # a loop inside the step
    UNKNOWN_SHAPE = "unknown-shape"  # a tensor kept for the backward pass has no static size
    NO_GRADIENTS = "no-gradients"  # nothing is kept for a backward pass

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """The first construct of a step that the pass cannot plan: its kind, the op or tensor, and the explanation."""

    kind: SkipKind
    subject: str
    detail: str


@dataclasses.dataclass
class SkippedTrace:
    """A graph the pass left unmodified: ``kind`` is ``"unsupported-graph"`` (no ops, a cycle, a plan that did
    not fit the graph), ``"control-flow"``, ``"unknown-shape"`` or ``"no-gradients"``; ``subject`` names the op
    or tensor; ``reason`` is the warning's text."""

    function_name: str
    kind: SkipKind
    subject: str
    reason: str
    replica: int | None = None


#: Loops (a Keras RNN on the TensorFlow backend; lowered to Enter/Exit/NextIteration frames by the time the pass
#: runs): they keep per-iteration feature maps in TensorList accumulators, which the planner can neither size
#: nor swap.
LOOP_OP_TYPES = frozenset({"While", "StatelessWhile", "Enter", "NextIteration", "LoopCond"})
#: Conditionals and function calls that were not inlined: what the backward pass needs from them leaves them as
#: outputs, so they are planned as opaque ops.
OPAQUE_OP_TYPES = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                             "StatefulPartitionedCall"})
#: Lowered control flow's plumbing: its outputs forward tensors (a loop's counter, an Optional) and are not
#: feature maps.
FLOW_OP_TYPES = frozenset({"Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond"})
#: Ops that hand the step its batch (a strategy's per-device iterators included): the native pass's step inputs
#: (:data:`dymem_tf.op_sets.STEP_INPUT_TYPES`) and the optional-returning iterator, whose one output it cannot fill.
INPUT_OP_TYPES = op_sets.STEP_INPUT_TYPES | {"IteratorGetNextAsOptional"}
_REPLICA_SCOPE = re.compile(r"(?:^|/)replica_(\d+)/")


NO_GRADIENTS = ("the step has no gradient ops (no GradientTape.gradient in train_step, or no trainable weights), "
                "so no feature map is kept for a backward pass and there is nothing to swap.")


OBSERVED_NOTE = ("batch size {} as seen in the first batches of the data (its adapter reports no batch size): a "
                 "later batch of another size runs the same swaps; only the plan's predicted sizes and times differ")
OBSERVED_UNDER_BUDGET = ("; the batch size is known only from the first batches of the data ({}), which do not "
                         "bound the later ones, so a memory_budget cannot be planned with it")


class StepPass:
    """The listener the graph pass calls with each instantiated train-step graph; keeps the plans it made.

    ``settings``: what every plan is made with (the callback's arguments, validated; fixed for the pass's life).
    Each instantiation is planned with them as its :class:`PlanRequest` fills in (:func:`instantiation_settings`).
    ``verbose``: 1 prints each plan's summary, 2 also the seconds of each stage of the pass."""

    def __init__(self, settings: pipeline.PlanSettings = pipeline.PlanSettings(), verbose: int = 1, print_fn=print):
        self.settings = settings
        self.verbose = verbose
        self.records: list[TraceRecord] = []
        self.skipped: list[SkippedTrace] = []
        #: the most recent instantiation, when the pass left it unmodified (None once a later one is planned)
        self.last_skipped: SkippedTrace | None = None
        self._print = print_fn
        self._captures = CaptureCache()
        self._warned: set[str] = set()
        self._mobility: dict = {}

    def listener(self, request: PlanRequest, outcome: "PassOutcome | None" = None):
        """The listener to arm the graph pass with (:func:`dymem_tf.passes.graph_pass.armed`): plans each graph
        offered while armed for ``request``, and says in ``outcome`` why it cancelled one."""
        return functools.partial(self.__call__, request=request, outcome=outcome)

    @property
    def last_plan(self):
        return self.records[-1].plan if self.records else None

    def __call__(self, call: graph_pass.PassCall, request: PlanRequest | None = None,
                 outcome: "PassOutcome | None" = None) -> None:
        """Plan and rewrite one instantiated graph for ``request`` (None: no budget, nothing measured); a refusal
        cancels the instantiation and is kept in ``outcome``."""
        request = PlanRequest() if request is None else request
        start = time.perf_counter()
        clock = stages.StageClock()
        with clock.active(), _collector_paused():
            with stages.stage("read"):
                groups = self._captures.read(call.graph_def_bytes, call.outputs_bytes, keep=request.plans_again())
            planned = []
            onednn_later = call.stage != "after_partitioning" and bool(compat.onednn_enabled())
            for replica, ops in groups:
                try:
                    result = self.plan_ops(call.function_name, ops, replica, len(groups), onednn_later, request)
                except planner.BudgetTooSmallError as err:
                    if outcome is not None:
                        outcome.refusal = err
                    call.fail(str(err))
                    return
                if result is not None:
                    planned.append((replica, result))
            if planned:
                self._apply(call, planned, start, clock)

    def plan_ops(self, function_name: str, ops: list, replica: int | None, replicas: int, onednn_later: bool,
                 req: PlanRequest):
        """The planned step for one device's ops for ``req``, or None when they are left unmodified.
        ``onednn_later``: oneDNN's layout pass rewrites the graph after this plan (``PlanSettings.onednn_later``)."""
        batch = graph_batch_size(ops) or replica_batch(req.default_batch_size, replicas)
        observed = None
        if batch is None and req.observed_batch_size:
            observed = replica_batch(req.observed_batch_size, replicas)
            # Without a budget the batch size only scales the model of the step (sizes, times): the swaps compute
            # the same values for any batch. A budget needs the largest batch, which the first ones do not bound.
            if req.budget_bytes is None and not req.probe:
                batch = observed
        with stages.stage("capture"):
            step_graph, problem = self._captures.capture(replica, ops, batch, observed if batch is None else None)
        if problem is not None:
            self.skip(function_name, problem, replica)
            return None
        settings = instantiation_settings(self.settings, req, ops, batch, onednn_later)
        placed = not req.probe and req.calibration is not None and bool(req.calibration.persistent_group)
        # copy: another plan of the same graph follows (the preparation adds its deferral edges in place, and would
        # find none to insert on a graph that has them): the calibrated plan after the probe's, the placement's
        # re-plans
        key = (replica, batch, observed, pipeline.preparation_key(settings))
        prepared = self._captures.prepared(key, lambda: pipeline.prepare_step(
            step_graph, settings, copy=req.plans_again() or placed))
        planned = self._placed_plan(prepared, settings, req) if placed else pipeline.finish_plan(prepared, settings)
        plan = planned.plan
        if req.probe:
            plan.params.stage = "probe"
            plan.notes.append("first step under the budget: the least-memory plan, measured to calibrate the next")
        elif req.calibration is not None:
            plan.params.stage = req.calibration.stage
            plan.predicted.calibration = dataclasses.replace(req.calibration)
            plan.notes.append(req.calibration.summary())
        if batch is not None and batch == observed:
            plan.notes.append(OBSERVED_NOTE.format(observed))
        return planned

    def _placed_plan(self, prepared: pipeline.PreparedStep, settings: pipeline.PlanSettings, req: PlanRequest):
        """The calibrated plan, its device peak predicted by its placement
        (:func:`~dymem_tf.planning.first_step.placed_prediction`, kept as ``predicted.calibrated_peak_bytes``):
        planned with the calibration's headroom and, while that prediction is over the calibration's limit, again
        with the headroom raised by what it missed the limit by (at most
        :data:`~dymem_tf.planning.first_step.PLACEMENT_REPLANS` times; the plan predicted lowest stays when none
        fits, and its first step is guarded). The headroom is never lowered: the simulator's bytes in use are
        calibrated on the probe, which swaps everything, and a plan that swaps much less than it measured up to 12%
        more than simulated (DenseNet-121 32px + SGD, no swaps: 136 MiB simulated, 152 measured)."""
        cal = req.calibration
        budget = int(cal.budget_bytes)
        limit = (1.0 - cal.margin) * budget
        headroom, best, tries = cal.headroom, None, 0
        for tries in range(1, first_step.PLACEMENT_REPLANS + 2):
            try:
                planned = pipeline.finish_plan(prepared, dataclasses.replace(settings, headroom=headroom))
            except planner.BudgetTooSmallError:
                if best is None:
                    raise
                break
            peak = self._placed_peak(planned, req)
            if best is None or peak < best[0]:
                best = (peak, planned)
            raised = min(headroom + (peak - limit) / budget, first_step.MAX_HEADROOM)
            if peak <= limit or raised <= headroom + 1e-3:
                break
            headroom = raised
        peak, planned = best
        planned.plan.predicted.calibrated_peak_bytes = int(peak)
        planned.plan.notes.append(
            f"placed in GTBM's groups: {peak / 2**20:.1f} MiB reserved predicted at the peak, limit "
            f"{limit / 2**20:.1f} MiB ({tries} plan{'s' if tries > 1 else ''} made)")
        return planned

    @stages.timed("placement")
    def _placed_peak(self, planned, req: PlanRequest) -> int:
        """The calibrated device peak that the placement of ``planned``'s simulated step predicts."""
        res = simulator.simulate(planned.step_graph, planned.plan, self.settings.profile,
                                 temporaries=req.memory.held_during(planned.step_graph) if req.memory else None)
        group = placement.PersistentGroup(**req.calibration.persistent_group)
        placed = placement.place(res.allocations, group)
        return first_step.placed_prediction(req.calibration, placed)

    def _apply(self, call: graph_pass.PassCall, planned: list, start: float, clock: stages.StageClock) -> None:
        """Hand every replica's plan to the C++ pass at once and record what it inserted (and the pass's seconds
        since ``start``, with ``clock``'s stages)."""
        swaps = [d for _, step in planned for d in step.plan.swaps]
        edges = [e for _, step in planned for e in step.deferrals]
        resident = [r for _, step in planned for r in step.resident]
        sequences = [(step.sequence.ops, step.sequence.with_added, step.sequence.bands) for _, step in planned
                     if step.sequence.ops]
        try:
            with stages.stage("rewrite"):
                rewritten = call.apply(graph_pass.encode_plan(swaps, edges, resident, sequences))
        except graph_pass.PlanApplyError as err:
            self.skip(call.function_name, Unsupported(SkipKind.UNSUPPORTED_GRAPH, "", f"the plan did not fit the "
                                                                                   f"graph ({err})"), None)
            return
        seconds = time.perf_counter() - start
        times = clock.times()
        for replica, step in planned:
            step_graph, plan, deferrals = step.step_graph, step.plan, step.deferrals
            report = rewrite_report(plan, deferrals)
            for name in report.swap_in_ops:
                plan.mobility[name] = "mobile"
            self._mobility.update(plan.mobility)  # every instantiation of this fit stays callable
            record = TraceRecord(call.function_name, plan.batch_size, step_graph, plan, report, replica, rewritten,
                                 seconds, times)
            self.records.append(record)
            self.last_skipped = None
            if self.verbose:
                where = f" (replica {replica})" if replica is not None else ""
                self._print(plan.summary())
                self._print(f"dymem_tf: rewrite{where}: {report.summary()} (pass: {seconds:.2f} s)")
                if self.verbose >= 2:
                    self._print(f"dymem_tf: pass stages{where}: {times.summary()}")
        _install_mobility(self._mobility)

    def skip(self, function_name: str, problem: Unsupported, replica: int | None) -> None:
        """Record that the graph is left unmodified, and warn once per construct."""
        reason = f"dymem_tf left this train step unmodified (no swapping): {problem.detail}"
        self.last_skipped = SkippedTrace(function_name, problem.kind, problem.subject, reason, replica)
        self.skipped.append(self.last_skipped)
        # one warning per construct: the same op in another replica or a retrace is the same construct
        self._warn_once(f"{problem.kind}:{_REPLICA_SCOPE.sub(_keep_slash, problem.subject)}", reason)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            compat.warn_user(message)


class CaptureCache:
    """The graph of the last instantiation the pass read, and the step graphs captured from it.

    Under a budget one ``fit`` instantiates the same train step two or three times (the probe's plan, the
    calibrated plan, a refined one), and TensorFlow hands the pass the same graph each time: it is read, captured
    and prepared for planning (:func:`~dymem_tf.planning.pipeline.prepare_step`) once. Callers that keep an entry must plan on copies of its step graph (the planning stages add
    edges and mark tensors in place). Only the last graph is kept: a large step's analysis holds hundreds of MiB.
    """

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._groups: list = []
        self._graphs: dict = {}
        self._prepared: dict = {}
        self.hits = 0  # instantiations whose graph was read before

    def read(self, data: bytes, outputs: bytes, keep: bool) -> list[tuple[int | None, list]]:
        """The graph's ops per training device (:func:`replica_ops`; ``data`` and ``outputs`` as
        :class:`~dymem_tf.passes.graph_def_view.GraphView` takes them), read again only for another graph;
        ``keep``: keep the graph (and what is captured from it) for the next call."""
        graph_def = graph_def_view.parse(data)
        # the fingerprint (a deterministic serialization of the whole graph) only where a hit is possible
        key = None
        if keep or self._key is not None:
            key = graph_def_view.fingerprint(graph_def) + hashlib.sha256(outputs).digest()
        if key is not None and key == self._key:
            self.hits += 1
            return self._groups
        groups = replica_ops(graph_def_view.GraphView(graph_def, outputs))
        self._key, self._groups, self._graphs = (key, groups, {}) if keep else (None, [], {})
        self._prepared = {}
        return groups

    def capture(self, replica: int | None, ops: list, batch_size: int | None, observed_batch: int | None = None):
        """:func:`capture` of one replica's ops, once per graph kept and batch size."""
        entry = (replica, batch_size, observed_batch)
        if entry in self._graphs:
            return self._graphs[entry]
        result = capture(ops, batch_size, observed_batch)
        if self._key is not None:
            self._graphs[entry] = result
        return result

    def prepared(self, key: tuple, prepare):
        """``prepare()`` (a :class:`~dymem_tf.planning.pipeline.PreparedStep` of a captured graph), made once per
        graph kept and ``key`` (the capture's entry and :func:`~dymem_tf.planning.pipeline.preparation_key`);
        the plans made from it must leave it unchanged, as :func:`~dymem_tf.planning.pipeline.finish_plan` does."""
        if key not in self._prepared:
            result = prepare()
            if self._key is None:
                return result
            self._prepared[key] = result
        return self._prepared[key]


def instantiation_settings(settings: pipeline.PlanSettings, req: PlanRequest, ops: list, batch: int | None,
                           onednn_later: bool) -> pipeline.PlanSettings:
    """``settings`` (what every plan is made with) for one instantiation of ``ops`` planned for ``req``: its
    budget, persistent bytes, headroom and measured memory, the batch size it is planned with, and offloading only
    where ``req`` allows it; the probe is the least-memory plan, without a budget or headroom.
    ``onednn_later``: oneDNN's layout pass rewrites the graph after this plan (``PlanSettings.onednn_later``)."""
    return dataclasses.replace(
        settings, budget_bytes=None if req.probe else req.budget_bytes, persistent_bytes=req.persistent_bytes,
        batch_size=batch, headroom=0.0 if req.probe else req.headroom, least_memory=req.probe,
        memory=None if req.probe else req.memory, onednn_later=onednn_later,
        offload_variables=_may_offload(ops, settings.offload_variables, req),
        offload_weights=_may_offload(ops, settings.offload_weights, req))


def _may_offload(ops, asked: bool, req: PlanRequest) -> bool:
    """Whether this step's plan may offload optimizer state (or weights): when ``asked``, under a budget (or for the
    probe), and on the CPU device, where the variable kernels run and a read between steps sees host memory."""
    if not asked or not (req.probe or req.budget_bytes is not None):
        return False
    return all("GPU" not in (op.device or "").upper() for op in ops)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the pass runs: the pass creates several hundred thousand
    objects on a large step, and each collection they trigger walks the whole heap (a third of the capture's time
    on a 47k-op step); what the pass leaves behind is collected afterwards as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



def rewrite_report(plan, deferrals) -> RewriteReport:
    """What the pass inserts for ``plan``: the names :func:`dymem_tf.passes.graph_pass.encode_plan` gives the ops."""
    report = RewriteReport(swapped_tensors=len(plan.swaps), deferral_edges=len(deferrals))
    for decision in plan.swaps:
        if decision.kind == "recompute":
            report.recomputed += 1
            report.rerouted_inputs += len(decision.recompute.reroutes)
            continue
        if decision.kind == "weight":
            names = graph_pass.weight_op_names(decision.tensor)
            report.offloaded_weights += 1
            report.swap_out_ops += [names["evict"], names["out_fwd"], names["out_bwd"]]
            report.swap_in_ops += [names["in_fwd"], names["in_bwd"]]
            report.rerouted_inputs += len(decision.route.reroutes)
            continue
        if decision.kind == "variable":
            evict, swap_in, swap_out = graph_pass.variable_op_names(decision.tensor)
            report.offloaded_variables += 1
            report.swap_out_ops += [evict, swap_out]
            report.swap_in_ops.append(swap_in)
            continue
        report.swap_out_ops.append(graph_pass.swap_out_name(decision.tensor))
        for i, swap_in in enumerate(decision.swap_ins):
            if swap_in.consumers:
                report.swap_in_ops.append(graph_pass.swap_in_name(decision.tensor, i))
                report.rerouted_inputs += len(swap_in.consumers)
    return report


def _keep_slash(match) -> str:
    return "/" if match.group(0).startswith("/") else ""


def replica_ops(graph: graph_def_view.GraphView) -> list[tuple[int | None, list]]:
    """The graph's ops per training device: ``[(None, all ops)]`` on one device, else ``(replica, ops on that
    device)`` for every device that runs gradient ops, in device-name order."""
    ops = graph.get_operations()
    grads = Counter(op.device for op in ops if graph_capture.is_gradient_name(op.name))
    devices = sorted(d for d, n in grads.items() if n * 10 >= max(grads.values(), default=0))
    if len(devices) <= 1:
        return [(None, ops)]
    return [(k, [op for op in ops if op.device == d]) for k, d in enumerate(devices)]


def replica_batch(batch: int | None, replicas: int = 1) -> int | None:
    """The batch of one of ``replicas`` replicas of a global ``batch`` (rounded up: the first replicas take the
    remainder); None when ``batch`` is unknown."""
    return -(-int(batch) // max(int(replicas), 1)) if batch else None


def graph_batch_size(ops) -> int | None:
    """The static batch dimension of the step's input (``IteratorGetNext``'s first output), or None."""
    for op in ops:
        if op.type in INPUT_OP_TYPES and op.outputs:
            shape = op.outputs[0].shape
            if shape.rank and shape[0] is not None:
                return int(shape[0])
    return None


def capture(ops: list, batch_size: int | None, observed_batch: int | None = None):
    """``(step_graph, None)`` for the step's ops, or ``(step_graph or None, Unsupported)`` when the pass would
    leave the step unmodified (see :func:`unsupported_construct`; ``observed_batch``: the batch size seen in the
    first batches, not planned with)."""
    try:
        step_graph = graph_capture.capture_step_graph(ops, batch_size=batch_size)
    except graph_capture.UnsupportedGraphError as err:
        return None, Unsupported(SkipKind.UNSUPPORTED_GRAPH, "", f"{err}")
    return step_graph, unsupported_construct(step_graph, batch_size, observed_batch)


def unsupported_construct(sg, batch_size: int | None = None, observed_batch: int | None = None) -> Unsupported | None:
    """The first construct in the step that the pass cannot plan, or None.

    * a loop (``While``: ``tf.while_loop``, a Keras RNN on the TensorFlow backend) in the backward pass, or in the
      forward pass upstream of it: its body lives in another FuncGraph and keeps the feature maps of every iteration
      in TensorList accumulators, which the analysis cannot size or swap, so the step's memory cannot be planned
      (a loop elsewhere -- the optimizer update -- holds no feature map and is fine; ``If``/``Case`` and nested
      function calls are planned as opaque ops: what the backward pass needs from them leaves them as outputs);
    * a forward tensor that the backward pass reads whose static shape is unknown beyond the batch dimension: its
      size, and so the step's peak, cannot be modelled;
    * no gradient ops: nothing is kept for a backward pass, so there is nothing to swap.
    """
    ops = sg.ops
    if not any(op.phase == "backward" for op in ops.values()):
        return Unsupported(SkipKind.NO_GRADIENTS, "", NO_GRADIENTS)
    loops = _loops_inside_the_step(sg)
    if loops:
        first = loops[0]
        more = f" and {len(loops) - 1} more" if len(loops) > 1 else ""
        return Unsupported(SkipKind.CONTROL_FLOW, first.name,
                f"its {first.phase} pass contains a loop ({first.type} op {first.name!r}{more}); a loop body keeps "
                "each iteration's feature maps in TensorList accumulators, which the pass can neither size nor "
                "swap, so the step's memory cannot be planned.")
    unknown = []
    for t in sg.tensors.values():
        if t.shape_known or t.persistent or t.alias_of is not None or t.dtype in ("resource", "variant", "string"):
            continue
        prod = ops[t.producer]
        if prod.is_backward or prod.type in FLOW_OP_TYPES:
            continue
        if any(ops[c].is_backward and ops[c].type not in FLOW_OP_TYPES and sg.is_data_consumer(c)
               for c in t.consumers):
            unknown.append(t)
    if unknown:
        first = unknown[0]
        shape = "[" + ", ".join("?" if d is None else str(d) for d in (first.shape or ())) + "]" \
            if first.shape else "unknown rank"
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        batch_note = ("" if batch_size is not None else
                      "; the batch size is unknown too (batch the dataset with drop_remainder=True)"
                      if observed_batch is None else OBSERVED_UNDER_BUDGET.format(observed_batch))
        return Unsupported(SkipKind.UNKNOWN_SHAPE, first.name,
                f"tensor {first.name!r}{more}, kept for the backward pass, has an unknown static shape ({shape}), "
                f"so its size cannot be planned{batch_note}.")
    return None


def _loops_inside_the_step(sg) -> list:
    """Loop ops in the backward pass or feeding it that run inside the step: a functional ``While``, or an op in a
    lowered loop frame deeper than the step's own (Keras' steps_per_execution runs the whole step inside a loop,
    which is fine: its ops are planned within that frame)."""
    ops = sg.ops
    base = min((op.frame.count("/") + bool(op.frame) for op in ops.values() if op.phase == "backward"), default=0)
    feeds_backward = graph_capture.reach(sg.graph, [n for n, op in ops.items() if op.phase == "backward"],
                                         sg.graph.predecessors)
    return [op for op in ops.values() if op.phase != "update" and (op.phase == "backward" or op.name in feeds_backward)
            and (op.type in LOOP_OP_TYPES and (op.type in ("While", "StatelessWhile")
                                               or op.frame.count("/") + bool(op.frame) > base))]


def _install_mobility(mobility: dict) -> None:
    from dymem_tf.memory import allocator

    if allocator.is_active():
        allocator.set_mobility_map(mobility)


def persistent_bytes(model, optimizer: bool = True) -> int:
    """Bytes of the model's variables, of its other optimizers'
    (:func:`~dymem_tf.planning.first_step.other_optimizers`) and (``optimizer``) of ``model.optimizer``'s: what
    lives across steps."""
    seen, total = set(), 0
    for var in list(model.variables) + first_step.optimizer_variables(model, main=optimizer):
        key = id(var)
        if key in seen:
            continue
        seen.add(key)
        total += variable_bytes(var)
    return total


def variable_bytes(var) -> int:
    """Bytes of one variable's value (unknown dimensions count as 0)."""
    shape = [d if d is not None else 0 for d in var.shape]
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(var.dtype).size


