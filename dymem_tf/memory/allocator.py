"""Python API of the GTBM allocator (Group Tensors By Mobility), TensorFlow's CPU device allocator under dymem_tf.

GTBM is registered when ``import dymem_tf`` runs right after ``import tensorflow`` (before the first tensor). It
serves every CPU-device tensor from one pool under a byte budget (``DYMEM_DEVICE_MEMORY_LIMIT``, e.g. ``512MiB``;
default min(physical RAM, 64 GiB)); an allocation beyond the budget raises ``tf.errors.ResourceExhaustedError``.
The pool is cut into pageblocks (2 MiB, ``DYMEM_GTBM_BLOCK_SIZE``; smaller for budgets under 64 MiB) owned by
mobility groups -- persistent (weights, optimizer slots, set-up), transient (step intermediates), mobile (tensors
swapped between device and host) -- so that short-lived and moving tensors do not pin holes between long-lived ones.
Free blocks are returned to the OS (madvise) beyond a cache of ``DYMEM_GTBM_RELEASE_CACHE`` bytes kept resident for
reuse (default min(256 MiB, budget / 8); :func:`trim` empties it).

Mobility of an allocation, first match wins: :func:`mobility` / ``dymem_gtbm_push_mobility`` on the allocating
thread; the op's entry in :func:`set_mobility_map`; otherwise persistent for eager ops, allocations outside any op
and variable updates (``Assign*VariableOp``, ``ResourceApply*``: TF's copy-on-write gives the variable a new buffer),
transient for the other kernels of a ``tf.function`` (a Keras train step).

Host inputs (``DYMEM_HOST_INPUTS``, default on; ``0`` counts everything against the budget). On a GPU the input
pipeline lives in host memory, so on the CPU its allocations are served from a separate "host inputs" arena that
the budget does not cap (``host_inputs_*`` in :func:`memory_stats`; ``get_memory_info('CPU:0')`` reports the device
only): tensors that ``tf.data`` builds from Python values (``Dataset.from_tensors`` / ``from_tensor_slices``, hence
the NumPy arrays handed to Keras ``fit``/``evaluate``/``predict``; see :func:`install_input_pipeline_hook`),
everything allocated on ``tf.data``'s threads (map functions, batches, shuffle and prefetch buffers), and tf.data's
iterator ops (``MakeIterator``, ``IteratorGetNext``, ...). Variables, eager ops and everything the train step's
kernels allocate still count. :func:`host_memory` sends a thread's allocations there explicitly.

GPUs (opt-in, ``DYMEM_GTBM_GPU=1``; never run on a GPU so far, see docs/gpu.md). When the library loads with the
flag set, a ``GPUProcessState`` subclass is installed (only possible before TensorFlow creates its first GPU device)
whose ``GetGPUAllocator`` takes one region of the limit TensorFlow computed for each GPU from TensorFlow's own GPU
sub-allocator and serves the device from a GTBM pool inside it (the same region + placement code as the CPU device,
``cc/allocator/region_allocator.cc``). Memory growth (``set_memory_growth``) is refused: that GPU stays on
TensorFlow's allocator with the reason in :func:`gpu_status`. :func:`serves_gpu` says whether GTBM serves a GPU;
:func:`memory_stats`, :func:`get_memory_limit`, :func:`set_memory_limit` and :func:`reset_peak_stats` take
``device="GPU:0"``.

Native C API (``_dymem_gtbm``; every ``int`` function returns 0 / a count on success and -1 on failure with
``dymem_gtbm_last_error()`` set)::

    int         dymem_gtbm_is_active(void);
    const char* dymem_gtbm_last_error(void);
    void        dymem_gtbm_push_mobility(int group);     /* 0 persistent, 1 transient, 2 mobile, 3 host; per thread */
    void        dymem_gtbm_pop_mobility(void);
    int         dymem_gtbm_set_mobility_map(const char* text);   /* "op_name\\tgroup" lines; returns entries */
    int         dymem_gtbm_clear_mobility_map(void);
    int         dymem_gtbm_mobility_map_size(void);
    int         dymem_gtbm_set_limit(int64_t bytes);
    int64_t     dymem_gtbm_get_limit(void);
    const char* dymem_gtbm_stat_names(void);             /* comma-separated, order of get_stats */
    int         dymem_gtbm_num_stats(void);
    int         dymem_gtbm_get_stats(int64_t* out, int n);
    int         dymem_gtbm_reset_peak_stats(void);
    int         dymem_gtbm_trim(void);                   /* give cached free blocks back to the OS */
    int         dymem_gtbm_trace_start(int64_t max_records);
    int         dymem_gtbm_trace_stop(void);
    int         dymem_gtbm_trace_dump(const char* path);
    int64_t     dymem_gtbm_trace_count(void);
    int         dymem_gtbm_trace_info(int64_t* out, int n);  /* active, records, dropped, events, max_records */
    int         dymem_gtbm_parse_bytes(const char* text, int64_t* out);
    int         dymem_gtbm_set_host_inputs(int enabled);  /* input pipeline from host memory (1) or counted (0) */
    int         dymem_gtbm_host_inputs(void);            /* 1, 0, or -1 when inactive */
    int         dymem_gtbm_gpu_compiled(void);           /* GPU hook compiled in (TF with GPU support) */
    int         dymem_gtbm_gpu_hook_state(void);         /* 0 not requested, 1 installed, 2 not installed, 3 not compiled */
    const char* dymem_gtbm_gpu_hook_reason(void);
    int         dymem_gtbm_gpu_allow_growth(int option); /* TF's growth rule incl. TF_FORCE_GPU_ALLOW_GROWTH */
    int         dymem_gtbm_gpu_num_devices(void);
    int         dymem_gtbm_gpu_serves(int tf_device_id); /* 1 or 0 (last_error says why) */
    int         dymem_gtbm_gpu_get_stats(int tf_device_id, int64_t* out, int n);  /* gtbm stat names order */
    int         dymem_gtbm_gpu_set_limit(int tf_device_id, int64_t bytes);
    int64_t     dymem_gtbm_gpu_get_limit(int tf_device_id);
    int         dymem_gtbm_gpu_reset_peak_stats(int tf_device_id);
    int         dymem_gtbm_gpu_trace_start(int tf_device_id, int64_t max_records);
    int         dymem_gtbm_gpu_trace_stop(int tf_device_id);
    int         dymem_gtbm_gpu_trace_dump(int tf_device_id, const char* path);
    int         dymem_gtbm_gpu_trace_info(int tf_device_id, int64_t* out, int n);
    int         dymem_gtbm_region_selftest(int threads, int64_t ops, uint64_t seed, int64_t region_bytes,
                                           int64_t base_alignment, int64_t refuse_above, int64_t* out, int n);
    int         dymem_replay_run(const char* csv, const char* policy, int64_t block_size, int64_t alignment,
                                 const char* groups_mode, int64_t* out, int n);   /* see dymem_tf.memory.replay */
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from typing import Iterator, Mapping

from dymem_tf import compat
from dymem_tf.units import ByteSize, env_bytes, parse_bytes  # parse_bytes: re-exported (this module's API)

__all__ = [
    "GROUPS",
    "GtbmNotActiveError",
    "clear_mobility_map",
    "dump_trace",
    "get_memory_limit",
    "gpu_requested",
    "gpu_status",
    "host_inputs_enabled",
    "host_memory",
    "install_input_pipeline_hook",
    "is_active",
    "memory_stats",
    "mobility",
    "parse_bytes",
    "record_trace",
    "region_selftest",
    "reset_peak_stats",
    "serves_gpu",
    "set_host_inputs",
    "set_memory_limit",
    "set_mobility_map",
    "start_trace",
    "stop_trace",
    "trace_info",
    "trim",
    "validate_memory_limit_env",
]

LIMIT_ENV = "DYMEM_DEVICE_MEMORY_LIMIT"
BLOCK_SIZE_ENV = "DYMEM_GTBM_BLOCK_SIZE"
RELEASE_CACHE_ENV = "DYMEM_GTBM_RELEASE_CACHE"
HOST_INPUTS_ENV = "DYMEM_HOST_INPUTS"
GPU_ENV = "DYMEM_GTBM_GPU"  # opt-in: GTBM serves GPUs too (read by the native library when it loads)
_HOOK_STATES = {0: "not requested", 1: "installed", 2: "not installed", 3: "not compiled"}
GROUPS = {"persistent": 0, "transient": 1, "mobile": 2}
HOST = 3  # dymem_gtbm_push_mobility value for the host-inputs arena (not a pool group)
_FALSE_WORDS = ("0", "false", "off", "no")
_TRUE_WORDS = ("1", "true", "on", "yes")
_GROUP_NAMES = {v: k for k, v in GROUPS.items()}
DEFAULT_MAX_TRACE_RECORDS = 2_000_000


class GtbmNotActiveError(RuntimeError):
    """The GTBM allocator does not serve TensorFlow's CPU device in this process."""


