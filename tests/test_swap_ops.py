"""Tests of the DymemSwapOut / DymemSwapIn ops and the host pool (CPU device)."""
from __future__ import annotations

import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import tensorflow as tf

from dymem_tf.memory import host_pool
from dymem_tf.memory.native import load_ops_library
from dymem_tf.ops.swap_ops import SUPPORTED_DTYPES, swap_in, swap_out

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4, 5), (1, 1000, 33)]
FLOAT_COMPONENT = {tf.complex64: np.float32, tf.complex128: np.float64}
UINT_OF_SIZE = {2: np.uint16, 4: np.uint32, 8: np.uint64}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _special_bits(np_float) -> list[int]:
    """Bit patterns a value-based copy would not preserve: -0.0, quiet and signalling NaNs with payloads,
    a denormal, -inf."""
    uint = UINT_OF_SIZE[np.dtype(np_float).itemsize]
    bits = np.dtype(uint).itemsize * 8
    inf = int(np.array(np.inf, dtype=np_float).view(uint))
    qnan = int(np.array(np.nan, dtype=np_float).view(uint))
    sign = 1 << (bits - 1)
    return [sign, qnan | 0x5, inf | 0x3, 0x1, sign | inf, sign | qnan | 0x2]


def random_array(dtype: tf.DType, shape, seed: int = 0) -> np.ndarray:
    """Random bytes of `dtype` (NaNs with random payloads included) with special float patterns planted."""
    rng = np.random.default_rng(seed)
    np_dtype = np.dtype(dtype.as_numpy_dtype)
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    n = int(np.prod(shape, dtype=np.int64))
    arr = rng.integers(0, 256, size=n * np_dtype.itemsize, dtype=np.uint8).view(np_dtype).reshape(shape)
    if dtype.is_floating or dtype.is_complex:
        component = FLOAT_COMPONENT.get(dtype, np_dtype)
        flat = arr.reshape(-1).view(component).view(UINT_OF_SIZE[np.dtype(component).itemsize])
        special = _special_bits(component)[: flat.size]
        flat[: len(special)] = special
    return arr


def assert_bit_equal(actual: tf.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype.as_numpy_dtype == expected.dtype
    assert tuple(actual.shape) == expected.shape
    assert actual.numpy().tobytes() == expected.tobytes()


def _sync() -> None:
    """Make sure released host tensors have gone back to the pool before reading its counters."""
    gc.collect()


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: d.name)
def test_round_trip_eager_bit_exact(dtype):
    for i, shape in enumerate(SHAPES):
        expected = random_array(dtype, shape, seed=i)
        x = tf.constant(expected)
        host = swap_out(x)
        assert host.dtype == dtype and tuple(host.shape) == shape
        assert_bit_equal(host, expected)  # the host copy itself is exact
        assert_bit_equal(swap_in(host), expected)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: d.name)
def test_round_trip_tf_function_bit_exact(dtype):
    @tf.function(input_signature=[tf.TensorSpec(None, dtype)])
    def round_trip(t):
        return swap_in(swap_out(t))

    for i, shape in enumerate(SHAPES):
        expected = random_array(dtype, shape, seed=100 + i)
        assert_bit_equal(round_trip(tf.constant(expected)), expected)


def test_large_tensor_parallel_copy():
    # Above the 8 MiB threshold the copy is sharded in 1 MiB chunks; an odd size checks the last partial chunk.
    expected = random_array(tf.uint8, (3 * (1 << 22) + 12345,), seed=7)
    assert_bit_equal(swap_in(swap_out(tf.constant(expected))), expected)
    expected = random_array(tf.float64, (1 << 20) + 3, seed=8)
    assert_bit_equal(swap_in(swap_out(tf.constant(expected))), expected)


