"""The GTBM allocator serving TensorFlow's CPU device (dymem_tf.memory.allocator and the _dymem_gtbm library).

Set-ups that must happen before TensorFlow starts (budget, disabling, late import) run in fresh interpreters; they are
started together on first use so that their TensorFlow imports overlap.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import textwrap

import pytest

from dymem_tf.memory import allocator
from conftest import script_result  # the tests folder is on sys.path (pytest's default import mode)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------------------------------------------
# Fresh interpreters.

LIVE_SCRIPT = """
import tensorflow as tf
import dymem_tf
import csv, json, os, sys
import numpy as np
import keras
from dymem_tf.memory import allocator, replay

out = {"active": allocator.is_active(), "limit": allocator.get_memory_limit()}
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.rand(64, 32).astype("float32"); y = np.random.randint(0, 10, 64)
trace = sys.argv[1]
with allocator.record_trace(trace):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)   # 2 steps
out["trace_info"] = allocator.trace_info()
for _ in range(5):  # the runtime may allocate in the background between the two reads: retry until stable
    info = tf.config.experimental.get_memory_info("CPU:0")
    stats = allocator.memory_stats()
    if (info["current"], info["peak"]) == (stats["bytes_in_use"], stats["peak_bytes_in_use"]):
        break
out["info"] = info
out["stats"] = {k: v for k, v in stats.items()}
allocator.trim()
out["cached_after_trim"] = allocator.memory_stats()["cached_free_bytes"]
# Explicit mobility: the thread-local override and the op-name map (eager ops allocate on this thread).
before = allocator.memory_stats()["groups"]["mobile"]["in_use"]
with allocator.mobility("mobile"):
    m = tf.ones((256, 256))
out["mobile_delta"] = allocator.memory_stats()["groups"]["mobile"]["in_use"] - before
del m
allocator.set_mobility_map({"Fill": "mobile"})
before = allocator.memory_stats()["groups"]["mobile"]["in_use"]
m = tf.fill((128, 128), 1.0)
out["map_delta"] = allocator.memory_stats()["groups"]["mobile"]["in_use"] - before
# The planner names ops as TF runs them (after Grappler): a nested function is inlined under its call op's name,
# and only that exact name matches (a bare leaf name must not match another function's op).
@tf.function
def inner(x):
    return tf.math.multiply(x, 2.0, name="dymem_probe")
@tf.function
def outer(x):
    return inner(x) + 1.0
probe = tf.ones((64, 64))
allocator.set_mobility_map({"dymem_probe": "mobile"})
before = allocator.memory_stats()["groups"]["mobile"]["num_allocs"]
outer(probe)
out["leaf_map_allocs"] = allocator.memory_stats()["groups"]["mobile"]["num_allocs"] - before
allocator.set_mobility_map({"PartitionedCall/dymem_probe": "mobile"})
before = allocator.memory_stats()["groups"]["mobile"]["num_allocs"]
outer(probe)
out["nested_map_allocs"] = allocator.memory_stats()["groups"]["mobile"]["num_allocs"] - before
allocator.clear_mobility_map()
r = replay.replay(trace, "gtbm")
out["replay"] = r.to_dict()
# The 64 MiB budget: a bigger tensor raises ResourceExhaustedError and the process carries on.
small = tf.ones((1000, 1000))
try:
    big = tf.ones((100, 1000, 1000))   # 400 MB > 64 MiB
    out["raised"] = False
except tf.errors.ResourceExhaustedError as err:
    out["raised"] = True
    out["message"] = str(err)[:300]
out["still_works"] = float(tf.reduce_sum(small + 1.0))
s = allocator.memory_stats()
out["failed"] = s["num_failed_allocs"]
out["reserved"] = s["bytes_reserved"]
out["block_size"] = s["block_size"]
print("RESULT" + json.dumps(out))
"""

LATE_SCRIPT = """
import tensorflow as tf
import json, warnings
x = tf.ones((4, 4))                     # TF's CPU allocator exists now
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dymem_tf
from dymem_tf.memory import allocator
out = {"warned": any("GTBM" in str(w.message) for w in caught), "active": allocator.is_active()}
try:
    allocator.memory_stats()
