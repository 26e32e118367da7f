"""Grappler settings for running a rewritten train step: TensorFlow's own memory optimizer is turned off.

Grappler's memory optimizer (``RewriterConfig.memory_optimization``, on by default) has a scheduling pass that,
when its *static* estimate of a function's peak exceeds 80% of the device's memory, rewrites ``AddN`` nodes whose
inputs are live at that peak into a ``TemporaryVariable`` plus one ``AssignAdd`` per input. The sum is then
accumulated in the order the inputs arrive, which rounds differently from ``AddN``.

Its estimate does not understand swap ops (it cannot see that ``DymemSwapOut`` lets a tensor die), so on a step
rewritten by Dymem it finds a different peak than on the original step and rewrites different ``AddN`` nodes.
Observed on TF 2.21 (CPU, ResNet-50 64x64 batch 32, op determinism on): one gradient ``AddN`` of
``conv5_block3_3_bn`` was turned into an accumulator only in the swapped step, and the weights after the first
step differed in the last bits. Dymem plans the step's memory itself, so the callback runs its train function with
that optimizer off (:func:`without_memory_optimizer`; not for ``policy="none"``, which inserts nothing); every other
Grappler setting stays as configured, and so does a ``memory_optimization`` the user set explicitly.
"""
from __future__ import annotations

import contextlib
import threading

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

_cache_lock = threading.Lock()
_cache: dict[tuple, bytes] = {}


def call_options_without_memory_optimizer(options):
    """A new eager ``FunctionCallOptions`` like ``options`` (same executor, same config) but with Grappler's memory
    optimizer off. A ``memory_optimization`` the user set explicitly (anything but ``DEFAULT_MEM_OPT``) is kept."""
    serialized = options.config_proto_serialized or b""
    key = (options.executor_type, serialized)
    with _cache_lock:
        patched = _cache.get(key)
        if patched is None:
            config = config_pb2.ConfigProto.FromString(serialized)
            rewrite = config.graph_options.rewrite_options
            if rewrite.memory_optimization == rewriter_config_pb2.RewriterConfig.DEFAULT_MEM_OPT:
                rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
            patched = _cache[key] = config.SerializeToString()
    # A fresh object per call: TF may edit a thread's options in place (tf.experimental.function_executor_type).
    return context.FunctionCallOptions(executor_type=options.executor_type,
                                       config_proto=config_pb2.ConfigProto.FromString(patched))


@contextlib.contextmanager
def without_memory_optimizer():
    """Run the tf.function calls in this block (this thread only) with Grappler's memory optimizer off.

    Each call passes its config to the runtime, which optimises a function once per config. The thread's previous
    call options are put back on exit (also when the block raises), unless TensorFlow replaced the block's options
    meanwhile (e.g. ``tf.config.optimizer.set_experimental_options`` resets them): then its choice stays.
    """
    ctx = context.context()
    saved = ctx.function_call_options
    installed = call_options_without_memory_optimizer(saved)
    ctx.function_call_options = installed
    try:
        yield
    finally:
        if ctx._thread_local_data.function_call_options is installed:  # pylint: disable=protected-access
            ctx.function_call_options = saved


def memory_optimizer_setting(options=None) -> str:
    """The ``memory_optimization`` value (e.g. ``"DEFAULT_MEM_OPT"``) of ``options`` or the thread's call options."""
    options = options or context.context().function_call_options
    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized or b"")
    return rewriter_config_pb2.RewriterConfig.MemOptType.Name(config.graph_options.rewrite_options.memory_optimization)
