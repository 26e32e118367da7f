"""Tests of the partial swap ops, DymemSwapOutPartial / DymemSwapInPartial (CPU device): a tensor's first rows
stay on the device, the rest go to host memory, and the pair gives back every bit."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from dymem_tf.memory import host_pool
from dymem_tf.ops.swap_ops import SUPPORTED_DTYPES, swap_in_partial, swap_out_partial
from test_swap_ops import _sync, assert_bit_equal, random_array

#: (shape, rows kept): fewer rows than the tensor, all of them, more than it has, one row of a wide tensor, empty rows
CASES = [((7,), 3), ((2, 3, 4, 5), 1), ((5, 3), 5), ((4, 2), 9), ((1, 1000, 33), 1), ((6, 0, 2), 2), ((0, 4), 1)]


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: d.name)
def test_partial_round_trip_is_bit_exact_and_splits_at_the_kept_rows(dtype):
    for i, (shape, rows) in enumerate(CASES):
        expected = random_array(dtype, shape, seed=i)
        host, kept = swap_out_partial(tf.constant(expected), rows)
        k = min(rows, shape[0])
        assert_bit_equal(kept, expected[:k])
        assert_bit_equal(host, expected[k:])
        assert_bit_equal(swap_in_partial(host, kept), expected)


def test_partial_round_trip_in_a_tf_function_keeps_static_shapes():
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 2], tf.float32)])
    def round_trip(t):
        host, kept = swap_out_partial(t, 2)
        y = swap_in_partial(host, kept)
        seen.append((host.shape.as_list(), kept.shape.as_list(), y.shape.as_list()))
        return y

    for n in (1, 2, 5, 64):
        expected = random_array(tf.float32, (n, 3, 2), seed=n)
        assert_bit_equal(round_trip(tf.constant(expected)), expected)
    assert seen[0] == ([None, 3, 2], [None, 3, 2], [None, 3, 2])


def test_partial_round_trip_of_a_tensor_above_the_sharded_copy_threshold():
    expected = random_array(tf.uint8, (9, (1 << 21) + 7), seed=3)  # 18 MiB: both copies take the sharded path
    host, kept = swap_out_partial(tf.constant(expected), 4)
    assert_bit_equal(swap_in_partial(host, kept), expected)


def test_partial_swap_counts_only_the_moved_rows_and_returns_its_host_memory():
    _sync()
    before = host_pool.host_pool_stats()
    expected = random_array(tf.float32, (8, 256), seed=5)  # 1 KiB a row
    host, kept = swap_out_partial(tf.constant(expected), 3)
    assert host_pool.host_pool_stats()["bytes_swapped_out"] - before["bytes_swapped_out"] == 5 * 1024
    swap_in_partial(host, kept)
    del host, kept
    _sync()
    after = host_pool.host_pool_stats()
    assert after["bytes_swapped_in"] - before["bytes_swapped_in"] == 5 * 1024
    assert after["num_swap_outs"] - before["num_swap_outs"] == 1
    assert after["bytes_in_use"] == before["bytes_in_use"]


def test_partial_swap_gradient_passes_through_both_parts():
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    weights = tf.constant(np.arange(12, 24, dtype=np.float32).reshape(4, 3))
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(swap_in_partial(*swap_out_partial(x, 1)) * weights)
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), weights.numpy())


def test_partial_swap_refuses_bad_input_with_clear_errors():
    with pytest.raises(ValueError, match="keep_rows must be at least 1"):
        swap_out_partial(tf.zeros([4]), 0)
    with pytest.raises(TypeError, match="cannot split a variant"):
        empty = tf.raw_ops.EmptyTensorList(element_shape=tf.constant([], tf.int32), max_num_elements=1,
                                           element_dtype=tf.float32)
        swap_out_partial(empty, 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="along its first dimension"):
        swap_out_partial(tf.constant(1.0), 1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="differ beyond their rows"):
        swap_in_partial(tf.zeros([2, 3]), tf.zeros([1, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not rows of one tensor"):
        swap_in_partial(tf.zeros([2, 3]), tf.zeros([3]))


def test_partial_swaps_from_threads_are_exact():
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = np.random.default_rng(tid)
        try:
            for it in range(25):
                dtype = SUPPORTED_DTYPES[(tid + it) % len(SUPPORTED_DTYPES)]
                shape = tuple(int(d) for d in rng.integers(1, 9, size=int(rng.integers(1, 4))))
                expected = random_array(dtype, shape, seed=tid * 100 + it)
                rows = int(rng.integers(1, shape[0] + 2))
                assert_bit_equal(swap_in_partial(*swap_out_partial(tf.constant(expected), rows)), expected)
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_with_gtbm_the_kept_rows_are_mobile_and_the_moved_ones_off_the_budget():
    allocator = pytest.importorskip("dymem_tf.memory.allocator")
    if not allocator.is_active():
        pytest.skip("GTBM does not serve the CPU device in this process")
    x = tf.fill([16, 1 << 16], 1.5)  # 4 MiB, 256 KiB a row
    before = allocator.memory_stats()
    host, kept = swap_out_partial(x, 4)
    after = allocator.memory_stats()
    mobile = after["groups"]["mobile"]["in_use"] - before["groups"]["mobile"]["in_use"]
    assert 1 << 20 <= mobile < 2 << 20  # the 4 kept rows, not the 12 moved ones
    np.testing.assert_array_equal(swap_in_partial(host, kept).numpy(), x.numpy())


def test_training_with_partial_swaps_is_bit_identical_to_plain_training():
    """Under budgets between whole tensors (an MLP of 1 MiB feature maps; the plan made without calibration, so
    it is the same each run) the planner keeps rows of a swapped feature map on the device, the graph pass inserts
    the partial swap ops, and losses and weights are those of training without Dymem."""
    import keras

    import dymem_tf

    tf.config.experimental.enable_op_determinism()

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((256,))
        h = inp
        for _ in range(12):
            h = keras.layers.Dense(256, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x, y = rng.random((4096, 256), dtype=np.float32), rng.integers(0, 10, 4096)
    fit = dict(batch_size=1024, epochs=1, shuffle=False, verbose=0)
    model = build()
    plain = model.fit(x, y, **fit).history["loss"]
    weights = [w.numpy() for w in model.weights]
    for budget in ("12MiB", "20MiB"):
        model = build()
        cb = dymem_tf.DymemCallback(memory_budget=budget, calibrate=False, verbose=0)
        assert model.fit(x, y, callbacks=[cb], **fit).history["loss"] == plain
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, model.weights))
        partial = [s for s in cb.plan.swaps if s.kept_bytes]
        assert partial and any(n.startswith("partial swaps: ") for n in cb.plan.notes), cb.plan.notes
        assert all(0 < s.keep_rows < 1024 and s.kept_bytes == s.keep_rows * 1024 for s in partial)