except allocator.GtbmNotActiveError as err:
    out["error"] = str(err)
out["works"] = float(tf.reduce_sum(x * 2.0))
print("RESULT" + json.dumps(out))
"""

DISABLED_SCRIPT = """
import tensorflow as tf
import dymem_tf
import json
from dymem_tf.memory import allocator
out = {"active": allocator.is_active(), "works": float(tf.reduce_sum(tf.ones((3, 3))))}
try:
    allocator.memory_stats()
except allocator.GtbmNotActiveError as err:
    out["error"] = str(err)
print("RESULT" + json.dumps(out))
"""

INVALID_SCRIPT = "import tensorflow as tf\nimport dymem_tf\n"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("DYMEM_DEVICE_MEMORY_LIMIT", "DYMEM_GTBM",
                                                             "DYMEM_GTBM_BLOCK_SIZE", "DYMEM_GTBM_RELEASE_CACHE",
                                                             "DYMEM_HOST_INPUTS", "TF_CPU_ALLOCATOR_USE_BFC")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def run_together(specs: dict) -> dict:
    """Run ``{name: (code, argv, env)}`` in fresh interpreters started together (their TF imports overlap);
    returns ``{name: (returncode, stdout, stderr)}``."""
    started = {
        name: subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (code, args, env) in specs.items()
    }
    results = {}
    try:
        for name, p in started.items():
            stdout, stderr = p.communicate(timeout=600)
            results[name] = (p.returncode, stdout, stderr)
    finally:
        for p in started.values():
            if p.poll() is None:
                p.kill()
    return results


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("gtbm") / "live_trace.csv")
    results = run_together({
        "live": (LIVE_SCRIPT, [trace], _env(DYMEM_DEVICE_MEMORY_LIMIT="64MiB")),
        "late": (LATE_SCRIPT, [], _env()),
        "disabled": (DISABLED_SCRIPT, [], _env(DYMEM_GTBM="0")),
        "invalid": (INVALID_SCRIPT, [], _env(DYMEM_DEVICE_MEMORY_LIMIT="12 parsecs")),
    })
    results["trace"] = trace
    return results


def _result(procs, name) -> dict:
    rc, stdout, stderr = procs[name]
    return script_result(rc, stdout, stderr, name)


def test_live_training_stats_and_trace(procs):
    """Fresh interpreter, `import tensorflow; import dymem_tf` first, DYMEM_DEVICE_MEMORY_LIMIT=64MiB: a tiny Keras
    model trains 2 steps under GTBM while a trace is recorded, then the trace is replayed."""
    out = _result(procs, "live")
    assert out["active"] is True and out["limit"] == 64 << 20
    stats = out["stats"]
    # tf.config.experimental.get_memory_info reads the allocator's GetStats(): the same numbers.
    assert out["info"]["current"] == stats["bytes_in_use"]
    assert out["info"]["peak"] == stats["peak_bytes_in_use"]
    assert stats["num_allocs"] > 100 and stats["num_failed_allocs"] == 0
    groups = stats["groups"]
    assert groups["persistent"]["in_use"] > 0  # weights and optimizer slots
    assert groups["transient"]["num_allocs"] > 0  # the train step's kernels
    assert 0.0 <= stats["reserved_overhead"] < 1.0 and stats["bytes_reserved"] % stats["block_size"] == 0
    assert stats["peak_bytes_reserved"] >= stats["peak_bytes_in_use"] >= stats["bytes_in_use"]
    assert stats["cached_free_bytes"] <= (64 << 20) // 8 and out["cached_after_trim"] == 0
    assert out["mobile_delta"] == 256 * 256 * 4
    assert out["map_delta"] == 128 * 128 * 4
    assert out["nested_map_allocs"] >= 1  # the inlined op's exact name matches
    assert out["leaf_map_allocs"] == 0  # a bare leaf name does not
    info = out["trace_info"]
    assert info["records"] > 50 and info["dropped"] == 0 and not info["active"]
    # The CSV: MiniMalloc's columns first, then GTBM's.
    with open(procs["trace"]) as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0].keys()) == ["id", "lower", "upper", "size", "group", "offset", "op", "step", "alloc_ns",
                                    "free_ns"]
    assert len(rows) == info["records"]
    assert all(int(r["lower"]) < int(r["upper"]) <= info["events"] for r in rows)
    assert any(r["op"].startswith("StatefulPartitionedCall/") and r["group"] == "1" for r in rows)
    replayed = out["replay"]
    assert replayed["groups_from_trace"] and replayed["num_failed"] == 0
    assert replayed["footprint"] >= replayed["lower_bound"] > 0


def test_budget_exhaustion_raises_and_process_survives(procs):
    out = _result(procs, "live")
    assert out["raised"] is True and "OOM" in out["message"]
    assert out["still_works"] == 2_000_000.0
    assert out["failed"] >= 1 and out["reserved"] <= 64 << 20
    assert out["block_size"] == 256 << 10  # 2 MiB halved until the 64 MiB device holds 256 pageblocks


def test_import_after_tensorflow_initialised_warns_and_runs_without_gtbm(procs):
    out = _result(procs, "late")
    assert out["warned"] and out["active"] is False
    assert "not active" in out["error"]
    assert out["works"] == 32.0


def test_disabled_by_env(procs):
    out = _result(procs, "disabled")
    assert out["active"] is False and out["works"] == 9.0
    assert "DYMEM_GTBM=0" in out["error"]


def test_invalid_limit_env_is_a_clear_error_at_import(procs):
    rc, _, stderr = procs["invalid"]
    assert rc != 0
    assert "ValueError: DYMEM_DEVICE_MEMORY_LIMIT='12 parsecs' is not a valid memory limit" in stderr
    assert "unknown unit" in stderr


@pytest.mark.parametrize("value, fragment", [("-5MiB", "negative"), ("0", "positive"), ("lots", "expected a"),
                                             ("2 GiB", None), ("", None)])
def test_validate_memory_limit_env(monkeypatch, value, fragment):
    monkeypatch.setenv("DYMEM_DEVICE_MEMORY_LIMIT", value)
    monkeypatch.delenv("DYMEM_GTBM_BLOCK_SIZE", raising=False)
    monkeypatch.delenv("DYMEM_GTBM_RELEASE_CACHE", raising=False)
    if fragment is None:
        assert allocator.validate_memory_limit_env() == (2 << 30 if value else None)
    else:
        with pytest.raises(ValueError, match=fragment):
            allocator.validate_memory_limit_env()


def test_validate_release_cache_env(monkeypatch):
    monkeypatch.delenv("DYMEM_DEVICE_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("DYMEM_GTBM_BLOCK_SIZE", raising=False)
    monkeypatch.setenv("DYMEM_GTBM_RELEASE_CACHE", "0")
    assert allocator.validate_memory_limit_env() is None
    monkeypatch.setenv("DYMEM_GTBM_RELEASE_CACHE", "lots")
    with pytest.raises(ValueError, match="DYMEM_GTBM_RELEASE_CACHE"):
        allocator.validate_memory_limit_env()


@pytest.mark.parametrize("value, ok", [("1MiB", True), ("3MiB", False), ("1000", False), ("x", False)])
def test_validate_block_size_env(monkeypatch, value, ok):
    monkeypatch.delenv("DYMEM_DEVICE_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("DYMEM_GTBM_RELEASE_CACHE", raising=False)
    monkeypatch.setenv("DYMEM_GTBM_BLOCK_SIZE", value)
    if ok:
        assert allocator.validate_memory_limit_env() is None
    else:
        with pytest.raises(ValueError, match="DYMEM_GTBM_BLOCK_SIZE"):
            allocator.validate_memory_limit_env()


# --------------------------------------------------------------------------------------------------------------
# In-process: the test session imports dymem_tf first (conftest.py), so GTBM serves this process.

PARSE_CASES = [
    ("0", 0), ("1073741824", 1 << 30), ("512MiB", 512 << 20), ("512 mib", 512 << 20), ("2GB", 2 * 10**9),
    ("1.5GiB", 3 << 29), ("64M", 64 << 20), ("0.5KB", 500), (".5KiB", 512), (" 7 ", 7), ("+3k", 3072),
    (4096, 4096), ("9223372036854775807", 2**63 - 1),
]
PARSE_ERRORS = ["", "-1", "-1MiB", "abc", "12XB", "1.2.3", "MiB", "9223372036854775808", "1e6", -3]


@pytest.mark.parametrize("text, expected", PARSE_CASES)
def test_parse_bytes(text, expected):
    assert allocator.parse_bytes(text) == expected
    lib = allocator._loaded_library() if allocator.is_active() else None
    if lib is not None and isinstance(text, str):  # the C++ parser agrees
        import ctypes

        value = ctypes.c_int64()
        assert lib.dymem_gtbm_parse_bytes(text.encode(), ctypes.byref(value)) == 0 and value.value == expected


@pytest.mark.parametrize("text", PARSE_ERRORS)
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="invalid byte count"):
        allocator.parse_bytes(text)
    lib = allocator._loaded_library() if allocator.is_active() else None
    if lib is not None and isinstance(text, str):
        import ctypes

        assert lib.dymem_gtbm_parse_bytes(text.encode(), ctypes.byref(ctypes.c_int64())) == -1


@pytest.mark.parametrize("value", [1.5, None, True, b"1MiB"])
def test_parse_bytes_types(value):
    with pytest.raises(TypeError):
        allocator.parse_bytes(value)


needs_gtbm = pytest.mark.skipif(not allocator.is_active(), reason="GTBM is not active in this test session")


@needs_gtbm
def test_limit_api_roundtrip():
    import tensorflow as tf

    original = allocator.get_memory_limit()
    try:
        keep = tf.ones((512, 512))  # 1 MiB in use
        allocator.set_memory_limit("3GiB")
        assert allocator.get_memory_limit() == 3 << 30
        assert allocator.memory_stats()["bytes_limit"] == 3 << 30
        with pytest.raises(ValueError, match="below the bytes in use"):
            allocator.set_memory_limit(1024)
        with pytest.raises(ValueError, match="exceeds the pool capacity"):
            allocator.set_memory_limit(allocator.memory_stats()["capacity"] + 4096)
        with pytest.raises(ValueError, match="positive"):
            allocator.set_memory_limit(0)
        del keep
    finally:
        allocator.set_memory_limit(original)
    assert allocator.get_memory_limit() == original


@needs_gtbm
def test_reset_peak_and_stats_shape():
    import tensorflow as tf

    big = tf.ones((1024, 1024))
    del big
    allocator.reset_peak_stats()
    s = allocator.memory_stats()
    assert s["peak_bytes_in_use"] - s["bytes_in_use"] < 1 << 20  # other threads may allocate in between
    assert set(s["groups"]) == {"persistent", "transient", "mobile"}
    assert set(s["groups"]["mobile"]) == {"in_use", "peak_in_use", "reserved", "peak_reserved", "num_allocs"}
    for key in ("bytes_reserved", "peak_extent", "largest_free_block", "num_frees", "reserved_overhead",
                "peak_reserved_overhead", "live_allocations"):
        assert key in s
    # 1 - in use / reserved is the reserved overhead; "fragmentation" is the dashboard's 1 - largest gap / free
    assert "fragmentation" not in s and "peak_fragmentation" not in s


@needs_gtbm
def test_mobility_argument_validation():
    with pytest.raises(ValueError, match="unknown mobility group"):
        allocator.set_mobility_map({"MatMul": "sticky"})
    with pytest.raises(ValueError, match="invalid op name"):
        allocator.set_mobility_map({"a\tb": 1})
    with pytest.raises(ValueError):
        with allocator.mobility(7):
            pass
    assert allocator.set_mobility_map({"x/MatMul": 0, "y/Conv2D": "mobile"}) == 2
    allocator.clear_mobility_map()
    with pytest.raises(ValueError, match="max_records"):
        allocator.start_trace(0)