# --------------------------------------------------------------------------------------------------------------
# Environment.

def validate_memory_limit_env() -> int | None:
    """Check ``DYMEM_DEVICE_MEMORY_LIMIT`` (and ``DYMEM_GTBM_BLOCK_SIZE``, ``DYMEM_GTBM_RELEASE_CACHE``,
    ``DYMEM_HOST_INPUTS``) before the allocator is loaded.

    Returns the limit in bytes, or None when unset. Raises ValueError with a clear message when invalid, so that a
    typo fails at ``import dymem_tf`` instead of silently running without a budget.
    """
    limit = env_bytes(LIMIT_ENV, "memory limit")
    if limit == 0:
        raise ValueError(f"{LIMIT_ENV}={os.environ[LIMIT_ENV]!r} is not a valid memory limit: it must be positive")
    block = env_bytes(BLOCK_SIZE_ENV, "block size")
    page = os.sysconf("SC_PAGE_SIZE")
    if block is not None and (block <= 0 or block % page or block & (block - 1)):
        raise ValueError(
            f"{BLOCK_SIZE_ENV}={os.environ[BLOCK_SIZE_ENV]!r} is not a valid block size: it must be a power of two "
            f"and a multiple of the page size ({page} bytes), e.g. '2MiB'"
        )
    env_bytes(RELEASE_CACHE_ENV, "size")
    raw_host = os.environ.get(HOST_INPUTS_ENV)
    if raw_host is not None and raw_host.strip() and raw_host.strip().lower() not in _FALSE_WORDS + _TRUE_WORDS:
        raise ValueError(f"{HOST_INPUTS_ENV}={raw_host!r} is not valid: use 1 (default) or 0")
    return limit


