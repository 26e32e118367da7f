"""Grappler settings for running a rewritten train step: TensorFlow's own memory optimizer is turned off.

Grappler's memory optimizer (``RewriterConfig.memory_optimization``, on by default) has a scheduling pass that,
when its *static* estimate of a function's peak exceeds 80% of the device's memory, rewrites ``AddN`` nodes whose
inputs are live at that peak into a ``TemporaryVariable`` plus one ``AssignAdd`` per input. The sum is then
accumulated in the order the inputs arrive, which rounds differently from ``AddN``.

Its estimate does not understand swap ops (it cannot see that ``DymemSwapOut`` lets a tensor die), so on a step
rewritten by Dymem it finds a different peak than on the original step and rewrites different ``AddN`` nodes.
Observed on TF 2.21 (CPU, ResNet-50 64x64 batch 32, op determinism on): one gradient ``AddN`` of
``conv5_block3_3_bn`` was turned into an accumulator only in the swapped step, and the weights after the first
step differed in the last bits. Dymem plans the step's memory itself, so it runs its train function with that
optimizer off (:func:`without_memory_optimizer`); every other Grappler pass stays as configured.
"""
from __future__ import annotations

import contextlib
import threading

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

_cache_lock = threading.Lock()
_cache: dict[bytes, object] = {}


def call_options_without_memory_optimizer(options):
    """A copy of the eager ``FunctionCallOptions`` ``options`` with Grappler's memory optimizer off."""
    serialized = options.config_proto_serialized or b""
    with _cache_lock:
        cached = _cache.get(serialized)
        if cached is None:
            config = config_pb2.ConfigProto()
            config.ParseFromString(serialized)
            config.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
            cached = context.FunctionCallOptions(executor_type=options.executor_type, config_proto=config)
            _cache[serialized] = cached
    return cached


@contextlib.contextmanager
def without_memory_optimizer():
    """Run the tf.function calls in this block (this thread only) with Grappler's memory optimizer off.

    Functions first called inside the block are instantiated (and optimised) with that setting; the thread's
    previous call options are restored on exit, also when the block raises.
    """
    ctx = context.context()
    saved = ctx.function_call_options
    ctx.function_call_options = call_options_without_memory_optimizer(saved)
    try:
        yield
    finally:
        ctx.function_call_options = saved


def memory_optimizer_setting(options=None) -> str:
    """The ``memory_optimization`` value (e.g. ``"DEFAULT_MEM_OPT"``) of ``options`` or the thread's call options."""
    options = options or context.context().function_call_options
    config = config_pb2.ConfigProto()
    config.ParseFromString(options.config_proto_serialized or b"")
    return rewriter_config_pb2.RewriterConfig.MemOptType.Name(config.graph_options.rewrite_options.memory_optimization)
