"""dymem_tf: train larger Keras models on the same device by swapping feature maps to host memory.

``import dymem_tf`` does not import TensorFlow itself. It registers the GTBM allocator (unless ``DYMEM_GTBM=0``) as
soon as TensorFlow is imported: at once when it already is (``import tensorflow as tf; import dymem_tf``, the
documented order), otherwise right after the process imports it, directly or through Keras. So the TensorFlow-free
parts -- :mod:`dymem_tf.planning`, :mod:`dymem_tf.memory.replay` -- import in any process without pulling in
TensorFlow or touching its allocator. It never crashes the interpreter: when the allocator cannot be registered
safely it warns and TensorFlow keeps its own allocator.

The public API below is imported on first use (PEP 562).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

__version__ = "0.1.0"

GTBM_ENV = "DYMEM_GTBM"


def _gtbm_wanted() -> bool:
    """Whether the environment asks for GTBM (``DYMEM_GTBM`` not off, TF's own CPU BFC allocator not requested)."""
    if os.environ.get(GTBM_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    # TF_CPU_ALLOCATOR_USE_BFC: the user asked for TF's own BFC allocator on the CPU; it bypasses the registry anyway
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() not in ("1", "true")


def _load_allocator() -> None:
    """Register GTBM with TensorFlow's allocator factory if that is still safe; warn (never raise) otherwise."""
    from dymem_tf.memory import allocator, native

    try:
        if native.load_gtbm_library() is not None:
            allocator.install_input_pipeline_hook()  # tf.data's NumPy conversions go to host memory
            allocator.warn_if_gpu_hook_missing()  # DYMEM_GTBM_GPU=1 but TF's GPU state already existed
        else:
            gpus = " (nor serve GPUs, as DYMEM_GTBM_GPU=1 asks)" if allocator.gpu_requested() else ""
            warnings.warn(
                "dymem_tf was imported after TensorFlow had already initialised its runtime, so the GTBM "
                f"allocator cannot be registered any more{gpus}; training continues with TensorFlow's own "
                "allocator (no device budget, no mobility groups). Import dymem_tf right after tensorflow, before "
                "any tensor is created, to use GTBM.",
                RuntimeWarning,
                stacklevel=4,
            )
    except ImportError as err:  # LibraryNotBuiltError, TensorFlowVersionMismatchError
        warnings.warn(f"GTBM allocator unavailable: {err}", RuntimeWarning, stacklevel=4)


class _ThenRegister(importlib.abc.Loader):
    """Wraps TensorFlow's loader: executes the module, puts the original loader back, then registers GTBM."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _load_allocator()


class _OnTensorFlowImport(importlib.abc.MetaPathFinder):
    """One-shot finder: the next import of ``tensorflow`` registers GTBM right after TensorFlow has loaded."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        _remove_hook()
        spec = importlib.util.find_spec("tensorflow")
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OnTensorFlowImport)]


def _arm() -> None:
    """Register GTBM now if TensorFlow is loaded, or as soon as it is (see the module docstring)."""
    if not _gtbm_wanted():
        return
    from dymem_tf.memory.allocator import validate_memory_limit_env

    validate_memory_limit_env()  # a malformed DYMEM_DEVICE_MEMORY_LIMIT raises ValueError before anything loads
    if "tensorflow" in sys.modules:
        _load_allocator()
    elif not any(isinstance(f, _OnTensorFlowImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnTensorFlowImport())


_arm()

_LAZY = {
    "DymemCallback": ("dymem_tf.keras.callback", "DymemCallback"),
    "dry_run": ("dymem_tf.keras.dry_run", "dry_run"),
    "Plan": ("dymem_tf.planning.plan", "Plan"),
    "make_plan": ("dymem_tf.planning.planner", "make_plan"),
    "BudgetTooSmallError": ("dymem_tf.planning.planner", "BudgetTooSmallError"),
    "memory_stats": ("dymem_tf.memory.allocator", "memory_stats"),
    "reset_peak_stats": ("dymem_tf.memory.allocator", "reset_peak_stats"),
    "set_memory_limit": ("dymem_tf.memory.allocator", "set_memory_limit"),
    "get_memory_limit": ("dymem_tf.memory.allocator", "get_memory_limit"),
    "host_pool_stats": ("dymem_tf.memory.host_pool", "host_pool_stats"),
}


def __getattr__(name):  # PEP 562: the public API, imported on first use so `import dymem_tf` stays light
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dymem_tf' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