# --------------------------------------------------------------------------------------------------------------
# Native library.

_setup_lock = threading.Lock()
_configured: set[int] = set()


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    with _setup_lock:
        if id(lib) in _configured:
            return lib
        i64, c_int, c_char_p = ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
        i64p = ctypes.POINTER(ctypes.c_int64)
        signatures = {
            "dymem_gtbm_is_active": (c_int, []),
            "dymem_gtbm_last_error": (c_char_p, []),
            "dymem_gtbm_push_mobility": (None, [c_int]),
            "dymem_gtbm_pop_mobility": (None, []),
            "dymem_gtbm_set_mobility_map": (c_int, [c_char_p]),
            "dymem_gtbm_clear_mobility_map": (c_int, []),
            "dymem_gtbm_mobility_map_size": (c_int, []),
            "dymem_gtbm_set_limit": (c_int, [i64]),
            "dymem_gtbm_get_limit": (i64, []),
            "dymem_gtbm_stat_names": (c_char_p, []),
            "dymem_gtbm_num_stats": (c_int, []),
            "dymem_gtbm_get_stats": (c_int, [i64p, c_int]),
            "dymem_gtbm_reset_peak_stats": (c_int, []),
            "dymem_gtbm_trim": (c_int, []),
            "dymem_gtbm_trace_start": (c_int, [i64]),
            "dymem_gtbm_trace_stop": (c_int, []),
            "dymem_gtbm_trace_dump": (c_int, [c_char_p]),
            "dymem_gtbm_trace_count": (i64, []),
            "dymem_gtbm_trace_info": (c_int, [i64p, c_int]),
            "dymem_gtbm_parse_bytes": (c_int, [c_char_p, i64p]),
            "dymem_gtbm_set_host_inputs": (c_int, [c_int]),
            "dymem_gtbm_host_inputs": (c_int, []),
            "dymem_gtbm_gpu_compiled": (c_int, []),
            "dymem_gtbm_gpu_hook_state": (c_int, []),
            "dymem_gtbm_gpu_hook_reason": (c_char_p, []),
            "dymem_gtbm_gpu_allow_growth": (c_int, [c_int]),
            "dymem_gtbm_gpu_num_devices": (c_int, []),
            "dymem_gtbm_gpu_serves": (c_int, [c_int]),
            "dymem_gtbm_gpu_get_stats": (c_int, [c_int, i64p, c_int]),
            "dymem_gtbm_gpu_set_limit": (c_int, [c_int, i64]),
            "dymem_gtbm_gpu_get_limit": (i64, [c_int]),
            "dymem_gtbm_gpu_reset_peak_stats": (c_int, [c_int]),
            "dymem_gtbm_gpu_trace_start": (c_int, [c_int, i64]),
            "dymem_gtbm_gpu_trace_stop": (c_int, [c_int]),
            "dymem_gtbm_gpu_trace_dump": (c_int, [c_int, c_char_p]),
            "dymem_gtbm_gpu_trace_info": (c_int, [c_int, i64p, c_int]),
            "dymem_gtbm_region_selftest": (c_int, [c_int, i64, ctypes.c_uint64, i64, i64, i64, i64p, c_int]),
        }
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _configured.add(id(lib))
        return lib


def _inactive_reason() -> str:
    if os.environ.get("DYMEM_GTBM", "1").strip().lower() in ("0", "false", "off", "no"):
        return "it is disabled by DYMEM_GTBM=0"
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true"):
        return "TF_CPU_ALLOCATOR_USE_BFC makes TensorFlow use its own BFC allocator on the CPU"
    return (
        "dymem_tf was imported after TensorFlow had initialised its runtime (import dymem_tf right after "
        "tensorflow, before the first tensor), or its native library is not built"
    )


