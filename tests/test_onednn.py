"""Bit-identity with oneDNN's CPU kernels on and off (#30). With oneDNN on, its layout pass rewrites the graph after
partitioning; the pass then plans the partition oneDNN left (stage "after_partitioning"), so that no swap op or
ordering edge keeps a pair of ops from fusing as they fuse in the plain step, and the planned order is applied too.
``TF_ENABLE_ONEDNN_OPTS`` is read once per process: each setting other than this process's runs in a subprocess."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, proc_result, run_python
from dymem_tf import compat

# A convolution behind a ZeroPadding2D (oneDNN merges Pad + Conv2D "VALID" only when the Pad feeds nothing else),
# Conv2D + BiasAdd + ReLU, batch norm and max pooling: the patterns oneDNN's layout pass rewrites.
IDENTITY_SCRIPT = r"""
import json
import numpy as np, tensorflow as tf, keras
import dymem_tf
from dymem_tf import compat
tf.config.experimental.enable_op_determinism()

def run(callbacks):
    keras.backend.clear_session()
    keras.utils.set_random_seed(2)
    inp = keras.Input((24, 24, 3))
    h = keras.layers.Conv2D(8, 3, padding="valid", activation="relu")(keras.layers.ZeroPadding2D(1)(inp))
    h = keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, padding="same")(h))
    h = keras.layers.MaxPooling2D()(keras.layers.Activation("relu")(h))
    h = keras.layers.Conv2D(16, 3, padding="valid")(keras.layers.ZeroPadding2D(1)(h))
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 24, 24, 3), dtype=np.float32), rng.integers(0, 10, 32)
    loss = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks).history["loss"]
    return loss, [w.numpy() for w in model.weights]

base_loss, base_w = run([])
cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
loss, w = run([cb])
record = cb.records[-1]
print("RESULT" + json.dumps({
    "onednn": compat.onednn_enabled(),
    "identical": loss == base_loss and all(np.array_equal(a, b) for a, b in zip(w, base_w)),
    "swapped": record.report.swapped_tensors,
    "chained": any("chained in the planned order" in n for n in cb.plan.notes),
    "onednn_ops": sum(op.node_def.op.startswith("_Mkl") for op in record.graph.get_operations()),
}))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    return proc_result(proc)


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_step_onednn_rewrites_is_swapped_chained_and_bit_identical(setting):
    out = _result(run_python(IDENTITY_SCRIPT, env={"TF_ENABLE_ONEDNN_OPTS": setting}))
    assert out["onednn"] is (setting == "1")
    assert out["swapped"] > 3 and out["chained"]
    # with oneDNN on the plan was made on oneDNN's ops (after its rewrite), with it off on TF's own
    assert (out["onednn_ops"] > 0) is (setting == "1")
    assert out["identical"]


@pytest.mark.slow
def test_the_model_tests_hold_with_onednn_switched():
    """tests/test_models.py (bit-identity on Keras models, with and without a budget) under the other setting."""
    flipped = "0" if compat.onednn_enabled() else "1"
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": flipped, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_models.py"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:]
