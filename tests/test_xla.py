"""XLA and the callback (issue #12, item 4): XLA is off for a train step that swaps, and given back when the plan
swaps nothing; auto-clustering (``tf.config.optimizer.set_jit``) is turned off for the rewritten step only.

By default Dymem's pass runs after XLA's clustering passes, which on TF 2.21's CPU auto-jit put the whole step into
clusters (the pass then sees no gradient op; ``test_auto_clustering_is_off_for_the_rewritten_step_only`` shows it).
``DymemCallback(memory_budget=None, xla="auto")`` moves the pass before them:
the step is auto-clustered around its swap ops
(``test_xla_auto_clusters_the_step_around_its_swap_ops``).
"""
from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import dymem_tf
from dymem_tf import compat

from conftest import xla  # the tests folder is on sys.path (pytest's default import mode)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def without_op_determinism():
    """Keras turns XLA off while op determinism is on: these tests need ``jit_compile`` to mean what is set."""
    from tensorflow.python.framework import config as tf_config

    was_on = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    yield
    if was_on:
        tf_config.enable_op_determinism()


def model_and_data(jit_compile=True, n=32):
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss=LOSS, jit_compile=jit_compile)
    rng = np.random.default_rng(1)
    return model, rng.normal(size=(n, 16, 16, 3)).astype("float32"), np.arange(n) % 10


def xla_of(model) -> bool:
    """Whether the model's current train function compiles its step with XLA (``jit_compile``)."""
    (value,) = xla(model.train_function)
    return value


def test_a_plan_that_swaps_nothing_gives_the_step_back_to_xla(capsys):
    model, x, y = model_and_data()
    per_batch = []
    watch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: per_batch.append(xla_of(model)))
    cb = dymem_tf.DymemCallback(memory_budget=None, policy="none", verbose=1)
    hist = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb, watch])
    out = capsys.readouterr().out
    assert cb.plan is not None and not cb.plan.swaps
    assert per_batch == [True, True, True, True]  # the first step's function is replaced once it has run
    assert "XLA (jit_compile=True) is off for the train step while Dymem plans it" in out
    assert "the plan swaps nothing, so the train step runs with XLA (jit_compile=True) as you set it" in out
    assert model.jit_compile is True and not getattr(model.train_function, "_dymem_wrapped", False)
    # the same training as without the callback, to float rounding (the first step ran without XLA)
    plain, x, y = model_and_data()
    base = plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(hist.history["loss"], base.history["loss"], rtol=1e-4)


def test_a_plan_that_swaps_keeps_xla_off():
    model, x, y = model_and_data()
    per_batch = []
    watch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: per_batch.append(xla_of(model)))
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb, watch])
    assert cb.plan.swaps and per_batch == [False] * 4


def test_forced_auto_jit_flag_is_read_from_tf_xla_flags(monkeypatch):
    for flags, expected in (("", None), ("--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", "2"),
                            ("--tf_xla_auto_jit=-1", None), ("--tf_xla_auto_jit=0", None),
                            ("--tf_xla_cpu_global_jit", None), ("--tf_xla_auto_jit=single-gpu(1)", "single-gpu(1)")):
        monkeypatch.setenv("TF_XLA_FLAGS", flags)
        assert compat.forced_auto_jit_flag() == expected, flags


AUTO_CLUSTERING = r"""
import contextlib, json, keras, numpy as np, tensorflow as tf
import dymem_tf
from dymem_tf import compat
from dymem_tf.memory import allocator
from dymem_tf.passes import graph_pass, graph_def_view
tf.config.optimizer.set_jit("autoclustering")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

def run(callbacks=(), capture=None, clustering=True):
    keras.backend.clear_session()
    keras.utils.set_random_seed(1)
    inp = keras.Input((16, 16, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    b = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(a)
    c = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(keras.layers.Add()([a, b]))
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(c)))
    model.compile(optimizer="sgd", loss=LOSS, jit_compile=False)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(24, 16, 16, 3)).astype("float32"), np.arange(24) % 10
    allocator.reset_peak_stats()
    if capture is not None:
        off = contextlib.nullcontext() if clustering else compat.autoclustering_off()
        with graph_pass.armed(capture), off:
            hist = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=list(callbacks))
    else:
        hist = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=list(callbacks))
    return hist.history["loss"], allocator.memory_stats()["peak_bytes_in_use"]

seen = {"on": [], "off": []}
def capture_in(key):
    def capture(call):  # the pass is offered only graphs with gradient ops outside XLA clusters
        ops = call.graph().get_operations()
        seen[key].append(sorted({op.type for op in ops if op.type.startswith("_Xla") or op.type.endswith("Grad")}))
    return capture

run(capture=capture_in("off"), clustering=False)
clustered_loss, clustered_peak = run(capture=capture_in("on"))
cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
swap_loss, swap_peak = run([cb])
none = dymem_tf.DymemCallback(memory_budget=None, policy="none", verbose=1)
none_loss, _ = run([none])
print("RESULT " + json.dumps({"seen": seen, "clustered": [clustered_loss, clustered_peak],
                              "swapped": [swap_loss, swap_peak, len(cb.plan.swaps)],
                              "none": [none_loss, len(none.plan.swaps)]}))
"""


