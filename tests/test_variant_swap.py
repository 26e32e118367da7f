"""DymemSwapOut / DymemSwapIn on variant tensors of TensorLists (a while loop's accumulators), CPU device.

Swapping out makes new TensorLists whose elements are host-pool copies; swapping in makes new ones whose elements
are device copies. The element shape, dtype and maximum size are kept, values bit for bit, and the device's
elements are freed once nothing else holds the list that was swapped out.
"""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import tensorflow as tf

import dymem_tf
from dymem_tf.memory import host_pool
from dymem_tf.ops.swap_ops import swap_in, swap_out

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.int32, tf.int64, tf.uint8, tf.bool,
          tf.complex64]
MiB = 1 << 20


def random_elements(dtype: tf.DType, shape, count: int, seed: int) -> np.ndarray:
    """``count`` stacked elements of ``shape``: random bytes (NaN payloads and all) or, for bool, random bits."""
    rng = np.random.default_rng(seed)
    full = (count, *shape)
    np_dtype = np.dtype(dtype.as_numpy_dtype)
    if dtype == tf.bool:
        return rng.integers(0, 2, size=full).astype(np.bool_)
    n = int(np.prod(full, dtype=np.int64))
    return rng.integers(0, 256, size=n * np_dtype.itemsize, dtype=np.uint8).view(np_dtype).reshape(full)


def bits(t) -> bytes:
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t).tobytes()


def round_trip_fn(dtype: tf.DType, element_shape):
    """A ``tf.function``: push each row of its input onto a new TensorList, swap the list out and in, stack it."""
    @tf.function(input_signature=[tf.TensorSpec([None, *element_shape], dtype)])
    def round_trip(rows):
        handle = tf.raw_ops.EmptyTensorList(element_shape=tf.constant(element_shape, tf.int32),
                                            max_num_elements=-1, element_dtype=dtype)
        for i in tf.range(tf.shape(rows)[0]):
            handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=rows[i])
        back = swap_in(swap_out(handle))
        return tf.raw_ops.TensorListStack(input_handle=back, element_dtype=dtype,
                                          element_shape=tf.constant(element_shape, tf.int32))
    return round_trip


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_a_list_swapped_out_and_in_stacks_bit_exact(dtype):
    rng = np.random.default_rng(dtype.as_datatype_enum)
    for trial in range(3):
        shape = tuple(int(d) for d in rng.integers(1, 6, size=rng.integers(0, 3)))
        count = int(rng.integers(1, 9))
        rows = random_elements(dtype, shape, count, seed=trial)
        stacked = round_trip_fn(dtype, list(shape))(tf.constant(rows))
        assert stacked.dtype == dtype and tuple(stacked.shape) == rows.shape
        assert bits(stacked) == rows.tobytes()


