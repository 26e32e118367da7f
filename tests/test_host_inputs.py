"""A faithful emulated device: the input pipeline is served from host memory, not from the GTBM budget.

On a GPU, the NumPy arrays handed to ``fit`` and everything tf.data allocates (map outputs, batches, shuffle and
prefetch buffers) live in host memory; on the CPU, GTBM serves them from its host-inputs arena, which the device
budget does not cap (``DYMEM_HOST_INPUTS``, default on). Variables, eager ops and the train step still count.
Budgets must be set before TensorFlow starts, so the checks run in fresh interpreters started together.
"""
from __future__ import annotations

import pytest
from test_gtbm_allocator import _env as _gtbm_env
from test_gtbm_allocator import _result, run_together

from dymem_tf.memory import allocator
from conftest import proc_result  # the tests folder is on sys.path (pytest's default import mode)

MiB = 1 << 20

# A Keras fit on NumPy arrays of argv[1] rows x 3072 float32 (12 KiB a row) under the budget of the environment.
FIT_SCRIPT = """
import json, sys
import tensorflow as tf
import dymem_tf
import numpy as np, keras
from dymem_tf.memory import allocator
rows = int(sys.argv[1])
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).random((rows, 3072), dtype=np.float32)
y = np.random.default_rng(1).integers(0, 10, rows)
model = keras.Sequential([keras.Input((3072,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
out = {"data_bytes": x.nbytes + y.nbytes, "limit": allocator.get_memory_limit()}
try:
    hist = model.fit(x, y, batch_size=256, epochs=1, steps_per_epoch=3, verbose=0)
    out["trained"] = True
    out["loss"] = hist.history["loss"]
except tf.errors.ResourceExhaustedError as err:
    out["trained"] = False
    out["error"] = type(err).__name__
out["variable_bytes"] = sum(v.numpy().nbytes for v in model.trainable_variables + model.optimizer.variables)
# tf.data's threads may still allocate after a failed fit: read the pool's statistics between two equal reads of
# TF's view of it, so both describe the same moment.
for _ in range(50):
    before = tf.config.experimental.get_memory_info("CPU:0")
    s = allocator.memory_stats()
    after = tf.config.experimental.get_memory_info("CPU:0")
    if before == after:
        break
out.update({k: v for k, v in s.items() if not isinstance(v, dict)})
out["persistent_in_use"] = s["groups"]["persistent"]["in_use"]
out["transient_allocs"] = s["groups"]["transient"]["num_allocs"]
out["info"] = after
print("RESULT" + json.dumps(out), flush=True)
"""

# Where single allocations go: deltas of (device bytes in use, host-inputs bytes in use) around each action.
PLACEMENT_SCRIPT = """
import gc, json, time
import tensorflow as tf
import dymem_tf
import numpy as np, keras
from dymem_tf.memory import allocator
def snap():
    gc.collect()
    s = allocator.memory_stats()
    return {"device": s["bytes_in_use"], "host": s["host_inputs_bytes_in_use"]}
def delta(a, b):
    return {k: b[k] - a[k] for k in a}
out = {"enabled": allocator.host_inputs_enabled()}
# Variables built from NumPy values: TF's AssignVariableOp adopts the converted buffer, which must count.
s0 = snap(); v = tf.Variable(np.ones((1024, 1024), np.float32)); s1 = snap()
out["variable"] = delta(s0, s1)
v.assign(np.full((1024, 1024), 2.0, np.float32)); s2 = snap()
out["assign"] = delta(s1, s2)
kv = keras.Variable(np.ones((512, 1024), np.float32)); s3 = snap()
out["keras_variable"] = delta(s2, s3)
e = tf.matmul(v, v); s4 = snap()
out["eager_op"] = delta(s3, s4)
del v, kv, e
# A dataset built from NumPy values holds them in host memory, and gives them back when it goes. TF shares a
# 64-byte-aligned NumPy buffer instead of copying it (no allocation at all): make sure this one is copied.
buf = np.ones(2048 * 1024 + 16, np.float32)
skip = next(k for k in range(1, 16) if (buf.ctypes.data + 4 * k) % 64)
arr = buf[skip:skip + 2048 * 1024].reshape(2048, 1024)  # 8 MiB
out["copied"] = arr.ctypes.data % 64 != 0
s0 = snap(); ds = tf.data.Dataset.from_tensor_slices(arr); s1 = snap()
out["from_tensor_slices"] = delta(s0, s1)
del ds; s2 = snap()
out["dataset_deleted"] = delta(s1, s2)
# tf.data's threads: a parallel map making 4 MiB elements, prefetched.
ds = tf.data.Dataset.range(6).map(lambda i: tf.fill((1024, 1024), tf.cast(i, tf.float32)), num_parallel_calls=2)
ds = ds.prefetch(3)
s0 = snap(); it = iter(ds); first = next(it); time.sleep(0.5); s1 = snap()
out["map_prefetch"] = delta(s0, s1)
del it, first, ds
# The run-time switch (as DYMEM_HOST_INPUTS=0) and the explicit scope.
allocator.set_host_inputs(False)
out["enabled_after_off"] = allocator.host_inputs_enabled()
s0 = snap(); ds = tf.data.Dataset.from_tensors(arr); s1 = snap()
out["switched_off"] = delta(s0, s1)
del ds
allocator.set_host_inputs(True)
s0 = snap()
with allocator.host_memory():
    t = tf.constant(arr)
s1 = snap()
out["host_memory_scope"] = delta(s0, s1)
del t
out["stats"] = {k: v for k, v in allocator.memory_stats().items() if k.startswith("host_inputs_")}
allocator.reset_peak_stats()
s = allocator.memory_stats()
out["peak_after_reset"] = [s["host_inputs_peak_bytes_in_use"], s["host_inputs_bytes_in_use"]]
print("RESULT" + json.dumps(out), flush=True)
"""


