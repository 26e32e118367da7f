"""Optimizer state off the device between its uses (dymem_tf.planning.offload, the simulator and planner's variable
decisions, the `var` record of the rewrite and the DymemVariableSwapOut / DymemVariableSwapIn kernels)."""
import threading

import numpy as np
import pytest

from dymem_tf.planning import offload, pipeline, planner, simulator
from dymem_tf.planning.analysis import StepGraph
from conftest import proc_result  # the tests folder is on sys.path (pytest's default import mode)

MB = 1 << 20


def _step(weight_read_in_forward: bool = False) -> StepGraph:
    return StepGraph.from_spec(_spec(weight_read_in_forward))


def _spec(weight_read_in_forward: bool = False) -> dict:
    """A forward pass with two 40 MB activations (not kept for the backward pass: nothing to swap but ``m``), its
    backward pass, and an update that reads and writes an 8 MB optimizer variable ``m`` (and, optionally, ``m`` read
    in the forward pass too, like a weight)."""
    spec = {
        "x": {"bytes": 4 * MB, "type": "IteratorGetNext"},
        "m": {"bytes": 0, "type": "_Arg", "dtype": "resource", "persistent": True, "phase": "update"},
        "f1": {"inputs": ["x"], "bytes": 40 * MB, "flops": 4e9},
        "f2": {"inputs": ["f1"], "bytes": 40 * MB, "flops": 4e9},
        "loss": {"inputs": ["f2"], "bytes": 4, "flops": 1e6},
        "g2": {"inputs": ["loss"], "bytes": 40 * MB, "backward": True, "flops": 4e9},
        "g1": {"inputs": ["g2"], "bytes": 40 * MB, "backward": True, "flops": 4e9},
        "grad": {"inputs": ["g1"], "bytes": 8 * MB, "backward": True, "flops": 1e9},
        "read_m": {"inputs": ["m"], "bytes": 8 * MB, "shape": (2 * MB,), "type": "ReadVariableOp",
                   "persistent": True, "phase": "update"},
        "new_m": {"inputs": ["read_m", "grad"], "bytes": 8 * MB, "phase": "update", "flops": 1e6},
        "assign_m": {"inputs": ["m", "new_m"], "bytes": [], "type": "AssignVariableOp", "phase": "update"},
    }
    if weight_read_in_forward:
        spec["read_m_fwd"] = {"inputs": ["m"], "bytes": 8 * MB, "shape": (2 * MB,), "type": "ReadVariableOp",
                              "persistent": True}
        spec["f1"]["inputs"] = ["x", "read_m_fwd"]
    return spec


def test_only_variables_used_after_the_gradients_are_offloadable():
    found = offload.find_offloadable(_step())
    assert [(v.tensor, v.bytes, v.shape) for v in found] == [("m:0", 8 * MB, (2 * MB,))]
    assert offload.find_offloadable(_step(weight_read_in_forward=True)) == []  # a weight: read in the forward pass
    assert offload.early_reads(_step(), found) == {"read_m"}


def test_an_offloadable_variable_is_resident_all_step_unless_swapped():
    sg = _step()
    offload.mark(sg, offload.find_offloadable(sg))
    assert sg.tensors["m:0"].variable and not sg.tensors["m:0"].persistent
    kept = simulator.simulate(sg, [], "cpu")
    # the forward/backward peak holds the variable when it stays, and not when it is offloaded
    plan = pipeline.plan_step(_step(), pipeline.PlanSettings(offload_variables=True, least_memory=True))
    assert [s.tensor for s in plan.plan.swaps] == ["m:0"] and plan.plan.swaps[0].kind == "variable"
    swapped = simulator.simulate(plan.step_graph, plan.plan, "cpu")
    assert kept.peak_bytes - swapped.peak_bytes == 8 * MB
    decision = plan.plan.swaps[0]
    assert set(decision.backward_consumers) == {"read_m", "assign_m"} and not decision.forward_consumers
    # the early read was deferred behind the gradient, so the swap-in can come after the backward pass started
    assert ("grad", "read_m") in plan.deferrals
    event = swapped.swap_events[0]
    assert event.in_end <= event.consumer_start + 1e-12 and event.out_start >= event.consumer_start
    assert swapped.step_time_s >= event.out_end  # the step ends when the copy back to host memory is done