def test_a_list_keeps_its_element_shape_dtype_and_maximum_size():
    handle = tf.raw_ops.EmptyTensorList(element_shape=tf.constant([-1, 3]), max_num_elements=2,
                                        element_dtype=tf.float32)
    for i in range(2):
        handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=tf.fill([i + 1, 3], float(i)))
    host = swap_out(handle)
    for lst in (host, swap_in(host)):
        assert tf.raw_ops.TensorListElementShape(input_handle=lst, shape_type=tf.int32).numpy().tolist() == [-1, 3]
        assert int(tf.raw_ops.TensorListLength(input_handle=lst)) == 2
        for i in range(2):
            item = tf.raw_ops.TensorListGetItem(input_handle=lst, index=i, element_shape=[-1, 3],
                                                element_dtype=tf.float32)
            np.testing.assert_array_equal(item.numpy(), np.full([i + 1, 3], float(i), np.float32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="full list"):  # max_num_elements came along
            tf.raw_ops.TensorListPushBack(input_handle=lst, tensor=tf.zeros([1, 3]))
        with pytest.raises(tf.errors.InvalidArgumentError):  # and so did element_dtype
            tf.raw_ops.TensorListGetItem(input_handle=lst, index=0, element_shape=[-1, 3], element_dtype=tf.int32)


def test_unset_reserved_elements_and_empty_lists_come_back_as_they_were():
    reserved = tf.raw_ops.TensorListReserve(element_shape=[2], num_elements=4, element_dtype=tf.float32)
    reserved = tf.raw_ops.TensorListSetItem(input_handle=reserved, index=1, item=tf.constant([1.0, 2.0]))
    back = swap_in(swap_out(reserved))
    stacked = tf.raw_ops.TensorListStack(input_handle=back, element_dtype=tf.float32, element_shape=[2])
    np.testing.assert_array_equal(stacked.numpy(), [[0, 0], [1, 2], [0, 0], [0, 0]])  # unset ones read as zeros
    empty = tf.raw_ops.EmptyTensorList(element_shape=-1, max_num_elements=-1, element_dtype=tf.int64)
    assert int(tf.raw_ops.TensorListLength(input_handle=swap_in(swap_out(empty)))) == 0


def test_a_list_of_lists_swaps_every_element():
    inner = [tf.raw_ops.TensorListFromTensor(tensor=tf.constant(np.arange(6 * k, 6 * k + 6, dtype=np.int32)
                                                                .reshape(2, 3)), element_shape=[3])
             for k in range(3)]
    outer = tf.raw_ops.EmptyTensorList(element_shape=-1, max_num_elements=-1, element_dtype=tf.variant)
    for lst in inner:
        outer = tf.raw_ops.TensorListPushBack(input_handle=outer, tensor=lst)
    back = swap_in(swap_out(outer))
    for k in range(3):
        lst = tf.raw_ops.TensorListGetItem(input_handle=back, index=k, element_shape=[], element_dtype=tf.variant)
        got = tf.raw_ops.TensorListStack(input_handle=lst, element_dtype=tf.int32, element_shape=[3])
        np.testing.assert_array_equal(got.numpy(), np.arange(6 * k, 6 * k + 6).reshape(2, 3))


def test_the_swapped_list_keeps_its_element_shape_for_shape_inference():
    @tf.function
    def stacked(rows):
        handle = tf.raw_ops.TensorListFromTensor(tensor=rows, element_shape=tf.constant([3, 4]))
        back = swap_in(swap_out(handle))
        return tf.raw_ops.TensorListStack(input_handle=back, element_dtype=tf.float32, element_shape=-1)

    graph_out = stacked.get_concrete_function(tf.TensorSpec([None, 3, 4], tf.float32)).outputs[0]
    assert graph_out.shape.as_list()[1:] == [3, 4]


def test_a_variant_that_is_no_tensor_list_is_refused():
    dataset = tf.data.experimental.to_variant(tf.data.Dataset.range(3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="TensorLists only"):
        swap_out(dataset)


def _device_bytes() -> int:
    gc.collect()
    return int(dymem_tf.memory_stats()["bytes_in_use"])


def test_swapping_out_frees_the_elements_device_memory_and_swapping_in_takes_it_back():
    if not dymem_tf.memory_stats():
        pytest.skip("GTBM does not serve the CPU device in this process")
    count, element = 8, [256, 1024]  # 1 MiB each
    before = _device_bytes()
    handle = tf.raw_ops.EmptyTensorList(element_shape=element, max_num_elements=-1, element_dtype=tf.float32)
    for i in range(count):
        handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=tf.fill(element, float(i)))
    held = _device_bytes() - before
    assert held >= count * MiB
    pool_before = host_pool.host_pool_stats()["bytes_in_use"]
    host = swap_out(handle)
    del handle
    assert _device_bytes() - before < MiB  # the device's elements went with the last reference to the list
    assert host_pool.host_pool_stats()["bytes_in_use"] - pool_before >= count * MiB
    back = swap_in(host)
    del host
    gc.collect()
    assert host_pool.host_pool_stats()["bytes_in_use"] == pool_before  # the host copies are given back
    assert _device_bytes() - before >= count * MiB
    stacked = tf.raw_ops.TensorListStack(input_handle=back, element_dtype=tf.float32, element_shape=element)
    np.testing.assert_array_equal(stacked.numpy()[:, 0, 0], np.arange(count, dtype=np.float32))


def test_concurrent_list_swaps_from_threads():
    fns = {dtype: round_trip_fn(dtype, [5, 7]) for dtype in (tf.float32, tf.int64, tf.bfloat16)}
    for dtype, fn in fns.items():  # traced on this thread: the threads only run them
        fn(tf.constant(random_elements(dtype, (5, 7), 1, seed=0)))
    errors, barrier = [], threading.Barrier(6)

    def work(worker: int):
        try:
            barrier.wait()
            for rnd in range(10):
                dtype = list(fns)[(worker + rnd) % len(fns)]
                rows = random_elements(dtype, (5, 7), 1 + (worker + rnd) % 6, seed=100 * worker + rnd)
                if bits(fns[dtype](tf.constant(rows))) != rows.tobytes():
                    errors.append((worker, rnd, dtype.name))
        except Exception as err:  # pylint: disable=broad-except  (reported by the main thread)
            errors.append((worker, repr(err)))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
