"""DymemCallback under tf.distribute: MirroredStrategy on two logical CPU devices, MultiWorkerMirroredStrategy with two
worker processes on 127.0.0.1. Every set-up needs a fresh interpreter (logical devices and the cluster must be
configured before TensorFlow starts its runtime); the three processes start together at the first test.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import script_result  # the tests folder is on sys.path (pytest's default import mode)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240

COMMON = r"""
import json, os, sys
import tensorflow as tf
import dymem_tf                       # right after TensorFlow: the GTBM allocator
import numpy as np, keras
tf.config.experimental.enable_op_determinism()

def net():
    inp = keras.Input((16, 16, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    b = keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3, padding="same")(a))
    c = keras.layers.Activation("relu")(keras.layers.Add()([a, b]))
    d = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(c)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(keras.layers.Concatenate()([c, d])))
    return keras.Model(inp, out)

def data(n=32):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 16, 16, 3)).astype("float32"), rng.integers(0, 10, size=(n,))

def describe(cb):
    records = []
    for r in cb.records:
        g = r.graph
        swapped = [g.get_tensor_by_name(s.tensor) for s in r.plan.swaps]
        ops = [g.get_operation_by_name(n) for n in r.report.swap_out_ops + r.report.swap_in_ops]
        records.append({"replica": r.replica, "batch": r.batch_size, "swaps": len(r.plan.swaps),
                        "names": [t.name for t in swapped], "tensor_devices": sorted({t.device for t in swapped}),
                        "swap_op_devices": sorted({op.device for op in ops}), "n_swap_ops": len(ops),
                        "model_scope": r.step_graph.meta.get("model_scope"), "graph": id(g)})
    return records
"""

MIRRORED_SCRIPT = COMMON.replace("import dymem_tf                       # right after TensorFlow: the GTBM allocator", """import dymem_tf                       # right after TensorFlow: the GTBM allocator
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)""") + r"""
def run(callbacks, **fit_kwargs):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = net()
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    hist = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks, **fit_kwargs)
    return hist.history["loss"], [w.numpy() for w in model.weights]

out = {"devices": [d.name for d in tf.config.list_logical_devices("CPU")]}
base, base_w = run([])
from dymem_tf.memory import allocator
cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
sizes = []  # the GTBM mobility map while the step trains
watch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: sizes.append(allocator.mobility_map_size()))
loss, weights = run([cb, watch])
out.update(base=base, dymem=loss, same_weights=all(np.array_equal(a, b) for a, b in zip(base_w, weights)),
           records=describe(cb), skipped=[s.reason for s in cb.skipped])
# the GTBM mobility map serves both replicas: the union of their plans' entries, while the fit runs
out["map_size"], out["map_after_fit"] = min(sizes), allocator.mobility_map_size()
out["plan_map_sizes"] = [len(r.plan.mobility) for r in cb.records]
out["union_size"] = len({k for r in cb.records for k in r.plan.mobility})
# a budget per replica: every replica plans its own ops against it
cb2 = dymem_tf.DymemCallback(memory_budget="64MiB", verbose=0)
loss2, _ = run([cb2])
out.update(budget_loss=loss2, budget_records=describe(cb2))
print("RESULT" + json.dumps(out), flush=True)
"""

MWMS_SCRIPT = COMMON + r"""
strategy = tf.distribute.MultiWorkerMirroredStrategy()
# Two Keras 3.15 defects break MultiWorkerMirroredStrategy in fit() with or without Dymem (keras-team/keras#20585,
# tensorflow/tensorflow#72388); both runs below get the same two work-arounds:
# 1. fit's symbolic build reduces a PerReplica batch eagerly and fails: build model and optimizer up front, skip it;
# 2. the per-step metrics are reduced with strategy.reduce("MEAN", v, axis=0), which fails on scalars: use axis=None.
from keras.src.backend.tensorflow import trainer as _trainer
_reduce_per_replica = _trainer.reduce_per_replica
def reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and _trainer._collective_all_reduce_multi_worker(strategy):
        return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
    return _reduce_per_replica(values, strategy, reduction)
_trainer.reduce_per_replica = reduce_per_replica

def run(callbacks):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = net()
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    model._maybe_symbolic_build = lambda *a, **k: None
    x, y = data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True).with_options(options)
    hist = model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
    run.trainable_sum = float(sum(np.sum(w.numpy(), dtype=np.float64) for w in model.trainable_weights))
    return hist.history["loss"], [w.numpy() for w in model.weights]