def test_shapes_and_dtypes_preserved_in_graph():
    traced = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float16), tf.TensorSpec(None, tf.int64)])
    def fn(a, b):
        ha, hb = swap_out(a), swap_out(b)
        ya, yb = swap_in(ha), swap_in(hb)
        traced.extend([ha, hb, ya, yb])
        return ya, yb

    a = random_array(tf.float16, (5, 3), seed=1)
    b = random_array(tf.int64, (2, 1, 4), seed=2)
    ya, yb = fn(tf.constant(a), tf.constant(b))
    ha, hb, ga, gb = traced
    assert ha.shape.as_list() == [None, 3] and ga.shape.as_list() == [None, 3]
    assert hb.shape.rank is None and gb.shape.rank is None
    assert (ha.dtype, ga.dtype, hb.dtype, gb.dtype) == (tf.float16, tf.float16, tf.int64, tf.int64)
    assert_bit_equal(ya, a)
    assert_bit_equal(yb, b)


def test_tf_function_runs_the_kernels():
    # The pair is an identity in value: if the runtime's Grappler pass dropped it, the counters would not move.
    @tf.function
    def fn(t):
        return swap_in(swap_out(t)) * 2.0

    x = tf.ones([16, 16])
    before = host_pool.host_pool_stats()
    np.testing.assert_array_equal(fn(x).numpy(), np.full([16, 16], 2.0, np.float32))
    after = host_pool.host_pool_stats()
    assert after["num_swap_outs"] - before["num_swap_outs"] == 1
    assert after["num_swap_ins"] - before["num_swap_ins"] == 1
    assert after["bytes_swapped_out"] - before["bytes_swapped_out"] == 16 * 16 * 4
    assert after["bytes_swapped_in"] - before["bytes_swapped_in"] == 16 * 16 * 4


def test_grappler_keeps_swap_pair_in_partition_graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
        y = swap_in(swap_out(x, name="swap_out"), name="swap_in")
        # A foldable product proves that Grappler's constant folding did run on this graph.
        folded = tf.multiply(tf.constant(2.0), tf.constant(3.0), name="fold_me")
        z = tf.identity(y * folded, name="z")
    with tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto()) as sess:
        metadata = tf.compat.v1.RunMetadata()
        result = sess.run(z, options=tf.compat.v1.RunOptions(output_partition_graphs=True), run_metadata=metadata)
    np.testing.assert_array_equal(result, np.arange(12, dtype=np.float32).reshape(3, 4) * 6.0)
    nodes = {node.name: node.op for part in metadata.partition_graphs for node in part.node}
    assert nodes.get("swap_out") == "DymemSwapOut", nodes
    assert nodes.get("swap_in") == "DymemSwapIn", nodes
    assert nodes.get("fold_me") == "Const", nodes  # folded: Grappler did run on this graph


def test_host_pool_accounting_and_release():
    _sync()
    before = host_pool.host_pool_stats()
    for key in ("bytes_in_use", "peak_bytes_in_use", "num_allocs", "live_buffers", "bytes_swapped_out",
                "bytes_swapped_in"):
        assert key in before
    x = tf.random.uniform([256, 1024])  # 1 MiB
    nbytes = 256 * 1024 * 4
    host = swap_out(x)
    held = host_pool.host_pool_stats()
    assert held["bytes_in_use"] - before["bytes_in_use"] >= nbytes
    assert held["live_buffers"] == before["live_buffers"] + 1
    assert held["num_allocs"] == before["num_allocs"] + 1
    assert held["bytes_swapped_out"] - before["bytes_swapped_out"] == nbytes
    assert held["peak_bytes_in_use"] >= held["bytes_in_use"]

    y = swap_in(host)
    assert host_pool.host_pool_stats()["bytes_swapped_in"] - before["bytes_swapped_in"] == nbytes
    np.testing.assert_array_equal(y.numpy(), x.numpy())

    del host
    _sync()
    released = host_pool.host_pool_stats()
    assert released["bytes_in_use"] == before["bytes_in_use"]
    assert released["live_buffers"] == before["live_buffers"]

    host_pool.reset_host_pool_peak()
    assert host_pool.host_pool_stats()["peak_bytes_in_use"] == released["bytes_in_use"]


