"""The first step under a budget (dymem_tf/planning/first_step.py): least-memory probe, guarded variables, calibrated re-plan.

Budgets need a fresh interpreter (DYMEM_DEVICE_MEMORY_LIMIT is read when GTBM loads): those tests run a script in
a subprocess, with oneDNN off (TF 2.21's oneDNN kernels crash instead of raising when an allocation fails).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import keras
import tensorflow as tf

from dymem_tf.keras import variables
from dymem_tf.planning import first_step, first_step_control
from conftest import proc_result  # the tests folder is on sys.path (pytest's default import mode)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def test_headroom_keeps_the_measured_error_of_the_step_memory_free():
    # the simulator saw 100 MiB of step memory where 150 MiB were measured: a ratio of 1.5 on the step's own part
    h = first_step.calibrated_headroom(512 * MiB, predicted_peak=300 * MiB, measured_peak=350 * MiB,
                                       persistent_bytes=200 * MiB, margin=0.05)
    allowed = (1 - h) * 512 * MiB  # the plan's predicted peak may reach this
    measured_then = 200 * MiB + (allowed - 200 * MiB) * 1.5
    assert measured_then == pytest.approx(0.95 * 512 * MiB)


def test_an_overestimate_is_not_relied_on_and_the_headroom_is_bounded():
    assert first_step.calibrated_headroom(512 * MiB, 400 * MiB, 300 * MiB, 100 * MiB, margin=0.03) == \
        pytest.approx(0.03)
    assert first_step.calibrated_headroom(512 * MiB, 101 * MiB, 500 * MiB, 100 * MiB) == first_step.MAX_HEADROOM


def test_the_calibrated_prediction_of_a_plan_at_the_headroom_is_the_margin():
    """calibrated_prediction scales a prediction as calibrated_headroom assumes: a plan predicted at (1 - h) * B
    is expected to measure (1 - margin) * B."""
    cal = {"predicted_peak_bytes": 300 * MiB, "measured_peak_bytes": 350 * MiB, "persistent_bytes": 200 * MiB}
    h = first_step.calibrated_headroom(512 * MiB, 300 * MiB, 350 * MiB, 200 * MiB, margin=0.05)
    assert first_step.calibrated_prediction(cal, int((1 - h) * 512 * MiB)) == pytest.approx(0.95 * 512 * MiB, abs=2)
    # an overestimate is not scaled down
    assert first_step.calibrated_prediction({**cal, "measured_peak_bytes": 250 * MiB}, 400 * MiB) == 400 * MiB


def test_fragmentation_is_added_as_measured_and_the_ratio_comes_from_bytes_in_use():
    """The probe: 127 MiB predicted, 127 MiB in use, 150 MiB reserved over 90 MiB persistent. A plan predicted at
    190 MiB is then expected at 190 + 23 MiB (the ratio of bytes in use is 1), not scaled by 150 / 127."""
    cal = first_step.Calibration.from_probe(279 * MiB, 127 * MiB, 150 * MiB, 90 * MiB, measured_in_use=127 * MiB)
    assert cal.margin == pytest.approx(first_step.STEP_VARIATION + first_step.MIN_MODEL_ERROR)
    as_dict = dataclasses.asdict(cal)
    assert first_step.calibrated_prediction(as_dict, 190 * MiB) == 213 * MiB
    # the headroom lets a plan reach exactly (1 - margin) of the budget once calibrated
    allowed = int((1 - cal.headroom) * 279 * MiB)
    assert first_step.calibrated_prediction(as_dict, allowed) == pytest.approx((1 - cal.margin) * 279 * MiB, abs=2)
    # without the in-use measurement: the reserved peak scales the step memory, with the fixed margin
    old = first_step.Calibration.from_probe(279 * MiB, 127 * MiB, 150 * MiB, 90 * MiB)
    assert old.margin == first_step.CALIBRATION_MARGIN and old.headroom > cal.headroom
    assert first_step.calibrated_prediction(dataclasses.asdict(old), 190 * MiB) > 250 * MiB


def test_the_margin_grows_with_the_simulators_error_on_the_probe_within_bounds():
    margin = first_step.calibration_margin
    assert margin(100 * MiB, 108 * MiB) == pytest.approx(first_step.STEP_VARIATION + 8 / 108)
    assert margin(100 * MiB, 200 * MiB) == pytest.approx(first_step.STEP_VARIATION + first_step.MAX_MODEL_ERROR)
    assert margin(100 * MiB, 0) == first_step.CALIBRATION_MARGIN


def test_a_small_budget_keeps_whole_pageblocks_free_for_later_steps():
    """Later steps move the reserved peak by whole pageblocks: EfficientNet-B0 under 73 MiB measured 66 MiB in the
    budgeted plan's first step and ran out of memory in step 15. Its slack is 8 MiB, not 6% (4.4 MiB): 66 MiB is too
    close and the probe's plan takes over; a large budget keeps the 6%."""
    slack = first_step.step_slack
    assert slack(73 * MiB) == pytest.approx(8 / 73)
    assert 66 * MiB > (1 - slack(73 * MiB)) * 73 * MiB
    assert slack(512 * MiB) == first_step.STEP_VARIATION == slack(None)
    assert slack(4 * MiB) == first_step.MAX_HEADROOM / 2  # a tiny budget is not left without room to plan
    margin = first_step.calibration_margin
    assert margin(100 * MiB, 102 * MiB, budget_bytes=80 * MiB) == pytest.approx(8 / 80 + first_step.MIN_MODEL_ERROR)
    assert margin(100 * MiB, 102 * MiB, budget_bytes=400 * MiB) == margin(100 * MiB, 102 * MiB)
    assert margin(100 * MiB, 0, budget_bytes=40 * MiB) == pytest.approx(8 / 40 + first_step.MIN_MODEL_ERROR)
    cal = first_step.Calibration.from_probe(73 * MiB, 14 * MiB, 52 * MiB, 0, measured_in_use=15 * MiB)
    assert cal.margin >= 8 / 73 and cal.headroom >= cal.margin


def _leaves(budget: int, used: int) -> bool:
    return first_step_control.FirstStepControl(budget).leaves_slack(used)


