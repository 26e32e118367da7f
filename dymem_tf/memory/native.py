"""Finds and loads dymem_tf's native libraries, checking that they match the running TensorFlow.

Three libraries live next to the package (built by ``pip install .``):

* ``_dymem_ops``: the ``DymemSwapOut`` / ``DymemSwapIn`` kernels, the host pool and the graph pass that plans the
  train step after Grappler (``cc/pass/graph_pass.cc``); safe to load at any time.
* ``_dymem_gtbm``: the GTBM allocator. It registers with TF's allocator factory from a static initializer, which
  TensorFlow turns into a process-killing CHECK failure once its CPU allocator exists. It is therefore loaded only
  while TF's eager context is not yet initialised (see :func:`gtbm_load_is_safe`).
* ``_dymem_replay``: the GTBM core and its trace replay engine, not linked to TF; loaded with ctypes by
  :mod:`dymem_tf.memory.replay` at any time (this module only finds its path).
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import threading

from dymem_tf import compat
from dymem_tf.units import env_bytes

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dymem_tf/, where setup.py puts them
#: bytes of freed host-pool blocks kept for reuse (default 1 GiB), e.g. ``512MiB``; applied when _dymem_ops loads
HOST_POOL_CACHE_ENV = "DYMEM_HOST_POOL_CACHE_BYTES"
_lock = threading.Lock()
_loaded: dict[str, object] = {}


class LibraryNotBuiltError(ImportError):
    """The native library is missing: the package was not installed with ``pip install .``."""


class TensorFlowVersionMismatchError(ImportError):
    """The native libraries were compiled against a different TensorFlow version."""


def library_path(name: str) -> str:
    """Path of the shared library ``_dymem_<name>`` in the package (``name``: ``ops``, ``gtbm`` or ``replay``)."""
    matches = sorted(glob.glob(os.path.join(PACKAGE_DIR, f"_dymem_{name}*.so")))
    if not matches:
        raise LibraryNotBuiltError(
            f"dymem_tf's native library _dymem_{name} was not found in {PACKAGE_DIR}. Install the package with "
            "`pip install .` (or `pip install -e .`) so that dymem_tf/cc is compiled against your TensorFlow."
        )
    return matches[-1]


def build_info() -> dict:
    """What the native libraries were built against (written by setup.py at build time)."""
    path = os.path.join(PACKAGE_DIR, "_build_info.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


def check_tensorflow_version() -> None:
    """Raise :class:`TensorFlowVersionMismatchError` unless the running TF is the one the libraries were built for."""
    import tensorflow as tf

    built_for = build_info().get("tensorflow_version")
    if built_for and built_for != tf.__version__:
        raise TensorFlowVersionMismatchError(
            f"dymem_tf's native libraries were built for TensorFlow {built_for}, but TensorFlow {tf.__version__} "
            f"is installed. The op ABI is tied to the exact version: reinstall dymem_tf (`pip install "
            f"--force-reinstall --no-binary dymem_tf .`) or install tensorflow=={built_for}."
        )


def load_ops_library():
    """Load ``_dymem_ops`` with ``tf.load_op_library`` (once) and return the generated op module; the host pool
    gets the cache limit of ``DYMEM_HOST_POOL_CACHE_BYTES``, and a malformed value raises ValueError first."""
    import tensorflow as tf

    with _lock:
        if "ops" not in _loaded:
            check_tensorflow_version()
            cache_limit = env_bytes(HOST_POOL_CACHE_ENV, "host pool cache size")
            _loaded["ops"] = tf.load_op_library(library_path("ops"))
            if cache_limit is not None:
                _cdll("ops").dymem_host_pool_set_cache_limit(ctypes.c_int64(cache_limit))
        return _loaded["ops"]


def ops_cdll() -> ctypes.CDLL:
    """The ops library as a ctypes handle (host-pool statistics), loading it first if needed."""
    load_ops_library()
    return _cdll("ops")


def gtbm_load_is_safe() -> bool:
    """Whether registering the GTBM allocator factory now cannot trip TF's registration CHECK."""
    return "gtbm" in _loaded or not compat.eager_context_initialized()


def load_gtbm_library():
    """Load ``_dymem_gtbm`` (registers the allocator) if that is still safe; return its ctypes handle or None."""
    import tensorflow as tf

    with _lock:
        if "gtbm" not in _loaded:
            if not gtbm_load_is_safe():
                return None
            check_tensorflow_version()
            tf.load_op_library(library_path("gtbm"))
            _loaded["gtbm"] = True
        return _cdll("gtbm")


def gtbm_cdll() -> ctypes.CDLL | None:
    """The GTBM library's ctypes handle, or None when it was not loaded in this process."""
    with _lock:
        return _cdll("gtbm") if "gtbm" in _loaded else None


def _cdll(name: str) -> ctypes.CDLL:
    key = f"cdll:{name}"
    if key not in _loaded:
        # dlopen of an already-loaded library returns the same handle: same globals as TF's copy.
        _loaded[key] = ctypes.CDLL(library_path(name), mode=ctypes.RTLD_GLOBAL)
    return _loaded[key]  # type: ignore[return-value]