base, base_w = run([])
cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
loss, weights = run([cb])
out = {"task": json.loads(os.environ["TF_CONFIG"])["task"]["index"], "replicas": strategy.num_replicas_in_sync,
       "base": base, "dymem": loss, "same_weights": all(np.array_equal(a, b) for a, b in zip(base_w, weights)),
       "trainable_sum": run.trainable_sum,
       "records": describe(cb), "skipped": [s.reason for s in cb.skipped]}
print("RESULT" + json.dumps(out), flush=True)
"""


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DYMEM_DEVICE_MEMORY_LIMIT", "DYMEM_GTBM", "TF_CPU_ALLOCATOR_USE_BFC", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def _start(code, env):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def procs():
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
    started = {"mirrored": _start(MIRRORED_SCRIPT, _env())}
    for i in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        started[f"worker{i}"] = _start(MWMS_SCRIPT, _env(TF_CONFIG=tf_config))
    done = {}

    def result(name):
        if name not in done:
            proc = started[name]
            try:
                stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in started.values():  # a worker waiting for a dead peer would wait forever
                    if p.poll() is None:
                        p.kill()
                stdout, stderr = proc.communicate()
                pytest.fail(f"{name} did not finish within {TIMEOUT_S} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
            done[name] = script_result(proc.returncode, stdout, stderr, name)
        return done[name]

    yield result
    for p in started.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_mirrored_strategy_plans_each_replica_on_its_own_device(procs):
    out = procs("mirrored")
    assert out["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert out["dymem"] == out["base"] and out["same_weights"]
    assert not out["skipped"]
    records = out["records"]
    # the pass planned each replica's ops (those on its device) in the one instantiated graph
    assert sorted(r["replica"] for r in records) == [0, 1]
    assert len({r["graph"] for r in records}) == 1
    by_replica = {r["replica"]: r for r in records}
    for replica, r in by_replica.items():
        device = f"device:CPU:{replica}"
        assert r["batch"] == 4  # the global batch of 8 split over two replicas
        assert r["swaps"] > 0 and r["n_swap_ops"] > r["swaps"]
        # its tensors only, and its swap ops on its device
        assert len(r["tensor_devices"]) == 1 and r["tensor_devices"][0].endswith(device), r["tensor_devices"]
        assert len(r["swap_op_devices"]) == 1 and r["swap_op_devices"][0].endswith(device), r["swap_op_devices"]
        ops = [name for name in r["names"] if not name.startswith("IteratorGetNext")]  # each replica's input
        in_replica_scope = [("replica_1/" in name) for name in ops]
        assert all(in_replica_scope) if replica == 1 else not any(in_replica_scope)
    # the replica scope is set aside: both replicas' ops map to the same Keras layers
    assert by_replica[1]["model_scope"] == by_replica[0]["model_scope"]
    assert by_replica[0]["swaps"] == by_replica[1]["swaps"]  # the replicas are alike: so are their plans
    assert out["map_size"] == out["union_size"] > max(out["plan_map_sizes"])  # both replicas' mobility installed
    assert out["map_after_fit"] == 0  # and none left when the fit ends
    # with a budget
    assert out["budget_loss"] == out["base"]
    # the probe (least memory) and the calibrated plan, each for both replicas
    assert sorted(r["replica"] for r in out["budget_records"]) == [0, 0, 1, 1]


def test_multi_worker_mirrored_strategy_two_workers_match_training_without_dymem(procs):
    workers = [procs("worker0"), procs("worker1")]
    for i, out in enumerate(workers):
        assert out["task"] == i and out["replicas"] == 2
        assert out["dymem"] == out["base"] and out["same_weights"]
        assert not out["skipped"]
        assert len(out["records"]) >= 1
        for r in out["records"]:
            assert r["replica"] is None  # one replica per worker: nothing to separate
            assert r["batch"] == 4 and r["swaps"] > 0
            assert r["swap_op_devices"] == [f"/job:worker/replica:0/task:{i}/device:CPU:0"]
    # the workers trained one model together: same losses, same trainable weights (batch norm's moving statistics
    # are per worker: each sees its own shard)
    assert workers[0]["dymem"] == workers[1]["dymem"]
    assert workers[0]["trainable_sum"] == workers[1]["trainable_sum"]