def _library() -> ctypes.CDLL | None:
    """The loaded GTBM library (with TF's runtime initialised so that the allocator exists), or None."""
    from dymem_tf.memory import native

    lib = native.gtbm_cdll()
    if lib is None:
        return None
    # TF creates its CPU allocator (and so calls our factory) when the eager context initialises.
    compat.ensure_eager_context()
    return _declare(lib)


def _active_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None or not lib.dymem_gtbm_is_active():
        detail = ""
        if lib is not None:
            detail = f" ({lib.dymem_gtbm_last_error().decode(errors='replace')})" if lib.dymem_gtbm_last_error() else ""
        raise GtbmNotActiveError(f"the GTBM allocator is not active: {_inactive_reason()}{detail}")
    return lib


def _check(lib: ctypes.CDLL, rc: int, what: str) -> int:
    if rc < 0:
        raise RuntimeError(f"{what} failed: {lib.dymem_gtbm_last_error().decode(errors='replace')}")
    return rc


def is_active() -> bool:
    """Whether GTBM serves TensorFlow's CPU device in this process (initialises TF's runtime if needed)."""
    lib = _library()
    return bool(lib is not None and lib.dymem_gtbm_is_active())


# --------------------------------------------------------------------------------------------------------------
# Statistics and budget.

_GROUP_FIELDS = ("in_use", "peak_in_use", "reserved", "peak_reserved", "num_allocs")


def memory_stats(device: str | None = None) -> dict:
    """Snapshot of the pool's statistics (bytes unless noted).

    Keys: ``bytes_in_use``, ``peak_bytes_in_use`` (what ``tf.config.experimental.get_memory_info('CPU:0')``
    reports as current/peak), ``requested_bytes_in_use`` (before 64-byte alignment), ``bytes_reserved`` (pageblocks
    owned by groups: the pool's resident memory, free blocks are returned to the OS), ``peak_bytes_reserved``,
    ``extent`` / ``peak_extent`` (end of the highest owned block: what a flat arena would need),
    ``cached_free_bytes`` (free blocks still resident, see :func:`trim`), ``largest_free_block``, ``largest_alloc_size``, ``num_allocs``, ``num_frees``, ``num_failed_allocs``,
    ``live_allocations``, ``bytes_limit``, ``capacity`` (reserved address space), ``block_size``;
    ``reserved_overhead`` = 1 - in_use / reserved now (the share of the reserved pageblocks no live buffer uses) and
    ``peak_reserved_overhead`` at the moment of peak use (not "fragmentation": the dashboard keeps that word for
    ``1 - largest free gap / free bytes`` of the traced pool);
    ``groups``: {"persistent"|"transient"|"mobile": {in_use, peak_in_use, reserved, peak_reserved, num_allocs}}.

    All of the above describe the emulated device. The host-inputs arena (input-pipeline tensors served from host
    memory, not counted by the budget; see the module docstring) reports ``host_inputs_enabled`` (1 while its rule
    is on), ``host_inputs_bytes_in_use``, ``host_inputs_peak_bytes_in_use``, ``host_inputs_bytes_reserved``,
    ``host_inputs_peak_bytes_reserved``, ``host_inputs_num_allocs``, ``host_inputs_live_allocations``,
    ``host_inputs_largest_alloc_size`` and ``host_inputs_capacity`` (its address space); ``overflow_to_host_allocs``
    / ``overflow_to_host_bytes`` count the device allocations it served because the device refused them and
    TensorFlow could not have handled the refusal (a function's instantiation, a tensor made from a Python value):
    memory a real device of this budget would not have had. (The swap-out host pool's statistics are
    :func:`dymem_tf.host_pool_stats`.)

    ``device``: None or ``"CPU:0"`` for the CPU device (above); ``"GPU:<k>"`` for a GPU that GTBM serves
    (:func:`serves_gpu`): the same keys without the ``host_inputs_*`` ones (a GPU has no host-inputs region).

    Raises GtbmNotActiveError when GTBM does not serve that device.
    """
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        names = lib.dymem_gtbm_stat_names().decode().split(",")
        values = (ctypes.c_int64 * len(names))()
        count = _check(lib, lib.dymem_gtbm_gpu_get_stats(gpu, values, len(names)), f"reading GPU:{gpu} statistics")
        return _stats_dict(dict(zip(names[:count], values[:count])))
    lib = _active_library()
    names = lib.dymem_gtbm_stat_names().decode().split(",")
    values = (ctypes.c_int64 * len(names))()
    _check(lib, lib.dymem_gtbm_get_stats(values, len(names)), "reading GTBM statistics")
    return _stats_dict(dict(zip(names, values)))