def test_the_planner_offloads_only_where_the_budget_needs_it():
    settings = dict(offload_variables=True, headroom=0.0, persistent_bytes=8 * MB)  # the callback counts m in it
    sg = _step()
    loose = pipeline.plan_step(sg, pipeline.PlanSettings(budget_bytes=10 * 2**30, **settings))
    assert loose.plan.swaps == []
    base = loose.plan.predicted.no_swap_peak_bytes
    tight = pipeline.plan_step(_step(), pipeline.PlanSettings(budget_bytes=base - 4 * MB, **settings))
    assert [s.kind for s in tight.plan.swaps] == ["variable"]
    assert tight.plan.predicted.peak_bytes <= base - 4 * MB
    assert "1 optimizer variables (8.0 MiB) may be offloaded" in " ".join(tight.plan.notes)
    assert tight.plan.persistent_bytes == 0 and loose.plan.persistent_bytes == 0  # m is modelled, not persistent
    with pytest.raises(planner.BudgetTooSmallError):
        pipeline.plan_step(_step(), pipeline.PlanSettings(budget_bytes=base - 40 * MB, **settings))
    with pytest.raises(planner.BudgetTooSmallError):  # not allowed to offload: nothing else can be swapped
        pipeline.plan_step(_step(), pipeline.PlanSettings(budget_bytes=base - 4 * MB, offload_variables=False,
                                                                  headroom=0.0, persistent_bytes=8 * MB))


def test_a_variable_swap_must_serve_every_use():
    plan = pipeline.plan_step(_step(), pipeline.PlanSettings(offload_variables=True, least_memory=True))
    decision = plan.plan.swaps[0]
    decision.swap_ins[0].consumers = ["assign_m"]
    with pytest.raises(ValueError, match="one swap-in before all of its uses"):
        simulator.simulate(plan.step_graph, plan.plan, "cpu")
    decision.kind = "tensor"
    with pytest.raises(ValueError, match="as a tensor, but it is a variable"):
        simulator.simulate(plan.step_graph, plan.plan, "cpu")


def _update_before_the_peak() -> StepGraph:
    """:func:`_spec` with ``m``'s update early in the backward pass (its read deferred to its gradient, as the
    pass does): the step's peak (``g1`` and ``g0``, 104 MB) comes after, when an offloaded ``m`` is back in host
    memory."""
    spec = _spec()
    spec["read_m"] = {**spec["read_m"], "control": ["grad"]}
    spec["grad"] = {**spec["grad"], "inputs": ["g2"]}
    spec["g1"] = {**spec["g1"], "control": ["assign_m"]}
    spec["g0"] = {"inputs": ["g1"], "bytes": 64 * MB, "backward": True, "flops": 4e9}
    return StepGraph.from_spec(spec)


def test_the_greedy_search_offloads_state_whose_last_use_precedes_the_peak():
    # an offloaded variable is off the device again once its last use is copied back: the greedy search, which adds
    # the candidates absent at the peak, must see it there (it used to count only the time before its swap-in)
    from dymem_tf.planning.cost_model import as_cost_model

    sg = _update_before_the_peak()
    offload.mark(sg, offload.find_offloadable(sg))
    pl = planner._Planner(sg, as_cost_model("cpu"), 1, None, 3)
    m = [c for c in pl.candidates("dymem", relaxed=True) if c.tensor == "m:0"]
    base = pl.run([], 0)
    assert len(m) == 1 and base.peak_op == "g0"
    windows = pl.absent_windows("dymem", "queue", m[0], base)
    assert any(a <= base.peak_time_s < b for a, b in windows)
    chosen, res = pl.fit_budget("dymem", "queue", m, [], base.peak_bytes - 4 * MB, 0)
    assert [c.tensor for c in chosen] == ["m:0"]
    assert res.peak_bytes == base.peak_bytes - 8 * MB


def test_encode_plan_writes_one_var_record():
    from dymem_tf.passes import graph_pass, plan_message

    plan = pipeline.plan_step(_step(), pipeline.PlanSettings(offload_variables=True, least_memory=True))
    (fields,) = plan_message.records_of(graph_pass.encode_plan(plan.plan.swaps))
    assert fields[:6] == ["var", "m", "0", "m/dymem_var_evict_0", "m/dymem_var_swap_in_0", "m/dymem_var_swap_out_0"]
    assert set(fields[7].split(",")) == {"read_m", "assign_m"}


