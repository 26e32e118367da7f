"""``DymemCallback``: the one-line entry point, ``model.fit(..., callbacks=[dymem_tf.DymemCallback()])``."""
from __future__ import annotations

import contextlib
import os
import sys

import keras
import tensorflow as tf

from dymem_tf import allocator, device_profiles, fit_guard, grappler_config, planner, step_pass, units

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
        log_dir: where to write ``tf.summary`` scalars and the plan for TensorBoard's "Dymem" dashboard (the run
            ``<log_dir>/dymem``); None writes nothing. Pass a Keras ``TensorBoard`` callback's log dir to have the
            Dymem run next to its ``train`` and ``validation`` runs.
        trace_allocations: with a log dir, record the GTBM allocator's allocations during ``fit`` and save them in
            the run (the dashboard's pool map and tensors at the peak need them).
        defer_updates: run optimizer arithmetic that needs no gradient next to its gradient (saves about one
            weight-sized temporary per optimizer slot, see :mod:`dymem_tf.update_deferral`).
        verbose: 0 silent, 1 prints the plan summary when the step is traced.
    """

    def __init__(self, memory_budget=None, policy: str = "dymem", device=None, swapin_ahead: int = 1,
                 min_swap_bytes: int = 1 << 16, log_dir: str | None = None, trace_allocations: bool = False,
                 defer_updates: bool = True, verbose: int = 1):
        super().__init__()
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if isinstance(swapin_ahead, bool) or not isinstance(swapin_ahead, int) or swapin_ahead < 1:
            raise ValueError(f"swapin_ahead must be a positive integer, got {swapin_ahead!r}")
        min_swap_bytes = _resolve_min_swap_bytes(min_swap_bytes)
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir must be a directory path (str or os.PathLike) or None, got "
                            f"{type(log_dir).__name__}")
        if log_dir is not None:
            log_dir = os.fspath(log_dir)
            if not log_dir.strip():
                raise ValueError("log_dir must be a non-empty directory path or None")
        if not isinstance(defer_updates, bool):
            raise TypeError(f"defer_updates must be True or False, got {defer_updates!r}")
        if not isinstance(trace_allocations, bool):
            raise TypeError(f"trace_allocations must be True or False, got {trace_allocations!r}")
        if isinstance(verbose, bool):
            verbose = int(verbose)
        if not isinstance(verbose, int) or verbose not in (0, 1, 2):
            raise ValueError(f"verbose must be 0 (silent), 1 or 2, got {verbose!r}")
        if device is not None and not isinstance(device, (str, device_profiles.DeviceProfile)):
            raise TypeError(f"device must be a profile name such as 'a100' or a DeviceProfile, got "
                            f"{type(device).__name__} (known profiles: {', '.join(device_profiles.known_profiles())})")
        self.memory_budget = memory_budget
        self.budget_bytes = _resolve_budget(memory_budget)
        self.profile = device_profiles.get_profile(device or default_device_profile())
        self.policy = policy
        self.log_dir = log_dir
        self.trace_allocations = trace_allocations
        self.verbose = verbose
        self.pass_ = step_pass.StepPass(step_pass.PassConfig(
            policy=policy, budget_bytes=self.budget_bytes, device=self.profile, swapin_ahead=swapin_ahead,
            min_swap_bytes=min_swap_bytes, defer_updates=defer_updates, verbose=verbose))
        self._writer = None
        self._exit_guard = None

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
        model = self.model
        weights = step_pass.persistent_bytes(model)
        if self.budget_bytes is not None and weights > self.budget_bytes:
            raise planner.BudgetTooSmallError(
                f"memory_budget {_fmt(self.budget_bytes)} is smaller than the model's weights alone "
                f"({_fmt(weights)}); raise the budget or use a smaller model.")
        _warn_onednn_out_of_memory_crash()
        self.pass_.default_batch_size = _fit_batch_size(model)
        step_pass.attach(model, self.pass_)
        if _make_train_function_without_xla(model):
            self._say("dymem_tf: XLA (jit_compile) turned off for the train step: an XLA cluster would swallow "
                      "the swap ops.")
        model.train_function = self._wrap_train_function(model.train_function)
        log_dir = self.log_dir
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
        self._end_fit()

    def _end_fit(self):
        """Undo what ``on_train_begin`` did; run when training ends and when ``fit`` raises (can run twice)."""
        if self._exit_guard is not None:
            self._exit_guard.release()
            self._exit_guard = None
        step_pass.detach(self.model)
        # Later fit() calls without this callback must trace the plain step again.
        self.model.train_function = None
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()  # also stops and saves an allocator trace

    def _wrap_train_function(self, train_function):
        """``train_function`` run without Grappler's memory optimizer (see :mod:`dymem_tf.grappler_config`; a
        swapping policy only), re-raising an out-of-memory error with the budget it hit and what to change."""
        if train_function is None or getattr(train_function, "_dymem_wrapped", False):
            return train_function
        callback = self
        swap_step_options = (contextlib.nullcontext if self.policy == "none"
                             else grappler_config.without_memory_optimizer)

        def dymem_train_function(iterator):
            try:
                # TF's own memory optimizer misjudges a step with swap ops and would change its arithmetic.
                with swap_step_options():
                    return train_function(iterator)
            except tf.errors.ResourceExhaustedError as err:
                if "dymem_tf:" in (err.message or ""):
                    raise
                raise tf.errors.ResourceExhaustedError(
                    err.node_def, err.op, f"{err.message}\n\n{callback.out_of_memory_hint()}") from err

        dymem_train_function._dymem_wrapped = True  # pylint: disable=protected-access
        return dymem_train_function

    def out_of_memory_hint(self) -> str:
        """What the out-of-memory error of a train step under this callback adds: the budget, and what to change."""
        limits = []
        if allocator.is_active():
            env = os.environ.get(allocator.LIMIT_ENV)
            src = f"{allocator.LIMIT_ENV}={env}" if env else "the GTBM default (no DYMEM_DEVICE_MEMORY_LIMIT set)"
            limits.append(f"GTBM device budget {_fmt(allocator.get_memory_limit())} ({src})")
        if self.budget_bytes is not None:
            limits.append(f"memory_budget={_fmt(self.budget_bytes)}")
        where = "; ".join(limits) if limits else "the device's memory"
        plan = self.plan
        predicted = ""
        if plan is not None and plan.predicted.get("peak_bytes"):
            predicted = f" The plan predicted a peak of {_fmt(int(plan.predicted['peak_bytes']))}."
        device_limit = allocator.get_memory_limit() if allocator.is_active() else None
        fixes = ["lower the batch size",
                 f"raise the budget ({allocator.LIMIT_ENV} before starting Python, or dymem_tf.set_memory_limit)"
                 if device_limit is not None else "use a device with more memory"]
        if self.budget_bytes is not None and device_limit is not None and self.budget_bytes > device_limit:
            fixes.append(f"plan for the device's real size: memory_budget=\"{_fmt(device_limit)}\" (memory_budget "
                         f"{_fmt(self.budget_bytes)} exceeds the device budget)")
        elif self.policy != "dymem" or self.budget_bytes is None:
            budget = _fmt(self.budget_bytes or device_limit) if (self.budget_bytes or device_limit) \
                else "<device memory>"
            fixes.append(f'let the planner swap enough feature maps to fit: DymemCallback(policy="dymem", '
                         f'memory_budget="{budget}")')
        else:
            fixes.append(f"lower memory_budget below {_fmt(self.budget_bytes)} to leave room for what the planner "
                         "does not model (workspace, fragmentation), or min_swap_bytes=0 to swap small tensors too")
        return (f"dymem_tf: the train step ran out of device memory under the {where}.{predicted} To fit: "
                + "; or ".join(fixes) + ".")

    # -- results -------------------------------------------------------------------------------------------------
    @property
    def plan(self):
        """The plan of the most recent trace of the train step (None before the first step)."""
        return self.pass_.last_plan

    @property
    def skipped(self):
        """Traces the pass left unmodified, each with the reason it warned about (see ``step_pass.SkippedTrace``)."""
        return list(self.pass_.skipped)

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


_ONEDNN_WARNED = []


def _warn_onednn_out_of_memory_crash() -> None:
    """Warn once when running out of a GTBM budget would crash TensorFlow instead of raising an error.

    TensorFlow 2.21's oneDNN kernels (``MklConvOp`` ...) do not stop when their output allocation fails: they touch
    the missing buffer and the process dies with SIGSEGV. TF's own CPU allocator never fails, so only a capped GTBM
    pool reaches that path; with ``TF_ENABLE_ONEDNN_OPTS=0`` TensorFlow uses its Eigen kernels, which raise
    ``ResourceExhaustedError`` as on a GPU.
    """
    if _ONEDNN_WARNED or not allocator.is_active() or not os.environ.get(allocator.LIMIT_ENV, "").strip():
        return
    try:
        from tensorflow.python.util import _pywrap_util_port

        onednn = bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return
    if onednn:
        _ONEDNN_WARNED.append(True)
        import warnings

        warnings.warn(
            f"dymem_tf: {allocator.LIMIT_ENV} caps the device pool while TensorFlow's oneDNN kernels are on; in "
            "TensorFlow 2.21 a oneDNN kernel that runs out of the budget crashes the process (SIGSEGV) instead of "
            "raising ResourceExhaustedError. Set TF_ENABLE_ONEDNN_OPTS=0 before starting Python to get the error.",
            RuntimeWarning, stacklevel=3)


def _resolve_budget(memory_budget):
    if memory_budget is None:
        return None
    if isinstance(memory_budget, str) and memory_budget.strip().lower() == "auto":
        return device_memory_capacity()
    if isinstance(memory_budget, float) and memory_budget.is_integer():
        memory_budget = int(memory_budget)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str)):
        raise TypeError(f"memory_budget must be None, \"auto\", a number of bytes or a string such as \"6GiB\", "
                        f"got {memory_budget!r}")
    if isinstance(memory_budget, int) and memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
    try:
        budget = allocator.parse_bytes(memory_budget)
    except ValueError as err:
        raise ValueError(f"memory_budget={memory_budget!r} is not a valid budget: {err}") from None
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
    return budget


def _resolve_min_swap_bytes(value) -> int:
    if isinstance(value, str):
        try:
            return allocator.parse_bytes(value)
        except ValueError as err:
            raise ValueError(f"min_swap_bytes={value!r} is not a valid size: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_swap_bytes must be a non-negative integer (bytes) or a string such as \"64KiB\", "
                         f"got {value!r}")
    return value


def _fit_batch_size(model) -> int | None:
    """The batch size of the ``fit`` call that is running (global, over all replicas), or None when unknown.

    A traced step's batch dimension is unknown when the data has a partial last batch (NumPy data whose length is
    not a multiple of the batch size) or comes from a dataset batched without ``drop_remainder``; the planner then
    needs the largest batch the step will see. Keras hands callbacks no batch size, so this reads the ``fit`` frame
    that called ``on_train_begin``: its data adapter's batch size, or the ``batch`` call of a ``tf.data`` pipeline.
    """
    frame = sys._getframe(1)  # pylint: disable=protected-access
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                loc = frame.f_locals
                adapter = getattr(loc.get("epoch_iterator"), "data_adapter", None)
                for candidate in (_safe_attr(adapter, "batch_size"), loc.get("batch_size"),
                                  _dataset_batch_size(getattr(adapter, "_dataset", None))):
                    if isinstance(candidate, int) and not isinstance(candidate, bool) and candidate > 0:
                        return candidate
                return None
            frame = frame.f_back
    finally:
        del frame
    return None


def _safe_attr(obj, name):
    try:
        return getattr(obj, name, None)
    except Exception:  # pylint: disable=broad-except  (a data adapter property may fail on exotic data)
        return None


def _dataset_batch_size(dataset, depth: int = 0) -> int | None:
    """Static ``batch_size`` of the last ``batch``/``padded_batch`` applied in a ``tf.data`` pipeline, if any."""
    if dataset is None or depth > 64:
        return None
    size = getattr(dataset, "_batch_size", None)
    if size is not None:
        value = tf.get_static_value(size) if tf.is_tensor(size) else size
        try:
            return int(value) if value is not None and int(value) > 0 else None
        except (TypeError, ValueError):
            return None
    return _dataset_batch_size(getattr(dataset, "_input_dataset", None), depth + 1)


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


def _make_train_function_without_xla(model) -> bool:
    """Build ``model.train_function`` afresh without XLA; return whether the model asked for XLA.

    Keras reads ``model.jit_compile`` when it builds a function (``tf.function(..., jit_compile=...)``), so the flag
    is off only while the train function is built: the model keeps the user's value, and its evaluate and predict
    functions (traced during ``fit`` for validation, or after it) keep XLA.
    """
    if not getattr(model, "jit_compile", False):
        model.make_train_function(force=True)
        return False
    has_private = "_jit_compile" in vars(model)
    saved = model._jit_compile if has_private else model.jit_compile  # pylint: disable=protected-access
    model.jit_compile = False
    try:
        model.make_train_function(force=True)
    finally:
        if has_private:
            model._jit_compile = saved  # pylint: disable=protected-access  (the setter would re-check support)
        else:
            model.jit_compile = saved
    return True


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