@pytest.mark.parametrize("seed", range(3))
def test_the_least_budget_is_the_least_that_leaves_the_step_slack(seed):
    """The refusal's "raise the budget to at least" figure: that budget passes the check a probe's first step
    must pass, one byte less does not; and the check's slack in bytes is the share :func:`step_slack` gives, in
    each of its three regions (a capped share, 8 MiB, 6%)."""
    rng = random.Random(seed)
    for used in [22 * MiB, 18 * MiB + 123, 125 * MiB] + [rng.randrange(1, 4 << 30) for _ in range(300)]:
        least = first_step.least_budget(used)
        assert _leaves(least, used) and (least == 1 or not _leaves(least - 1, used)), used
    assert first_step.least_budget(22 * MiB) == 30 * MiB  # 8 MiB of slack: 4 pageblocks
    for budget in [rng.randrange(1, 28 * MiB), rng.randrange(28 * MiB, 133 * MiB), rng.randrange(134 * MiB, 1 << 40)]:
        assert abs(first_step.slack_bytes(budget) - first_step.step_slack(budget) * budget) <= 1, budget
    # exactly the slack left passes: in floats, (1 - 8 MiB / B) * B falls a fraction of a byte short of B - 8 MiB
    # for this B, and a probe that measured B - 8 MiB was refused
    assert _leaves(38939324, 38939324 - 8 * MiB) and not _leaves(38939324, 38939324 - 8 * MiB + 1)


def test_a_measurement_is_exact_only_when_the_peaks_grew_in_the_step():
    before = {"peak_bytes_in_use": 10 * MiB, "peak_bytes_reserved": 12 * MiB}
    grew = first_step.measurement(before, {"peak_bytes_in_use": 30 * MiB, "peak_bytes_reserved": 32 * MiB}, 24 * MiB)
    assert grew == first_step.Measurement(outcome="ran", peak_bytes=32 * MiB, peak_bytes_reserved=32 * MiB,
                                          peak_bytes_in_use=30 * MiB, exact=True, predicted_peak_bytes=24 * MiB,
                                          error=0.25)
    # an earlier step since the last reset peaked higher: this step's peak is only bounded
    hidden = first_step.measurement(before, dict(before), 8 * MiB)
    assert hidden.exact is False and hidden.peak_bytes == 12 * MiB
    oom = first_step.measurement(before, {"peak_bytes_in_use": 40 * MiB, "peak_bytes_reserved": 48 * MiB}, 24 * MiB,
                                 outcome="out_of_memory", steps=2)
    assert oom.outcome == "out_of_memory" and oom.error is None and oom.steps == 2


def test_the_plan_summary_prints_predicted_and_measured_once_the_step_ran():
    from dymem_tf.planning.plan import Plan, Prediction

    plan = Plan(policy="dymem", device="cpu", budget_bytes=64 * MiB, persistent_bytes=MiB, batch_size=8, num_layers=4,
                predicted=Prediction(peak_bytes=30 * MiB, no_swap_peak_bytes=40 * MiB))
    assert "first step" not in plan.summary() and plan.measured_error is None
    plan.measured = first_step.measurement({"peak_bytes_in_use": 0, "peak_bytes_reserved": 0},
                                           {"peak_bytes_in_use": 29 * MiB, "peak_bytes_reserved": 32 * MiB},
                                           30 * MiB)
    line = "  first step      : predicted 30.0 MiB, measured 32.0 MiB (error +6.2%); in use 29.0 MiB"
    assert line in plan.summary().splitlines()
    assert plan.measured_error == pytest.approx(2 / 32)
    assert Plan.from_json(plan.to_json()).measured == plan.measured  # plan.json keeps it
    plan.measured.exact = False
    assert plan.measured_summary() == "predicted 30.0 MiB, measured at most 32.0 MiB; in use at most 29.0 MiB"
    plan.measured.outcome = "out_of_memory"
    assert plan.measured_error is None
    assert plan.measured_summary() == ("predicted 30.0 MiB, ran out of memory in its first step (pool reserved "
                                       "32.0 MiB, in use 29.0 MiB)")