# ---------------------------------------------------------------------------------------------------- kernels
tf = pytest.importorskip("tensorflow")


def test_offload_and_bring_back_keep_the_value_byte_for_byte():
    from dymem_tf.memory import host_pool
    from dymem_tf.ops import swap_ops

    rng = np.random.default_rng(3)
    value = rng.standard_normal((257, 129)).astype(np.float32)
    v = tf.Variable(value)
    before = host_pool.host_pool_stats()
    assert not swap_ops.variable_is_offloaded(v)
    swap_ops.offload_variable(v)
    swap_ops.offload_variable(v)  # already in host memory: nothing happens
    assert swap_ops.variable_is_offloaded(v)
    np.testing.assert_array_equal(v.numpy(), value)  # a read sees the host copy
    after = host_pool.host_pool_stats()
    assert after["num_swap_outs"] - before["num_swap_outs"] == 1
    assert after["bytes_swapped_out"] - before["bytes_swapped_out"] == value.nbytes
    assert swap_ops.bring_back_variable(v) and not swap_ops.variable_is_offloaded(v)
    assert not swap_ops.bring_back_variable(v)
    np.testing.assert_array_equal(v.numpy(), value)


def test_assigning_an_offloaded_variable_brings_it_back_with_the_new_value():
    from dymem_tf.ops import swap_ops

    v = tf.Variable(np.ones((64, 64), np.float32))
    swap_ops.offload_variable(v)
    v.assign_add(tf.ones_like(v))
    assert not swap_ops.variable_is_offloaded(v)
    np.testing.assert_array_equal(v.numpy(), np.full((64, 64), 2, np.float32))
    assert not swap_ops.bring_back_variable(v)


def test_offloading_from_many_threads_keeps_every_value():
    from dymem_tf.ops import swap_ops

    rng = np.random.default_rng(7)
    values = [rng.standard_normal((int(n), 33)).astype(np.float32) for n in rng.integers(1, 300, size=12)]
    variables = [tf.Variable(v) for v in values]
    errors = []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(40):
                i = int(r.integers(len(variables)))
                (swap_ops.offload_variable if r.random() < 0.5 else swap_ops.bring_back_variable)(variables[i])
                np.testing.assert_array_equal(variables[i].numpy(), values[i])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for v, value in zip(variables, values):
        swap_ops.bring_back_variable(v)
        np.testing.assert_array_equal(v.numpy(), value)


OFFLOAD_SCRIPT = r"""
import gc, json
import numpy as np, keras, tensorflow as tf
import dymem_tf
from dymem_tf.ops import swap_ops

tf.config.experimental.enable_op_determinism()
offloaded = []

class Offloaded(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        offloaded.append(sum(swap_ops.variable_is_offloaded(v) for v in self.model.optimizer.variables))

def run(callbacks):
    keras.utils.set_random_seed(1)
    inp = keras.Input((1024,))
    h = inp
    for _ in range(4):
        h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 1024)).astype("float32"), rng.integers(0, 10, 64)
    losses = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=callbacks).history["loss"]
    state = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    resident = not any(swap_ops.variable_is_offloaded(v) for v in model.optimizer.variables)
    return losses, state, resident

plain_losses, plain_state, _ = run([])
gc.collect()
# planned from the model alone (no probe step): the predicted no-swap peak is 72.2 MiB, above the budget less the
# default headroom, and the step's activations are tiny: only offloading optimizer state can make room
cb = dymem_tf.DymemCallback(memory_budget="80MiB", calibrate=False, verbose=0)
losses, state, resident = run([cb, Offloaded()])
# calibrated on a probe that offloads state: the calibration's persistent bytes are the plan's (weights), not the
# weights and state the callback started from, so the calibrated prediction stays a sane number
gc.collect()
cb2 = dymem_tf.DymemCallback(memory_budget="96MiB", verbose=0)
run([cb2])
calibrated = [r.plan for r in cb2.records if r.plan.params.stage == "calibrated"]
probe = cb2.records[0].plan
out_calibration = {"probe_offloads": len(probe.offloaded_variables),
                    "persistent": calibrated[0].predicted.calibration.persistent_bytes if calibrated else None,
                    "probe_persistent": probe.persistent_bytes,
                    "calibrated_prediction": (calibrated[0].measured.calibrated_predicted_peak_bytes
                                              if calibrated else None)}
out = {"calibration": out_calibration, "same_losses": losses == plain_losses,
       "same_state": all(np.array_equal(a, b) for a, b in zip(state, plain_state)) and len(state) == len(plain_state),
       "resident_after_fit": resident, "offloaded": offloaded,
       "planned": [len(r.plan.offloaded_variables) for r in cb.records],
       "stages": [r.plan.params.stage for r in cb.records]}
print("RESULT" + json.dumps(out), flush=True)
"""