def _stats_dict(raw: dict) -> dict:
    """The flat name -> value statistics grouped per mobility group, with the overhead ratios added."""
    stats: dict = {}
    groups: dict = {name: {} for name in GROUPS}
    for key, value in raw.items():
        group, _, field = key.partition("_")
        if group in groups and field in _GROUP_FIELDS:
            groups[group][field] = value
        else:
            stats[key] = value
    stats["groups"] = groups
    reserved = stats["bytes_reserved"]
    stats["reserved_overhead"] = 1.0 - stats["bytes_in_use"] / reserved if reserved else 0.0
    at_peak = stats["reserved_at_peak_in_use"]
    stats["peak_reserved_overhead"] = 1.0 - stats["peak_bytes_in_use"] / at_peak if at_peak else 0.0
    return stats


def reset_peak_stats(device: str | None = None) -> None:
    """Restart the peak values (in use, reserved, extent, per group; host inputs too) from the current ones
    (``device``: None for the CPU device, or ``"GPU:<k>"``)."""
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        _check(lib, lib.dymem_gtbm_gpu_reset_peak_stats(gpu), f"resetting GPU:{gpu} peak statistics")
        return
    lib = _active_library()
    _check(lib, lib.dymem_gtbm_reset_peak_stats(), "resetting GTBM peak statistics")


def trim() -> None:
    """Give the cached free blocks back to the OS now (resident memory drops to ``bytes_reserved``)."""
    lib = _active_library()
    _check(lib, lib.dymem_gtbm_trim(), "trimming the GTBM release cache")


def set_memory_limit(limit: ByteSize, device: str | None = None) -> None:
    """Change the device budget (bytes or a string like ``"512MiB"``); ``device``: None for the CPU device, or
    ``"GPU:<k>"`` (at most the region GTBM took for that GPU).

    Raises ValueError when the new limit is below the bytes currently in use or above the reserved address space.
    A limit below the currently reserved (but partly free) memory is accepted: allocations that need new blocks
    fail until enough is freed.
    """
    value = parse_bytes(limit)
    if value <= 0:
        raise ValueError("the memory limit must be positive")
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        if lib.dymem_gtbm_gpu_set_limit(gpu, value) < 0:
            raise ValueError(f"cannot set the GPU:{gpu} limit: {lib.dymem_gtbm_last_error().decode(errors='replace')}")
        return
    lib = _active_library()
    if lib.dymem_gtbm_set_limit(value) < 0:
        raise ValueError(f"cannot set the GTBM memory limit: {lib.dymem_gtbm_last_error().decode(errors='replace')}")


def get_memory_limit(device: str | None = None) -> int:
    """The current device budget in bytes (``device``: None for the CPU device, or ``"GPU:<k>"``)."""
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        return _check(lib, lib.dymem_gtbm_gpu_get_limit(gpu), f"reading the GPU:{gpu} limit")
    lib = _active_library()
    return _check(lib, lib.dymem_gtbm_get_limit(), "reading the GTBM memory limit")


# --------------------------------------------------------------------------------------------------------------
# GPUs (opt-in, DYMEM_GTBM_GPU=1).

def gpu_requested() -> bool:
    """As the native library reads it: set, non-empty and not a false word (0, false, off, no)."""
    value = os.environ.get(GPU_ENV, "").strip().lower()
    return bool(value) and value not in _FALSE_WORDS


def _gpu_index(device: str | None) -> int | None:
    """``"GPU:1"`` / ``"/device:GPU:1"`` -> 1; None or a CPU device -> None; anything else raises ValueError."""
    if device is None:
        return None
    kind, _, index = device.split("device:")[-1].upper().rpartition(":")
    if kind == "CPU" and index == "0":
        return None
    if kind == "GPU" and index.isdigit():
        return int(index)
    raise ValueError(f"unknown device {device!r}: use None, 'CPU:0' or 'GPU:<k>'")


def _gpu_library(gpu: int) -> ctypes.CDLL:
    """The GTBM library when GTBM serves GPU ``gpu``; GtbmNotActiveError (with the reason) otherwise."""
    lib = _library()
    if lib is None:
        raise GtbmNotActiveError(f"GTBM does not serve GPU:{gpu}: the GTBM library is not loaded ({_inactive_reason()})")
    if not lib.dymem_gtbm_gpu_serves(gpu):
        raise GtbmNotActiveError(gpu_status()["devices"].get(f"GPU:{gpu}", {}).get("reason")
                                 or lib.dymem_gtbm_last_error().decode(errors="replace"))
    return lib