def test_host_pool_reuses_freed_blocks_and_cache_limit():
    default_limit = host_pool.host_pool_stats()["cache_limit"]
    try:
        x = tf.zeros([300, 1000])
        host = swap_out(x)
        del host
        _sync()
        before = host_pool.host_pool_stats()
        assert before["bytes_cached"] >= 300 * 1000 * 4
        host = swap_out(x)
        assert host_pool.host_pool_stats()["cache_hits"] == before["cache_hits"] + 1
        del host
        _sync()

        host_pool.set_host_pool_cache_limit(0)
        assert host_pool.host_pool_stats()["bytes_cached"] == 0
        host = swap_out(x)
        del host
        _sync()
        assert host_pool.host_pool_stats()["bytes_cached"] == 0
        host_pool.set_host_pool_cache_limit(default_limit)
        host = swap_out(x)
        del host
        _sync()
        assert host_pool.release_host_pool_cache() > 0
        assert host_pool.host_pool_stats()["bytes_cached"] == 0
    finally:
        host_pool.set_host_pool_cache_limit(default_limit)


def test_host_pool_limit_raises_resource_exhausted():
    _sync()
    in_use = host_pool.host_pool_stats()["bytes_in_use"]
    host_pool.set_host_pool_limit(in_use + (1 << 20))
    try:
        with pytest.raises(tf.errors.ResourceExhaustedError, match="dymem host pool: cannot allocate"):
            swap_out(tf.zeros([1 << 19], tf.float32))  # 2 MiB
        small = swap_out(tf.zeros([1 << 10], tf.float32))  # still fits
        assert small.shape == (1 << 10,)
        del small
    finally:
        host_pool.set_host_pool_limit(None)
    assert host_pool.host_pool_stats()["bytes_limit"] == 0
    assert swap_out(tf.zeros([1 << 19], tf.float32)).shape == (1 << 19,)
    with pytest.raises(ValueError):
        host_pool.set_host_pool_limit(-1)


class _Charged:
    """The accounting path of DymemSwapOut's GPU kernel (AllocateChargedTensor: pinned buffers charged to the host
    pool), driven through its ctypes test hooks with TF's CPU allocator standing in for the pinned allocator."""

    def __init__(self):
        import ctypes

        from dymem_tf.memory.native import ops_cdll

        self.ctypes, lib = ctypes, ops_cdll()
        lib.dymem_host_pool_charged_alloc.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int]
        lib.dymem_host_pool_charged_alloc.restype = ctypes.c_void_p
        lib.dymem_host_pool_charged_free.argtypes = [ctypes.c_void_p]
        lib.dymem_host_pool_charged_free.restype = None
        self.lib = lib

    def alloc(self, nbytes: int) -> tuple[int | None, str]:
        """(handle, "") or (None, the error message)."""
        error = self.ctypes.create_string_buffer(512)
        handle = self.lib.dymem_host_pool_charged_alloc(nbytes, error, len(error))
        return handle, error.value.decode()

    def free(self, handle: int) -> None:
        self.lib.dymem_host_pool_charged_free(handle)


def test_charged_pinned_buffers_count_in_use_peak_and_release_on_free():
    charged, mib = _Charged(), 1 << 20
    _sync()
    before = host_pool.host_pool_stats()
    host_pool.reset_host_pool_peak()
    handles = [charged.alloc(n)[0] for n in (3 * mib, mib + 5)]
    assert all(handles)
    held = host_pool.host_pool_stats()
    assert held["bytes_in_use"] - before["bytes_in_use"] == 4 * mib + 5  # payload bytes, not rounded
    assert held["live_buffers"] - before["live_buffers"] == 2
    assert held["num_allocs"] - before["num_allocs"] == 2
    assert held["largest_alloc"] >= 3 * mib
    charged.free(handles.pop(0))
    assert host_pool.host_pool_stats()["bytes_in_use"] - before["bytes_in_use"] == mib + 5
    charged.free(handles.pop())
    after = host_pool.host_pool_stats()
    assert (after["bytes_in_use"], after["live_buffers"]) == (before["bytes_in_use"], before["live_buffers"])
    assert after["peak_bytes_in_use"] == before["bytes_in_use"] + 4 * mib + 5
    assert after["bytes_cached"] == before["bytes_cached"]  # a pinned buffer is freed by its own allocator
    zero, error = charged.alloc(0)  # no elements, no buffer, no charge
    assert zero and not error
    charged.free(zero)
    assert host_pool.host_pool_stats()["num_allocs"] == after["num_allocs"]