def test_adam_state_offloaded_under_a_budget_trains_bit_identically(python_subprocess):
    proc = python_subprocess(OFFLOAD_SCRIPT, env={"DYMEM_DEVICE_MEMORY_LIMIT": "256MiB", "TF_ENABLE_ONEDNN_OPTS": "0"})
    out = proc_result(proc)
    assert out["same_losses"] and out["same_state"], out
    assert len(out["planned"]) == 1 and 1 <= out["planned"][0] <= 8  # of the m and v of the 1024x1024 kernels
    # between steps, exactly the variables the plan offloads live in host memory
    assert out["offloaded"] == out["planned"] * 4
    assert out["resident_after_fit"]
    cal = out["calibration"]
    assert cal["probe_offloads"] == 8 and cal["persistent"] == cal["probe_persistent"], cal
    assert 0 < cal["calibrated_prediction"] < 2 * 96 * 2**20, cal


COMPACT_SCRIPT = r"""
import json
import numpy as np, keras, tensorflow as tf
import dymem_tf
from dymem_tf.keras import variables
from dymem_tf.memory import allocator
from dymem_tf.ops import swap_ops

keras.utils.set_random_seed(1)
inp = keras.Input((400,))
h = inp
for _ in range(12):
    h = keras.layers.Dense(400)(h)
model = keras.Model(inp, h)
model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
model.optimizer.build(model.trainable_variables)  # each kernel's m and v right after it: 625 KiB each, interleaved
# an optimizer a custom train_step keeps as an attribute (a GAN's): its momentum stays on the device, packed too
model.extra_optimizer = keras.optimizers.SGD(momentum=0.9)
model.extra_optimizer.build(model.trainable_variables)
every = list(model.variables) + list(model.optimizer.variables) + list(model.extra_optimizer.variables)
for v in list(model.optimizer.variables) + list(model.extra_optimizer.variables):
    if len(v.shape):
        v.assign(tf.random.normal(v.shape))
# copies: an array from .numpy() may share the variable's buffer and keep it alive
values = [np.array(v.numpy(), copy=True) for v in every]

def persistent():
    return allocator.memory_stats()["groups"]["persistent"]

offloaded = variables.offload_optimizer_state(model, 1 << 16)
before = persistent()
moved = variables.compact_weights(model)
after = persistent()
same = all(np.array_equal(a, v.numpy()) for a, v in zip(values, every))
print("RESULT" + json.dumps({"offloaded": offloaded, "moved": moved, "before": before, "after": after,
                             "same": same, "staying": len(model.variables) + len(model.optimizer.variables)
                             - offloaded + len(model.extra_optimizer.variables),
                             "still_offloaded": sum(swap_ops.variable_is_offloaded(v)
                                                                  for v in model.optimizer.variables)}))
"""


def test_weights_are_packed_again_after_the_state_leaves_the_device(python_subprocess):
    """With Adam's m and v offloaded, the weights they were interleaved with pin half-empty pageblocks: moving every
    variable that stays to host and back packs them, the persistent group's reserved bytes drop, its bytes in use
    and every value stay the same, and the offloaded state stays in host memory."""
    proc = python_subprocess(COMPACT_SCRIPT, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    out = proc_result(proc)
    assert out["offloaded"] == 24 and out["still_offloaded"] == 24 and out["same"], out
    # every variable that stays: 12 kernels, 12 biases, the extra optimizer's 24 momenta, the optimizers' scalars
    assert out["moved"] == out["staying"] >= 48, out
    before, after = out["before"], out["after"]
    assert abs(after["in_use"] - before["in_use"]) < 4096, out  # the same variables (TF's own scalars may move)
    # at least one 2 MiB pageblock freed (a 12-block GPT's probe step: 194 -> 152 MiB reserved; here a few small
    # buffers of TF's own, scattered over the group's pageblocks, keep most of them)
    assert before["reserved"] - after["reserved"] >= 2 << 20, out
