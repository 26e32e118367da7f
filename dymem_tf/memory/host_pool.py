"""Statistics and limits of the native host pool that holds swapped-out tensors.

The pool lives in ``_dymem_ops`` (``dymem_tf/cc/ops/host_pool.cc``) and is reached through ctypes. On the CPU device
``DymemSwapOut`` stores its output there, outside the device allocator's budget. On a GPU the host copies come from
TF's pinned host allocator (a real asynchronous DMA needs pinned memory), but they are charged to this pool: the byte
limit refuses them and ``bytes_in_use``, ``peak_bytes_in_use``, ``num_allocs``, ``live_buffers`` and
``largest_alloc`` count them, until TF's allocator frees them. They never enter the cache. (That GPU path has only
run on the CPU, with TF's CPU allocator standing in for the pinned one: ``tests/test_swap_ops.py``.)

Keys of :func:`host_pool_stats` (all ints, bytes unless noted):

* ``bytes_in_use`` / ``peak_bytes_in_use``: memory held by live host tensors, and its high-water mark.
* ``num_allocs`` (count), ``live_buffers`` (count): blocks handed out so far, and blocks still held.
* ``bytes_swapped_out`` / ``bytes_swapped_in``, ``num_swap_outs`` / ``num_swap_ins`` (counts): totals of the copies.
* ``bytes_cached``, ``cache_hits`` (count), ``cache_limit``: freed blocks kept for reuse by later swap-outs.
* ``bytes_limit``: cap on ``bytes_in_use + bytes_cached`` (0: unlimited); ``largest_alloc``: largest block.
"""
from __future__ import annotations

import ctypes
import threading

from dymem_tf.memory.native import ops_cdll

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_names: tuple[str, ...] = ()


def _native() -> ctypes.CDLL:
    """The ops library with the host-pool functions' ctypes signatures declared (done once)."""
    global _lib, _names
    with _lock:
        if _lib is None:
            lib = ops_cdll()
            lib.dymem_host_pool_num_stats.argtypes = []
            lib.dymem_host_pool_num_stats.restype = ctypes.c_int
            lib.dymem_host_pool_stat_name.argtypes = [ctypes.c_int]
            lib.dymem_host_pool_stat_name.restype = ctypes.c_char_p
            lib.dymem_host_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
            lib.dymem_host_pool_stats.restype = ctypes.c_int
            lib.dymem_host_pool_reset_peak.argtypes = []
            lib.dymem_host_pool_reset_peak.restype = None
            lib.dymem_host_pool_release_cache.argtypes = []
            lib.dymem_host_pool_release_cache.restype = ctypes.c_int64
            lib.dymem_host_pool_set_cache_limit.argtypes = [ctypes.c_int64]
            lib.dymem_host_pool_set_cache_limit.restype = None
            lib.dymem_host_pool_set_bytes_limit.argtypes = [ctypes.c_int64]
            lib.dymem_host_pool_set_bytes_limit.restype = None
            # The native side names its counters, so their order is defined in one place only.
            _names = tuple(
                lib.dymem_host_pool_stat_name(i).decode() for i in range(lib.dymem_host_pool_num_stats())
            )
            _lib = lib
        return _lib


def host_pool_stats() -> dict[str, int]:
    """A consistent snapshot of the host pool's counters (see the module docstring for the keys)."""
    lib = _native()
    values = (ctypes.c_int64 * len(_names))()
    count = lib.dymem_host_pool_stats(values, len(_names))
    return {name: int(values[i]) for i, name in enumerate(_names[:count])}


def reset_host_pool_peak() -> None:
    """Restart ``peak_bytes_in_use`` from the current ``bytes_in_use``."""
    _native().dymem_host_pool_reset_peak()


def release_host_pool_cache() -> int:
    """Give every cached (free) block back to the system; returns the number of bytes released."""
    return int(_native().dymem_host_pool_release_cache())


def set_host_pool_cache_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` of freed blocks for reuse (0 disables caching; default 1 GiB or the environment
    variable ``DYMEM_HOST_POOL_CACHE_BYTES``, e.g. ``512MiB``, applied when the library is loaded)."""
    if nbytes < 0:
        raise ValueError(f"cache limit must be >= 0, got {nbytes}")
    _native().dymem_host_pool_set_cache_limit(int(nbytes))


def set_host_pool_limit(nbytes: int | None) -> None:
    """Cap the host memory of swapped-out tensors, the pinned copies of a GPU's swap-outs included (``None`` or 0:
    unlimited). A swap-out that would exceed it fails with ``tf.errors.ResourceExhaustedError``; blocks already
    handed out are not affected."""
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"host pool limit must be >= 0 or None, got {nbytes}")
    _native().dymem_host_pool_set_bytes_limit(int(nbytes or 0))
