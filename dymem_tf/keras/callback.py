"""``DymemCallback``: the one-line entry point, ``model.fit(..., callbacks=[dymem_tf.DymemCallback()])``."""
from __future__ import annotations

import csv
import dataclasses
import os
import tempfile

import keras
import tensorflow as tf

from dymem_tf import compat
from dymem_tf.keras import arguments, errors, fit_batch, fit_guard, fits_first, variables, xla
from dymem_tf.memory import allocator, devices, placement
from dymem_tf.passes import graph_pass, step_pass
from dymem_tf.planning import (device_profiles, first_step, first_step_control, memory_model, pipeline, planner,
                               simulator)

POLICIES, XLA_MODES, EXECUTION_ORDERS = arguments.POLICIES, arguments.XLA_MODES, arguments.EXECUTION_ORDERS
_fmt = errors.fmt


class DymemCallback(keras.callbacks.Callback):
    """Plans and inserts feature-map swapping into the model's train step, on the graph TensorFlow runs.

    With the defaults, a step that fits the device trains exactly as without Dymem (its first step guarded, see
    :mod:`dymem_tf.keras.fits_first`); one that does not is planned for the device: Dymem's graph pass (after
    Grappler) plans the swaps on the optimized graph and inserts them (:mod:`dymem_tf.passes.step_pass`).
    docs/configuration.md lists every argument with its default.

    Args:
        memory_budget: device bytes the step may use: ``"auto"`` (default: the device's memory; swap only when the
            step does not fit it), an int, a string such as ``"6GiB"`` or ``"512MiB"`` (plan for that budget from
            the first step on), or ``None`` (no budget: swap every tensor worth swapping, for the least memory).
        profile: cost-model profile the planner times copies and kernels with (``"cpu"``, ``"v100"``,
            ``"a100"``, ``"h100"``, ``"h200"``, ...) or a :class:`~dymem_tf.planning.device_profiles.DeviceProfile`;
            default: this machine's (a GPU no profile matches gets ``"a100"``, with a warning naming it).
        policy: ``"dymem"`` (dependency-layer schedule), or a baseline: ``"vdnn"``, ``"tflms"``, ``"none"``.
        execution_order: ``"planned"`` (default, for the ``"dymem"`` policy): the step's ops run in the order the
            planner simulated them, chained by control edges, so every step peaks alike; under a budget at the
            peak predicted, whatever the executor's thread count. Where the bytes in use stay far enough below the
            peak, ops of a band run side by side; without a budget convolutions and matrix products may too, whose
            workspaces then coexist in the steps where the executor runs two at once (see
            :mod:`dymem_tf.planning.sequencing`; the values are unchanged either way).
            ``"strict"``: every op chained, one at a time: the bytes in use repeat by construction. ``"free"``: TF's
            executor orders the ops as they become ready; steps then differ by several % in memory.
        xla: ``None`` (default): a step that swaps runs without XLA (an XLA cluster would swallow the swap ops); a
            step that swaps nothing keeps your XLA settings. ``"auto"``: the pass plans before XLA's clustering and
            the step is auto-clustered around the swap ops (on the CPU only with
            ``TF_XLA_FLAGS=--tf_xla_cpu_global_jit``). See docs/gpu.md.
        log_dir: where to write the data of TensorBoard's "Dymem" dashboard (the run ``<log_dir>/dymem``); None
            writes nothing. A Keras ``TensorBoard`` callback's log dir puts it next to its runs.
        trace_allocations: with a log dir, record the GTBM allocator's allocations during ``fit`` and save them in
            the run (the dashboard's pool map and tensors at the peak need them).
        verbose: 0 silent, 1 prints the plan summary when the step is traced, 2 also the pass's time per stage.
        offload_optimizer_state: under a budget, let the planner keep optimizer state (Adam's ``m`` and ``v``,
            momentum) in host memory between its uses where the budget needs it, a round trip per step each
            (:mod:`dymem_tf.planning.offload`). ``None`` (default): where implemented, the CPU device.
        offload_weights: likewise for weights (three copies per step each). ``None`` (default): where implemented.
        calibrate: under a budget, run the first planned step as a measured probe (least memory, variables
            guarded) and plan again from what it measured (:mod:`dymem_tf.planning.first_step`). ``False`` plans
            for the budget from the model alone, with the fixed default headroom.
        defer_updates: run optimizer arithmetic that needs no gradient next to its gradient, and each variable's
            update after the users of its reads (:mod:`dymem_tf.planning.update_deferral`, ``read_ordering``).
        min_swap_bytes: tensors smaller than this are never swapped.
        swapin_ahead: for ``policy="tflms"``, how many topological levels ahead of its consumer a swap-in starts.
        device: the former name of ``profile``; still accepted, with a warning.
    """

    def __init__(self, memory_budget="auto", *, profile=None, policy: str = "dymem",
                 execution_order: str = "planned", xla: str | None = None, log_dir: str | None = None,
                 trace_allocations: bool = False, verbose: int = 1, offload_optimizer_state: bool | None = None,
                 offload_weights: bool | None = None, calibrate: bool = True, defer_updates: bool = True,
                 min_swap_bytes: int = 1 << 16, swapin_ahead: int = 1, device=None):
        super().__init__()
        compat.check_versions()  # a clear error now, not a missing attribute inside fit
        profile = arguments.profile_argument(profile, device)
        min_swap_bytes, log_dir, verbose = arguments.validate(
            policy=policy, swapin_ahead=swapin_ahead, min_swap_bytes=min_swap_bytes, log_dir=log_dir,
            defer_updates=defer_updates, trace_allocations=trace_allocations,
            offload_optimizer_state=offload_optimizer_state, offload_weights=offload_weights, calibrate=calibrate,
            xla=xla, execution_order=execution_order, verbose=verbose, device=profile)
        self.memory_budget = memory_budget
        #: "auto": train as compiled while the step fits the device (see :meth:`_begin_fit`)
        self.fits_first = arguments.is_auto(memory_budget)
        asked = None if self.fits_first else arguments.resolve_budget(memory_budget)
        self.profile = device_profiles.get_profile(profile or arguments.default_device_profile())
        self.policy = policy
        self.log_dir = log_dir
        self.trace_allocations = trace_allocations
        self.calibrate = calibrate
        self.offload_optimizer_state = offload_optimizer_state
        self.offload_weights = offload_weights
        self.xla = xla
        self.execution_order = execution_order
        self.verbose = verbose
        #: what every plan is made with (``PlanSettings``'s budget fields stay unset: each instantiation's
        #: ``plan_request`` fills them in)
        self.settings = pipeline.PlanSettings(
            policy=policy, profile=self.profile, swapin_ahead=swapin_ahead, min_swap_bytes=min_swap_bytes,
            defer_updates=defer_updates, execution_order=execution_order,
            offload_variables=offload_optimizer_state is not False, offload_weights=offload_weights is not False)
        self.pass_ = step_pass.StepPass(self.settings, verbose=verbose)
        self._writer = None
        #: what the next instantiation of the train step is planned for (replaced whole, never changed)
        self.plan_request = step_pass.PlanRequest(budget_bytes=asked)
        self._asked_budget = asked  # the budget every fit plans for from its first step (None with "auto")
        self._exit_guard = None
        self._plans_written = 0  # how many of pass_.records the summary writer has seen
        self._xla_asked = []  # the XLA settings the user asked for, off while the step swaps
        #: which plan the step runs next under a budget (a FirstStepControl, made per fit; None: not guarded)
        self.first_steps = None

    # -- Keras hooks ---------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        # fit calls on_train_end only when training finishes: every other way out of fit undoes the set-up here
        try:
            self._begin_fit()
            self._exit_guard = fit_guard.FitGuard(self, self._end_fit).arm()
        except BaseException:
            self._end_fit()
            raise

    def _begin_fit(self):
        """Set up this ``fit``: with ``memory_budget="auto"`` the step first trains as compiled
        (:func:`dymem_tf.keras.fits_first.begin`), else it is planned for the budget from its first step
        (:meth:`_begin_planning`)."""
        fit_locals = compat.fit_frame_locals(self.model)  # the running fit's locals: its data adapter, batch_size
        self._skips_before_fit = len(self.pass_.skipped)  # an earlier fit's step is not this one's
        self.plan_request = step_pass.PlanRequest(default_batch_size=fit_batch.fit_batch_size(fit_locals),
                                                  observed_batch_size=fit_batch.observed_batch_size(fit_locals))
        self._say_options_off_here()
        if self.fits_first:  # the step trains as compiled while it fits the device
            fits_first.begin(self)
        else:
            self._begin_planning(self._asked_budget)
        log_dir = self.log_dir
        if log_dir:
            from dymem_tf.observe import summaries

            self._writer = summaries.DymemSummaryWriter(log_dir, profile=self.profile)
            self._plans_written = len(self.pass_.records)  # plans of an earlier fit are not this run's
            if self.trace_allocations:
                traced = devices.trace_device()
                self._writer.start_allocator_trace(device=None if traced is False else traced)

    def _plan_for_device(self) -> None:
        """The step does not fit the device: plan it for the device from the next call of the train function on
        (and in later fits of this callback)."""
        self._device_too_small = True
        self._begin_planning(None, device_bytes=devices.device_memory_capacity())

    def _begin_planning(self, budget_bytes: int | None, *, device_bytes: int | None = None):
        """Plan the train step for ``budget_bytes`` (None: swap every tensor worth swapping) from its next call:
        place the variables, and under a budget make that call the guarded probe. ``device_bytes`` (with no
        ``budget_bytes``): plan for the device, whose budget is its bytes less what it holds besides this model,
        measured here as the device's cap and the first steps' measurements are (the cap is the budget plus those
        bytes: the whole device)."""
        assert budget_bytes is None or device_bytes is None, "a budget or a device to plan for, not both"
        model = self.model
        offload, offload_weights = self._offloading(budget_bytes if device_bytes is None else device_bytes)
        # what the device holds besides this model, read before the optimizer builds: offloaded state is made in
        # host memory (a device that holds the weights need not hold it all at once)
        stats = devices.device_memory_stats()
        held = variables.device_resident_bytes(model) if offload else step_pass.persistent_bytes(model)
        self._others_bytes = devices.others_bytes(stats, held)
        if device_bytes is not None:
            budget_bytes = max(device_bytes - self._others_bytes, 1)
        self.plan_request = dataclasses.replace(self.plan_request, budget_bytes=budget_bytes)
        variables.build_optimizer(model, in_host_memory=offload and allocator.is_active())
        weights = step_pass.persistent_bytes(model)
        resident = step_pass.persistent_bytes(model, optimizer=not offload)  # what must stay on the device
        if offload_weights:  # at least the largest weight, and those too small to move
            resident = variables.resident_weight_bytes(model, self.settings.min_swap_bytes)
        if self.budget_bytes is not None and resident > self.budget_bytes:
            raise errors.weights_over_budget(self.budget_bytes, resident, offload, offload_weights)
        # under a budget the first step is the probe (dymem_tf.planning.first_step): least memory, measured,
        # variables guarded, and the device capped at the budget (which cannot go below GTBM's pageblocks)
        guard = self.budget_bytes is not None and self.policy != "none" and self.calibrate
        floor = variables.pageblock_floor(stats, resident)
        if guard and floor > self.budget_bytes:
            raise errors.below_block_floor(self.budget_bytes, floor, resident, int(stats["block_size"]))
        errors.warn_onednn_out_of_memory_crash()
        if offload:  # the state starts in host memory: each plan brings back only what it needs, when it needs it
            variables.offload_optimizer_state(model, self.settings.min_swap_bytes)
            if offload_weights:  # so do the weights: the first step (the probe) finds them there
                variables.offload_weights(model, self.settings.min_swap_bytes)
            variables.compact_weights(model)  # what stays (and state made in the host arena) is packed on the device
        # A new train function: its first call instantiates it, and the graph pass plans that instantiation (the
        # probe under a guarded budget, see above).
        self.plan_request = dataclasses.replace(self.plan_request, probe=guard, calibration=None, memory=None,
                                                persistent_bytes=weights, headroom=planner.DEFAULT_HEADROOM)
        #: the first steps under the budget: which plan runs next (None: no guarded first step)
        self.first_steps = first_step_control.FirstStepControl(self.budget_bytes) if guard else None
        if guard:
            self._cap_device_at_budget()
        self._xla_asked = xla.turn_off(model, self.xla, self._say, self._warn)
        model.train_function = self._wrap_train_function(model.train_function, guard=guard)

    def _say_options_off_here(self) -> None:
        """Say once per callback which options asked for explicitly do nothing on this device."""
        off = arguments.options_off_here(self)
        if off and not getattr(self, "_said_off_here", False):
            self._said_off_here = True
            self._warn(off)

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is not None:
            # Keras reports the last batch of each execution (steps_per_execution), and a retrace can come at any
            # step: write each new plan once (with its measured first step), after the execution that traced it
            while len(self.pass_.records) > self._plans_written:
                self._plans_written += 1
                self._writer.write_plan(self.pass_.records[self._plans_written - 1])
            self._steps = getattr(self, "_steps", -1) + 1  # the dashboard's step: every batch of every fit
            self._writer.write_step(self._steps, devices.step_stats(self.pass_.last_plan, self._own))

    def on_train_end(self, logs=None):
        self._end_fit()

    def _end_fit(self):
        """Undo what ``on_train_begin`` did; run when training ends and when ``fit`` raises (can run twice)."""
        if self._exit_guard is not None:
            self._exit_guard.release()
            self._exit_guard = None
        self._restore_device_limit()
        offload, offload_weights = self._offloading()
        if offload:  # the device holds the whole optimizer state (and every weight) again after fit
            variables.bring_back_offloaded(self.model, weights=offload_weights)
        # Later fit() calls without this callback must trace the plain step again.
        self.model.train_function = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()  # also stops and saves an allocator trace

    def _offloading(self, budget_bytes: int | None = None) -> tuple[bool, bool]:
        """Whether this fit's plans may keep optimizer state, and weights, in host memory between their uses
        (:func:`dymem_tf.keras.arguments.offloading`), under ``budget_bytes`` (None: the budget in force)."""
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        return arguments.offloading(budget, self.policy, self.offload_optimizer_state, self.offload_weights)

    def _wrap_train_function(self, train_function, guard: bool = False, fallback=None):
        """``train_function`` run with the graph pass armed (its instantiation is planned and rewritten after
        Grappler), re-raising a refusal of the pass as its own error and an out-of-memory error with the budget it
        hit and what to change.

        ``guard``: its first call (the one that instantiates it) runs with the variables copied to host and put
        back if it runs out of memory (see :mod:`dymem_tf.planning.first_step`); ``fallback`` is the probe's train function
        that a failed or refused budgeted plan falls back to."""
        if train_function is None or getattr(train_function, "_dymem_wrapped", False):
            return train_function
        callback = self
        state = {"first": True}

        def run(iterator, first=False):
            outcome = step_pass.PassOutcome()
            seen_records = len(callback.pass_.records)
            seen = seen_records + len(callback.pass_.skipped)
            before = callback._peak_stats(reset=first)
            clustering = xla.step_clustering(callback.xla)
            try:
                with graph_pass.armed(callback.pass_.listener(callback.plan_request, outcome),
                                      stage=callback._pass_stage(), batch_size=callback._replica_batch_size()), \
                        clustering:
                    outputs = train_function(iterator)
            except tf.errors.CancelledError as err:
                if outcome.refusal is not None and "dymem_tf:" in (err.message or ""):
                    raise outcome.refusal from None  # the step never ran: no training state changed
                raise
            except tf.errors.ResourceExhaustedError:
                compat.release_step_resources()  # what the failed step left for the next call (see compat)
                callback._measure_first_step(seen_records, before, "out_of_memory")
                raise
            callback._measure_first_step(seen_records, before)
            if (first and not getattr(callback.model, "run_eagerly", False)
                    and len(callback.pass_.records) + len(callback.pass_.skipped) == seen):
                # the first call instantiated the step, and the pass saw no gradient ops in it (a step run eagerly
                # has no graph: the pass is never offered one)
                callback.pass_.skip(getattr(train_function, "__name__", "train_function"),
                                    step_pass.Unsupported(step_pass.SkipKind.NO_GRADIENTS, "", step_pass.NO_GRADIENTS),
                                    None)
            if first and callback._xla_asked and not callback.plan_request.probe and not any(
                    record.plan.swaps for record in callback.pass_.records[seen_records:]):
                xla.restore(callback.model, callback._xla_asked, callback._say)
                callback._xla_asked = []
            return outputs

        def dymem_train_function(iterator):
            first, state["first"] = state["first"], False
            try:
                if first and guard:
                    return callback._guarded_first_call(lambda it: run(it, first=True), iterator, fallback)
                return run(iterator, first)
            except tf.errors.ResourceExhaustedError as err:
                if "dymem_tf:" in (err.message or ""):
                    raise
                raise tf.errors.ResourceExhaustedError(
                    err.node_def, err.op, f"{err.message}\n\n{callback.out_of_memory_hint()}") from err

        dymem_train_function._dymem_wrapped = True  # pylint: disable=protected-access
        return dymem_train_function

    def _pass_stage(self) -> str:
        """Where the graph pass plans the step (:data:`~dymem_tf.passes.graph_pass.STAGES`): before XLA's clustering
        for ``xla="auto"``; after oneDNN's rewrite (:func:`~dymem_tf.passes.graph_pass.default_stage`) for a step on
        one CPU device, the only one whose partition oneDNN rewrites and holds the whole step; else after XLA's
        clustering, where the graph is still the whole step of every replica."""
        if self.xla == "auto":
            return "before_xla"
        strategy = getattr(self.model, "distribute_strategy", None)
        if devices.training_gpus() or (getattr(strategy, "num_replicas_in_sync", 1) or 1) > 1:
            return "after_xla"
        return graph_pass.default_stage()

    def _replica_batch_size(self) -> int | None:
        """The batch size of one replica's step in the running ``fit`` (None when unknown): what an unknown batch
        dimension of the step's input stands for when the pass infers its shapes."""
        strategy = getattr(self.model, "distribute_strategy", None)
        return step_pass.replica_batch(self.plan_request.default_batch_size,
                                       getattr(strategy, "num_replicas_in_sync", 1) or 1)

    def _guarded_first_call(self, run, iterator, fallback):
        """Run a new train function's first step with the variables saved to host, report it to
        :attr:`first_steps` and carry out its decision (:meth:`_carry_out`); ``fallback`` is the probe's train
        function (None for the probe itself)."""
        snapshot = first_step.VariableSnapshot(self.model)
        devices.reset_device_peaks()
        probe = self.first_steps.state is first_step_control.State.PROBE
        if probe:  # the persistent group the probe finds: the calibration predicts each plan's placement from it
            self._probe_group = self._persistent_group()
        try:
            outputs = self._traced_probe(run, iterator) if probe else run(iterator)
        except tf.errors.ResourceExhaustedError as err:
            snapshot.restore()
            if self.first_steps.ran_out_of_memory().action is first_step_control.Action.REFUSE:
                raise errors.measured_too_small(self, err) from err  # fit's exit restores the device limit
            self._warn(f"dymem_tf: the plan made for memory_budget {_fmt(self.budget_bytes)} ran out of memory in "
                       "its first step; the variables were restored and training goes on with the first step's "
                       "least-memory plan (one batch was skipped).")
            self.model.train_function = fallback
            return fallback(iterator)
        except planner.BudgetTooSmallError as refusal:
            if self.first_steps.refused().action is first_step_control.Action.REFUSE:
                raise
            # no plan fits the calibrated budget: the probe's plan is measured to fit, keep it (the step never ran)
            self._say(f"dymem_tf: {refusal}; keeping the first step's least-memory plan, which fits.")
            self.model.train_function = fallback
            return fallback(iterator)
        stats = self._own(devices.device_memory_stats())
        measured, in_use = (stats["peak_bytes_reserved"], stats["peak_bytes_in_use"]) if stats else (None, None)
        decision = self.first_steps.stepped(measured, in_use)
        if decision.action is first_step_control.Action.REFUSE:
            snapshot.restore()
            raise errors.too_close(self, measured)
        self._carry_out(decision, measured, in_use, self.model.train_function if probe else fallback)
        return outputs

    def _carry_out(self, decision, measured: int | None, in_use: int | None, fallback) -> None:
        """Act on the :attr:`first_steps` ``decision`` after a first step that trained (it measured ``measured``
        reserved and ``in_use`` bytes at its peak); ``fallback`` is the probe's train function."""
        action = first_step_control.Action
        said = "" if measured is None else (  # within the slack: what the next decisions say first
            f"dymem_tf: the plan made for memory_budget {_fmt(self.budget_bytes)} measured {_fmt(measured)} in its "
            f"first step, within {first_step.step_slack(self.budget_bytes):.0%} of the budget; ")
        if decision.action is action.CALIBRATE:
            if decision.source == "probe":
                self.plan_request = dataclasses.replace(self.plan_request, probe=False)
            else:
                self._say(said + "planning again, calibrated on that step.")
            self._install_calibrated(measured, fallback=fallback, in_use=in_use, source=decision.source)
        elif decision.action is action.FALL_BACK:
            self._say(said + "training goes on with the first step's least-memory plan, which leaves that room.")
            self.model.train_function = fallback
        if decision.source != "probe" and decision.action is not action.FALL_BACK and self._offloading()[0]:
            # the variables this budgeted plan keeps came back one by one during its first step (into the
            # persistent group, between the holes of those that went to host memory); packed, later steps reserve
            # less (the probe's plan keeps nothing there to pack)
            variables.compact_weights(self.model)

    def _traced_probe(self, run, iterator):
        """Run the probe step with GTBM's trace on and keep the kernel temporaries it measured in the pass
        (``plan_request.memory``, for the budgeted plan and the calibration); without GTBM serving the training device
        (the CPU, or the one training GPU) just run it."""
        traced = devices.trace_device()
        if traced is False:
            return run(iterator)
        with tempfile.TemporaryDirectory(prefix="dymem_probe_") as tmp:
            path = os.path.join(tmp, "probe_trace.csv")
            planned = len(self.pass_.records)
            with allocator.record_step(path, device=traced) as trace:
                outputs = run(iterator)
            new = self.pass_.records[planned:]
            if len(new) == 1 and not trace["dropped"]:  # one plan (not one per replica), whole trace
                with open(path, newline="") as f:
                    memory = memory_model.from_trace(csv.DictReader(f), new[0].step_graph,
                                                     first_event=trace["first_event"])
                self.plan_request = dataclasses.replace(self.plan_request, memory=memory)
        return outputs

    def _install_calibrated(self, measured: int | None, fallback, in_use: int | None = None,
                            source: str = "probe") -> None:
        """Calibrate the planner from the first step just run (its ``measured`` reserved and ``in_use`` peaks; None
        without GTBM) of the ``source`` plan (the probe, or a calibrated plan that left too little slack) and make
        the train function planned for the budget."""
        record = self.pass_.records[-1] if self.pass_.records else None
        predicted = record.plan.predicted.peak_bytes if record is not None else None
        group, placed = getattr(self, "_probe_group", None), None
        memory = self.plan_request.memory
        if record is not None and memory is not None:
            # the step again, with its kernels' temporaries (a calibrated plan was made with them), and placed
            sim = simulator.simulate(record.step_graph, record.plan, self.settings.profile,
                                     temporaries=memory.held_during(record.step_graph))
            predicted = sim.peak_bytes if source == "probe" else predicted
            if group is not None and source == "probe":  # the group held the variables the probe kept
                group = self._probe_group = group.without(placement.resident_bytes(sim.allocations))
            placed = placement.place(sim.allocations, group) if group is not None else None
        if measured and predicted:
            # the bytes the probe's plan kept on the device all step: optimizer state it offloads is not among them
            # (its prediction counts that state only while it is back on the device)
            persistent = record.plan.persistent_bytes
            calibration = first_step.Calibration.from_probe(self.budget_bytes, int(predicted), int(measured),
                                                            persistent, int(in_use or 0), source=source,
                                                            placed=placed, group=group)
            self.plan_request = dataclasses.replace(self.plan_request, calibration=calibration,
                                                    headroom=calibration.headroom)
        xla.make_train_function_without_xla(self.model)
        self.model.train_function = self._wrap_train_function(self.model.train_function, guard=True,
                                                               fallback=fallback)

    def _peak_stats(self, reset: bool = False) -> dict | None:
        """The training device's memory statistics before a call of the train function (None when nothing
        measures it); ``reset``: its peaks are reset first (a fit's first step, so that they measure that step)."""
        if reset:
            devices.reset_device_peaks()
        return self._own(devices.device_memory_stats())

    def _persistent_group(self) -> placement.PersistentGroup | None:
        """GTBM's persistent group on the training device now, less what other models held when ``fit`` began
        (None without GTBM's groups)."""
        return placement.PersistentGroup.from_stats(self._own(devices.device_memory_stats()))

    def _own(self, stats: dict | None) -> dict | None:
        """``stats`` less what the device held besides this model when ``fit`` began (the budget is this fit's)."""
        return devices.less_others(stats, getattr(self, "_others_bytes", 0))

    def _measure_first_step(self, planned: int, before: dict | None, outcome: str = "ran") -> None:
        """Keep what the allocator measured in the call that instantiated the step (its first step) in the plan
        made for it (``Plan.measured``, see :func:`dymem_tf.planning.first_step.measurement`) and, with verbose,
        print predicted against measured."""
        new = self.pass_.records[planned:]
        if before is None or len(new) != 1:  # nothing planned, or several replicas' plans that share the peak
            return
        plan = new[0].plan
        steps = getattr(self.model, "steps_per_execution", 1)
        after = self._own(devices.device_memory_stats())
        plan.measured = first_step.measurement(before, after, plan.predicted.peak_bytes, plan.predicted.calibration,
                                               outcome, steps if isinstance(steps, int) else 1,
                                               plan.predicted.calibrated_peak_bytes)
        stage = plan.params.stage
        self._say(f"dymem_tf: first step of the {stage + ' ' if stage else ''}plan: {plan.measured_summary()}")

    def _cap_device_at_budget(self) -> None:
        """Cap the GTBM device at the budget for this ``fit`` (:func:`dymem_tf.memory.devices.cap_at`), so that a
        probe that needs more raises instead of succeeding over the budget; :meth:`_restore_device_limit` undoes
        it. Other models the process held when ``fit`` began keep their memory."""
        self._saved_limit = devices.cap_at(self.budget_bytes + getattr(self, "_others_bytes", 0))

    def _restore_device_limit(self) -> None:
        saved, self._saved_limit = getattr(self, "_saved_limit", None) or {}, {}
        devices.restore_limits(saved)

    def _warn(self, text: str) -> None:
        compat.warn_user(text)

    def out_of_memory_hint(self) -> str:
        """What the out-of-memory error of a train step under this callback adds: the budget, and what to change."""
        return errors.out_of_memory_hint(self)

    # -- results -------------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int | None:
        """The budget in force: the one asked for, the device's with ``"auto"`` once the step did not fit it, or
        None (no budget)."""
        return self.plan_request.budget_bytes

    @property
    def plan(self):
        """The plan of the most recent trace of the train step (None before the first step)."""
        return self.pass_.last_plan

    @property
    def last_skipped(self):
        """This fit's most recent instantiation of the step when the pass left it unmodified, else None."""
        fresh = len(self.pass_.skipped) > getattr(self, "_skips_before_fit", 0)
        return self.pass_.last_skipped if fresh else None

    @property
    def skipped(self):
        """Traces the pass left unmodified, each with the reason it warned about (see ``step_pass.SkippedTrace``)."""
        return list(self.pass_.skipped)

    @property
    def records(self):
        """Every instantiated graph the pass rewrote: function name, batch size, step graph, plan, rewrite report and
        the rewritten graph (``record.graph``)."""
        return list(self.pass_.records)

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)
