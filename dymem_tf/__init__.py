"""dymem_tf: train larger Keras models on the same device by swapping feature maps to host memory.

``import dymem_tf`` loads the GTBM allocator (when TensorFlow has not allocated yet and ``DYMEM_GTBM`` is not
``0``) and the swap-op library. It never crashes the interpreter: when the allocator cannot be registered safely it
warns and TensorFlow keeps its own allocator.
"""
from __future__ import annotations

import os
import warnings

import tensorflow as tf  # noqa: F401  (must be imported before the native libraries)

from dymem_tf.ops import loader as _loader

__version__ = "0.1.0"

GTBM_ENV = "DYMEM_GTBM"


def _load_allocator() -> None:
    if os.environ.get(GTBM_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true"):
        return  # the user asked for TF's own BFC allocator on the CPU: it bypasses the registry anyway
    from dymem_tf.allocator import install_input_pipeline_hook, validate_memory_limit_env

    validate_memory_limit_env()  # a malformed DYMEM_DEVICE_MEMORY_LIMIT raises ValueError before anything loads
    try:
        if _loader.load_gtbm_library() is not None:
            install_input_pipeline_hook()  # tf.data's NumPy conversions go to host memory (DYMEM_HOST_INPUTS)
        else:
            warnings.warn(
                "dymem_tf was imported after TensorFlow had already initialised its runtime, so the GTBM "
                "allocator cannot be registered any more; training continues with TensorFlow's own allocator "
                "(no device budget, no mobility groups). Import dymem_tf right after tensorflow, before any "
                "tensor is created, to use GTBM.",
                RuntimeWarning,
                stacklevel=3,
            )
    except _loader.LibraryNotBuiltError as err:
        warnings.warn(f"GTBM allocator unavailable: {err}", RuntimeWarning, stacklevel=3)


_load_allocator()

_LAZY = {
    "DymemCallback": ("dymem_tf.callback", "DymemCallback"),
    "Plan": ("dymem_tf.plan", "Plan"),
    "make_plan": ("dymem_tf.planner", "make_plan"),
    "BudgetTooSmallError": ("dymem_tf.planner", "BudgetTooSmallError"),
    "memory_stats": ("dymem_tf.allocator", "memory_stats"),
    "reset_peak_stats": ("dymem_tf.allocator", "reset_peak_stats"),
    "set_memory_limit": ("dymem_tf.allocator", "set_memory_limit"),
    "get_memory_limit": ("dymem_tf.allocator", "get_memory_limit"),
    "host_pool_stats": ("dymem_tf.ops.host_pool", "host_pool_stats"),
}


def __getattr__(name):  # PEP 562: the public API, imported on first use so `import dymem_tf` stays light
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dymem_tf' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
