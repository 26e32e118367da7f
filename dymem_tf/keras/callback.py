"""``DymemCallback``: the one-line entry point, ``model.fit(..., callbacks=[dymem_tf.DymemCallback()])``."""
from __future__ import annotations

import weakref

import keras

from dymem_tf import compat
from dymem_tf.keras import arguments, errors, fit_guard
from dymem_tf.keras.config import DymemConfig
from dymem_tf.keras.session import FitSession
from dymem_tf.memory import devices
from dymem_tf.passes import step_pass
from dymem_tf.planning.first_step_control import State

POLICIES, XLA_MODES, EXECUTION_ORDERS = arguments.POLICIES, arguments.XLA_MODES, arguments.EXECUTION_ORDERS


class DymemCallback(keras.callbacks.Callback):
    """Plans and inserts feature-map swapping into the model's train step, on the graph TensorFlow runs.

    With the defaults, a step that fits the device trains exactly as without Dymem (its first step guarded, see
    :mod:`dymem_tf.keras.fits_first`); one that does not is planned for the device: Dymem's graph pass (after
    Grappler) plans the swaps on the optimized graph and inserts them (:mod:`dymem_tf.passes.step_pass`).
    docs/configuration.md lists every argument with its default.

    Args:
        memory_budget: device bytes the step may use: ``"auto"`` (default: the device's memory; swap only when the
            step does not fit it), an int, a string such as ``"6GiB"`` or ``"512MiB"`` (plan for that budget from
            the first step on), or ``None`` (no budget: swap every tensor worth swapping, for the least memory;
            nothing where all of them together would save less than one of GTBM's 2 MiB pageblocks).
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
        min_swap_bytes: tensors smaller than this are never swapped; 0 swaps every candidate, also where all of
            them save less than a pageblock under ``memory_budget=None``.
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
        #: every knob, validated (read-only: the callback's attributes of the same names read it)
        self.config = DymemConfig.from_arguments(
            memory_budget, profile=profile, policy=policy, execution_order=execution_order, xla=xla,
            log_dir=log_dir, trace_allocations=trace_allocations, verbose=verbose,
            offload_optimizer_state=offload_optimizer_state, offload_weights=offload_weights, calibrate=calibrate,
            defer_updates=defer_updates, min_swap_bytes=min_swap_bytes, swapin_ahead=swapin_ahead, device=device)
        #: what every plan is made with, from the configuration
        self.settings = self.config.plan_settings()
        self.pass_ = step_pass.StepPass(self.settings, verbose=self.config.verbose)
        #: the running (or the last) fit's first-step session: its train functions, records and decisions
        self.session: FitSession | None = None
        self._writer = None
        self._exit_guard = None
        self._plans_written = 0  # how many of the session's records the summary writer has seen
        self._steps = -1  # the dashboard's step: every batch of every fit
        self._device_too_small = False  # the step as compiled did not fit the device in an earlier fit
        self._given_back = None  # weak reference to the train function the last fit gave the model back
        self._plain_inputs = None  # the session inputs at which that function fitted the device as compiled, if it did
        self._kept = None  # the planned train function the last fit ended with (session.KeptStep)
        self._said_off_here = False

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
        """Open this ``fit``'s first-step session (:mod:`dymem_tf.keras.session`), which installs the train
        function, and the dashboard's writer."""
        self._say_options_off_here()
        fit_locals = compat.fit_frame_locals(self.model)
        # the model's train function is the one the last fit gave back: same model, not compiled again since
        same = self._given_back is not None and self._given_back() is self.model.train_function
        self.session = FitSession(self.model, self.config, self.pass_, fit_locals, self._device_too_small,
                                  plain_inputs=self._plain_inputs if same else None,
                                  kept=self._kept if same else None, say=self._say, warn=self._warn)
        self._plans_written = 0
        self.session.begin()
        if self.config.log_dir:
            from dymem_tf.observe import summaries

            self._writer = summaries.DymemSummaryWriter(self.config.log_dir, profile=self.config.profile)
            if self.config.trace_allocations:
                traced = devices.trace_device()
                self._writer.start_allocator_trace(device=None if traced is False else traced)

    def _say_options_off_here(self) -> None:
        """Say once per callback which options asked for explicitly do nothing on this device."""
        off = arguments.options_off_here(self.config)
        if off and not self._said_off_here:
            self._said_off_here = True
            self._warn(off)

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is not None:
            # Keras reports the last batch of each execution (steps_per_execution), and a retrace can come at any
            # step: write each new plan once (with its measured first step), after the execution that traced it
            records = self.session.records
            while len(records) > self._plans_written:
                self._plans_written += 1
                self._writer.write_plan(records[self._plans_written - 1])
            self._steps += 1
            self._writer.write_step(self._steps, devices.step_stats(self.plan, self.session.own))

    def on_train_end(self, logs=None):
        self._end_fit()

    def _end_fit(self):
        """Undo what ``on_train_begin`` did; run when training ends and when ``fit`` raises (can run twice)."""
        if self._exit_guard is not None:
            self._exit_guard.release()
            self._exit_guard = None
        if self.session is not None:
            self._device_too_small = self.session.device_too_small
            self._kept = self.session.end()
            given_back = self.model.train_function
            self._given_back = weakref.ref(given_back) if given_back is not None else None
            self._plain_inputs = self.session.inputs if self.session.state is State.PLAIN else None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()  # also stops and saves an allocator trace

    def _warn(self, text: str) -> None:
        compat.warn_user(text)

    def _say(self, text: str) -> None:
        if self.config.verbose:
            print(text)

    def out_of_memory_hint(self) -> str:
        """What the out-of-memory error of a train step under this callback adds: the budget, and what to change."""
        return errors.out_of_memory_hint(self)

    # -- results -------------------------------------------------------------------------------------------------
    @property
    def plan_request(self) -> step_pass.PlanRequest:
        """What the running fit's train function is planned for now (before a fit: the configured budget)."""
        if self.session is not None:
            return self.session.request
        return step_pass.PlanRequest(budget_bytes=self.config.budget_bytes)

    @property
    def budget_bytes(self) -> int | None:
        """The budget in force: the one asked for, the device's with ``"auto"`` once the step did not fit it, or
        None (no budget)."""
        return self.plan_request.budget_bytes

    @property
    def plan(self):
        """The plan of the running (or last) fit's latest rewritten instantiation (None before one)."""
        return self.session.plan if self.session is not None else None

    @property
    def last_skipped(self):
        """The running (or last) fit's latest instantiation when the pass left it unmodified, else None."""
        return self.session.last_skipped if self.session is not None else None

    @property
    def skipped(self) -> list:
        """The running (or last) fit's instantiations the pass left unmodified, each with the reason it warned
        about (``step_pass.SkippedTrace``)."""
        return list(self.session.skipped) if self.session is not None else []

    @property
    def records(self) -> list:
        """The running (or last) fit's rewritten instantiations: function name, batch size, step graph, plan (with
        its first step's measurement), rewrite report and the rewritten graph (``record.graph``)."""
        return list(self.session.records) if self.session is not None else []


def _config_property(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only).")


for _name in ("memory_budget", "profile", "policy", "execution_order", "xla", "log_dir", "trace_allocations",
              "verbose", "offload_optimizer_state", "offload_weights", "calibrate", "defer_updates",
              "min_swap_bytes", "swapin_ahead"):
    setattr(DymemCallback, _name, _config_property(_name))
del _name