def gpu_status() -> dict:
    """Whether GTBM serves the GPUs, and why not where it does not (initialises TF's runtime if needed).

    ``{"requested": DYMEM_GTBM_GPU is set, "hook": "not requested" | "installed" | "not installed" |
    "not compiled" | "not loaded", "reason": why there is no hook (empty when installed or not requested),
    "devices": {"GPU:<k>": {"served": bool, "reason": str}}, "summary": one line for a report}``.
    """
    from dymem_tf.memory import native

    requested = gpu_requested()
    status = {"requested": requested, "hook": "not loaded", "reason": "", "devices": {}}
    lib = native.gtbm_cdll()
    if lib is None:
        status["reason"] = f"the GTBM library is not loaded: {_inactive_reason()}"
    else:
        lib = _declare(lib)
        status["hook"] = _HOOK_STATES.get(lib.dymem_gtbm_gpu_hook_state(), "unknown")
        status["reason"] = lib.dymem_gtbm_gpu_hook_reason().decode(errors="replace")
        status["devices"] = _gpu_devices(lib) if status["hook"] == "installed" else {}
    status["summary"] = _gpu_summary(status)
    return status


def _gpu_devices(lib: ctypes.CDLL) -> dict:
    """``{"GPU:<k>": {"served", "reason"}}`` for the GPUs of TF's eager context (created now if needed)."""
    devices = {}
    for name, _ in compat.local_device_memory("GPU"):
        index = int(name.rsplit(":", 1)[-1])
        served = bool(lib.dymem_gtbm_gpu_serves(index))
        reason = "" if served else lib.dymem_gtbm_last_error().decode(errors="replace")
        devices[f"GPU:{index}"] = {"served": served, "reason": reason}
    return devices


def _gpu_summary(status: dict) -> str:
    """One line: what serves the GPUs and why."""
    if not status["requested"]:
        return f"no: GTBM on GPUs is opt-in ({GPU_ENV}=1 before import dymem_tf)"
    if status["hook"] != "installed":
        return f"no ({GPU_ENV}=1 is set, but {status['reason'] or 'the GPU hook is ' + status['hook']})"
    if not status["devices"]:
        return f"no GPU device was created in this process ({GPU_ENV}=1 does nothing without a GPU)"
    return "; ".join(f"{name}: {'yes' if d['served'] else 'no (' + d['reason'] + ')'}"
                     for name, d in status["devices"].items())


def serves_gpu(device: str = "GPU:0") -> bool:
    """Whether GTBM serves ``device`` (``"GPU:<k>"``); see :func:`gpu_status` for why not."""
    gpu = _gpu_index(device)
    if gpu is None:
        raise ValueError(f"serves_gpu takes a GPU, not {device!r}")
    return gpu_status()["devices"].get(f"GPU:{gpu}", {}).get("served", False)


def warn_if_gpu_hook_missing() -> bool:
    """After the library loaded: one RuntimeWarning when DYMEM_GTBM_GPU=1 but the GPU hook could not be installed.
    Returns whether it warned."""
    from dymem_tf.memory import native

    lib = native.gtbm_cdll()
    if not gpu_requested() or lib is None:
        return False
    lib = _declare(lib)
    if _HOOK_STATES.get(lib.dymem_gtbm_gpu_hook_state()) == "installed":
        return False
    import warnings

    warnings.warn(f"{GPU_ENV}=1, but GTBM cannot serve GPUs: {lib.dymem_gtbm_gpu_hook_reason().decode()}; "
                  "TensorFlow's own allocator serves them", RuntimeWarning, stacklevel=5)
    return True


def region_selftest(threads: int = 4, ops_per_thread: int = 2000, seed: int = 1, region_bytes: int = 64 << 20,
                    base_alignment: int = 0, refuse_above: int = 0) -> dict:
    """Run the native RegionAllocator test: the GPU hook's region + placement code over a host stand-in for TF's
    GPU sub-allocator, randomised and multi-threaded (``cc/allocator/region_selftest.cc``). Returns its report;
    raises RuntimeError with the first violation. Works whether or not GTBM serves any device."""
    from dymem_tf.memory import native

    lib = native.gtbm_cdll()
    if lib is None:
        raise GtbmNotActiveError(f"the GTBM library is not loaded: {_inactive_reason()}")
    lib = _declare(lib)
    values = (ctypes.c_int64 * 8)()
    _check(lib, lib.dymem_gtbm_region_selftest(threads, ops_per_thread, seed, region_bytes, base_alignment,
                                               refuse_above, values, 8), "the RegionAllocator self-test")
    keys = ("allocations", "refusals", "over_aligned", "peak_bytes_in_use", "capacity", "max_alignment",
            "sub_allocs", "sub_frees")
    return dict(zip(keys, values))


# --------------------------------------------------------------------------------------------------------------
# Host inputs.

def host_inputs_enabled() -> bool:
    """Whether input-pipeline allocations are served from the host-inputs arena (not counted by the budget)."""
    lib = _active_library()
    return bool(_check(lib, lib.dymem_gtbm_host_inputs(), "reading the host-inputs setting"))


