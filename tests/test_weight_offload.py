"""Weights in host memory between their uses (issue #14, item 2): dymem_tf.planning.offload's weights, the planner's
and the simulator's "weight" decisions, the rewrite's vin/vout/vread/clone/reroute records and the kernels behind
them (DymemVariableSwapIn keep_host, DymemVariableSwapOut discard, DymemVariableRead)."""
import numpy as np
import pytest
import tensorflow as tf

from dymem_tf.passes import graph_pass
from dymem_tf.planning import offload, pipeline, planner, simulator
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.plan import Plan
from conftest import proc_result  # the tests folder is on sys.path (pytest's default import mode)

MB = 1 << 20


def _step(read_late_in_forward: bool = False) -> StepGraph:
    """A 2 Mi-float weight ``w`` read once in the forward pass (``rw``, and a ``Reshape`` of it ``rs``), used by two
    forward ops and, through the read and through the reshape, by two backward ops, decayed and written by the
    update. The peaks (a 100 MB forward tensor, a 100 MB gradient) lie between its forward and backward uses."""
    spec = {
        "x": {"bytes": 4 * MB, "type": "IteratorGetNext"},
        "w": {"bytes": 0, "type": "_Arg", "dtype": "resource", "persistent": True},
        "rw": {"inputs": ["w"], "bytes": 8 * MB, "shape": (2 * MB,), "type": "ReadVariableOp", "persistent": True},
        "rs": {"inputs": ["rw"], "bytes": 8 * MB, "shape": (1024, 2048), "type": "Reshape", "persistent": True},
        "f1": {"inputs": ["x", "rw"], "bytes": 40 * MB, "flops": 4e9, "type": "MatMul"},
        "f2": {"inputs": ["f1", "rs"], "bytes": 40 * MB, "flops": 4e9, "type": "MatMul"},
        "f3": {"inputs": ["f2"], "bytes": 100 * MB, "flops": 4e9},
        "loss": {"inputs": ["f3"], "bytes": 4, "flops": 1e6},
        "g3": {"inputs": ["loss"], "bytes": 100 * MB, "backward": True, "flops": 4e9},
        "g2": {"inputs": ["g3"], "bytes": 40 * MB, "backward": True, "flops": 4e9},
        "g1": {"inputs": ["g2", "rs"], "bytes": 40 * MB, "backward": True, "flops": 4e9, "type": "MatMul"},
        "gx": {"inputs": ["g1", "rw"], "bytes": 4 * MB, "backward": True, "flops": 4e9, "type": "MatMul"},
        "dw": {"inputs": ["g1", "x"], "bytes": 8 * MB, "backward": True, "flops": 1e9, "type": "MatMul"},
        "ru": {"inputs": ["w"], "bytes": 8 * MB, "shape": (2 * MB,), "type": "ReadVariableOp", "persistent": True,
               "phase": "update"},
        "wd": {"inputs": ["ru", "dw"], "bytes": 8 * MB, "phase": "update", "flops": 1e6, "type": "Mul"},
        "upd": {"inputs": ["w", "wd"], "bytes": [], "type": "AssignSubVariableOp", "phase": "update"},
    }
    if read_late_in_forward:  # a forward user right before the backward users: no layer between the two stays
        spec["loss"]["inputs"] = ["f3", "rw"]
        spec["g3"]["inputs"] = ["loss", "rw"]
    return StepGraph.from_spec(spec)


def test_a_weight_read_in_both_passes_is_offloadable_with_its_route():
    (w,) = offload.find_offloadable_weights(_step())
    assert (w.tensor, w.bytes, w.shape) == ("w:0", 8 * MB, (2 * MB,))
    assert w.forward_users == ("f1", "f2") and w.backward_users == ("g1", "gx") and w.update_users == ("ru", "upd")
    route = w.route
    assert route.reads == ["rw"] and route.writes == ["upd"]
    assert route.clones == [["rs", "rw"]]  # the backward pass reads the weight through the reshape too
    assert sorted(map(tuple, route.reroutes)) == [("g1", "rs"), ("gx", "rw")]
    assert offload.early_reads(_step(), [], [w]) == {"ru"}  # the decay's read waits for the gradient
    assert offload.find_offloadable(_step()) == []  # not optimizer state: read in the forward pass