def test_snapshot_restores_weights_optimizer_state_and_metrics():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    snap = variables.VariableSnapshot(model)
    saved = model.variables + model.optimizer.variables + model.metrics_variables  # the loss's running mean too
    before = [v.numpy().copy() for v in saved]
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), verbose=0)
    assert snap.restore() > 0
    for v, b in zip(saved, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert len(snap) == len(before)


def test_a_plain_step_keeps_its_largest_buffer_free_where_that_is_more_than_its_slack():
    assert first_step.plain_step_margin(74 * MiB, 30 * MiB) == 30 * MiB  # the GAN's convolution workspace
    assert first_step.plain_step_margin(74 * MiB, 1 * MiB) == first_step.slack_bytes(74 * MiB) == 8 * MiB
    assert first_step.plain_step_margin(1 << 40, None) == math.ceil(first_step.PROBE_SLACK * (1 << 40))


def test_optimizers_kept_as_model_attributes_count_and_are_restored():
    # Regression: a GAN's two optimizers (attributes set in its compile) were left out of the model's persistent
    # bytes, so fits_first took their 3.1 MiB of Adam state for other models' memory and cut it from the device,
    # and a failed first step did not put their state back
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(loss="mse")
    model.g_optimizer = keras.optimizers.Adam(0.1)
    model.g_optimizer.build(model.trainable_variables)
    assert variables.other_optimizers(model) == [model.g_optimizer]
    state = sum(variables.variable_bytes(v) for v in model.g_optimizer.variables)
    weights = sum(variables.variable_bytes(v) for v in model.variables)
    assert state > 0 and variables.persistent_bytes(model, optimizer=False) == weights + state  # never offloaded
    snap = variables.VariableSnapshot(model)
    before = [v.numpy().copy() for v in model.g_optimizer.variables]
    model.g_optimizer.apply([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables)
    assert snap.restore() >= 3  # the iteration count, m and v changed
    for v, b in zip(model.g_optimizer.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


SCRIPT = r"""
import dataclasses, gc, json, os, warnings
import tensorflow as tf
import dymem_tf
import numpy as np, keras
from dymem_tf.memory import allocator
warnings.simplefilter("always")
tf.config.experimental.enable_op_determinism()

def build(width=256, depth=12):
    # an MLP: its memory is feature maps (no kernel workspaces), 4 MiB each at batch 4096
    keras.utils.set_random_seed(0)
    inp = keras.Input((width,))
    h = inp
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model

def state(model):
    return {v.path: v.numpy() for v in list(model.variables) + list(model.optimizer.variables)}

rng = np.random.default_rng(0)
x = rng.random((32768, 256), dtype=np.float32)
y = rng.integers(0, 10, 32768)
peaks = []
class Peak(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        allocator.reset_peak_stats()
    def on_train_batch_end(self, batch, logs=None):
        peaks.append(allocator.memory_stats()["peak_bytes_reserved"])
out = {"limit": allocator.get_memory_limit()}

# 1. a batch whose least-memory plan cannot fit: refused after a measured first step, nothing changed
model = build()
before = state(model)
try:
    model.fit(x, y, batch_size=32768, epochs=1, verbose=0,
              callbacks=[dymem_tf.DymemCallback(memory_budget="auto", verbose=0)])
    out["refused"] = None
except dymem_tf.BudgetTooSmallError as err:
    out["refused"] = str(err)
    out["suggested"] = err.suggested_batch
after = state(model)
out["changed"] = sorted(k for k in before if not np.array_equal(before[k], after[k]))

# 2. a batch that fits only with swapping: probe, calibrated plan, every step under the budget, same losses
del model
keras.backend.clear_session()
gc.collect()
dymem_tf.set_memory_limit("1GiB")  # the reference run without Dymem does not fit the budget
allocator.reset_peak_stats()
x, y = x[:16384], y[:16384]
plain = build().fit(x, y, batch_size=4096, epochs=1, shuffle=False, verbose=0).history["loss"]
out["plain_peak"] = allocator.memory_stats()["peak_bytes_reserved"]
keras.backend.clear_session()
gc.collect()
dymem_tf.set_memory_limit(out["limit"])
model = build()
cb = dymem_tf.DymemCallback(memory_budget="auto", verbose=0)
with warnings.catch_warnings(record=True) as caught:
    hist = model.fit(x, y, batch_size=4096, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Peak()])
out["losses"], out["plain"] = hist.history["loss"], plain
out["peaks"] = peaks
out["stages"] = [r.plan.params.stage for r in cb.records]
out["notes"] = [n for r in cb.records for n in r.plan.notes]
out["warnings"] = [str(w.message) for w in caught if "dymem_tf" in str(w.message)]
cal = cb.records[-1].plan.predicted.calibration
out["calibration"] = dataclasses.asdict(cal) if cal is not None else None
out["placed"] = cb.records[-1].plan.predicted.calibrated_peak_bytes
measured = cb.records[-1].plan.measured
out["measured"] = measured.peak_bytes if measured is not None else None
out["prepared_once"] = cb.records[-1].step_graph is cb.records[0].step_graph
out["kept"] = [sum(s.kept_bytes for s in r.plan.swaps) for r in cb.records]
print("RESULT" + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def budget_run():
    env = {k: v for k, v in os.environ.items() if k not in ("DYMEM_GTBM", "TF_CPU_ALLOCATOR_USE_BFC")}
    env.update(DYMEM_DEVICE_MEMORY_LIMIT="56MiB", TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    return proc_result(proc)


def test_a_budget_the_least_memory_plan_cannot_meet_is_refused_after_measuring_and_nothing_changes(budget_run):
    text = budget_run["refused"]
    assert text is not None and "ran out of memory" in text and "No variable was changed" in text
    assert "reduce the batch size from 32768" in text and budget_run["suggested"] < 32768
    assert budget_run["changed"] == []  # weights, optimizer slots and the iteration counter all restored


def test_the_first_step_calibrates_and_every_step_stays_under_the_budget(budget_run):
    out = budget_run
    assert out["stages"][0] == "probe" and out["calibration"] is not None
    # the calibrated plan, or a refinement of it where its first step left less than the allowance (the probe's
    # bytes in use vary from run to run here: 15.2 or 18.6 MiB)
    assert out["stages"][1] == "calibrated" and set(out["stages"][2:]) <= {"refined"}, out["stages"]
    assert out["plain_peak"] > out["limit"]  # without Dymem this batch does not fit
    assert all(peak <= out["limit"] for peak in out["peaks"]), (out["peaks"], out["limit"])
    assert len(out["peaks"]) == 4 and out["warnings"] == []
    assert out["losses"] == out["plain"]  # the probe step and the calibrated steps both train bit-identically
    assert any("calibrated on the first step" in note for note in out["notes"])
    # the calibrated plan's peak is predicted by its placement in GTBM's groups, from the probe's persistent group;
    # not below what its first step measured (here it is well above: the probe measured 1.5x its simulated bytes
    # in use, the calibrated plan 1.16x, and the calibration scales the step's memory by the probe's ratio)
    assert out["calibration"]["persistent_group"]["block_size"] > 0
    assert out["placed"] and out["placed"] >= 0.95 * out["measured"], out
    assert any("placed in GTBM's groups" in note for note in out["notes"])
    # the calibrated plan is made on the probe's preparation of the same graph (deferrals, holds, offload marks)
    assert out["prepared_once"]


MEASURED_SCRIPT = r"""
import dataclasses, json, sys
import tensorflow as tf
import dymem_tf
import numpy as np, keras
from tensorboard_plugin_dymem import logdata

keras.utils.set_random_seed(0)
inp = keras.Input((16, 16, 3))
h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(96, 16, 16, 3)).astype("float32")
cb = dymem_tf.DymemCallback(memory_budget="128MiB", min_swap_bytes=0, log_dir=sys.argv[1], verbose=1)
model.fit(x, np.arange(96) % 10, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
print("SUMMARY" + json.dumps(cb.plan.summary()))
def fields(x):
    return dataclasses.asdict(x) if x is not None else None
out = {"plans": [{"stage": r.plan.params.stage, "predicted": r.plan.predicted.peak_bytes,
                  "measured": fields(r.plan.measured), "calibration": fields(r.plan.predicted.calibration)}
                 for r in cb.records]}
data = logdata.load_run(sys.argv[1], "dymem")
out["logged"], out["steps"] = data["plans"], [(s["step"], s.get("plan")) for s in data["steps"]]
print("RESULT" + json.dumps(out), flush=True)
"""


def test_a_budgeted_fit_records_predicted_and_measured_peaks_of_each_plan(tmp_path):
    """A budgeted tiny fit: the probe's and the calibrated plan's first steps are measured, the verbose output and
    the plan summary print predicted against measured, and the dashboard's data has both numbers per plan."""
    env = {k: v for k, v in os.environ.items() if k not in ("DYMEM_GTBM", "TF_CPU_ALLOCATOR_USE_BFC")}
    env.update(DYMEM_DEVICE_MEMORY_LIMIT="128MiB", TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(MEASURED_SCRIPT), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc_result(proc)
    probe, calibrated = out["plans"]
    assert (probe["stage"], calibrated["stage"]) == ("probe", "calibrated")
    for plan in (probe, calibrated):
        m = plan["measured"]
        assert m["outcome"] == "ran" and m["exact"] is True and m["predicted_peak_bytes"] == plan["predicted"]
        assert 0 < m["peak_bytes_in_use"] <= m["peak_bytes"] == m["peak_bytes_reserved"] <= 128 * MiB
        assert m["error"] == pytest.approx((m["peak_bytes"] - plan["predicted"]) / m["peak_bytes"])
        printed = (f"dymem_tf: first step of the {plan['stage']} plan: predicted {plan['predicted'] / MiB:.1f} MiB"
                   f"{' (calibrated ' if plan['calibration'] else ''}")
        line = next(l for l in proc.stdout.splitlines() if l.startswith(printed))
        assert f"measured {m['peak_bytes'] / MiB:.1f} MiB (error {m['error']:+.1%}" in line, line
    # the calibration of the second plan is the probe's measurement, against the probe's plan simulated again with
    # the kernel temporaries GTBM traced in that step (never less than without them)
    cal = calibrated["calibration"]
    assert cal["predicted_peak_bytes"] >= probe["predicted"]
    assert abs(cal["measured_in_use_bytes"] - probe["measured"]["peak_bytes_in_use"]) <= 2 * MiB
    assert abs(cal["measured_peak_bytes"] - probe["measured"]["peak_bytes"]) <= 2 * MiB
    summary = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("SUMMARY"))[len("SUMMARY"):])
    m = calibrated["measured"]
    assert f"  first step      : predicted {calibrated['predicted'] / MiB:.1f} MiB (calibrated " in summary
    assert f"measured {m['peak_bytes'] / MiB:.1f} MiB (error {m['error']:+.1%}; calibrated " in summary
    # the dashboard's data: both plans with both numbers, the calibration, and the plan each step ran
    logged = out["logged"]
    assert [(p["index"], p["stage"]) for p in logged] == [(0, "probe"), (1, "calibrated")]
    for plan, row in zip((probe, calibrated), logged):
        assert row["predicted_peak_bytes"] == plan["predicted"]
        assert row["measured_peak_bytes"] == plan["measured"]["peak_bytes"]
        assert row["measured_peak_bytes_in_use"] == plan["measured"]["peak_bytes_in_use"]
        assert row["error"] == pytest.approx(plan["measured"]["error"])
    assert logged[0]["calibration"] is None
    assert logged[1]["calibration"]["measured_peak_bytes"] == cal["measured_peak_bytes"]
    assert logged[1]["calibration"]["headroom"] == pytest.approx(cal["headroom"])
    assert out["steps"] == [[0, 0]] + [[s, 1] for s in range(1, 6)]


def test_a_calibrated_plan_without_slack_is_calibrated_again_once_then_the_probes_plan_takes_over():
    """The first-step controller's decisions on measured peaks: a step within the slack of the budget (8% of
    100 MiB) re-plans once from its own measurement (source: the calibrated plan's step, its fragmentation), a
    second such step falls back to the probe's plan, a step with room settles."""
    control = first_step_control
    fsc = control.FirstStepControl(100 * MiB)
    assert fsc.state is control.State.PROBE and fsc.guarded and not fsc.settled
    assert fsc.stepped(30 * MiB, 20 * MiB) == control.Decision(control.Action.CALIBRATE, control.State.CALIBRATED,
                                                               control.State.PROBE)
    assert fsc.stepped(95 * MiB, 80 * MiB) == control.Decision(control.Action.CALIBRATE, control.State.REFINED,
                                                               control.State.CALIBRATED)
    assert fsc.stepped(95 * MiB, 80 * MiB).action is control.Action.FALL_BACK
    assert fsc.state is control.State.FALLBACK and not fsc.guarded and fsc.settled
    assert fsc.stepped(99 * MiB).action is control.Action.KEEP  # nothing is guarded any more

    settles = control.FirstStepControl(100 * MiB)
    settles.stepped(30 * MiB)
    assert settles.stepped(80 * MiB, 70 * MiB) == control.Decision(control.Action.KEEP, control.State.SETTLED)
    unmeasured = control.FirstStepControl(100 * MiB)  # nothing measures the device: nothing to decide on
    unmeasured.stepped(None)
    assert unmeasured.stepped(None).state is control.State.SETTLED
    no_in_use = control.FirstStepControl(100 * MiB)
    no_in_use.stepped(30 * MiB)
    assert no_in_use.stepped(95 * MiB).action is control.Action.FALL_BACK  # nothing to calibrate the refinement on


def test_a_placed_plan_that_does_not_hold_is_refined_three_times_before_the_probes_plan_takes_over():
    """A placed plan's refinement is calibrated on the refined plan's own step again (DenseNet-121 under 95 MiB: a
    refined plan 1 block over the allowance fell back to the probe's plan, 0.53 of the budget used; under 71 MiB
    three plans placed on their limit missed it by 0.1-0.6 MiB); an unplaced one is refined once."""
    control = first_step_control
    placed = (86 * MiB, 2 * MiB)
    fsc = control.FirstStepControl(95 * MiB)
    fsc.stepped(48 * MiB, 26 * MiB)
    assert fsc.stepped(88 * MiB, 82 * MiB, placed=placed) == control.Decision(
        control.Action.CALIBRATE, control.State.REFINED, control.State.CALIBRATED)
    for _ in range(first_step.PLACED_REFINEMENTS - 1):
        assert fsc.stepped(88 * MiB, 82 * MiB, placed=placed) == control.Decision(
            control.Action.CALIBRATE, control.State.REFINED, control.State.REFINED)
    assert fsc.refinements == first_step.PLACED_REFINEMENTS == 3
    assert fsc.stepped(88 * MiB, 82 * MiB, placed=placed) == control.Decision(control.Action.FALL_BACK,
                                                                              control.State.FALLBACK)
    settles = control.FirstStepControl(95 * MiB)
    settles.stepped(48 * MiB, 26 * MiB)
    for _ in range(first_step.PLACED_REFINEMENTS):
        settles.stepped(88 * MiB, 82 * MiB, placed=placed)
    assert settles.stepped(86 * MiB, 81 * MiB, placed=(84 * MiB, 2 * MiB)).state is control.State.SETTLED
    unplaced = control.FirstStepControl(95 * MiB)
    unplaced.stepped(48 * MiB, 26 * MiB)
    assert unplaced.stepped(88 * MiB, 82 * MiB).state is control.State.REFINED
    assert unplaced.stepped(88 * MiB, 82 * MiB).state is control.State.FALLBACK


def test_a_placed_plan_that_runs_out_of_memory_is_refined_while_refinements_are_left():
    """An out-of-memory first step of a placed budgeted plan is refined like one that does not hold (it shares
    their count), once (each try skips a batch); without a placement or the step's bytes in use, or after the refinements, the probe's plan
    trains; the probe's own refuses the budget."""
    control = first_step_control
    placed = (170 * MiB, 2 * MiB)
    fsc = control.FirstStepControl(179 * MiB)
    fsc.stepped(80 * MiB, 60 * MiB)
    assert fsc.ran_out_of_memory(150 * MiB, placed) == control.Decision(
        control.Action.CALIBRATE, control.State.REFINED, control.State.CALIBRATED)
    assert fsc.ran_out_of_memory(150 * MiB, placed) == control.Decision(control.Action.FALL_BACK,
                                                                        control.State.FALLBACK)  # once: a batch each
    once = control.FirstStepControl(179 * MiB)
    once.stepped(80 * MiB, 60 * MiB)
    assert once.stepped(190 * MiB, 170 * MiB, placed=placed).source is control.State.CALIBRATED
    assert once.ran_out_of_memory(150 * MiB, placed).state is control.State.REFINED  # the second refinement
    assert once.ran_out_of_memory(150 * MiB, placed).state is control.State.FALLBACK
    for in_use, where in ((None, placed), (150 * MiB, None)):
        unplaced = control.FirstStepControl(179 * MiB)
        unplaced.stepped(80 * MiB, 60 * MiB)
        assert unplaced.ran_out_of_memory(in_use, where).state is control.State.FALLBACK
    probe = control.FirstStepControl(179 * MiB)
    assert probe.ran_out_of_memory(150 * MiB, placed).state is control.State.REFUSED


def test_a_calibration_on_a_step_that_ran_out_of_memory_measures_the_budget_and_carries_the_whole_miss():
    """The failed step reserved at most the budget before it ran out: the calibration takes it to have measured the
    budget, discounts no jitter, and says so; a probe that ran out has nothing to calibrate."""
    from dymem_tf.memory import placement
    group = placement.PersistentGroup(reserved_bytes=40 * MiB, in_use_bytes=39 * MiB)
    placed = placement.Placement(step_in_use_bytes=40 * MiB, step_reserved_bytes=44 * MiB, resident_bytes=0,
                                 persistent_reserved_bytes=40 * MiB)
    args = (95 * MiB, 82 * MiB, 93 * MiB, 40 * MiB, 82 * MiB)
    ran_out = first_step.Calibration.from_probe(*args, source="calibrated", placed=placed, group=group,
                                                outcome="out_of_memory")
    held = first_step.Calibration.from_probe(*args, source="calibrated", placed=placed, group=group)
    assert ran_out.measured_peak_bytes == 95 * MiB and ran_out.outcome == "out_of_memory"
    assert ran_out.placement_residual_bytes == 95 * MiB - 84 * MiB  # the whole miss, against 93 - 84 - 2 held
    assert held.placement_residual_bytes == 7 * MiB
    assert ran_out.headroom >= held.headroom and "ran out of memory at 95.0 MiB" in ran_out.summary()
    with pytest.raises(ValueError, match="refuses the budget"):
        first_step.Calibration.from_probe(*args, outcome="out_of_memory")
    with pytest.raises(ValueError, match="outcome must be one of"):
        first_step.Calibration.from_probe(*args, source="calibrated", outcome="crashed")
    from dymem_tf.passes.step_pass import PlanRequest
    keys = {PlanRequest(budget_bytes=95 * MiB, calibration=cal).cache_key() for cal in (ran_out, held)}
    assert len(keys) == 2  # planned, not served the plan of the step that held from the cache


def test_a_placed_plan_that_holds_with_room_to_spare_is_made_once_more_to_keep_more():
    """GatedCNN under 147 MiB: placed at 132 MiB, its first step measured 98 (0.67 of the budget used). A plan that
    holds and measured under its placement by more than the allowance is made again once to keep more (USE_MORE);
    that plan settles when it holds, and when it does not hold or runs out of memory the plan that held trains."""
    control = first_step_control
    budget = 147 * MiB
    allowance = first_step.placed_allowance(budget)
    fsc = control.FirstStepControl(budget)
    fsc.stepped(82 * MiB, 76 * MiB)
    assert fsc.stepped(98 * MiB, 92 * MiB, placed=(132 * MiB, 2 * MiB), swaps=True) == control.Decision(
        control.Action.USE_MORE, control.State.REFINED, control.State.CALIBRATED)
    assert fsc.used_more and fsc.refinements == 1
    # once: the plan keeping more settles even with room to spare
    assert fsc.stepped(110 * MiB, 104 * MiB, placed=(136 * MiB, 2 * MiB), swaps=True).state is control.State.SETTLED
    for report in (lambda c: c.stepped(146 * MiB, 140 * MiB, placed=(136 * MiB, 2 * MiB), swaps=True),
                   lambda c: c.ran_out_of_memory(140 * MiB, (136 * MiB, 2 * MiB)), lambda c: c.refused()):
        over = control.FirstStepControl(budget)
        over.stepped(82 * MiB, 76 * MiB)
        over.stepped(98 * MiB, 92 * MiB, placed=(132 * MiB, 2 * MiB), swaps=True)
        assert report(over) == control.Decision(control.Action.FALL_BACK, control.State.FALLBACK)
    # within UNDER_USE_ALLOWANCES allowances, swapping nothing, or unplaced: it settles as before
    near = 132 * MiB - first_step.UNDER_USE_ALLOWANCES * allowance
    for args in ((near, 90 * MiB, (132 * MiB, 2 * MiB), True), (98 * MiB, 92 * MiB, (132 * MiB, 2 * MiB), False),
                 (98 * MiB, 92 * MiB, None, True)):
        fsc = control.FirstStepControl(budget)
        fsc.stepped(82 * MiB, 76 * MiB)
        assert fsc.stepped(*args).state is control.State.SETTLED
    assert first_step.placed_plan_under_uses(near - 1, 132 * MiB, budget)
    assert not first_step.placed_plan_under_uses(near, 132 * MiB, budget)


def test_a_calibration_on_an_under_used_step_scales_the_next_plan_by_its_measured_ratio():
    """An under-used plan's calibration scales the next plan's step bytes by measured over predicted bytes in use
    below 1 (down to MIN_UNDER_USED_RATIO; other calibrations never go below 1), keeps only the allowance as its
    margin, and carries what its scaled placement still left beyond the allowance as a residual below 0."""
    from dymem_tf.memory import placement
    budget, allowance = 147 * MiB, first_step.placed_allowance(147 * MiB)
    group = placement.PersistentGroup(reserved_bytes=2 * MiB, in_use_bytes=1 * MiB)

    def placed(step_reserved):
        return placement.Placement(step_in_use_bytes=step_reserved, step_reserved_bytes=step_reserved,
                                   resident_bytes=0, persistent_reserved_bytes=2 * MiB)

    def calibration(in_use, measured, step_reserved, outcome="under_used"):
        return first_step.Calibration.from_probe(budget, 130 * MiB, measured, 1 * MiB, in_use, source="calibrated",
                                                 placed=placed(step_reserved), group=group, outcome=outcome)

    gated = calibration(92 * MiB, 96 * MiB, 130 * MiB)  # GatedCNN: 91.7 MiB in use of 130 predicted
    ratio = (91 / 129)
    assert gated.margin == pytest.approx(allowance / budget) and "keeping more" in gated.summary()
    scaled = 2 * MiB + ratio * 130 * MiB
    assert first_step.placed_prediction(gated, placed(130 * MiB)) == pytest.approx(
        scaled + max(96 * MiB - scaled - 2 * MiB, 0), abs=2)
    assert first_step.placed_prediction(gated, placed(200 * MiB)) == pytest.approx(
        2 * MiB + ratio * 200 * MiB + gated.placement_residual_bytes, abs=2)  # a plan keeping more, scaled
    held = calibration(92 * MiB, 96 * MiB, 130 * MiB, outcome="ran")
    assert first_step.placed_prediction(held, placed(200 * MiB)) >= 202 * MiB  # never scaled below 1
    floor = calibration(30 * MiB, 96 * MiB, 130 * MiB)
    assert first_step.calibrated_prediction(floor, 101 * MiB) == 1 * MiB + 50 * MiB + (96 - 30) * MiB
    below = calibration(120 * MiB, 125 * MiB, 150 * MiB)  # its scaled placement is still over what it measured
    assert below.placement_residual_bytes == pytest.approx(
        125 * MiB - (2 * MiB + 119 / 129 * 150 * MiB) + allowance, abs=2) and below.placement_residual_bytes < 0
    with pytest.raises(ValueError, match="calibrates nothing"):
        first_step.Calibration.from_probe(budget, 130 * MiB, 98 * MiB, 1 * MiB, outcome="under_used")


def test_an_under_used_calibration_may_search_headrooms_below_0():
    """After an under-used plan the calibrated headroom and the placed plan's search go below 0, down to
    least_headroom (the simulator's peaks scaled by a ratio below 1); other calibrations stay at 0 and above."""
    budget, limit = 147 * MiB, 138 * MiB
    floor = first_step.least_headroom("under_used")
    assert floor == 1.0 - 1.0 / first_step.MIN_UNDER_USED_RATIO < 0 and first_step.least_headroom("ran") == 0.0
    nxt = first_step.next_headroom([(0.0, 100 * MiB)], limit, budget, 2 * MiB, floor)
    assert floor <= nxt < 0.0
    assert first_step.next_headroom([(0.0, 100 * MiB)], limit, budget, 2 * MiB) is None  # at 0 already
    assert first_step.calibrated_headroom(budget, 130 * MiB, 96 * MiB, 1 * MiB, 0.056, 92 * MiB, "under_used") < 0
    assert first_step.calibrated_headroom(budget, 130 * MiB, 96 * MiB, 1 * MiB, 0.056, 92 * MiB) >= 0.056


def test_each_refinement_is_planned_not_served_from_the_plan_cache():
    """Plans are cached per graph and request; two refinements of one plan differ in their calibration's source
    only, so the source is part of the key (else the second refinement got the first one's plan back)."""
    from dymem_tf.passes.step_pass import PlanRequest
    args = (95 * MiB, 82 * MiB, 88 * MiB, 40 * MiB, 82 * MiB)
    first, second = (PlanRequest(budget_bytes=95 * MiB, calibration=first_step.Calibration.from_probe(
        *args, source=source)) for source in ("calibrated", "refined"))
    assert first.stage == second.stage == "refined"
    assert first.cache_key() != second.cache_key()


def test_the_last_refinement_keeps_one_allowance_more_free_and_is_planned_not_served_from_the_cache():
    """The last refinement of a placed plan (:data:`first_step.PLACED_REFINEMENTS`) is planned one allowance lower
    than the one before it, whose source and outcome it shares, and says so; its cache key differs."""
    from dymem_tf.memory import placement
    from dymem_tf.passes.step_pass import PlanRequest
    group = placement.PersistentGroup(reserved_bytes=40 * MiB, in_use_bytes=39 * MiB)
    placed = placement.Placement(step_in_use_bytes=40 * MiB, step_reserved_bytes=44 * MiB, resident_bytes=0,
                                 persistent_reserved_bytes=40 * MiB)
    args = (95 * MiB, 82 * MiB, 88 * MiB, 40 * MiB, 82 * MiB)
    second, last = (first_step.Calibration.from_probe(*args, source="refined", placed=placed, group=group, last=last)
                    for last in (False, True))
    allowance = first_step.placed_allowance(95 * MiB, 2 * MiB) / (95 * MiB)
    assert last.last and not second.last and last.margin == pytest.approx(second.margin + allowance)
    assert last.headroom == pytest.approx(second.headroom + allowance)
    assert "the last refinement: one allowance more kept free" in last.summary()
    assert PlanRequest(budget_bytes=95 * MiB, calibration=second).cache_key() != \
        PlanRequest(budget_bytes=95 * MiB, calibration=last).cache_key()
    unplaced = first_step.Calibration.from_probe(*args, source="refined", last=True)
    assert not unplaced.last  # without a placement there is no allowance (and no third refinement)


def test_a_calibration_on_a_refined_plan_carries_its_whole_miss():
    """The placement residual of a calibration discounts one pageblock of jitter, except on a refined plan's step:
    that miss repeated after a calibration that discounted it."""
    from dymem_tf.memory import placement
    group = placement.PersistentGroup(reserved_bytes=40 * MiB, in_use_bytes=39 * MiB)
    placed = placement.Placement(step_in_use_bytes=40 * MiB, step_reserved_bytes=44 * MiB, resident_bytes=0,
                                 persistent_reserved_bytes=40 * MiB)
    args = (95 * MiB, 82 * MiB, 88 * MiB, 40 * MiB, 82 * MiB)
    on_calibrated = first_step.Calibration.from_probe(*args, source="calibrated", placed=placed, group=group)
    on_refined = first_step.Calibration.from_probe(*args, source="refined", placed=placed, group=group)
    assert on_calibrated.placement_residual_bytes == 2 * MiB  # 88 - 84 placed - one 2 MiB block
    assert on_refined.placement_residual_bytes == 4 * MiB
    assert on_refined.stage == "refined" and "of the refined plan" in on_refined.summary()
    assert first_step.placed_prediction(on_refined, placed) == 88 * MiB


def test_the_first_step_controller_refuses_only_on_the_probes_measurement_and_a_refusal_is_terminal():
    control = first_step_control
    for report in (lambda c: c.ran_out_of_memory(), lambda c: c.stepped(93 * MiB, 90 * MiB), lambda c: c.refused()):
        fsc = control.FirstStepControl(100 * MiB)
        assert report(fsc) == control.Decision(control.Action.REFUSE, control.State.REFUSED)
        assert fsc.settled and not fsc.guarded
    for state_after_probe in (1, 2):  # the calibrated plan, then the refined one
        for report in (lambda c: c.ran_out_of_memory(), lambda c: c.refused()):
            fsc = control.FirstStepControl(100 * MiB)
            fsc.stepped(30 * MiB, 20 * MiB)
            if state_after_probe == 2:
                fsc.stepped(95 * MiB, 80 * MiB)
            assert report(fsc) == control.Decision(control.Action.FALL_BACK, control.State.FALLBACK)
    with pytest.raises(ValueError, match="positive budget"):
        control.FirstStepControl(None)


def test_the_auto_attempt_is_a_state_of_the_first_step_controller():
    """memory_budget="auto": the step as compiled either fits (terminal PLAIN) or is planned for the device, with a
    guarded probe or unguarded; a decision of another state's report is an error, not a silent move."""
    control = first_step_control
    fits = control.FirstStepControl(state=control.State.AUTO)
    assert fits.guarded and fits.budget_bytes is None
    assert fits.plain_fits() == control.Decision(control.Action.KEEP, control.State.PLAIN)
    assert fits.settled and not fits.guarded
    with pytest.raises(RuntimeError, match="state"):
        fits.plain_fits()
    with pytest.raises(RuntimeError, match="cannot be planned anew"):
        fits.plan_for(100 * MiB, guarded=True)
    planned = control.FirstStepControl(state=control.State.AUTO)
    assert planned.plan_for(100 * MiB, guarded=True) == control.Decision(control.Action.PLAN, control.State.PROBE)
    assert planned.budget_bytes == 100 * MiB and planned.guarded
    unguarded = control.FirstStepControl(state=control.State.AUTO)
    assert unguarded.plan_for(100 * MiB, guarded=False).state is control.State.UNGUARDED and unguarded.settled
    assert unguarded.refused() == control.Decision(control.Action.REFUSE, control.State.REFUSED)
    with pytest.raises(ValueError, match="positive budget"):
        control.FirstStepControl(state=control.State.AUTO).plan_for(None, guarded=True)
    assert control.TERMINAL == {control.State.PLAIN, control.State.SETTLED, control.State.FALLBACK,
                                control.State.UNGUARDED, control.State.REFUSED}


def test_a_calibration_says_which_plan_it_measured_and_the_stage_of_the_plan_it_makes():
    probe = first_step.Calibration.from_probe(279 * MiB, 127 * MiB, 150 * MiB, 90 * MiB, measured_in_use=127 * MiB)
    again = first_step.Calibration.from_probe(279 * MiB, 240 * MiB, 270 * MiB, 90 * MiB, measured_in_use=240 * MiB,
                                              source="calibrated")
    assert (probe.stage, again.stage) == ("calibrated", "refined")
    assert "of the calibrated plan" in again.summary() and "of the probe plan" in probe.summary()
    # the fragmentation measured on the fuller plan (30 MiB, against 23 in the probe) is what the next one keeps free
    assert again.headroom > probe.headroom
    with pytest.raises(ValueError, match="source must be one of"):
        first_step.Calibration.from_probe(279 * MiB, 127 * MiB, 150 * MiB, 90 * MiB, source="guess")


def test_a_placed_plan_keeps_pageblocks_and_a_share_of_the_budget_free_not_the_step_slack():
    """The allowance of a plan placed in GTBM's groups is 3 pageblocks and 1.5% of the budget; its margin adds
    the bytes the probe's prediction missed beyond 2% of its bytes in use, as a share of the budget (the runs the
    allowance was measured on were within 2%), and nothing for a probe predicted over what it used."""
    assert first_step.placed_allowance(512 * MiB) == 6 * MiB + math.ceil(0.015 * 512 * MiB)
    assert first_step.placed_allowance(512 * MiB, block_size=1 * MiB) == 3 * MiB + math.ceil(0.015 * 512 * MiB)
    # smaller blocks count as 1 MiB: a small device's reserved bytes follow its steps' variation in bytes in use
    assert first_step.placed_allowance(96 * MiB, block_size=256 << 10) == 3 * MiB + math.ceil(0.015 * 96 * MiB)
    assert first_step.placed_allowance(10 * MiB) == 3 * MiB  # capped at MAX_HEADROOM / 2 of a tiny budget
    for budget in (64 * MiB, 512 * MiB, 2048 * MiB):
        within = first_step.placed_margin(budget, 100 * MiB, 101 * MiB)
        assert within == pytest.approx(first_step.placed_allowance(budget) / budget)
        assert within < first_step.calibration_margin(100 * MiB, 101 * MiB, budget)  # the slack rule keeps more
        assert first_step.placed_margin(budget, 110 * MiB, 100 * MiB) == pytest.approx(within)  # predicted over
        beyond = first_step.placed_margin(budget, 100 * MiB, 110 * MiB)  # the simulator missed 10 MiB of 110
        missed = (10 - first_step.MIN_MODEL_ERROR * 110) * MiB / budget
        assert beyond == pytest.approx(within + min(missed, first_step.MAX_MODEL_ERROR))
    assert first_step.placed_margin(2048 * MiB, 100 * MiB, 110 * MiB) < first_step.placed_margin(
        512 * MiB, 100 * MiB, 110 * MiB) - 0.01  # the same miss is a smaller share of a larger budget
    assert first_step.placed_margin(512 * MiB, 100 * MiB, 300 * MiB) == pytest.approx(
        first_step.placed_allowance(512 * MiB) / (512 * MiB) + first_step.MAX_MODEL_ERROR)


def test_a_placed_probe_calibration_carries_its_miss_in_bytes_a_calibrated_plan_s_scales():
    """A probe swaps every candidate and the calibrated plan few: the probe's miss on bytes in use (10 MiB here) is
    added to a placed plan's step, not scaled with it; a calibration on a calibrated plan's own step scales."""
    from dymem_tf.memory import placement
    group = placement.PersistentGroup(reserved_bytes=40 * MiB, in_use_bytes=39 * MiB)
    probe_placed = placement.Placement(step_in_use_bytes=60 * MiB, step_reserved_bytes=62 * MiB, resident_bytes=0,
                                       persistent_reserved_bytes=40 * MiB)
    plan = placement.Placement(step_in_use_bytes=400 * MiB, step_reserved_bytes=404 * MiB, resident_bytes=0,
                               persistent_reserved_bytes=40 * MiB)
    args = (512 * MiB, 100 * MiB, 112 * MiB, 40 * MiB, 110 * MiB)  # predicted 100, measured 110 in use
    probe = first_step.Calibration.from_probe(*args, placed=probe_placed, group=group)
    assert first_step.placed_prediction(probe, plan) == 40 * MiB + 404 * MiB + 10 * MiB + \
        probe.placement_residual_bytes
    again = first_step.Calibration.from_probe(*args, placed=probe_placed, group=group, source="calibrated")
    ratio = (110 - 40) / (100 - 40)
    assert first_step.placed_prediction(again, plan) == pytest.approx(
        40 * MiB + ratio * 404 * MiB + again.placement_residual_bytes, abs=1)
    assert first_step.placed_prediction(again, plan) > first_step.placed_prediction(probe, plan)
    unplaced = first_step.Calibration.from_probe(*args)  # without a placement the ratio scales as before
    assert first_step.calibrated_prediction(unplaced, 400 * MiB) == pytest.approx(
        40 * MiB + ratio * 360 * MiB + 2 * MiB, abs=1)


def test_a_calibration_with_a_placement_takes_the_placed_margin_and_one_without_the_step_slack():
    from dymem_tf.memory import placement
    group = placement.PersistentGroup(reserved_bytes=40 * MiB, in_use_bytes=39 * MiB)
    placed = placement.Placement(step_in_use_bytes=50 * MiB, step_reserved_bytes=52 * MiB, resident_bytes=0,
                                 persistent_reserved_bytes=40 * MiB)
    args = (512 * MiB, 100 * MiB, 104 * MiB, 40 * MiB, 101 * MiB)
    with_placement = first_step.Calibration.from_probe(*args, placed=placed, group=group)
    without = first_step.Calibration.from_probe(*args)
    assert with_placement.persistent_group and without.persistent_group is None
    assert with_placement.margin == pytest.approx(first_step.placed_allowance(512 * MiB) / (512 * MiB))
    assert without.margin == pytest.approx(first_step.calibration_margin(100 * MiB, 101 * MiB, 512 * MiB))
    assert with_placement.headroom < without.headroom


@pytest.mark.parametrize("measured, predicted, holds", [
    (480, 480, True),  # both within the allowance of 512 MiB (6 MiB + 7.7 MiB)
    (470, 500, False),  # the prediction (the steady peak: later steps grow to it) leaves less than the allowance
    (495, 480, True),  # the first step came 15 MiB over its prediction: later steps repeat it, within the allowance
    (500, 480, False),  # ... 20 MiB over: the first step itself leaves less than the allowance
    (505, 470, False),  # over the allowance
])
def test_a_placed_plan_holds_when_its_prediction_and_its_first_step_leave_the_allowance(measured, predicted, holds):
    assert first_step.placed_plan_holds(measured * MiB, predicted * MiB, 512 * MiB) is holds
    fsc = first_step_control.FirstStepControl(512 * MiB)
    fsc.stepped(100 * MiB, 90 * MiB)  # the probe
    decision = fsc.stepped(measured * MiB, measured * MiB - MiB, placed=(predicted * MiB, 2 * MiB))
    assert decision.state is (first_step_control.State.SETTLED if holds else first_step_control.State.REFINED)


def test_a_placed_plan_uses_the_budget_the_step_slack_kept_free():
    """490 MiB of 512 leaves less than the slack of an unplaced plan (6%: 30.7 MiB) but holds when placed."""
    unplaced, placed = (first_step_control.FirstStepControl(512 * MiB) for _ in range(2))
    for fsc in (unplaced, placed):
        fsc.stepped(100 * MiB, 90 * MiB)
    assert unplaced.stepped(490 * MiB, 480 * MiB).state is first_step_control.State.REFINED
    assert placed.stepped(490 * MiB, 480 * MiB, placed=(490 * MiB, 2 * MiB)).state is first_step_control.State.SETTLED


def test_the_calibrated_plan_kept_is_the_one_placed_highest_within_the_limit_or_lowest_over_it():
    from dymem_tf.passes.step_pass import _better_placed
    limit = 100.0
    assert _better_placed(98, 90, limit) and not _better_placed(90, 98, limit)  # within: more kept on the device
    assert _better_placed(90, 101, limit) and not _better_placed(101, 90, limit)  # within beats over
    assert _better_placed(101, 110, limit) and not _better_placed(110, 101, limit)  # over: the lowest


def test_the_headroom_search_brackets_the_limit_and_stops_within_a_pageblock_under_it():
    budget, limit, close = 100 * MiB, 90.0 * MiB, 2 * MiB
    step = first_step.next_headroom
    assert step([(0.3, 60 * MiB)], limit, budget, close) == pytest.approx(0.0)  # 30 MiB under: 30% less headroom
    assert step([(0.3, 89 * MiB)], limit, budget, close) is None  # within a pageblock under the limit
    # the secant between a plan under (0.3: 60 MiB) and one over (0.1: 100 MiB): 90 MiB at 0.15
    assert step([(0.3, 60 * MiB), (0.1, 100 * MiB)], limit, budget, close) == pytest.approx(0.15)
    # ... kept a quarter of the bracket from its ends: 0.3 MiB over at 0.1, 30 MiB under at 0.3
    assert step([(0.3, 60 * MiB), (0.1, 90.3 * MiB)], limit, budget, close) == pytest.approx(0.15)
    assert step([(0.15, 89.9 * MiB - close), (0.1, 100 * MiB)], limit, budget, close) == pytest.approx(0.1375)
    assert step([(0.0, 60 * MiB)], limit, budget, close) is None  # no headroom left to give
    assert step([(0.1, 60 * MiB), (0.2, 100 * MiB)], limit, budget, close) is None  # the peak rose with the headroom
    assert step([(0.52, 95 * MiB)], limit, budget, close) == pytest.approx(0.57)  # over by 5%: 5% more
    assert step([(0.59, 95 * MiB)], limit, budget, close) == pytest.approx(first_step.MAX_HEADROOM)  # at most
    assert step([(first_step.MAX_HEADROOM, 95 * MiB)], limit, budget, close) is None


def test_a_placed_plan_is_close_enough_within_a_pageblock_or_one_percent_of_the_budget():
    assert first_step.placed_close(100 * MiB) == 2 * MiB
    assert first_step.placed_close(1024 * MiB) == int(0.01 * 1024 * MiB)
    limit = 0.98 * 1024 * MiB
    assert first_step.next_headroom([(0.1, int(limit - 9 * MiB))], limit, 1024 * MiB,
                                    first_step.placed_close(1024 * MiB)) is None
    assert first_step.next_headroom([(0.1, int(limit - 11 * MiB))], limit, 1024 * MiB,
                                    first_step.placed_close(1024 * MiB)) is not None


def test_a_plan_just_over_the_limit_moves_the_headroom_by_at_least_a_pageblock_or_the_resolution():
    """Placed peaks move in pageblocks: 0.4 MiB over the limit under 95 MiB moves the headroom by a 2 MiB block,
    not by the 0.5% resolution (4 such plans of DenseNet-121 all stayed over)."""
    limit, budget = 90.0 * MiB, 100 * MiB
    nxt = first_step.next_headroom([(0.15, int(limit) + 1000)], limit, budget, 2 * MiB)
    assert nxt == pytest.approx(0.15 + 0.02)
    nxt = first_step.next_headroom([(0.15, int(limit) + 1000)], limit, budget, 100 * 1024)
    assert nxt == pytest.approx(0.15 + first_step.HEADROOM_RESOLUTION)