def _env(**extra):
    return _gtbm_env(TF_ENABLE_ONEDNN_OPTS="0", **extra)


SPECS = {
    # 96 MiB of arrays under a 64 MiB device
    "larger_than_budget": (FIT_SCRIPT, ["8192"], _env(DYMEM_DEVICE_MEMORY_LIMIT="64MiB")),
    # 48 MiB of arrays: fits on its own, but not together with the step -- unless the arrays are host memory
    "host": (FIT_SCRIPT, ["4096"], _env(DYMEM_DEVICE_MEMORY_LIMIT="64MiB")),
    "counted": (FIT_SCRIPT, ["4096"], _env(DYMEM_DEVICE_MEMORY_LIMIT="64MiB", DYMEM_HOST_INPUTS="0")),
    "placement": (PLACEMENT_SCRIPT, [], _env(DYMEM_DEVICE_MEMORY_LIMIT="256MiB")),
}


@pytest.fixture(scope="module")
def procs():
    return run_together(SPECS)


def test_fit_on_numpy_arrays_larger_than_the_budget_trains(procs):
    out = _result(procs, "larger_than_budget")
    assert out["data_bytes"] > out["limit"] == 64 * MiB
    assert out["trained"] is True and len(out["loss"]) == 1
    assert out["host_inputs_enabled"] == 1
    # the arrays (and the batches cut from them) were host memory ...
    assert out["host_inputs_peak_bytes_in_use"] >= out["data_bytes"]
    # ... while the device held the weights, the optimizer slots and the step, and nothing of the data set
    assert out["variable_bytes"] <= out["peak_bytes_in_use"] < out["variable_bytes"] + 16 * MiB
    assert out["peak_bytes_in_use"] <= out["limit"]


def test_counting_the_inputs_again_runs_out_of_memory(procs):
    """The same fit: trains with the arrays in host memory, runs out of memory with DYMEM_HOST_INPUTS=0."""
    host, counted = _result(procs, "host"), _result(procs, "counted")
    assert host["trained"] is True and host["host_inputs_enabled"] == 1
    assert host["peak_bytes_in_use"] < host["variable_bytes"] + 16 * MiB
    assert counted["host_inputs_enabled"] == 0 and counted["host_inputs_peak_bytes_in_use"] == 0
    assert counted["trained"] is False and counted["error"] == "ResourceExhaustedError"
    # the arrays were on the device when it ran out
    assert counted["persistent_in_use"] >= counted["data_bytes"]


@pytest.mark.parametrize("name", ["larger_than_budget", "host", "counted"])
def test_device_statistics_keep_describing_the_device(procs, name):
    out = _result(procs, name)
    # tf.config.experimental.get_memory_info('CPU:0') reports the device pool only
    assert out["info"]["current"] == out["bytes_in_use"] and out["info"]["peak"] == out["peak_bytes_in_use"]
    # the step's kernels still allocate on the device, the variables still count (in either group: a variable
    # adopts the buffer of a value the step computed)
    assert out["transient_allocs"] > 0
    assert out["bytes_in_use"] >= out["variable_bytes"]
    if out["host_inputs_enabled"]:
        assert out["host_inputs_bytes_in_use"] == 0  # the data set went with the fit
        assert out["host_inputs_num_allocs"] > 0 and out["host_inputs_capacity"] >= 1 << 30


def _about(delta: dict, device: int, host: int) -> bool:
    """Deltas within 64 KiB of the expected bytes (the runtime makes small allocations of its own)."""
    return abs(delta["device"] - device) < 64 << 10 and abs(delta["host"] - host) < 64 << 10