def set_host_inputs(enabled: bool) -> None:
    """Serve input-pipeline allocations from host memory (True, the default unless ``DYMEM_HOST_INPUTS=0``) or count
    them against the device budget (False). Applies to new allocations; live tensors stay where they are."""
    lib = _active_library()
    _check(lib, lib.dymem_gtbm_set_host_inputs(1 if enabled else 0), "changing the host-inputs setting")


@contextlib.contextmanager
def host_memory() -> Iterator[None]:
    """Serve every allocation the current thread makes inside the block from the host-inputs arena (not counted by
    the device budget), e.g. for input data built outside ``tf.data``. No effect while host inputs are off."""
    lib = _loaded_library()
    lib.dymem_gtbm_push_mobility(HOST)
    try:
        yield
    finally:
        lib.dymem_gtbm_pop_mobility()


def install_input_pipeline_hook() -> bool:
    """Make ``tf.data`` convert Python values (NumPy arrays) into tensors in host memory.

    ``Dataset.from_tensors`` / ``from_tensor_slices`` (and so Keras's adapter for NumPy inputs) convert their
    arguments on the calling thread, where the allocation carries no op annotation -- exactly like the buffers that
    variables adopt from ``tf.Variable(numpy_array)`` or ``assign``, which must count. The allocator cannot tell them
    apart, so this wraps ``tensorflow.python.data.util.structure.normalize_element`` (the one place where tf.data
    turns its arguments into tensors) in :func:`host_memory`. Called by ``import dymem_tf`` once GTBM is loaded;
    idempotent. Returns False (and changes nothing) when GTBM is not loaded or TensorFlow has no such function.
    """
    from dymem_tf.memory import native

    lib = native.gtbm_cdll()
    if lib is None:
        return False
    lib = _declare(lib)
    push, pop = lib.dymem_gtbm_push_mobility, lib.dymem_gtbm_pop_mobility

    def host_inputs(original):
        @functools.wraps(original)
        def normalize_element(*args, **kwargs):
            push(HOST)
            try:
                return original(*args, **kwargs)
            finally:
                pop()

        normalize_element._dymem_host_inputs = True  # type: ignore[attr-defined]
        return normalize_element

    return compat.wrap_tf_data_conversion(host_inputs)


# --------------------------------------------------------------------------------------------------------------
# Mobility.

def _group_number(group: str | int) -> int:
    if isinstance(group, bool):
        raise TypeError("a mobility group is a name or a number, not a bool")
    if isinstance(group, int):
        if group in _GROUP_NAMES:
            return group
    elif isinstance(group, str) and group.strip().lower() in GROUPS:
        return GROUPS[group.strip().lower()]
    raise ValueError(f"unknown mobility group {group!r}: use one of {sorted(GROUPS)} or 0, 1, 2")


def set_mobility_map(mapping: Mapping[str, str | int]) -> int:
    """Install the op-name -> mobility group map (replaces the previous one); returns its size.

    Keys are executing op names as TensorFlow reports them (e.g. ``StatefulPartitionedCall/model/conv1/Conv2D``);
    values are ``"persistent"``, ``"transient"``, ``"mobile"`` or 0, 1, 2. Can be called before TF initialises.
    """
    lines = []
    for name, group in mapping.items():
        if not isinstance(name, str) or not name or any(c in name for c in "\t\n\r"):
            raise ValueError(f"invalid op name {name!r} in the mobility map (non-empty, no tabs or newlines)")
        lines.append(f"{name}\t{_group_number(group)}")
    lib = _loaded_library()
    return _check(lib, lib.dymem_gtbm_set_mobility_map("\n".join(lines).encode()), "setting the mobility map")


def clear_mobility_map() -> None:
    """Remove the op-name -> mobility map (default classification only)."""
    lib = _loaded_library()
    lib.dymem_gtbm_clear_mobility_map()


def mobility_map_size() -> int:
    """How many ops the installed op-name -> mobility map names (0: none installed)."""
    return int(_loaded_library().dymem_gtbm_mobility_map_size())


@contextlib.contextmanager
def mobility(group: str | int) -> Iterator[None]:
    """Place every allocation the current thread makes inside the block in ``group`` (nestable).

    Only allocations made on this thread are affected: eager ops and the swap kernels allocate on the calling
    thread, while a ``tf.function`` may run its kernels on TF's inter-op threads (use :func:`set_mobility_map`).
    """
    number = _group_number(group)
    lib = _loaded_library()
    lib.dymem_gtbm_push_mobility(number)
    try:
        yield
    finally:
        lib.dymem_gtbm_pop_mobility()


def _loaded_library() -> ctypes.CDLL:
    from dymem_tf.memory import native

    lib = native.gtbm_cdll()
    if lib is None:
        raise GtbmNotActiveError(f"the GTBM allocator is not loaded: {_inactive_reason()}")
    return _declare(lib)


