"""Dymem runs its train step without Grappler's memory optimizer (see dymem_tf/grappler_config.py)."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import dymem_tf
from dymem_tf import grappler_config


def test_block_turns_the_memory_optimizer_off_and_restores_the_thread_options():
    before = context.context().function_call_options
    assert grappler_config.memory_optimizer_setting() != "NO_MEM_OPT"
    with grappler_config.without_memory_optimizer():
        assert grappler_config.memory_optimizer_setting() == "NO_MEM_OPT"
        inside = context.context().function_call_options
        # Every other setting is kept (soft placement is the eager default for functions).
        assert inside.config_proto_serialized != before.config_proto_serialized
        assert inside.executor_type == before.executor_type
    assert context.context().function_call_options is before
    with pytest.raises(RuntimeError):
        with grappler_config.without_memory_optimizer():
            raise RuntimeError("boom")
    assert context.context().function_call_options is before


def test_other_rewriter_settings_survive():
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    try:
        context.context().function_call_options = None  # rebuilt from the context's config
        with grappler_config.without_memory_optimizer():
            from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
            cfg = config_pb2.ConfigProto.FromString(context.context().function_call_options.config_proto_serialized)
            assert cfg.graph_options.rewrite_options.arithmetic_optimization == rewriter_config_pb2.RewriterConfig.OFF
            assert cfg.graph_options.rewrite_options.memory_optimization == rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    finally:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": True})
        context.context().function_call_options = None


def test_functions_still_run_and_give_the_same_values():
    @tf.function
    def f(x):
        return tf.add_n([x, 2 * x, 3 * x]) + tf.reduce_sum(x)

    x = tf.constant(np.linspace(-1, 1, 64, dtype=np.float32))
    plain = f(x).numpy()
    with grappler_config.without_memory_optimizer():
        np.testing.assert_array_equal(f(x).numpy(), plain)


def test_the_callbacks_train_function_runs_without_the_memory_optimizer():
    cb = dymem_tf.DymemCallback(verbose=0)
    seen = []
    wrapped = cb._wrap_train_function(lambda it: seen.append(grappler_config.memory_optimizer_setting()))
    wrapped(None)
    assert seen == ["NO_MEM_OPT"]
    assert grappler_config.memory_optimizer_setting() != "NO_MEM_OPT"