def test_weights_that_cannot_be_rerouted_are_not_offloadable():
    sg = _step()
    sg.ops["rs"].type = "Transpose"  # an alias op the rewrite does not copy
    assert offload.find_offloadable_weights(sg) == []
    sg = _step()
    sg.ops["upd"].phase = "backward"  # written before the update
    assert offload.find_offloadable_weights(sg) == []
    assert offload.find_offloadable_weights(_step(), min_bytes=16 * MB) == []


def _least_memory(sg: StepGraph, **kw):
    return pipeline.plan_step(sg, pipeline.PlanSettings(offload_weights=True, least_memory=True,
                                                        persistent_bytes=8 * MB, **kw))


def test_the_least_memory_plan_keeps_the_weight_off_the_device_at_the_peaks():
    kept = pipeline.plan_step(_step(), pipeline.PlanSettings(least_memory=True, persistent_bytes=8 * MB))
    planned = _least_memory(_step())
    (decision,) = planned.plan.offloaded_weights
    assert decision.kind == "weight" and len(decision.swap_ins) == 2
    first, second = decision.swap_ins
    assert first.consumers == ["f1", "f2"] and sorted(second.consumers) == ["g1", "gx", "ru", "upd"]
    assert planner.validate_plan(planned.step_graph, planned.plan) == []
    before = simulator.simulate(kept.step_graph, kept.plan, "cpu")
    after = simulator.simulate(planned.step_graph, planned.plan, "cpu")
    assert before.peak_bytes - after.peak_bytes == 8 * MB, (before.peak_bytes, after.peak_bytes)
    assert planned.plan.persistent_bytes == 0  # the weight left the persistent bytes
    # three copies: in for the forward users, in for the backward users, back after the update
    assert after.step_time_s > before.step_time_s
    assert any("weights" in n and "1 are" in n for n in planned.plan.notes), planned.plan.notes
    assert "offloaded weights: 1 weights" in planned.plan.summary()
    again = Plan.from_json(planned.plan.to_json())
    assert again.offloaded_weights[0].route == decision.route and again.diff(planned.plan) == []


def test_a_weight_without_room_between_its_stays_is_not_a_candidate():
    planned = _least_memory(_step(read_late_in_forward=True))
    assert planned.plan.offloaded_weights == []


def test_a_budget_offloads_the_weight_only_when_it_needs_it():
    sg = _step()
    no_swap = simulator.simulate(sg, [], "cpu", persistent_bytes=8 * MB).peak_bytes

    def plan(budget):
        return pipeline.plan_step(_step(), pipeline.PlanSettings(offload_weights=True, budget_bytes=budget,
                                                                 headroom=0.0, persistent_bytes=8 * MB,
                                                                 min_swap_bytes=1)).plan

    assert plan(no_swap).swaps == []
    assert plan(no_swap - 2 * MB).offloaded_weights == []  # swapping the 4 MB input is enough
    assert len(plan(no_swap - 6 * MB).offloaded_weights) == 1  # only the 8 MB weight makes that room


def test_the_simulator_rejects_a_weight_decision_without_two_stays():
    planned = _least_memory(_step())
    decision = planned.plan.offloaded_weights[0]
    decision.swap_ins = decision.swap_ins[:1]
    with pytest.raises(ValueError, match="two swap-ins"):
        simulator.simulate(planned.step_graph, planned.plan, "cpu")