# --------------------------------------------------------------------------------------------------------------
# Trace recording.

def start_trace(max_records: int = DEFAULT_MAX_TRACE_RECORDS, device: str | None = None) -> None:
    """Start recording every allocation and free (discarding any previous trace); at most ``max_records``
    allocations are kept (about 70 bytes each), later ones are counted in ``trace_info()['dropped']``.
    ``device``: None for the CPU device, or ``"GPU:<k>"`` for a GPU that GTBM serves (each pool has its trace)."""
    if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records <= 0:
        raise ValueError(f"max_records must be a positive int, got {max_records!r}")
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        _check(lib, lib.dymem_gtbm_gpu_trace_start(gpu, max_records), f"starting the GPU:{gpu} trace")
        return
    lib = _active_library()
    _check(lib, lib.dymem_gtbm_trace_start(max_records), "starting the GTBM trace")


def stop_trace(device: str | None = None) -> None:
    """Stop recording (the trace is kept until the next start)."""
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        _check(lib, lib.dymem_gtbm_gpu_trace_stop(gpu), f"stopping the GPU:{gpu} trace")
        return
    lib = _active_library()
    _check(lib, lib.dymem_gtbm_trace_stop(), "stopping the GTBM trace")


def trace_info(device: str | None = None) -> dict:
    """``{"active", "records", "dropped", "events", "max_records"}`` of the current trace."""
    values = (ctypes.c_int64 * 5)()
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        _check(lib, lib.dymem_gtbm_gpu_trace_info(gpu, values, 5), f"reading the GPU:{gpu} trace state")
    else:
        lib = _active_library()
        _check(lib, lib.dymem_gtbm_trace_info(values, 5), "reading the GTBM trace state")
    info = dict(zip(("active", "records", "dropped", "events", "max_records"), values))
    info["active"] = bool(info["active"])
    return info


def dump_trace(path: str | os.PathLike, device: str | None = None) -> dict:
    """Write the trace as CSV (``id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns``; the first four
    columns are MiniMalloc's, lower/upper are event indices of a half-open lifetime, unfreed buffers end at the last
    event + 1) and return :func:`trace_info`. Replay it with ``python -m dymem_tf.memory.replay PATH``."""
    target = os.fsencode(os.fspath(path))
    gpu = _gpu_index(device)
    if gpu is not None:
        lib = _gpu_library(gpu)
        _check(lib, lib.dymem_gtbm_gpu_trace_dump(gpu, target), f"writing the GPU:{gpu} trace")
    else:
        lib = _active_library()
        _check(lib, lib.dymem_gtbm_trace_dump(target), "writing the GTBM trace")
    return trace_info(device)


@contextlib.contextmanager
def record_trace(path: str | os.PathLike, max_records: int = DEFAULT_MAX_TRACE_RECORDS,
                 device: str | None = None) -> Iterator[None]:
    """Record the allocations made inside the block and write them to ``path`` as CSV on exit (``device``: see
    :func:`start_trace`).

    Example::

        with dymem_tf.memory.allocator.record_trace("step.csv"):
            model.fit(x, y, epochs=1, steps_per_epoch=2)

    Warns (RuntimeWarning) when the trace was truncated at ``max_records``.
    """
    start_trace(max_records, device)
    try:
        yield
    finally:
        stop_trace(device)
        info = dump_trace(path, device)
        if info["dropped"]:
            import warnings

            warnings.warn(
                f"GTBM trace truncated: {info['dropped']} allocations beyond max_records={max_records} were not "
                f"recorded in {os.fspath(path)}",
                RuntimeWarning,
                stacklevel=3,
            )


@contextlib.contextmanager
def record_step(path: str | os.PathLike, max_records: int = DEFAULT_MAX_TRACE_RECORDS,
                device: str | None = None) -> Iterator[dict]:
    """Write the allocations made inside the block to ``path`` as CSV on exit (see :func:`dump_trace`).

    Unlike :func:`record_trace` it joins a trace already being recorded (a ``DymemCallback(trace_allocations=
    True)`` run) instead of restarting it: the file then holds the whole trace, and the dict yielded gets
    ``first_event``, the event index the block's allocations start at (0 for a trace of its own), and ``dropped``
    (allocations past ``max_records``, not in the file). ``device``: see :func:`start_trace`."""
    info = trace_info(device)
    own = not info["active"]
    if own:
        start_trace(max_records, device)
    out = {"first_event": 0 if own else int(info["events"]), "dropped": 0}
    dropped_before = 0 if own else int(info["dropped"])
    try:
        yield out
    finally:
        if own:
            stop_trace(device)
        out["dropped"] = int(dump_trace(path, device)["dropped"]) - dropped_before