def test_charged_pinned_buffers_are_refused_over_the_host_pool_limit():
    charged, mib = _Charged(), 1 << 20
    _sync()
    in_use = host_pool.host_pool_stats()["bytes_in_use"]
    host_pool.set_host_pool_limit(in_use + 2 * mib)
    try:
        first, _ = charged.alloc(mib + mib // 2)
        assert first
        refused, error = charged.alloc(mib)
        assert refused is None
        assert error.startswith("RESOURCE_EXHAUSTED: dymem host pool: cannot allocate 1048576 bytes")
        assert f"of the pool's {in_use + 2 * mib} byte limit" in error
        assert "raise it with dymem_tf.memory.host_pool.set_host_pool_limit" in error
        assert host_pool.host_pool_stats()["bytes_in_use"] == in_use + mib + mib // 2  # the refusal charged nothing
        charged.free(first)
        again, _ = charged.alloc(mib)  # freeing gave the bytes back to the limit
        assert again
        charged.free(again)
    finally:
        host_pool.set_host_pool_limit(None)


def test_charged_pinned_buffers_evict_the_cache_to_fit_under_the_limit():
    charged = _Charged()
    host = swap_out(tf.zeros([512, 1024]))  # 2 MiB from the CPU kernel's pool, cached once freed
    del host
    _sync()
    stats = host_pool.host_pool_stats()
    assert stats["bytes_cached"] >= 2 << 20
    host_pool.set_host_pool_limit(stats["bytes_in_use"] + stats["bytes_cached"])
    try:
        handle, error = charged.alloc(stats["bytes_cached"])  # fits only once the cache is dropped
        assert handle, error
        assert host_pool.host_pool_stats()["bytes_cached"] == 0
        charged.free(handle)
    finally:
        host_pool.set_host_pool_limit(None)


def test_charged_pinned_buffers_respect_the_limit_across_threads():
    """Each round every thread asks for two buffers while all hold theirs (a barrier), then all free them: exactly
    the 5 that fit under the limit are granted per round, whichever threads win them."""
    charged, size, num_threads, rounds = _Charged(), 256 << 10, 8, 50
    _sync()
    before = host_pool.host_pool_stats()
    limit = before["bytes_in_use"] + 5 * size
    host_pool.reset_host_pool_peak()
    host_pool.set_host_pool_limit(limit)
    barrier = threading.Barrier(num_threads)
    granted, errors = [[0] * rounds for _ in range(num_threads)], []

    def worker(tid: int) -> None:
        try:
            for r in range(rounds):
                held = []
                for _ in range(2):
                    handle, error = charged.alloc(size)
                    if handle:
                        held.append(handle)
                    else:
                        assert "RESOURCE_EXHAUSTED" in error and "byte limit" in error, error
                granted[tid][r] = len(held)
                barrier.wait()  # everyone has asked while holding what they got
                for handle in held:
                    charged.free(handle)
                barrier.wait()  # everything is freed before the next round
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        host_pool.set_host_pool_limit(None)
    assert not errors, errors
    assert [sum(g[r] for g in granted) for r in range(rounds)] == [5] * rounds
    after = host_pool.host_pool_stats()
    assert after["peak_bytes_in_use"] == limit
    assert after["num_allocs"] - before["num_allocs"] == 5 * rounds
    assert (after["bytes_in_use"], after["live_buffers"]) == (before["bytes_in_use"], before["live_buffers"])


def _unsupported_tensors():
    return {
        "string": tf.constant(["a", "bc"]),
        "resource": tf.Variable(1.0).handle,
    }  # a variant holding a TensorList is swapped (tests/test_variant_swap.py)


@pytest.mark.parametrize("kind", ["string", "resource"])
def test_unsupported_dtypes_raise_clear_error(kind):
    tensor = _unsupported_tensors()[kind]
    for fn, op in ((swap_out, "DymemSwapOut"), (swap_in, "DymemSwapIn")):
        with pytest.raises(TypeError, match=rf"{op} cannot swap a tensor of dtype {kind}: only numeric and bool"):
            fn(tensor)


def test_unsupported_dtype_rejected_by_op_definition():
    # Bypassing the Python check, the op's type constraint still rejects the dtype, eagerly and in a graph.
    allowed = re.compile(r"not in (the )?list of allowed values")
    lib = load_ops_library()
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match=allowed):
        lib.dymem_swap_out(tf.constant(["a"]))
    with tf.Graph().as_default():
        with pytest.raises((TypeError, ValueError), match=allowed):
            lib.dymem_swap_in(tf.constant(["a"]))