def test_auto_clustering_is_off_for_the_rewritten_step_only(python_subprocess):
    """TF 2.21 clusters on the CPU with ``set_jit`` and ``--tf_xla_cpu_global_jit``: the plain step is compiled
    into XLA clusters before Dymem's pass (which is then not even offered the graph: no gradient op is left outside
    the clusters, while the same step with clustering off reaches it with its gradient ops); under the callback the
    step is planned and swaps, with losses close to the clustered run and a lower peak; a plan that swaps nothing
    gives the step back to auto-clustering."""
    proc = python_subprocess(AUTO_CLUSTERING, env={"TF_XLA_FLAGS": "--tf_xla_cpu_global_jit"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["seen"]["on"] == [], result["seen"]
    assert result["seen"]["off"] and all(any(t.endswith("Grad") for t in types) and "_XlaRun" not in types
                                         for types in result["seen"]["off"]), result["seen"]
    clustered_loss, clustered_peak = result["clustered"]
    swap_loss, swap_peak, swaps = result["swapped"]
    assert swaps > 0
    np.testing.assert_allclose(swap_loss, clustered_loss, rtol=1e-4)
    from dymem_tf import compat

    if compat.onednn_enabled():
        # with Eigen's kernels (oneDNN off: TF's default on CPUs without its AVX-512 features) the unclustered
        # step's convolution gradients take im2col workspaces of ~27 MiB that XLA's code does without, so the
        # swapped step peaks above the clustered one whatever it swaps
        assert swap_peak < clustered_peak
    none_loss, none_swaps = result["none"]
    assert none_swaps == 0
    assert "auto-clustering (tf.config.optimizer.set_jit)" in proc.stdout
    assert "the plan swaps nothing, so the train step runs with XLA" in proc.stdout
    np.testing.assert_allclose(none_loss, clustered_loss, rtol=1e-4)


XLA_AUTO = r"""
import json, keras, numpy as np, tensorflow as tf
import dymem_tf
from dymem_tf.memory import allocator, host_pool
keras.utils.set_random_seed(1)
inp = keras.Input((32, 32, 3))
h = inp
for filters in (16, 32):
    h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=MODE_JIT)
rng = np.random.default_rng(0)
x, y = rng.uniform(size=(48, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 48)
callbacks = []
if MODE == "auto":
    callbacks = [dymem_tf.DymemCallback(memory_budget=None, xla="auto", min_swap_bytes=0, verbose=1)]
else:
    tf.config.optimizer.set_jit("autoclustering")
allocator.reset_peak_stats()
hist = model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=callbacks)
print("RESULT " + json.dumps({"loss": hist.history["loss"], "peak": allocator.memory_stats()["peak_bytes_in_use"],
                              "swaps": len(callbacks[0].plan.swaps) if callbacks else 0,
                              "host_peak": host_pool.host_pool_stats()["peak_bytes_in_use"]}))
"""


def _xla_auto_run(python_subprocess, mode: str, jit_compile: bool = False) -> tuple[dict, str]:
    code = XLA_AUTO.replace("MODE_JIT", str(jit_compile)).replace("MODE", repr(mode))
    proc = python_subprocess(code, env={"TF_XLA_FLAGS": "--tf_xla_cpu_global_jit", "TF_CPP_MIN_LOG_LEVEL": "0",
                                        "TF_ENABLE_ONEDNN_OPTS": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1]), proc.stdout + proc.stderr


def test_xla_auto_clusters_the_step_around_its_swap_ops(python_subprocess):
    """``xla="auto"`` (CPU auto-jit): the pass plans and inserts the swaps before XLA's clustering passes, XLA compiles
    clusters of the step (the only function run with clustering on), the swap ops run (the host pool holds the
    swapped tensors), the loss matches the plainly auto-clustered run's and the measured peak is lower than it;
    ``jit_compile=True`` is replaced by auto-clustering, with a message."""
    auto, auto_log = _xla_auto_run(python_subprocess, "auto", jit_compile=True)
    clustered, clustered_log = _xla_auto_run(python_subprocess, "clustered")
    assert "Compiled cluster using XLA" in clustered_log
    assert "Compiled cluster using XLA" in auto_log, auto_log[-3000:]
    assert "auto-clustered around them instead" in auto_log
    assert auto["swaps"] > 0 and auto["host_peak"] > 0
    np.testing.assert_allclose(auto["loss"], clustered["loss"], rtol=1e-5)
    assert auto["peak"] < clustered["peak"], (auto, clustered)


def test_xla_auto_warns_on_the_cpu_without_cpu_auto_jit(monkeypatch):
    from dymem_tf.keras import callback

    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    from dymem_tf import compat
    from dymem_tf.keras import xla

    assert dymem_tf.DymemCallback(memory_budget=None, xla="auto", verbose=0).xla == "auto"
    with pytest.warns(RuntimeWarning, match="--tf_xla_cpu_global_jit"):
        xla.say_auto_clustering([], print, compat.warn_user)
    assert callback.XLA_MODES == (None, "auto")
    with pytest.raises(ValueError, match="unknown xla 'on'"):
        dymem_tf.DymemCallback(memory_budget=None, xla="on")