def test_placement_of_single_allocations(procs):
    out = _result(procs, "placement")
    assert out["enabled"] is True and out["copied"] is True
    four = 4 * MiB
    # variables (even those adopting a buffer converted from NumPy) and eager ops: device
    assert _about(out["variable"], four, 0), out["variable"]
    # in place, a new device buffer, or (a 64-byte-aligned NumPy array) TF adopting the array's own memory without a
    # copy, which frees the old buffer: never the host arena
    assert any(_about(out["assign"], d, 0) for d in (0, four, -four)), out["assign"]
    assert _about(out["keras_variable"], 2 * MiB, 0), out["keras_variable"]
    assert _about(out["eager_op"], four, 0), out["eager_op"]
    # tf.data: the NumPy array, and everything its threads make
    # (TF may share the array's memory instead of copying it: then nothing is allocated, but never on the device)
    assert _about(out["from_tensor_slices"], 0, 2 * four) or _about(out["from_tensor_slices"], 0, 0), \
        out["from_tensor_slices"]
    assert _about(out["dataset_deleted"], 0, -out["from_tensor_slices"]["host"]), out["dataset_deleted"]
    assert out["map_prefetch"]["host"] >= four and abs(out["map_prefetch"]["device"]) < MiB, out["map_prefetch"]
    # switched off: counted on the device; the explicit scope: host
    assert out["enabled_after_off"] is False
    # (TF converts the array again, or reuses the buffer it made from it before: never host memory when off)
    assert _about(out["switched_off"], 2 * four, 0) or _about(out["switched_off"], 0, 0), out["switched_off"]
    assert _about(out["host_memory_scope"], 0, 2 * four) or _about(out["host_memory_scope"], 0, 0), \
        out["host_memory_scope"]  # (or shared without a copy, as above: never on the device)
    stats = out["stats"]
    assert stats["host_inputs_enabled"] == 1 and stats["host_inputs_num_allocs"] >= 3
    assert stats["host_inputs_peak_bytes_in_use"] >= 2 * four
    assert stats["host_inputs_bytes_reserved"] % (2 * MiB) == 0
    peak, in_use = out["peak_after_reset"]
    assert peak == in_use


# --------------------------------------------------------------------------------------------------------------
# In-process (conftest.py imports dymem_tf first).

@pytest.mark.parametrize("value, ok", [("0", True), ("1", True), ("off", True), ("YES", True), ("", True),
                                       ("maybe", False), ("2", False)])
def test_validate_host_inputs_env(monkeypatch, value, ok):
    for name in ("DYMEM_DEVICE_MEMORY_LIMIT", "DYMEM_GTBM_BLOCK_SIZE", "DYMEM_GTBM_RELEASE_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DYMEM_HOST_INPUTS", value)
    if ok:
        assert allocator.validate_memory_limit_env() is None
    else:
        with pytest.raises(ValueError, match="DYMEM_HOST_INPUTS"):
            allocator.validate_memory_limit_env()


@pytest.mark.skipif(not allocator.is_active(), reason="GTBM is not active in this test session")
def test_input_pipeline_hook_is_installed_once():
    from tensorflow.python.data.util import structure

    hooked = structure.normalize_element
    assert getattr(hooked, "_dymem_host_inputs", False)
    assert allocator.install_input_pipeline_hook() is True
    assert structure.normalize_element is hooked  # not wrapped twice
    assert hooked.__wrapped__.__module__ == structure.__name__


PYTHON_VALUE_SCRIPT = """
import json
import numpy as np
import tensorflow as tf
import dymem_tf
from dymem_tf.memory import allocator
values = [float(i % 97) for i in range(4 << 20)]  # 16 MiB of float32 from a Python list, over the 8 MiB budget
t = tf.constant(values, dtype=tf.float32)
print("RESULT" + json.dumps({"same": bool(np.array_equal(t.numpy(), np.array(values, np.float32))),
                             "host": allocator.memory_stats()["host_inputs_bytes_in_use"],
                             "overflow": allocator.memory_stats()["overflow_to_host_bytes"]}), flush=True)
"""


def test_a_tensor_from_a_python_value_beyond_the_budget_is_served_from_host_memory(python_subprocess):
    """TF_NewTensor copies a Python value into its new buffer without checking the allocation: a refusal there would
    crash the process, so GTBM serves such a refused allocation (no op annotation) from its host arena and says so."""
    proc = python_subprocess(PYTHON_VALUE_SCRIPT, env={"DYMEM_DEVICE_MEMORY_LIMIT": "8MiB"})
    out = proc_result(proc)
    assert out["same"] and out["host"] >= 16 * MiB and out["overflow"] >= 16 * MiB, out
    assert "a tensor made from a Python value (TF_NewTensor)" in proc.stderr