def test_encode_plan_writes_the_weight_records():
    planned = _least_memory(_step())
    decision = planned.plan.offloaded_weights[0]
    lines = graph_pass.encode_plan([decision]).splitlines()[1:]  # after the version line
    names = graph_pass.weight_op_names("w:0")
    assert lines[:6] == [f"vout\tw\t0\t{names['evict']}\t0", f"vin\tw\t0\t{names['in_fwd']}\t1",
                         f"vout\tw\t0\t{names['out_fwd']}\t1", f"vin\tw\t0\t{names['in_bwd']}\t0",
                         f"vread\tw\t0\t{names['read_bwd']}\trw",
                         "clone\trs\trs/dymem_weight_copy\t0:" + names["read_bwd"]]
    assert f"reroute\tg1\trs\t0\trs/dymem_weight_copy" in lines and f"reroute\tgx\trw\t0\t{names['read_bwd']}" in lines
    edges = {tuple(line.split("\t")[1:]) for line in lines if line.startswith("ctrl")}
    assert {(names["in_fwd"], "rw"), ("f2", names["out_fwd"]), (names["out_fwd"], names["in_bwd"]),
            (names["in_bwd"], "upd"), ("upd", names["out_bwd"]), ("g1", "upd"), ("gx", "upd")} <= edges
    assert (first := decision.swap_ins[0].trigger_op) and (first, names["in_fwd"]) in edges


# ------------------------------------------------------------------------------------------------------ kernels
def _ops():
    from dymem_tf.memory.native import load_ops_library

    return load_ops_library()


def test_a_clean_swap_in_is_discarded_without_a_copy_and_read_again():
    from dymem_tf.memory import host_pool
    from dymem_tf.ops import swap_ops

    value = np.arange(4096, dtype=np.float32).reshape(64, 64)
    v = tf.Variable(value)
    swap_ops.offload_variable(v)
    ops = _ops()
    ops.dymem_variable_swap_in(v.handle, keep_host=True)
    assert not swap_ops.variable_is_offloaded(v)
    np.testing.assert_array_equal(ops.dymem_variable_read(v.handle, dtype=tf.float32).numpy(), value)
    outs = host_pool.host_pool_stats()["num_swap_outs"]
    ops.dymem_variable_swap_out(v.handle, discard=True)  # nothing wrote it: the host copy is put back
    assert swap_ops.variable_is_offloaded(v) and host_pool.host_pool_stats()["num_swap_outs"] == outs
    np.testing.assert_array_equal(v.numpy(), value)
    # written in between: the discarding swap-out must copy the new value
    ops.dymem_variable_swap_in(v.handle, keep_host=True)
    v.assign(value + 1)
    ops.dymem_variable_swap_out(v.handle, discard=True)
    assert swap_ops.variable_is_offloaded(v)
    np.testing.assert_array_equal(v.numpy(), value + 1)
    swap_ops.bring_back_variable(v)
    np.testing.assert_array_equal(v.numpy(), value + 1)


def test_a_discarding_swap_out_without_a_clean_copy_copies():
    from dymem_tf.ops import swap_ops

    value = np.linspace(0, 1, 1000, dtype=np.float32)
    v = tf.Variable(value)
    _ops().dymem_variable_swap_out(v.handle, discard=True)  # never swapped in: an ordinary swap-out
    assert swap_ops.variable_is_offloaded(v)
    np.testing.assert_array_equal(v.numpy(), value)
    swap_ops.bring_back_variable(v)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        _ops().dymem_variable_read(v.handle, dtype=tf.int32)