def test_gradient_is_identity():
    x = tf.constant([1.0, -2.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(swap_in(swap_out(x)) * tf.constant([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [1.0, 2.0, 3.0])


def test_concurrent_swaps_from_threads():
    _sync()
    before = host_pool.host_pool_stats()
    num_threads, iterations = 6, 20
    sizes = [(0,), (3,), (17, 5), (64, 64), (1 << 21) + 9]  # the last one takes the sharded copy path
    errors: list[BaseException] = []
    swapped = [0] * num_threads

    def worker(tid: int) -> None:
        try:
            for it in range(iterations):
                dtype = SUPPORTED_DTYPES[(tid + it) % len(SUPPORTED_DTYPES)]
                shape = sizes[(tid * 7 + it) % len(sizes)]
                expected = random_array(dtype, shape if isinstance(shape, tuple) else (shape,), seed=tid * 1000 + it)
                host = swap_out(tf.constant(expected))
                assert_bit_equal(swap_in(host), expected)
                swapped[tid] += expected.nbytes
                del host
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    _sync()
    after = host_pool.host_pool_stats()
    total = num_threads * iterations
    assert after["num_swap_outs"] - before["num_swap_outs"] == total
    assert after["num_swap_ins"] - before["num_swap_ins"] == total
    assert after["bytes_swapped_out"] - before["bytes_swapped_out"] == sum(swapped)
    assert after["bytes_swapped_in"] - before["bytes_swapped_in"] == sum(swapped)
    assert after["bytes_in_use"] == before["bytes_in_use"]
    assert after["live_buffers"] == before["live_buffers"]


def test_with_gtbm_host_copy_is_off_budget_and_swap_in_is_mobile():
    # Integration with the GTBM allocator when it serves the CPU device in this process (conftest imports dymem_tf
    # first): the host copy must not be allocated from the device pool, and the swap-in must land in MOBILE.
    allocator = pytest.importorskip("dymem_tf.memory.allocator")
    if not allocator.is_active():
        pytest.skip("GTBM does not serve the CPU device in this process")
    nbytes = 4 << 20
    x = tf.fill([nbytes // 4], 1.5)
    before = allocator.memory_stats()
    host = swap_out(x)
    after_out = allocator.memory_stats()
    assert after_out["bytes_in_use"] - before["bytes_in_use"] < nbytes
    y = swap_in(host)
    after_in = allocator.memory_stats()
    mobile_delta = after_in["groups"]["mobile"]["in_use"] - after_out["groups"]["mobile"]["in_use"]
    assert mobile_delta >= nbytes
    np.testing.assert_array_equal(y.numpy(), x.numpy())


@pytest.mark.parametrize("resident, group", [(False, "mobile"), (True, "persistent")])
def test_with_gtbm_a_variable_brought_back_to_stay_lands_in_persistent(resident, group):
    # A plan's resident swap-in (graph_pass.encode_plan's `vkeep`) brings back a variable that then stays on the
    # device: in GTBM's persistent group, so that it does not pin the mobile group's pageblocks between steps; an
    # offloaded variable's visit (`vin`) is mobile.
    allocator = pytest.importorskip("dymem_tf.memory.allocator")
    if not allocator.is_active():
        pytest.skip("GTBM does not serve the CPU device in this process")
    from dymem_tf.ops import swap_ops

    nbytes = 4 << 20
    var = tf.Variable(tf.fill([nbytes // 4], 2.5))
    swap_ops.offload_variable(var)
    before = allocator.memory_stats()["groups"][group]["in_use"]
    load_ops_library().dymem_variable_swap_in(var.handle, resident=resident)
    assert allocator.memory_stats()["groups"][group]["in_use"] - before >= nbytes
    assert not swap_ops.variable_is_offloaded(var)
    np.testing.assert_array_equal(var.numpy(), np.full(nbytes // 4, 2.5, np.float32))


_FAKE_GTBM = r"""
static int depth, max_depth, pushes, pops, last_group = -1;
void dymem_gtbm_push_mobility(int group) { ++pushes; last_group = group; if (++depth > max_depth) max_depth = depth; }
void dymem_gtbm_pop_mobility(void) { ++pops; --depth; }
int fake_stat(int i) { int v[] = {pushes, pops, last_group, depth, max_depth}; return v[i]; }
"""

_MOBILITY_SCRIPT = """
import ctypes, sys
import tensorflow as tf
fake = ctypes.CDLL(sys.argv[1], mode=getattr(ctypes, sys.argv[2]))
from dymem_tf.ops.swap_ops import swap_in, swap_out
for _ in range(3):
    y = swap_in(swap_out(tf.range(10)))
assert y.numpy().tolist() == list(range(10))
print("STATS", *[fake.fake_stat(i) for i in range(5)])
"""


@pytest.mark.parametrize("mode", ["RTLD_GLOBAL", "RTLD_LOCAL"])
def test_swap_in_tags_allocation_as_mobile(tmp_path, mode):
    # A stand-in for the GTBM library: SwapIn must find its hooks whether the library's symbols are global or
    # hidden (tf.load_op_library loads RTLD_LOCAL), and wrap its allocation in push(2) ... pop().
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    src = tmp_path / "fake_gtbm.c"
    src.write_text(_FAKE_GTBM)
    lib = tmp_path / "lib_dymem_gtbm_fake.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib)], check=True)
    env = dict(os.environ, DYMEM_GTBM="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_MOBILITY_SCRIPT), str(lib), mode],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats_line = [line for line in proc.stdout.splitlines() if line.startswith("STATS")][-1]
    pushes, pops, last_group, depth, max_depth = map(int, stats_line.split()[1:])
    assert pushes == 3 and pops == 3, stats_line
    assert last_group == 2 and depth == 0 and max_depth == 1, stats_line


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.skipif(_mem_available_bytes() < 12 * (1 << 30), reason="needs 12 GiB of available memory")
def test_tensor_larger_than_2gib():
    n = (1 << 31) + 17
    # A period of 251 bytes (prime) lines up with no copy chunk or page, so a misplaced chunk shows. The tensor is
    # built by concatenating one 64 MiB block whose length is a multiple of the period: one 2 GiB write, instead of
    # building it in numpy and copying it into TF.
    step = 251 << 18
    block = np.resize(np.arange(251, dtype=np.uint8), step)
    whole, rem = divmod(n, step)
    block_t = tf.constant(block)
    x = tf.concat([block_t] * whole + [block_t[:rem]], axis=0)
    _sync()
    before = host_pool.host_pool_stats()["bytes_in_use"]
    host = swap_out(x)
    del x
    assert host_pool.host_pool_stats()["bytes_in_use"] - before >= n
    assert host.shape == (n,) and host.dtype == tf.uint8
    y = swap_in(host)
    del host
    _sync()
    assert host_pool.host_pool_stats()["bytes_in_use"] == before
    host_pool.release_host_pool_cache()  # do not keep 2 GiB cached for the rest of the session
    assert y.shape == (n,) and y.dtype == tf.uint8
    actual = y.numpy()
    for start in range(0, n, step):  # every slice starts at phase 0 of the pattern
        chunk = actual[start:start + step]
        assert np.array_equal(chunk, block[: chunk.size]), start
