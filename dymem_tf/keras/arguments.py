"""``DymemCallback``'s arguments, parsed and validated (a clear error for each bad value), and the cost profile
that fits this machine."""
from __future__ import annotations

import os

from dymem_tf import compat
from dymem_tf.memory import allocator, devices
from dymem_tf.planning import device_profiles, planner, sequencing

POLICIES = planner.POLICIES
#: ``DymemCallback(xla=...)``: None (no XLA while the step swaps) or "auto" (auto-clustering around the swap ops).
XLA_MODES = (None, "auto")
#: ``DymemCallback(execution_order=...)``: see :data:`dymem_tf.planning.sequencing.EXECUTION_ORDERS`.
EXECUTION_ORDERS = sequencing.EXECUTION_ORDERS


def validate(*, policy, swapin_ahead, min_swap_bytes, log_dir, defer_updates, trace_allocations,
             offload_optimizer_state, offload_weights, calibrate, xla, execution_order, verbose, device):
    """Check ``DymemCallback``'s arguments (ValueError or TypeError naming the argument and what it accepts);
    returns ``min_swap_bytes`` in bytes, ``log_dir`` as a string (or None) and ``verbose`` as an int."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if isinstance(swapin_ahead, bool) or not isinstance(swapin_ahead, int) or swapin_ahead < 1:
        raise ValueError(f"swapin_ahead must be a positive integer, got {swapin_ahead!r}")
    min_swap_bytes = resolve_min_swap_bytes(min_swap_bytes)
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
    if trace_allocations and log_dir is None:
        compat.warn_user("dymem_tf: trace_allocations=True records into the log_dir's run, and no log_dir was "
                         "given: nothing is recorded. Pass log_dir=... as well.")
    if offload_optimizer_state is not None and not isinstance(offload_optimizer_state, bool):
        raise TypeError(f"offload_optimizer_state must be None (where supported), True or False, got "
                        f"{offload_optimizer_state!r}")
    if offload_weights is not None and not isinstance(offload_weights, bool):
        raise TypeError(f"offload_weights must be None (where supported), True or False, got {offload_weights!r}")
    if not isinstance(calibrate, bool):
        raise TypeError(f"calibrate must be True or False, got {calibrate!r}")
    if xla not in XLA_MODES:
        raise ValueError(f"unknown xla {xla!r}: choose None (no XLA while the step swaps) or 'auto' "
                         "(auto-clustering around the swap ops)")
    if not isinstance(execution_order, str) or execution_order not in EXECUTION_ORDERS:
        raise ValueError(f"unknown execution_order {execution_order!r}: choose one of "
                         f"{', '.join(EXECUTION_ORDERS)}")
    if isinstance(verbose, bool):
        verbose = int(verbose)
    if not isinstance(verbose, int) or verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0 (silent), 1 or 2, got {verbose!r}")
    if device is not None and not isinstance(device, (str, device_profiles.DeviceProfile)):
        raise TypeError(f"profile must be a profile name such as 'a100' or a DeviceProfile, got "
                        f"{type(device).__name__} (known profiles: {', '.join(device_profiles.known_profiles())})")
    return min_swap_bytes, log_dir, verbose


_DEVICE_NAME_WARNED = []


def profile_argument(profile, device):
    """``DymemCallback``'s cost profile from ``profile=`` or its former name ``device=`` (warned about once per
    process); both at once is an error."""
    if device is None:
        return profile
    if profile is not None:
        raise ValueError("pass the cost profile as profile=... only (device= is its former name)")
    if not _DEVICE_NAME_WARNED:
        _DEVICE_NAME_WARNED.append(True)
        compat.warn_user("dymem_tf: DymemCallback(device=...) is now called profile=...: it names the cost "
                         "profile the planner uses, not a device; device= still works.", FutureWarning)
    return device


def is_auto(memory_budget) -> bool:
    """Whether ``memory_budget`` is ``"auto"`` (any case): the device's memory, swapping only when the step does
    not fit it."""
    return isinstance(memory_budget, str) and memory_budget.strip().lower() == "auto"


def resolve_budget(memory_budget):
    """Bytes of an explicit ``memory_budget`` (None for None; ``"auto"`` is the device's capacity, None when the
    device has no limit)."""
    if memory_budget is None:
        return None
    if is_auto(memory_budget):
        return devices.device_memory_capacity()
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


def resolve_min_swap_bytes(value) -> int:
    if isinstance(value, str):
        try:
            return allocator.parse_bytes(value)
        except ValueError as err:
            raise ValueError(f"min_swap_bytes={value!r} is not a valid size: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_swap_bytes must be a non-negative integer (bytes) or a string such as \"64KiB\", "
                         f"got {value!r}")
    return value


def default_device_profile() -> str:
    """The cost-model profile for this machine: the GPU's class when one is visible, else ``"cpu"``."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu"
    shown = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "")
    name = shown.lower()
    for key in ("h200", "gh200", "h100", "a100", "v100"):
        if key in name:
            return key
    compat.warn_user(f"dymem_tf: no cost profile matches the GPU {shown!r}; planning with the 'a100' profile. Pass "
                     "DymemCallback(profile=...) with the closest of "
                     f"{', '.join(p for p in device_profiles.known_profiles() if p != 'cpu')}, or a DeviceProfile "
                     "measured on this GPU (dymem_tf.planning.device_profiles).")
    return "a100"


def offloading(budget_bytes: int | None, policy: str, state, weights) -> tuple[bool, bool]:
    """Whether plans may keep optimizer state, and weights, in host memory between their uses: under a budget, for
    the dymem policy, not turned off (``state``/``weights`` False), and on the CPU device, where it is
    implemented (:mod:`dymem_tf.planning.offload`)."""
    on = budget_bytes is not None and policy == "dymem" and state is not False and not devices.training_gpus()
    return on, on and weights is not False


def options_off_here(cb) -> str | None:
    """What to say about the options ``cb`` was given explicitly that do nothing on this device (optimizer-state
    and weight offloading run on the CPU device only), or None."""
    asked = [name for name in ("offload_optimizer_state", "offload_weights") if getattr(cb, name) is True]
    if not asked or not devices.training_gpus():
        return None
    return (f"dymem_tf: {' and '.join(asked)}=True has no effect on GPUs yet (it is implemented for the CPU device "
            "only): optimizer state and weights stay on the GPU.")
