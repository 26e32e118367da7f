"""Dymem runs its train step without Grappler's memory optimizer (see dymem_tf/grappler_config.py)."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import dymem_tf
from dymem_tf import grappler_config

RC = rewriter_config_pb2.RewriterConfig


def _config(options=None) -> config_pb2.ConfigProto:
    options = options or context.context().function_call_options
    return config_pb2.ConfigProto.FromString(options.config_proto_serialized or b"")


@pytest.fixture
def fresh_options():
    """The thread's function-call options rebuilt from the context's config, and rebuilt again afterwards."""
    ctx = context.context()
    ctx.function_call_options = None
    yield ctx
    ctx.function_call_options = None


def test_block_turns_only_the_memory_optimizer_off_and_restores_the_options(fresh_options):
    before = fresh_options.function_call_options
    assert grappler_config.memory_optimizer_setting() == "DEFAULT_MEM_OPT"
    with grappler_config.without_memory_optimizer():
        inside = fresh_options.function_call_options
        assert grappler_config.memory_optimizer_setting() == "NO_MEM_OPT"
        assert inside.executor_type == before.executor_type
        expected = _config(before)
        expected.graph_options.rewrite_options.memory_optimization = RC.NO_MEM_OPT
        assert _config(inside) == expected  # every other setting is kept
    assert fresh_options.function_call_options is before
    with pytest.raises(RuntimeError):
        with grappler_config.without_memory_optimizer():
            raise RuntimeError("boom")
    assert fresh_options.function_call_options is before


def test_each_call_gets_its_own_options_object_keyed_by_executor(fresh_options):
    base = fresh_options.function_call_options
    one = grappler_config.call_options_without_memory_optimizer(base)
    two = grappler_config.call_options_without_memory_optimizer(base)
    assert one is not two and one.config_proto_serialized == two.config_proto_serialized
    other = context.FunctionCallOptions(executor_type="SINGLE_THREADED_EXECUTOR", config_proto=_config(base))
    patched = grappler_config.call_options_without_memory_optimizer(other)
    assert patched.executor_type == "SINGLE_THREADED_EXECUTOR"
    assert grappler_config.memory_optimizer_setting(patched) == "NO_MEM_OPT"


def test_an_explicit_user_setting_is_kept(fresh_options):
    config = _config()
    config.graph_options.rewrite_options.memory_optimization = RC.RECOMPUTATION_HEURISTICS
    fresh_options.function_call_options = context.FunctionCallOptions(config_proto=config)
    with grappler_config.without_memory_optimizer():
        assert grappler_config.memory_optimizer_setting() == "RECOMPUTATION_HEURISTICS"


def test_options_replaced_by_tensorflow_inside_the_block_are_not_overwritten(fresh_options):
    with grappler_config.without_memory_optimizer():
        replacement = context.FunctionCallOptions(config_proto=_config())
        fresh_options.function_call_options = replacement
    assert fresh_options.function_call_options is replacement


def test_other_rewriter_settings_survive(fresh_options):
    saved = dict(fresh_options._optimizer_experimental_options)
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        with grappler_config.without_memory_optimizer():
            rewrite = _config().graph_options.rewrite_options
            assert rewrite.arithmetic_optimization == RC.OFF and rewrite.memory_optimization == RC.NO_MEM_OPT
    finally:
        fresh_options._optimizer_experimental_options.clear()
        fresh_options._optimizer_experimental_options.update(saved)


def test_nested_function_calls_traced_in_the_block_carry_the_setting(fresh_options):
    @tf.function
    def inner(x):
        return tf.add_n([x, 2 * x, 3 * x])

    @tf.function
    def outer(x):
        return inner(x) + 1.0

    x = tf.constant(np.linspace(-1, 1, 64, dtype=np.float32))
    plain = outer(x).numpy()
    with grappler_config.without_memory_optimizer():
        concrete = outer.get_concrete_function(tf.TensorSpec([32], tf.float32))  # a new trace, inside the block
        np.testing.assert_array_equal(outer(x).numpy(), plain)
    calls = [op for op in concrete.graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert calls
    for op in calls:
        cfg = config_pb2.ConfigProto.FromString(op.get_attr("config_proto"))
        assert cfg.graph_options.rewrite_options.memory_optimization == RC.NO_MEM_OPT


def test_the_callbacks_train_function_runs_without_the_memory_optimizer(fresh_options):
    seen = []
    probe = lambda it: seen.append(grappler_config.memory_optimizer_setting())  # noqa: E731
    dymem_tf.DymemCallback(verbose=0)._wrap_train_function(probe)(None)
    dymem_tf.DymemCallback(policy="none", verbose=0)._wrap_train_function(probe)(None)  # inserts nothing
    assert seen == ["NO_MEM_OPT", "DEFAULT_MEM_OPT"]
    assert grappler_config.memory_optimizer_setting() == "DEFAULT_MEM_OPT"