# ------------------------------------------------------------------------------------------- training, subprocess
WEIGHTS_SCRIPT = r"""
import gc, json, sys
import numpy as np, keras, tensorflow as tf
import dymem_tf
from dymem_tf.ops import swap_ops

tf.config.experimental.enable_op_determinism()
kind = sys.argv[1]

def build():
    keras.utils.set_random_seed(1)
    if kind == "mlp":
        inp = keras.Input((512,))
        h = inp
        for _ in range(4):
            h = keras.layers.Dense(512, activation="relu")(h)
        model = keras.Model(inp, keras.layers.Dense(10)(h))
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((64, 512)).astype("float32"), rng.integers(0, 10, 64)
        opt = keras.optimizers.SGD(1e-2, momentum=0.9)
    else:  # attention and layer norm: weights read through reshapes in both passes
        inp = keras.Input((16,), dtype="int32")
        h = keras.layers.Embedding(300, 128)(inp)
        for _ in range(2):
            n = keras.layers.LayerNormalization()(h)
            h = h + keras.layers.MultiHeadAttention(4, 32)(n, n, use_causal_mask=True)
            n = keras.layers.LayerNormalization()(h)
            h = h + keras.layers.Dense(128)(keras.layers.Dense(512, activation="gelu")(n))
        model = keras.Model(inp, keras.layers.Dense(300)(h))
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 300, size=(64, 17)).astype("int32")
        x, y = tokens[:, :-1], tokens[:, 1:]
        opt = keras.optimizers.AdamW(1e-3)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y

offloaded = []

class Offloaded(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        offloaded.append(sum(swap_ops.variable_is_offloaded(v) for v in self.model.variables))

def run(callbacks):
    model, x, y = build()
    losses = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=callbacks).history["loss"]
    state = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    resident = not any(swap_ops.variable_is_offloaded(v) for v in model.variables)
    return losses, state, resident

plain_losses, plain_state, _ = run([])
gc.collect()
cb = dymem_tf.DymemCallback(memory_budget=sys.argv[2], verbose=0)
losses, state, resident = run([cb, Offloaded()])
records = [r for r in cb.records]
print("RESULT" + json.dumps({
    "same_losses": losses == plain_losses,
    "same_state": len(state) == len(plain_state) and all(np.array_equal(a, b) for a, b in zip(state, plain_state)),
    "resident_after_fit": resident, "offloaded_between_steps": offloaded,
    "weights": [len(r.plan.offloaded_weights) for r in records],
    "reroutes": [sum(len(s.route.reroutes) for s in r.plan.offloaded_weights) for r in records],
    "clones": [sum(len(s.route.clones) for s in r.plan.offloaded_weights) for r in records],
    "stages": [r.plan.params.stage for r in records], "skipped": [s.reason for s in cb.skipped]}), flush=True)
"""


@pytest.mark.parametrize("kind,budget", [("mlp", "48MiB"), ("attention", "64MiB")])
def test_weights_offloaded_under_a_budget_train_bit_identically(python_subprocess, kind, budget):
    script = f"import sys; sys.argv[1:] = [{kind!r}, {budget!r}]\n" + WEIGHTS_SCRIPT
    proc = python_subprocess(script, env={"DYMEM_DEVICE_MEMORY_LIMIT": "256MiB", "TF_ENABLE_ONEDNN_OPTS": "0"})
    out = proc_result(proc)
    assert out["skipped"] == [], out
    assert out["same_losses"] and out["same_state"], out
    assert out["stages"][0] == "probe" and out["weights"][0] >= 4, out  # the probe keeps every big weight off
    if kind == "attention":
        assert out["clones"][0] > 0 and out["reroutes"][0] > 0, out  # kernels read through reshapes
    assert out["offloaded_between_steps"][0] == out["weights"][0], out
    assert out["resident_after_fit"], out


def test_clean_swap_ins_and_discards_from_many_threads_keep_every_value():
    """Random sequences of keep-host swap-ins, discarding swap-outs, writes and reads, each thread on variables of
    its own (one process-wide offload table for all): every read sees the last value written."""
    import threading

    from dymem_tf.ops import swap_ops

    ops = _ops()
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            values = [rng.standard_normal((int(rng.integers(1, 200)), 17)).astype(np.float32) for _ in range(3)]
            variables = [tf.Variable(v) for v in values]
            for _ in range(60):
                i = int(rng.integers(len(variables)))
                v, action = variables[i], rng.integers(5)
                if action == 0:
                    ops.dymem_variable_swap_in(v.handle, keep_host=True)
                elif action == 1:
                    ops.dymem_variable_swap_out(v.handle, discard=True)
                elif action == 2:
                    values[i] = values[i] + 1.0
                    v.assign(values[i])
                elif action == 3:
                    swap_ops.offload_variable(v)
                np.testing.assert_array_equal(ops.dymem_variable_read(v.handle, dtype=tf.float32).numpy(), values[i])
            for v, value in zip(variables, values):
                swap_ops.bring_back_variable(v)
                np.testing.assert_array_equal(v.numpy(), value)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
