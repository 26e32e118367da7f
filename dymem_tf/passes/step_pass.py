"""The Dymem pass over an instantiated train step: analyse ▶ defer ▶ plan ▶ rewrite, after Grappler.

TensorFlow offers every instantiated function graph that holds gradient ops to a :class:`StepPass` while a train
function armed with it runs (:meth:`StepPass.armed`; :mod:`dymem_tf.passes.graph_pass`, ``cc/pass/graph_pass.cc``).
The graph is the one TF will execute: Grappler has fused, folded and rewritten it already. The pass reads it (with
the shapes TF's own shape inference gives, :mod:`dymem_tf.passes.graph_def_view`), builds the step graph of each
training device (:mod:`dymem_tf.passes.graph_capture`), defers gradient-independent optimizer arithmetic
(:mod:`dymem_tf.planning.update_deferral`), plans the swaps (:mod:`dymem_tf.planning.planner`) for the call's
:class:`PlanRequest` and hands the plan back to the C++ pass, which inserts the swap ops by node name (all or
nothing). Because Grappler has finished, the inserted ops cannot change any of its numeric rewrites: training is
bit-identical by construction. Each armed call returns its own :class:`PassResult`; the pass keeps only its
caches (:mod:`dymem_tf.passes.caches`).

Each instantiation (first call, retrace on a new input shape) gets its own plan; under a distribution strategy
with several local replicas each replica's device gets its own plan (``TraceRecord.replica``).

Loops, conditionals and calls TF did not inline are planned around or seen into (:func:`unsupported_construct`).
What the pass cannot plan leaves the graph unmodified, with one warning per construct (:class:`SkippedTrace`):
forward tensors needed by the backward pass whose size is unknown, under a budget (without one they stay on the
device and the rest is planned), a step without gradient ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import gc
import logging
import re
import time
from collections import Counter

from dymem_tf import compat, op_sets
from dymem_tf.memory import placement
from dymem_tf.passes import caches, graph_capture, graph_def_view, graph_pass
from dymem_tf.planning import first_step, pipeline, planner, simulator, stages
from dymem_tf.planning.analysis import frame_depth, step_frame_depth

logger = logging.getLogger("dymem_tf")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What one train function's instantiations are planned for: the per-instantiation values a first-step session
    (:mod:`dymem_tf.keras.session`) makes from the configuration and what it measured. Immutable: each train
    function is armed with its own."""

    budget_bytes: int | None = None  # None: no budget (swap every tensor worth swapping)
    headroom: float | None = None  # share of the budget the planner leaves free (None: the settings' default)
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

    @property
    def stage(self) -> str:
        """Which plan of the first step this request makes: ``"probe"``, ``"calibrated"``, ``"refined"``, or
        ``"plan"`` (no calibration: without a budget, or ``calibrate=False``)."""
        if self.probe:
            return "probe"
        return self.calibration.stage if self.calibration is not None else "plan"

    def cache_key(self) -> tuple:
        """What a plan made for this request depends on besides the graph and the settings: its budget, stage (and
        the plan its calibration measured, how its step ended and whether it is a placed plan's last refinement: a
        placed plan may be refined three times) and batch sizes. A calibration's measured figures are left out: a
        calibrated plan of the same graph, budget and stage is made once per process (another ``fit``'s probe
        measures the same step again)."""
        headroom = None if self.calibration is not None else self.headroom
        cal = self.calibration
        source = (cal.source, cal.outcome, cal.last) if cal is not None else None
        return (self.budget_bytes, self.stage, source, headroom, self.persistent_bytes, self.default_batch_size,
                self.observed_batch_size)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What the pass did in one armed call of a train function (:meth:`StepPass.armed`): the instantiations it
    planned and rewrote, those it left unmodified, the refusal that cancelled one, and the mobility map it
    installed for the graphs it rewrote. Each call gets its own; nothing is shared between calls."""

    records: tuple = ()  # TraceRecord, one per planned replica of each instantiation
    skipped: tuple = ()  # SkippedTrace
    #: the error that made the pass cancel an instantiation (TF raises a CancelledError in its place)
    refusal: planner.BudgetTooSmallError | None = None
    #: op name to GTBM mobility group of every op the rewritten graphs run (empty: none rewritten)
    mobility: tuple = ()
    cached: int = 0  # instantiations whose plan came from the plan cache (no planning)
    #: exceptions the pass raised while planning (a bug: each left its graph unmodified, with a warning)
    errors: tuple = ()

    @property
    def offered(self) -> bool:
        """Whether the pass was offered a graph with gradient ops (planned, left unmodified, or failed)."""
        return bool(self.records or self.skipped or self.refusal or self.errors)

    @property
    def plan(self):
        """The plan of the last instantiation planned in the call, or None."""
        return self.records[-1].plan if self.records else None


class ArmedCall:
    """Collects what the pass does while one call of a train function is armed; :attr:`result` is set when the
    armed block exits (also when it raises)."""

    def __init__(self) -> None:
        self.records: list = []
        self.skipped: list = []
        self.refusal = None
        self.mobility: dict = {}
        self.cached = 0
        self.result: PassResult | None = None

    def close(self, errors=()) -> PassResult:
        """Freeze what was collected, and the ``errors`` the pass raised (each left its graph unmodified), into
        :attr:`result`."""
        self.result = PassResult(tuple(self.records), tuple(self.skipped), self.refusal,
                                 tuple(sorted(self.mobility.items())), self.cached, tuple(errors))
        return self.result

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
    streamed_lists: int = 0  # loops' lists kept in host memory element by element (their ops in the lists above)

    def summary(self) -> str:
        text = (f"{self.swapped_tensors} tensors swapped: {len(self.swap_out_ops)} swap-outs, "
                f"{len(self.swap_in_ops)} swap-ins, {self.rerouted_inputs} consumer inputs rerouted")
        if self.offloaded_variables:
            text += f"; {self.offloaded_variables} of them optimizer variables offloaded between their uses"
        if self.offloaded_weights:
            text += f"; {self.offloaded_weights} of them weights kept in host memory between their uses"
        if self.recomputed:
            text += f"; {self.recomputed} of them recomputed instead"
        if self.streamed_lists:
            text += f"; {self.streamed_lists} loop lists kept in host memory element by element"
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
    UNKNOWN_SHAPE = "unknown-shape"  # a tensor kept for the backward pass has no static size (under a budget)
    NO_GRADIENTS = "no-gradients"  # nothing is kept for a backward pass

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """The first construct of a step that the pass cannot plan: its kind, the op or tensor, and the explanation."""

    kind: SkipKind
    subject: str
    detail: str
    #: ``UNKNOWN_SHAPE``: how many tensors kept for the backward pass have no static size, and the first one's shape
    count: int = 0
    shape: str = ""

    def blocks(self, req: PlanRequest) -> bool:
        """Whether this construct leaves the step unmodified when planned for ``req``: always, except tensors of
        unknown size without a budget, which are planned around (they stay on the device, never swapped; the
        known-size tensors are swapped as usual). Under a budget (the probe's least-memory plan included) their
        size would leave the step's peak unbounded."""
        return not (self.kind is SkipKind.UNKNOWN_SHAPE and req.budget_bytes is None and not req.probe)

    def note(self) -> str:
        """The plan's note for a step planned around this construct (:meth:`blocks` is False)."""
        many = self.count != 1
        return (f"{self.count} tensor{'s' if many else ''} kept for the backward pass ({self.subject!r} "
                f"{self.shape}{' and others' if many else ''}) {'have' if many else 'has'} no static size: not "
                f"swapped, {'they stay' if many else 'it stays'} on the device and {'count' if many else 'counts'} "
                "as 0 bytes in the predicted peak")


@dataclasses.dataclass
class SkippedTrace:
    """A graph the pass left unmodified: ``kind`` is ``"unsupported-graph"`` (no ops, a cycle, a plan that did
    not fit the graph), ``"unknown-shape"`` or ``"no-gradients"``; ``subject`` names the op
    or tensor; ``reason`` is the warning's text."""

    function_name: str
    kind: SkipKind
    subject: str
    reason: str
    replica: int | None = None


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
    """Plans and rewrites each instantiated train-step graph offered while it is :meth:`armed`.

    ``settings``: what every plan is made with (from the configuration; fixed for the pass's life). Each
    instantiation is planned with them as its :class:`PlanRequest` fills in (:func:`instantiation_settings`).
    ``verbose``: 1 prints each plan's summary, 2 also the seconds of each stage of the pass. ``plans``: the plan
    cache (default: the process's, :data:`~dymem_tf.passes.caches.SHARED_PLANS`). The pass keeps no results: each
    armed call returns its own :class:`PassResult`."""

    def __init__(self, settings: pipeline.PlanSettings = pipeline.PlanSettings(), verbose: int = 1, print_fn=print,
                 plans: caches.PlanCache | None = None):
        self.settings = settings
        self.verbose = verbose
        self._print = print_fn
        self._captures = caches.CaptureCache()
        self._plans = caches.SHARED_PLANS if plans is None else plans
        self._warned: set[str] = set()

    @contextlib.contextmanager
    def armed(self, request: PlanRequest | None = None, *, stage: str | None = None, batch_size: int | None = None):
        """Plan every graph instantiated inside this block for ``request`` (None: no budget); yields an
        :class:`ArmedCall` whose ``result`` is this block's :class:`PassResult` once it exits. ``stage`` and
        ``batch_size`` as for :func:`dymem_tf.passes.graph_pass.armed`."""
        call = ArmedCall()
        listener = functools.partial(self.__call__, request=request, collected=call)
        block = None
        try:
            with graph_pass.armed(listener, stage=stage, batch_size=batch_size) as block:
                yield call
        finally:
            call.close(block.errors if block is not None else ())

    def release(self) -> None:
        """Let go of the graph kept for re-plans (at the end of a ``fit``; the plan cache stays)."""
        self._captures = caches.CaptureCache()

    @property
    def holds_graph(self) -> bool:
        """Whether the pass keeps a graph for re-plans."""
        return self._captures.holds_graph

    def __call__(self, call: graph_pass.PassCall, request: PlanRequest | None = None,
                 collected: ArmedCall | None = None) -> None:
        """Plan and rewrite one instantiated graph for ``request`` (None: no budget, nothing measured), into
        ``collected`` (None: nowhere); a refusal cancels the instantiation."""
        request = PlanRequest() if request is None else request
        collected = ArmedCall() if collected is None else collected
        start = time.perf_counter()
        clock = stages.StageClock()
        with clock.active(), collector_paused():
            with stages.stage("read"):
                graph_def = graph_def_view.parse(call.graph_def_bytes)
                key = caches.graph_key(graph_def, call.outputs_bytes)
            onednn_later = call.stage != "after_partitioning" and bool(compat.onednn_enabled())
            plan_key = (key, self._settings_key(onednn_later), request.cache_key())
            planned = self._plans.get(plan_key)
            if planned is not None:
                collected.cached += 1
            else:
                with stages.stage("read"):
                    groups = self._captures.read(graph_def, key, call.outputs_bytes, request.plans_again(),
                                                 replica_ops)
                try:
                    planned = self._plan_groups(call.function_name, groups, onednn_later, request, collected)
                except planner.BudgetTooSmallError as err:
                    collected.refusal = err
                    call.fail(str(err))
                    return
                if planned and len(planned) == len(groups):  # every replica planned: the graph's whole plan
                    self._plans.put(plan_key, planned)
            if planned:
                self._apply(call, planned, start, clock, collected)

    def _settings_key(self, onednn_later: bool) -> str:
        """The settings every plan of this pass depends on, as a key of the plan cache (the request's budget and
        stage are :meth:`PlanRequest.cache_key`)."""
        return repr((self.settings, onednn_later))

    def _plan_groups(self, function_name: str, groups: list, onednn_later: bool, request: PlanRequest,
                     collected: ArmedCall) -> list:
        """``(replica, PlannedStep)`` of each replica's ops that can be planned; the others are skipped."""
        planned = []
        for replica, ops in groups:
            result = self.plan_ops(function_name, ops, replica, len(groups), onednn_later, request, collected)
            if result is not None:
                planned.append((replica, result))
        return planned

    def plan_ops(self, function_name: str, ops: list, replica: int | None, replicas: int, onednn_later: bool,
                 req: PlanRequest, collected: ArmedCall | None = None):
        """The planned step for one device's ops for ``req``, or None when they are left unmodified (said in
        ``collected``). ``onednn_later``: oneDNN's layout pass rewrites the graph after this plan
        (``PlanSettings.onednn_later``)."""
        batch = graph_batch_size(ops) or replica_batch(req.default_batch_size, replicas)
        observed = None
        if batch is None and req.observed_batch_size:
            observed = replica_batch(req.observed_batch_size, replicas)
            # Without a budget the batch size only scales the model of the step (sizes, times): the swaps compute
            # the same values for any batch. A budget needs the largest batch, which the first ones do not bound.
            if req.budget_bytes is None and not req.probe:
                batch = observed
        with stages.stage("capture"):
            unplanned = observed if batch is None else None
            step_graph, problem = self._captures.capture((replica, batch, unplanned),
                                                         lambda: capture(ops, batch, unplanned))
        if problem is not None and problem.blocks(req):
            skipped = self.skip(function_name, problem, replica)
            if collected is not None:
                collected.skipped.append(skipped)
            return None
        planned = self.plan_captured(step_graph, ops, (replica, batch, observed), onednn_later, req)
        if problem is not None:  # tensors of unknown size, planned around without a budget
            planned.plan.notes.append(problem.note())
        return planned

    def plan_captured(self, step_graph, ops: list, where: tuple, onednn_later: bool, req: PlanRequest,
                      copy: bool = False) -> pipeline.PlannedStep:
        """The planned step of a captured ``step_graph`` (of ``ops``) for ``req``; ``where`` is ``(replica, batch
        size planned with, batch size observed)``; ``copy``: leave ``step_graph`` as it is (a dry run plans one
        graph under several policies)."""
        _, batch, observed = where
        settings = instantiation_settings(self.settings, req, ops, batch, onednn_later)
        placed = not req.probe and req.calibration is not None and bool(req.calibration.persistent_group)
        # copy: another plan of the same graph follows (the preparation adds its deferral edges in place, and would
        # find none to insert on a graph that has them): the calibrated plan after the probe's, the placement's
        # re-plans
        key = (*where, pipeline.preparation_key(settings))
        prepared = self._captures.prepared(key, lambda: pipeline.prepare_step(
            step_graph, settings, copy=copy or req.plans_again() or placed))
        planned = self._placed_plan(prepared, settings, req) if placed else pipeline.finish_plan(prepared, settings)
        _finish(planned, req, batch, observed)
        return planned

    def _placed_plan(self, prepared: pipeline.PreparedStep, settings: pipeline.PlanSettings, req: PlanRequest):
        """The calibrated plan, its device peak predicted by its placement
        (:func:`~dymem_tf.planning.first_step.placed_prediction`, kept as ``predicted.calibrated_peak_bytes``),
        planned to the calibration's limit: first with the calibration's headroom, then (at most
        :data:`~dymem_tf.planning.first_step.PLACEMENT_REPLANS` times) with the headroom
        :func:`~dymem_tf.planning.first_step.next_headroom` finds, until a plan lands close under the limit
        (:func:`~dymem_tf.planning.first_step.placed_close`). The plan kept is the one placed highest within the
        limit (it keeps the most tensors on the device), or the one placed lowest when none fits (its first step is
        guarded). A plan that keeps more than the probe's
        calibration transfers to is caught by its first step (:func:`~dymem_tf.planning.first_step.placed_plan_holds`)
        and calibrated again on itself."""
        cal = req.calibration
        budget = int(cal.budget_bytes)
        limit = (1.0 - cal.margin) * budget
        close = first_step.placed_close(budget, cal.persistent_group.get("block_size", first_step.DEFAULT_BLOCK_SIZE))
        headroom, best, tried = cal.headroom, None, []
        memo = planner.PlannerMemo()  # the plans differ in their headroom only
        for _ in range(first_step.PLACEMENT_REPLANS + 1):
            try:
                planned = pipeline.finish_plan(prepared, dataclasses.replace(settings, headroom=headroom), memo,
                                               sequenced=False)
            except planner.BudgetTooSmallError:
                if best is None:
                    raise
                break
            peak = self._placed_peak(planned, req)
            tried.append((headroom, peak))
            if best is None or _better_placed(peak, best[0], limit):
                best = (peak, planned)
            headroom = first_step.next_headroom(tried, limit, budget, close, first_step.least_headroom(cal.outcome))
            if headroom is None:
                break
        peak, planned = best
        if peak > limit and cal.outcome == "out_of_memory":
            # after a step that ran out of memory only a plan placed within the limit is tried (each try skips a
            # batch): ResNet-50 + Adam, batch 258 under 512 MiB, tried one placed 0.3 MiB over, which ran out too
            raise planner.BudgetTooSmallError(
                f"no plan is placed within {limit / 2**20:.1f} MiB of memory_budget {budget / 2**20:.1f} MiB after "
                f"the last plan ran out of memory (the lowest is placed at {peak / 2**20:.1f} MiB)",
                budget_bytes=budget)
        planned = pipeline.with_sequence(planned, settings)  # the kept plan alone: its placement reads no order
        planned.plan.predicted.calibrated_peak_bytes = int(peak)
        planned.plan.notes.append(
            f"placed in GTBM's groups: {peak / 2**20:.1f} MiB reserved predicted at the peak, limit "
            f"{limit / 2**20:.1f} MiB ({len(tried)} plan{'s' if len(tried) > 1 else ''} made)")
        return planned

    @stages.timed("placement")
    def _placed_peak(self, planned, req: PlanRequest) -> int:
        """The calibrated device peak that the placement of ``planned``'s simulated step predicts."""
        res = simulator.simulate(planned.step_graph, planned.plan, self.settings.profile,
                                 temporaries=req.memory.held_during(planned.step_graph) if req.memory else None)
        group = placement.PersistentGroup(**req.calibration.persistent_group)
        placed = placement.place(res.allocations, group)
        return first_step.placed_prediction(req.calibration, placed)

    def _apply(self, call: graph_pass.PassCall, planned: list, start: float, clock: stages.StageClock,
               collected: ArmedCall) -> None:
        """Hand every replica's plan to the C++ pass at once and record in ``collected`` what it inserted (and the
        pass's seconds since ``start``, with ``clock``'s stages)."""
        try:
            with stages.stage("rewrite"):
                rewritten = call.apply(encode_planned(planned))
        except graph_pass.PlanApplyError as err:
            problem = Unsupported(SkipKind.UNSUPPORTED_GRAPH, "", f"the plan did not fit the graph ({err})")
            collected.skipped.append(self.skip(call.function_name, problem, None))
            return
        seconds = time.perf_counter() - start
        times = clock.times()
        mobility = {}
        for replica, step in planned:
            plan = step.plan
            mobility.update(plan.mobility)
            report = rewrite_report(plan, step.deferrals)
            collected.records.append(TraceRecord(call.function_name, plan.batch_size, step.step_graph, plan, report,
                                                 replica, rewritten, seconds, times))
            if self.verbose:
                where = f" (replica {replica})" if replica is not None else ""
                self._print(plan.summary())
                self._print(f"dymem_tf: rewrite{where}: {report.summary()} (pass: {seconds:.2f} s)")
                if self.verbose >= 2:
                    self._print(f"dymem_tf: pass stages{where}: {times.summary()}")
        collected.mobility.update(mobility)
        install_mobility(collected.mobility)  # this call's graphs, for the step this call runs

    def skip(self, function_name: str, problem: Unsupported, replica: int | None) -> "SkippedTrace":
        """The record of a graph left unmodified; warns once per construct."""
        reason = f"dymem_tf left this train step unmodified (no swapping): {problem.detail}"
        # one warning per construct: the same op in another replica or a retrace is the same construct
        self._warn_once(f"{problem.kind}:{_REPLICA_SCOPE.sub(_keep_slash, problem.subject)}", reason)
        return SkippedTrace(function_name, problem.kind, problem.subject, reason, replica)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            compat.warn_user(message)


def _finish(planned: pipeline.PlannedStep, req: PlanRequest, batch: int | None, observed: int | None) -> None:
    """Complete the plan just made for ``req``: its stage, its notes, and the mobility of the swap-ins the rewrite
    adds (GTBM's mobile group). The plan is not changed after this."""
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
    for name in rewrite_report(plan, planned.deferrals).swap_in_ops:
        plan.mobility[name] = "mobile"


def encode_planned(planned: list) -> str:
    """The plan message of every replica's :class:`~dymem_tf.planning.pipeline.PlannedStep` in ``planned``
    (``(replica, step)`` pairs)."""
    swaps = [d for _, step in planned for d in step.plan.swaps]
    edges = [e for _, step in planned for e in step.deferrals]
    resident = [r for _, step in planned for r in step.resident]
    sequences = [(step.sequence.ops, step.sequence.with_added, step.sequence.bands) for _, step in planned
                 if step.sequence.ops]
    streamed = [x for _, step in planned for x in step.plan.streamed_lists]
    return graph_pass.encode_plan(swaps, edges, resident, sequences, streamed)


_installed_mobility: list = [None]  # the map GTBM holds now (compared by identity: installing is not free)


def install_mobility(mobility) -> None:
    """Make ``mobility`` (op name to group, a mapping or its items) GTBM's mobility map, replacing the one it held;
    a no-op when it already holds this one, or without GTBM."""
    from dymem_tf.memory import allocator

    if _installed_mobility[0] is mobility or not allocator.is_active():
        return
    allocator.set_mobility_map(dict(mobility))
    _installed_mobility[0] = mobility


def instantiation_settings(settings: pipeline.PlanSettings, req: PlanRequest, ops: list, batch: int | None,
                           onednn_later: bool) -> pipeline.PlanSettings:
    """``settings`` (what every plan is made with) for one instantiation of ``ops`` planned for ``req``: its
    budget, persistent bytes, headroom and measured memory, the batch size it is planned with, and offloading only
    where ``req`` allows it; the probe is the least-memory plan, without a budget or headroom.
    ``onednn_later``: oneDNN's layout pass rewrites the graph after this plan (``PlanSettings.onednn_later``)."""
    return dataclasses.replace(
        settings, budget_bytes=None if req.probe else req.budget_bytes, persistent_bytes=req.persistent_bytes,
        batch_size=batch, headroom=0.0 if req.probe else settings.headroom if req.headroom is None else req.headroom,
        least_memory=req.probe,
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
def collector_paused():
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
    for streamed in plan.streamed_lists:
        report.streamed_lists += 1
        report.swap_out_ops += [graph_pass.swap_out_name(element) for element, _ in streamed.pushes]
        report.swap_out_ops += [graph_pass.swap_out_name(f"{pop}:1") for pop, *_ in streamed.pops]
        report.swap_in_ops += [graph_pass.swap_in_name(f"{pop}:1", 0) for pop, *_ in streamed.pops]
        report.rerouted_inputs += len(streamed.pushes) + sum(len(readers) for _, *readers in streamed.pops)
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
    leave the step unmodified for some requests (see :func:`unsupported_construct` and :meth:`Unsupported.blocks`;
    ``observed_batch``: the batch size seen in the first batches, not planned with)."""
    try:
        step_graph = graph_capture.capture_step_graph(ops, batch_size=batch_size)
    except graph_capture.UnsupportedGraphError as err:
        return None, Unsupported(SkipKind.UNSUPPORTED_GRAPH, "", f"{err}")
    return step_graph, unsupported_construct(step_graph, batch_size, observed_batch)


def _better_placed(peak: int, best: int, limit: float) -> bool:
    """Whether a plan placed at ``peak`` beats one placed at ``best`` for ``limit``: within it and higher (more kept
    on the device), or lower while the best is over it."""
    if peak <= limit:
        return best > limit or peak > best
    return best > limit and peak < best


def unsupported_construct(sg, batch_size: int | None = None, observed_batch: int | None = None) -> Unsupported | None:
    """The first construct in the step that the pass cannot plan, or None.

    * a forward tensor of the step's own loop frame that the backward pass reads whose static shape is unknown
      beyond the batch dimension: its size, and so the step's peak, cannot be modelled. Only a plan under a budget
      needs that peak; without one the step is planned around such tensors (:meth:`Unsupported.blocks`): they are
      never swap candidates (the planner counts them as 0 bytes), stay on the device, and the plan notes them;
    * no gradient ops: nothing is kept for a backward pass, so there is nothing to swap.

    A loop is planned around: its ops stay in their frame, the lists it accumulates for its gradient leave it as
    tensors sized by :func:`~dymem_tf.planning.loop_lists.size_loop_lists`, and tensors of the step's frame can be
    swapped across it. Conditionals and calls TF did not inline are ops like any other.
    """
    ops = sg.ops
    if not any(op.phase == "backward" for op in ops.values()):
        return Unsupported(SkipKind.NO_GRADIENTS, "", NO_GRADIENTS)
    base = step_frame_depth(ops.values())
    unknown = []
    for t in sg.tensors.values():
        if t.shape_known or t.persistent or t.alias_of is not None or t.dtype in ("resource", "variant", "string"):
            continue
        prod = ops[t.producer]
        if prod.is_backward or prod.type in FLOW_OP_TYPES or frame_depth(prod.frame) > base:
            continue  # a loop's own tensors live and die in its iterations
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
                f"so the step's peak cannot be bounded under a memory_budget{batch_note}. Give the inputs a static "
                "shape (every dimension in keras.Input, images resized to one size), or train with "
                "memory_budget=None, which swaps the tensors of known size and keeps these on the device.",
                count=len(unknown), shape=shape)
    return None

