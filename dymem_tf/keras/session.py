"""One ``fit``'s first steps: the session that decides which train function trains, and owns what it made.

``DymemCallback.on_train_begin`` opens a :class:`FitSession` for the running ``fit``; it sets up the model
(optimizer state where the plans want it, the device capped at the budget), installs the first train function and
carries out each :class:`~dymem_tf.planning.first_step_control.Decision` of its controller: the step as compiled
while it fits (``memory_budget="auto"``, :mod:`dymem_tf.keras.fits_first`), the probe, the calibrated and refined
plans, the fall-back, or a refusal. Each train function it makes is armed with its own immutable
:class:`~dymem_tf.passes.step_pass.PlanRequest` and mobility map, and each call of one hands back its own
:class:`~dymem_tf.passes.step_pass.PassResult`. :meth:`FitSession.end` undoes the set-up and lets go of every
function, graph and plan the ``fit`` made; its records stay readable until the next ``fit``.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import tempfile

import tensorflow as tf

from dymem_tf import compat
from dymem_tf.keras import errors, fit_batch, fits_first, variables, xla
from dymem_tf.keras.config import DymemConfig
from dymem_tf.memory import allocator, devices, placement
from dymem_tf.passes import graph_pass, step_pass
from dymem_tf.planning import first_step, memory_model, planner, simulator
from dymem_tf.planning.first_step_control import Action, FirstStepControl, State

_fmt = errors.fmt


@dataclasses.dataclass
class _Step:
    """One train function the session armed: the function it wraps, the request it is planned for, the mobility map
    of the graphs it rewrote and its records."""

    function: object
    request: step_pass.PlanRequest
    mobility: dict | None = None
    records: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class KeptStep:
    """The train function a ``fit`` ended with, for the next ``fit`` of the same callback and model: reused while
    the budget, the batch size and the input signature are the same (a new input shape would retrace it with
    relaxed shapes, which the pass cannot size), so that the step is neither traced nor planned again."""

    budget_bytes: int | None
    inputs: tuple  # the fit's FitSession.inputs: batch size and input signature
    step: _Step
    state: State
    records: tuple = ()


class FitSession:
    """The first steps of one ``fit`` of ``model`` under ``config``, planned by ``pass_``.

    ``fit_locals``: the running ``fit``'s frame locals (its batch size); ``device_too_small``: an earlier ``fit`` of
    the same callback found that the step as compiled does not fit the device (plan for it at once); ``say`` prints
    what the session decided, ``warn`` warns."""

    def __init__(self, model, config: DymemConfig, pass_: step_pass.StepPass, fit_locals: dict | None = None,
                 device_too_small: bool = False, plain_inputs: tuple | None = None, kept: KeptStep | None = None,
                 say=print, warn=compat.warn_user):
        self.model, self.config, self.pass_ = model, config, pass_
        self.say, self.warn = say, warn
        self.device_too_small = device_too_small
        self.kept = kept  # the last fit's planned train function (KeptStep), reused where it fits this fit
        #: the train function fit made (or reused): the model's again when the session ends, unless it ran out of
        #: memory (then a new one, made then)
        self.keras_function = model.train_function
        self.request = step_pass.PlanRequest(default_batch_size=fit_batch.fit_batch_size(fit_locals),
                                             observed_batch_size=fit_batch.observed_batch_size(fit_locals))
        self.element_spec = compat.fit_element_spec(fit_locals)  # None: unknown (nothing is kept for a next fit)
        #: the model's train function is the one an earlier fit of the same callback found to fit the device, at
        #: these inputs (``plain_inputs``): it trains as compiled at once, unguarded (memory_budget="auto")
        self.plain_known_to_fit = plain_inputs is not None and plain_inputs == self.inputs
        self.control = FirstStepControl(state=State.AUTO if config.auto else State.UNGUARDED)
        self.records: list = []  # this fit's rewritten instantiations (each plan with its first step's measurement)
        self.skipped: list = []  # this fit's instantiations left unmodified
        self.last_result: step_pass.PassResult = step_pass.PassResult()  # the latest call's
        #: the gradient functions this fit's traces registered with TensorFlow for good (compat.new_gradients)
        self.gradient_keys: list[str] = []
        self.others_bytes = 0  # what the device held besides this model when fit began
        self._saved_limit: dict = {}
        self._xla_asked: list[str] = []
        self._probe_group = None
        self._offloaded = (False, False)
        self._ended, self._kept_at_end = False, None

    # -- the session's life --------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Set up the ``fit`` and install its first train function."""
        if self.config.auto:
            fits_first.begin(self)
        else:
            self._plan(self.config.budget_bytes)

    def end(self) -> KeptStep | None:
        """Undo what :meth:`begin` set up (safe to call twice): the device's limit, the offloaded variables, the
        mobility map; give the model back the train function ``fit`` made (never run under the pass: later fits,
        with or without a callback, reuse it as Keras does) and let go of the graph kept for re-plans. Returns the
        planned train function the fit ended with, for the next fit (None: none, or nothing settled)."""
        if self._ended:
            return self._kept_at_end
        self._ended = True
        devices.restore_limits(self._saved_limit)
        self._saved_limit = {}
        offload, offload_weights = self._offloaded
        if offload:  # the device holds the whole optimizer state (and every weight) again after fit
            variables.bring_back_offloaded(self.model, weights=offload_weights)
        self._offloaded = (False, False)
        step_pass.install_mobility({})
        self.pass_.release()
        # the traces are done: their gradients are never asked for again, and the entries would keep this fit's
        # graphs, and through them the model, alive for as long as the process runs
        compat.drop_gradients(self.gradient_keys)
        step = getattr(self.model.train_function, "dymem_step", None)
        kept = None
        if step is not None and self.control.settled and self.control.state is not State.REFUSED and self.inputs:
            kept = KeptStep(self.budget_bytes, self.inputs, step, self.control.state, tuple(step.records))
        if self.keras_function is None:  # it ran out of memory and was let go: a new one, not traced until called
            self.model.train_function = None
            self.model.make_train_function()
            self.keras_function = self.model.train_function
        self.model.train_function = self.keras_function
        self._kept_at_end = kept
        return kept

    @property
    def budget_bytes(self) -> int | None:
        """The budget in force: the one asked for, the device's once the step did not fit it, or None."""
        return self.request.budget_bytes

    @property
    def state(self) -> State:
        return self.control.state

    @property
    def batch_size(self) -> int | None:
        """The running ``fit``'s batch size (None when unknown)."""
        return self.request.default_batch_size

    @property
    def inputs(self) -> tuple | None:
        """What the train function's instantiations depend on besides the model: the batch size and the input
        signature of the running ``fit`` (None when the signature is unknown)."""
        return (self.batch_size, self.element_spec) if self.element_spec is not None else None

    @property
    def plan(self):
        """The plan of this fit's latest rewritten instantiation, or None."""
        return self.records[-1].plan if self.records else None

    @property
    def last_skipped(self):
        """This fit's latest instantiation when the pass left it unmodified, else None."""
        if not self.skipped:
            return None
        return self.skipped[-1] if not self.records or self.last_result.skipped else None

    # -- planning ------------------------------------------------------------------------------------------------
    def plan_for_device(self) -> None:
        """The step as compiled does not fit the device: plan it for the device from the next call of the train
        function on (and in later fits of the same callback)."""
        self.device_too_small = True
        self._plan(None, device_bytes=devices.device_memory_capacity())

    def _plan(self, budget_bytes: int | None, *, device_bytes: int | None = None) -> None:
        """Plan the train step for ``budget_bytes`` (None: swap every tensor worth swapping) from its next call:
        place the variables, and under a budget make that call the guarded probe. ``device_bytes`` (with no
        ``budget_bytes``): plan for the device, whose budget is its bytes less what it holds besides this model,
        measured here as the device's cap and the first steps' measurements are."""
        model, config = self.model, self.config
        offload, offload_weights = config.offloading(budget_bytes if device_bytes is None else device_bytes)
        # what the device holds besides this model, read before the optimizer builds: offloaded state is made in
        # host memory (a device that holds the weights need not hold it all at once)
        stats = devices.device_memory_stats()
        held = variables.device_resident_bytes(model) if offload else variables.persistent_bytes(model)
        self.others_bytes = devices.others_bytes(stats, held)
        if device_bytes is not None:
            budget_bytes = max(device_bytes - self.others_bytes, 1)
        variables.build_optimizer(model, in_host_memory=offload and allocator.is_active())
        weights = variables.persistent_bytes(model)
        resident = variables.persistent_bytes(model, optimizer=not offload)  # what must stay on the device
        if offload_weights:  # at least the largest weight, and those too small to move
            resident = variables.resident_weight_bytes(model, config.min_swap_bytes)
        if budget_bytes is not None and resident > budget_bytes:
            raise errors.weights_over_budget(budget_bytes, resident, offload, offload_weights)
        # under a budget the first step is the probe (dymem_tf.planning.first_step): least memory, measured,
        # variables guarded, and the device capped at the budget (which cannot go below GTBM's pageblocks)
        guard = config.guards_first_step(budget_bytes)
        floor = variables.pageblock_floor(stats, resident)
        if guard and floor > budget_bytes:
            raise errors.below_block_floor(budget_bytes, floor, resident, int(stats["block_size"]))
        errors.warn_onednn_out_of_memory_crash()
        if offload:  # the state starts in host memory: each plan brings back only what it needs, when it needs it
            self._offloaded = (True, offload_weights)
            variables.offload_optimizer_state(model, config.min_swap_bytes)
            if offload_weights:  # so do the weights: the first step (the probe) finds them there
                variables.offload_weights(model, config.min_swap_bytes)
            variables.compact_weights(model)  # what stays (and state made in the host arena) is packed on the device
        self.request = dataclasses.replace(self.request, budget_bytes=budget_bytes, probe=guard, calibration=None,
                                           memory=None, persistent_bytes=weights)
        self.control.plan_for(budget_bytes, guard)
        if guard:
            self._saved_limit = devices.cap_at(budget_bytes + self.others_bytes)
        kept = self.kept
        if kept is not None and (kept.budget_bytes, kept.inputs) == (budget_bytes, self.inputs):
            self._resume(kept)
            return
        self._xla_asked = xla.turn_off(model, config.xla, self.say, self.warn)
        model.train_function = self.wrap(model.train_function, self.request, guard=guard)

    def _resume(self, kept: KeptStep) -> None:
        """Train with the planned train function the last fit ended with (same model, budget, batch size and input
        signature): no trace, no plan, no guarded first step; its records are this fit's too."""
        self.control.resume(kept.state)
        self.request = kept.step.request
        self.records.extend(kept.records)
        self.model.train_function = self._wrap_step(kept.step, guard=False, fallback=None)
        self.say(f"dymem_tf: the train step runs the plan of the last fit ({kept.state}).")

    # -- train functions -----------------------------------------------------------------------------------------
    def wrap(self, train_function, request: step_pass.PlanRequest, guard: bool = False, fallback=None):
        """``train_function`` run with the pass armed for ``request`` (its instantiations planned and rewritten
        after Grappler), re-raising a refusal of the pass as its own error and an out-of-memory error with the
        budget it hit and what to change. ``guard``: its first call runs guarded (:meth:`_guarded_first_call`);
        ``fallback``: the probe's train function, that a failed or refused budgeted plan falls back to."""
        if train_function is None or getattr(train_function, "_dymem_wrapped", False):
            return train_function
        return self._wrap_step(_Step(train_function, request), guard, fallback)

    def _wrap_step(self, step: _Step, guard: bool, fallback):
        """The model's train function that runs ``step`` (see :meth:`wrap`)."""
        session, first = self, [True]
        train_function, request = step.function, step.request

        def run(iterator, first_call=False):
            before = session.peak_stats(reset=first_call)
            if step.mobility is not None:  # this function's graphs' grouping (another function may have run)
                step_pass.install_mobility(step.mobility)
            armed = None
            try:
                with session.pass_.armed(request, stage=session._pass_stage(),
                                         batch_size=session._replica_batch_size()) as armed, \
                        xla.step_clustering(session.config.xla), compat.new_gradients(session.gradient_keys):
                    outputs = train_function(iterator)
            except tf.errors.CancelledError as err:
                result = session._took(armed.result if armed else None, step)
                if result.refusal is not None and "dymem_tf:" in (err.message or ""):
                    raise result.refusal from None  # the step never ran: no training state changed
                raise
            except tf.errors.ResourceExhaustedError:
                compat.release_step_resources()  # what the failed step left for the next call (see compat)
                session._measure(session._took(armed.result, step), before, step, "out_of_memory")
                raise
            result = session._took(armed.result, step)
            session._measure(result, before, step)
            if first_call:
                session._after_first_call(step, result)
            return outputs

        def dymem_train_function(iterator):
            first_call, first[0] = first[0], False
            try:
                if first_call and guard:
                    return session._guarded_first_call(lambda it: run(it, first_call=True), iterator, fallback)
                return run(iterator, first_call)
            except tf.errors.ResourceExhaustedError as err:
                if "dymem_tf:" in (err.message or ""):
                    raise
                raise tf.errors.ResourceExhaustedError(
                    err.node_def, err.op, f"{err.message}\n\n{session.out_of_memory_hint()}") from err

        dymem_train_function._dymem_wrapped = True  # pylint: disable=protected-access
        dymem_train_function.dymem_step = step
        return dymem_train_function

    def _took(self, result: step_pass.PassResult | None, step: _Step) -> step_pass.PassResult:
        """Keep what one call's pass did (``result``) in this fit's records and ``step``'s; ``step``'s mobility
        map now includes the graphs the call rewrote (the pass installed theirs for the call; ``step``'s is
        installed before its next call)."""
        result = result or step_pass.PassResult()
        self.last_result = result
        self.records.extend(result.records)
        step.records.extend(result.records)
        self.skipped.extend(result.skipped)
        if result.mobility:
            step.mobility = {**(step.mobility or {}), **dict(result.mobility)}
        return result

    def _after_first_call(self, step: _Step, result: step_pass.PassResult) -> None:
        """After a train function's first call: say so when the pass saw no gradient ops in the graph it
        instantiated (a function an earlier fit instantiated is not offered again), and give the step back to XLA
        when its plan swaps nothing."""
        if not result.offered and not step.records and not getattr(self.model, "run_eagerly", False):
            # the pass saw no gradient ops (a step run eagerly has no graph: the pass is never offered one)
            problem = step_pass.Unsupported(step_pass.SkipKind.NO_GRADIENTS, "", step_pass.NO_GRADIENTS)
            self.skipped.append(self.pass_.skip(getattr(step.function, "__name__", "train_function"), problem,
                                                None))
        if self._xla_asked and not step.request.probe and not any(r.plan.swaps for r in result.records):
            xla.restore(self.model, self._xla_asked, self.say)
            self._xla_asked = []

    def _guarded_first_call(self, run, iterator, fallback):
        """Run a new train function's first step with the variables saved to host, report it to the controller
        and carry out its decision; ``fallback`` is the probe's train function (None for the probe itself)."""
        snapshot = variables.VariableSnapshot(self.model)
        devices.reset_device_peaks()
        probe = self.control.state is State.PROBE
        if probe:  # the persistent group the probe finds: the calibration predicts each plan's placement from it
            self._probe_group = self.persistent_group()
        failed = refined = None
        try:
            outputs = self._traced_probe(run, iterator) if probe else run(iterator)
        except tf.errors.ResourceExhaustedError as err:
            stats = None if probe else self.own(devices.device_memory_stats())  # the failed step's peaks
            snapshot.restore()
            failed, refined = self._ran_out(err, stats)
        except planner.BudgetTooSmallError as refusal:
            if self.control.refused().action is Action.REFUSE:
                raise
            # no plan fits the calibrated budget: the probe's plan is measured to fit, keep it (the step never ran)
            failed = (f"dymem_tf: {refusal}; keeping {self._fallback_plan()}, which fits.", self.say)
        except tf.errors.OpError:
            # any other failure of the step (a bug; LSTM under 7 MiB: Keras's loop output came back a float tensor):
            # the variables as they were before it, then its error
            snapshot.restore()
            raise
        if failed is not None:  # outside the except block: the failed step's traceback is gone
            text, tell = failed
            tell(text)
            if refined is None:
                return self._fall_back(fallback)(iterator)
            measured, in_use, source = refined
            self._install_calibrated(measured, fallback, in_use, source, outcome="out_of_memory")
            return self.model.train_function(iterator)  # the refined plan's first step, guarded
        stats = self.own(devices.device_memory_stats())
        measured, in_use = (stats["peak_bytes_reserved"], stats["peak_bytes_in_use"]) if stats else (None, None)
        swaps = any(r.plan.swaps for r in self.last_result.records)
        decision = self.control.stepped(measured, in_use, None if probe else self._placed_prediction(), swaps)
        if decision.action is Action.REFUSE:
            snapshot.restore()
            raise errors.too_close(self, measured)
        self._carry_out(decision, measured, in_use, self.model.train_function if probe else fallback)
        return outputs

    def _ran_out(self, err: tf.errors.ResourceExhaustedError, stats: dict | None) -> tuple[tuple, tuple | None]:
        """Report a guarded first step that ran out of memory (``stats``: the device's peaks in it; None for the
        probe's) and return ``(message and how to tell it, (measured, in use, source) to refine on or None to fall
        back)``; a probe's refuses the budget with an error."""
        in_use = stats["peak_bytes_in_use"] if stats else None
        decision = self.control.ran_out_of_memory(in_use, self._placed_prediction() if stats else None)
        if decision.action is Action.REFUSE:
            raise errors.measured_too_small(self, err) from err  # fit's exit restores the device limit
        ran_out = (f"dymem_tf: the plan made for memory_budget {_fmt(self.budget_bytes)} ran out of memory in its "
                   "first step; the variables were restored")
        if decision.action is Action.CALIBRATE:
            return ((f"{ran_out}; planning again, calibrated on that step (one batch was skipped).", self.say),
                    (stats["peak_bytes_reserved"], in_use, decision.source))
        return ((f"{ran_out} and training goes on with {self._fallback_plan()} (one batch was skipped).",
                 self.warn), None)

    def _fallback_plan(self) -> str:
        """The plan a fall-back trains with, in words."""
        return "the plan that held before it" if self.control.used_more else "the first step's least-memory plan"

    def _placed_prediction(self) -> tuple[int, int] | None:
        """``(predicted steady peak, pageblock size)`` of the budgeted plan whose first step just ran, where it was
        placed in GTBM's groups (one plan, made with a calibration that has a persistent group), else None."""
        records = self.last_result.records
        predicted = records[0].plan.predicted if len(records) == 1 else None
        cal = predicted.calibration if predicted is not None else None
        if cal is None or not cal.persistent_group or predicted.calibrated_peak_bytes is None:
            return None
        return int(predicted.calibrated_peak_bytes), int(cal.persistent_group["block_size"])

    def _fall_back(self, fallback):
        """Make the plan known to fit (``fallback``) train from now on, its next call guarded, and return the
        function that makes that call: the pool may still hold what the failed plan left (ResNet-50 + Adam, batch
        258 under 512 MiB: the probe's plan ran out of memory in the step after a calibrated plan had); if it runs
        out, its variables are restored and the budget is refused."""
        session = self

        def fallback_first_call(iterator):
            session.model.train_function = fallback
            snapshot = variables.VariableSnapshot(session.model)
            try:
                return fallback(iterator)
            except tf.errors.ResourceExhaustedError as err:
                snapshot.restore()
                raise errors.measured_too_small(session, err, fallen_back=True) from err

        fallback_first_call._dymem_wrapped = True  # pylint: disable=protected-access
        fallback_first_call.dymem_step = getattr(fallback, "dymem_step", None)
        self.model.train_function = fallback_first_call
        return fallback_first_call

    def _carry_out(self, decision, measured: int | None, in_use: int | None, fallback) -> None:
        """Act on the controller's ``decision`` after a first step that trained (it measured ``measured``
        reserved and ``in_use`` bytes at its peak); ``fallback`` is the probe's train function."""
        placed = self._placed_prediction()
        room = (f"(predicted {_fmt(placed[0])}); with what later steps may add it does not leave "
                f"{_fmt(first_step.placed_allowance(self.budget_bytes, placed[1]))} of the budget free"
                if placed else f"within {first_step.step_slack(self.budget_bytes):.0%} of the budget")
        said = "" if measured is None else (  # does not hold: what the next decisions say first
            f"dymem_tf: the plan made for memory_budget {_fmt(self.budget_bytes)} measured {_fmt(measured)} in its "
            f"first step {room}; ")
        if decision.action is Action.CALIBRATE:
            if decision.source is not State.PROBE:
                self.say(said + "planning again, calibrated on that step.")
            self._install_calibrated(measured, fallback=fallback, in_use=in_use, source=decision.source)
        elif decision.action is Action.USE_MORE:  # the plan that just held is the one to fall back to
            self.say(f"dymem_tf: the plan made for memory_budget {_fmt(self.budget_bytes)} measured {_fmt(measured)} "
                     f"in its first step (predicted {_fmt(placed[0])}), leaving more than "
                     f"{_fmt(first_step.placed_allowance(self.budget_bytes, placed[1]))} it was not predicted to "
                     "leave; planning again to keep more, calibrated on that step (this plan trains if that one "
                     "does not hold).")
            self._install_calibrated(measured, fallback=self.model.train_function, in_use=in_use,
                                     source=decision.source, outcome="under_used")
        elif decision.action is Action.FALL_BACK:
            self.say(said + f"training goes on with {self._fallback_plan()}, which leaves that room.")
            self._fall_back(fallback)
        if decision.source is not State.PROBE and decision.action is not Action.FALL_BACK:
            self._compact_kept_weights()

    def _compact_kept_weights(self) -> None:
        """After a budgeted plan's first step, where weights were offloaded: the variables that plan keeps came back
        one by one during the step (into the persistent group, between the holes of those that went to host
        memory); packed, later steps reserve less (the probe's plan keeps nothing there to pack)."""
        if self._offloaded[0]:
            variables.compact_weights(self.model)

    def _traced_probe(self, run, iterator):
        """Run the probe step with GTBM's trace on and keep the kernel temporaries it measured in the request
        (``memory``, for the budgeted plan and the calibration); without GTBM serving the training device (the
        CPU, or the one training GPU) just run it."""
        traced = devices.trace_device()
        if traced is False:
            return run(iterator)
        with tempfile.TemporaryDirectory(prefix="dymem_probe_") as tmp:
            path = os.path.join(tmp, "probe_trace.csv")
            with allocator.record_step(path, device=traced) as trace:
                outputs = run(iterator)
            new = self.last_result.records
            if len(new) == 1 and not trace["dropped"]:  # one plan (not one per replica), whole trace
                with open(path, newline="") as f:
                    memory = memory_model.from_trace(csv.DictReader(f), new[0].step_graph,
                                                     first_event=trace["first_event"])
                self.request = dataclasses.replace(self.request, memory=memory)
        return outputs

    def _install_calibrated(self, measured: int | None, fallback, in_use: int | None, source: State,
                            outcome: str = "ran") -> None:
        """Calibrate the planner from the first step just run (its ``measured`` reserved and ``in_use`` peaks; None
        without GTBM) of the ``source`` plan (the probe, or a calibrated or refined plan that did not hold, or with
        ``outcome`` "out_of_memory" ran out, or with "under_used" held with room to spare) and make the train
        function planned for the budget, falling back to ``fallback``; the calibration comes from that step's own
        call only."""
        records = self.last_result.records
        record = records[-1] if len(records) == 1 else None
        predicted = record.plan.predicted.peak_bytes if record is not None else None
        group, placed = self._probe_group, None
        memory = self.request.memory
        if record is not None and memory is not None:
            # the step again, with its kernels' temporaries (a calibrated plan was made with them), and placed
            sim = simulator.simulate(record.step_graph, record.plan, self.config.profile,
                                     temporaries=memory.held_during(record.step_graph))
            predicted = sim.peak_bytes if source is State.PROBE else predicted
            if group is not None and source is State.PROBE:  # the group held the variables the probe kept
                group = self._probe_group = group.without(placement.resident_bytes(sim.allocations))
            placed = placement.place(sim.allocations, group) if group is not None else None
        request = dataclasses.replace(self.request, probe=False)
        if measured and predicted:
            # the bytes the probe's plan kept on the device all step: optimizer state it offloads is not among them
            # (its prediction counts that state only while it is back on the device)
            last = source is not State.PROBE and self.control.refinements >= first_step.PLACED_REFINEMENTS
            calibration = first_step.Calibration.from_probe(
                self.budget_bytes, int(predicted), int(measured), record.plan.persistent_bytes, int(in_use or 0),
                source=source.value, placed=placed, group=group, outcome=outcome, last=last)
            request = dataclasses.replace(request, calibration=calibration, headroom=calibration.headroom)
        self.request = request
        xla.make_train_function_without_xla(self.model)
        self.model.train_function = self.wrap(self.model.train_function, request, guard=True, fallback=fallback)

    def _measure(self, result: step_pass.PassResult, before: dict | None, step: _Step, outcome: str = "ran") -> None:
        """Keep what the allocator measured in the call that instantiated the step (its first step) with the plan
        made for it (a copy of the plan with ``measured``, :func:`dymem_tf.planning.first_step.measurement`) in
        this fit's and ``step``'s records and, with verbose, print predicted against measured."""
        if before is None or len(result.records) != 1:  # nothing planned, or several replicas' plans
            return
        record = result.records[0]
        plan = record.plan
        steps = getattr(self.model, "steps_per_execution", 1)
        after = self.own(devices.device_memory_stats())
        measured = first_step.measurement(before, after, plan.predicted.peak_bytes, plan.predicted.calibration,
                                          outcome, steps if isinstance(steps, int) else 1,
                                          plan.predicted.calibrated_peak_bytes)
        measured_record = dataclasses.replace(record, plan=dataclasses.replace(plan, measured=measured))
        for records in (self.records, step.records):
            _replace(records, record, measured_record)
        stage = plan.params.stage
        self.say(f"dymem_tf: first step of the {stage + ' ' if stage else ''}plan: "
                 f"{measured_record.plan.measured_summary()}")

    # -- the device ----------------------------------------------------------------------------------------------
    def peak_stats(self, reset: bool = False) -> dict | None:
        """The training device's memory statistics before a call of the train function (None when nothing
        measures it); ``reset``: its peaks are reset first (a first step, so that they measure that step)."""
        if reset:
            devices.reset_device_peaks()
        return self.own(devices.device_memory_stats())

    def persistent_group(self) -> placement.PersistentGroup | None:
        """GTBM's persistent group on the training device now, less what other models held when ``fit`` began
        (None without GTBM's groups)."""
        return placement.PersistentGroup.from_stats(self.own(devices.device_memory_stats()))

    def own(self, stats: dict | None) -> dict | None:
        """``stats`` less what the device held besides this model when ``fit`` began (the budget is this fit's)."""
        return devices.less_others(stats, self.others_bytes)

    def out_of_memory_hint(self) -> str:
        """What the out-of-memory error of a train step in this fit adds: the budget, and what to change."""
        return errors.out_of_memory_hint(self)

    def _pass_stage(self) -> str:
        """Where the graph pass plans the step (:data:`~dymem_tf.passes.graph_pass.STAGES`): before XLA's clustering
        for ``xla="auto"``; after oneDNN's rewrite (:func:`~dymem_tf.passes.graph_pass.default_stage`) for a step on
        one CPU device, the only one whose partition oneDNN rewrites and holds the whole step; else after XLA's
        clustering, where the graph is still the whole step of every replica."""
        if self.config.xla == "auto":
            return "before_xla"
        if devices.training_gpus() or self._replicas() > 1:
            return "after_xla"
        return graph_pass.default_stage()

    def _replica_batch_size(self) -> int | None:
        """The batch size of one replica's step in the running ``fit`` (None when unknown): what an unknown batch
        dimension of the step's input stands for when the pass infers its shapes."""
        return step_pass.replica_batch(self.request.default_batch_size, self._replicas())

    def _replicas(self) -> int:
        strategy = getattr(self.model, "distribute_strategy", None)
        return getattr(strategy, "num_replicas_in_sync", 1) or 1


def _replace(items: list, old, new) -> None:
    """Replace the last item of ``items`` that is ``old`` (by identity) with ``new``."""
    for i in range(len(items) - 1, -1, -1):
        if items[i] is old:
            items[i] = new
            return
