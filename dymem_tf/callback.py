"""``DymemCallback``: the one-line entry point, ``model.fit(..., callbacks=[dymem_tf.DymemCallback()])``."""
from __future__ import annotations

import keras
import tensorflow as tf

from dymem_tf import allocator, device_profiles, planner, step_pass, units

POLICIES = planner.POLICIES


class DymemCallback(keras.callbacks.Callback):
    """Plans and inserts feature-map swapping into the model's train step when training begins.

    Args:
        memory_budget: device bytes the step may use: an int, a string such as ``"6GiB"`` or ``"512MiB"``,
            ``"auto"`` (the GTBM budget on the CPU, or the GPU's capacity), or ``None`` (no budget: swap every
            tensor worth swapping).
        policy: ``"dymem"`` (dependency-layer schedule), or a baseline: ``"vdnn"``, ``"tflms"``, ``"none"``.
        device: cost-model profile used by the planner (``"cpu"``, ``"v100"``, ``"a100"``, ``"h100"``,
            ``"h200"``, ...) or a :class:`~dymem_tf.device_profiles.DeviceProfile`; default: this machine's.
        swapin_ahead: for ``policy="tflms"``, how many topological levels ahead of its consumer a swap-in starts.
        min_swap_bytes: tensors smaller than this are never swapped.
        log_dir: where to write ``tf.summary`` scalars and the plan for TensorBoard's "Dymem" dashboard. Defaults
            to the log dir of a Keras ``TensorBoard`` callback in the same ``fit`` call, if any.
        trace_allocations: with a log dir, record the GTBM allocator's allocations during ``fit`` and save them in
            the run (the dashboard's pool map and tensors at the peak need them).
        verbose: 0 silent, 1 prints the plan summary when the step is traced.
    """

    def __init__(self, memory_budget=None, policy: str = "dymem", device=None, swapin_ahead: int = 1,
                 min_swap_bytes: int = 1 << 16, log_dir: str | None = None, trace_allocations: bool = False,
                 verbose: int = 1):
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if isinstance(swapin_ahead, bool) or not isinstance(swapin_ahead, int) or swapin_ahead < 1:
            raise ValueError(f"swapin_ahead must be a positive integer, got {swapin_ahead!r}")
        if isinstance(min_swap_bytes, bool) or not isinstance(min_swap_bytes, int) or min_swap_bytes < 0:
            raise ValueError(f"min_swap_bytes must be a non-negative integer, got {min_swap_bytes!r}")
        self.memory_budget = memory_budget
        self.budget_bytes = _resolve_budget(memory_budget)
        self.profile = device_profiles.get_profile(device or default_device_profile())
        self.policy = policy
        self.log_dir = log_dir
        self.trace_allocations = trace_allocations
        self.verbose = verbose
        self.pass_ = step_pass.StepPass(step_pass.PassConfig(
            policy=policy, budget_bytes=self.budget_bytes, device=self.profile, swapin_ahead=swapin_ahead,
            min_swap_bytes=min_swap_bytes, verbose=verbose))
        self._writer = None

    # -- Keras hooks ---------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        weights = step_pass.persistent_bytes(model)
        if self.budget_bytes is not None and weights > self.budget_bytes:
            raise planner.BudgetTooSmallError(
                f"memory_budget {_fmt(self.budget_bytes)} is smaller than the model's weights alone "
                f"({_fmt(weights)}); raise the budget or use a smaller model.")
        if getattr(model, "jit_compile", False):
            model.jit_compile = False
            self._say("dymem_tf: XLA (jit_compile) turned off for the train step: an XLA cluster would swallow "
                      "the swap ops.")
        step_pass.attach(model, self.pass_)
        model.make_train_function(force=True)
        log_dir = self.log_dir or _tensorboard_log_dir(self)
        if log_dir:
            from dymem_tf import summaries

            self._writer = summaries.DymemSummaryWriter(log_dir, profile=self.profile)
            if self.trace_allocations:
                self._writer.start_allocator_trace()

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is not None:
            if batch == 0 and self.pass_.records:
                self._writer.write_plan(self.pass_.records[-1])
            self._writer.write_step(self._global_step(batch), _step_stats(self.pass_))

    def on_train_end(self, logs=None):
        step_pass.detach(self.model)
        # Later fit() calls without this callback must trace the plain step again.
        self.model.train_function = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- results -------------------------------------------------------------------------------------------------
    @property
    def plan(self):
        """The plan of the most recent trace of the train step (None before the first step)."""
        return self.pass_.last_plan

    @property
    def records(self):
        """Every trace the pass rewrote: graph name, batch size, step graph, plan and rewrite report."""
        return list(self.pass_.records)

    def _global_step(self, batch: int) -> int:
        self._steps = getattr(self, "_steps", -1) + 1
        return self._steps

    def _say(self, text: str) -> None:
        if self.verbose:
            print(text)


def _resolve_budget(memory_budget):
    if memory_budget is None:
        return None
    if isinstance(memory_budget, str) and memory_budget.strip().lower() == "auto":
        return device_memory_capacity()
    budget = allocator.parse_bytes(memory_budget)
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
    return budget


def device_memory_capacity() -> int | None:
    """Bytes of the training device: the GPU's memory, or on the CPU the GTBM budget (None when unbounded)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        from tensorflow.python.client import device_lib

        limits = [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]
        return min(limits) if limits else None
    return allocator.get_memory_limit() if allocator.is_active() else None


def default_device_profile() -> str:
    """The cost-model profile for this machine: the GPU's class when one is visible, else ``"cpu"``."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu"
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "").lower()
    for key in ("h200", "gh200", "h100", "a100", "v100"):
        if key in name:
            return key
    return "a100"


def _tensorboard_log_dir(callback) -> str | None:
    """The log dir of a Keras ``TensorBoard`` callback passed to the same ``fit`` call, if any.

    Keras gives a callback no handle on its siblings; the ``CallbackList`` that holds this callback keeps them in a
    plain list, which the garbage collector's referrer graph finds.
    """
    import gc

    for holder in gc.get_referrers(callback):
        if isinstance(holder, list) and any(item is callback for item in holder):
            for cb in holder:
                if isinstance(cb, keras.callbacks.TensorBoard):
                    return cb.log_dir
    return None


def _step_stats(pass_) -> dict:
    stats = {}
    if allocator.is_active():
        stats.update(allocator.memory_stats())
    try:
        from dymem_tf.ops import host_pool

        stats.update({f"host_{k}": v for k, v in host_pool.host_pool_stats().items()})
    except Exception:  # pylint: disable=broad-except  (the op library may be unavailable: stats are optional)
        pass
    plan = pass_.last_plan
    if plan is not None:
        stats["planned_swap_bytes"] = sum(s.bytes for s in plan.swaps)
        stats["modelled_stall_s"] = plan.predicted.get("stall_s", 0.0)
    return stats


def _fmt(n: int) -> str:
    return units.format_bytes(n)
