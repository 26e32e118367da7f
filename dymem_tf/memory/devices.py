"""The training device's memory, whichever it is: GTBM's CPU device, GPUs that GTBM serves, or GPUs with TF's own
allocator. TensorFlow is imported inside the functions (the ``memory`` package loads it only where needed)."""
from __future__ import annotations

import functools

from dymem_tf import compat
from dymem_tf.memory import allocator


def training_gpus() -> list[str]:
    """The logical GPUs (``"GPU:0"``, ...) when the step trains on GPUs, else []: GTBM then measures nothing of it."""
    return list(_logical_gpus())


@functools.lru_cache(maxsize=1)
def _logical_gpus() -> tuple[str, ...]:
    """TF's logical GPUs, listed once: they are fixed once its runtime exists (the step reads them every call)."""
    import tensorflow as tf

    return tuple(d.name.split("device:")[-1] for d in tf.config.list_logical_devices("GPU"))


def gtbm_gpus(gpus: list[str]) -> list[str]:
    """``gpus`` when GTBM serves every one of them (opt-in ``DYMEM_GTBM_GPU=1``, see docs/gpu.md), else []: the
    callback reads and caps GTBM's GPU pools only when they describe the whole training device set."""
    return list(gpus) if gpus and allocator.is_active() and all(allocator.serves_gpu(g) for g in gpus) else []


def trace_device():
    """The GTBM pool whose trace shows the training step: None (the CPU device), ``"GPU:<k>"`` (the one training
    GPU, when GTBM serves it), or False when GTBM serves neither (or the step trains on several GPUs)."""
    gpus = training_gpus()
    if not gpus:
        return None if allocator.is_active() else False
    served = gtbm_gpus(gpus)
    return served[0] if len(served) == 1 else False


def reset_device_peaks() -> None:
    """Reset the peak counters of the training device: every GPU's (GTBM's pool where it serves them, else TF's
    allocator), else GTBM's CPU device."""
    import tensorflow as tf

    gpus = training_gpus()
    for gpu in gtbm_gpus(gpus):
        allocator.reset_peak_stats(device=gpu)
    for gpu in gpus:
        tf.config.experimental.reset_memory_stats(gpu)
    if not gpus and allocator.is_active():
        allocator.reset_peak_stats()


def device_memory_stats() -> dict | None:
    """The training device's memory, as GTBM names it (``bytes_in_use``, ``peak_bytes_in_use``,
    ``peak_bytes_reserved``): GTBM's statistics on the CPU, and on GPUs that GTBM serves (the GPU with the largest
    reserved peak); on other GPUs, TF's allocator's (``get_memory_info``: in use and peak, taken as reserved too: its
    fragmentation is not measured), the largest over the GPUs; None when neither is available."""
    import tensorflow as tf

    gpus = training_gpus()
    if not gpus:
        return allocator.memory_stats() if allocator.is_active() else None
    served = gtbm_gpus(gpus)
    if served:
        return max((allocator.memory_stats(device=gpu) for gpu in served), key=lambda s: s["peak_bytes_reserved"])
    infos = [tf.config.experimental.get_memory_info(gpu) for gpu in gpus]
    peak, current = max(int(i["peak"]) for i in infos), max(int(i["current"]) for i in infos)
    return {"bytes_in_use": current, "peak_bytes_in_use": peak, "peak_bytes_reserved": peak}


def device_memory_capacity() -> int | None:
    """Bytes of the training device: the memory limit TF gave the GPU's allocator (the smallest, with several), or
    on the CPU the GTBM budget (None when unbounded).

    The GPU's limit is read from the devices TF's eager context already has (:func:`dymem_tf.compat.gpu_memory_limits`),
    so it respects ``memory_limit``, virtual devices and ``set_memory_growth``; no second device set is created."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        limits = compat.gpu_memory_limits()
        return min(limits) if limits else None
    return allocator.get_memory_limit() if allocator.is_active() else None


def cap_at(cap: int) -> dict:
    """Cap every GTBM pool serving training at ``cap`` bytes where its limit is higher: the CPU device, or the
    training GPUs GTBM serves (``DYMEM_GTBM_GPU=1``; GPUs on TF's allocator keep its fixed limit). Returns the
    limits it replaced, for :func:`restore_limits`."""
    gpus = training_gpus()
    pools = gtbm_gpus(gpus) if gpus else ([None] if allocator.is_active() else [])
    saved = {}
    for device in pools:
        limit = allocator.get_memory_limit(device=device)
        if cap < limit:
            allocator.set_memory_limit(cap, device=device)
            saved[device] = limit
    return saved


def restore_limits(saved: dict) -> None:
    """Put back the limits :func:`cap_at` replaced."""
    for device, limit in saved.items():
        allocator.set_memory_limit(limit, device=device)


def others_bytes(stats: dict | None, held: int) -> int:
    """Bytes the device holds in use (``stats``, None: unknown) besides the ``held`` bytes of the model's own
    variables: what other models of the process hold, not the fit's to budget (0 when unknown)."""
    return max(int(stats["bytes_in_use"]) - int(held), 0) if stats is not None else 0


def less_others(stats: dict | None, others: int) -> dict | None:
    """``stats`` less ``others`` bytes (what the device held besides the model when ``fit`` began) in use, at the
    peak and reserved, never below 0; GTBM's persistent group holds those bytes, and loses them too."""
    if stats is None or not others:
        return stats
    own = _less(stats, others, ("bytes_in_use", "peak_bytes_in_use", "peak_bytes_reserved", "bytes_reserved"))
    persistent = (stats.get("groups") or {}).get("persistent")
    if persistent:
        groups = dict(stats["groups"])
        groups["persistent"] = _less(persistent, others, ("in_use", "peak_in_use", "reserved", "peak_reserved"))
        own["groups"] = groups
    return own


def _less(stats: dict, others: int, keys) -> dict:
    """A copy of ``stats`` with ``others`` bytes taken from each of ``keys`` it has (never below 0)."""
    out = dict(stats)
    for key in keys:
        if key in out:
            out[key] = max(int(out[key]) - others, 0)
    return out


def step_stats(plan, own) -> dict:
    """One step's row for the dashboard: the device's statistics as ``own`` makes them this fit's (see
    :func:`less_others`), the host pool's, and the swap figures of ``plan`` (or None). The device is GTBM's pool of
    the training GPUs where it serves them all, else GTBM's CPU device."""
    stats = {}
    if gtbm_gpus(training_gpus()):
        stats.update(own(device_memory_stats()))
    elif allocator.is_active():
        stats.update(own(allocator.memory_stats()))
    try:
        from dymem_tf.memory import host_pool

        stats.update({f"host_{k}": v for k, v in host_pool.host_pool_stats().items()})
    except Exception:  # pylint: disable=broad-except  (the op library may be unavailable: stats are optional)
        pass
    if plan is not None:
        stats["planned_swap_bytes"] = plan.swapped_bytes
        stats["modelled_stall_s"] = plan.predicted.stall_s
    return stats
