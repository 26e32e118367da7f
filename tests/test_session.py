"""The first-step session (dymem_tf.keras.session): one per fit, its states, the request each train function is armed
with, and what it lets go of at the end of the fit. Each test of a suspected bug of issue 46 names it."""
from __future__ import annotations

import contextlib
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import dymem_tf
from dymem_tf.keras import session as session_module, variables
from dymem_tf.keras.config import DymemConfig
from dymem_tf.memory import allocator
from dymem_tf.passes import step_pass
from dymem_tf.planning.first_step_control import State
from conftest import unknown_width_model  # the tests folder is on sys.path (pytest's default import mode)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(size=16):
    keras.utils.set_random_seed(1)
    inp = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS)
    return model


def after_the_probe(model, measured, in_use):
    """A session of ``model`` under 64 MiB whose probe fitted, measuring ``measured`` reserved and ``in_use`` bytes:
    the calibrated plan's guarded first step comes next."""
    config = DymemConfig.from_arguments("64MiB", verbose=0)
    session = session_module.FitSession(model, config, step_pass.StepPass(config.plan_settings(), verbose=0))
    session.request = step_pass.PlanRequest(budget_bytes=64 << 20)
    session.control.plan_for(64 << 20, guarded=True)
    session.control.stepped(measured, in_use)
    return session


def updates_then_fails(model, error, message):
    """A train function that changes every trainable variable, then raises ``error(message)`` (a step that failed
    after its updates ran)."""
    def step(iterator):
        for v in model.trainable_variables:
            v.assign(v + 1.0)
        raise error(None, None, message)

    return step


def unknown_width():
    """A step the pass leaves unmodified under a budget (conftest's :func:`unknown_width_model`)."""
    return unknown_width_model()


def images(n=16, size=16):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 10, size=(n,))


class RecordingPass(step_pass.StepPass):
    """A real pass that also notes the request each armed call is made with."""

    def __init__(self, settings):
        super().__init__(settings, verbose=0)
        self.requests = []

    @contextlib.contextmanager
    def armed(self, request=None, **kwargs):
        self.requests.append(request)
        with super().armed(request, **kwargs) as call:
            yield call


def test_a_session_ends_in_a_terminal_state_for_each_kind_of_budget():
    x, y = images()
    for budget, state in (("auto", State.PLAIN), (None, State.UNGUARDED), ("64MiB", State.SETTLED)):
        cb = dymem_tf.DymemCallback(budget, min_swap_bytes=0, verbose=0)
        cnn().fit(x, y, batch_size=8, verbose=0, callbacks=[cb])
        assert cb.session.state is state, (budget, cb.session.state)
        assert cb.session.control.settled and not cb.session.control.guarded


def test_each_train_function_is_planned_for_its_own_request_not_the_sessions_latest():
    """Suspected bug 2: after a fall-back the callback's request stayed the calibrated one, so a retrace of the
    probe's function (a partial last batch) was planned as the budgeted plan that had just failed. Each function is
    now armed with the request it was made for."""
    config = DymemConfig.from_arguments("64MiB", verbose=0)
    pass_ = RecordingPass(config.plan_settings())
    session = session_module.FitSession(keras.Sequential(), config, pass_)
    probe = step_pass.PlanRequest(budget_bytes=64 << 20, probe=True)
    calibrated = step_pass.PlanRequest(budget_bytes=64 << 20, headroom=0.3)
    probe_function = session.wrap(lambda iterator: "probe", probe)
    session.request = calibrated  # the session moved on to the calibrated plan
    calibrated_function = session.wrap(lambda iterator: "calibrated", calibrated)
    assert calibrated_function(None) == "calibrated" and probe_function(None) == "probe"
    assert pass_.requests == [calibrated, probe]  # the fallen-back-to probe function still plans as the probe


def test_a_calibration_comes_from_this_fits_probe_only():
    """Suspected bug 1: the calibration took the pass's last record without checking that the probe's call made it;
    after a fit of another model whose probe the pass left unmodified, it was calibrated on the earlier fit's plan
    (found with an LSTM, which the pass now plans)."""
    x, y = images()
    cb = dymem_tf.DymemCallback("64MiB", min_swap_bytes=0, verbose=0)
    cnn().fit(x, y, batch_size=8, verbose=0, callbacks=[cb])
    assert [r.plan.params.stage for r in cb.records] == ["probe", "calibrated"]
    rng = np.random.default_rng(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step is left unmodified, with a warning
        unknown_width().fit(rng.normal(size=(16, 6, 8)).astype("float32"), rng.integers(0, 10, 16), batch_size=8, verbose=0,
                   callbacks=[cb])
    assert cb.records == [] and cb.skipped and cb.plan is None
    assert cb.plan_request.calibration is None  # nothing of the CNN's plan is in this fit's request


def test_the_fall_back_runs_after_the_failed_step_is_handled_not_inside_its_except_block():
    """Suspected bug 7: the fall-back ran inside the ``except`` block, whose traceback keeps the failed step's
    tensors alive while the fall-back's step runs."""
    model = cnn()
    session = after_the_probe(model, 1 << 20, 1 << 20)
    seen = {}

    def fallback(iterator):
        seen["handling"] = sys.exc_info()[0]
        return "fallback"

    def out_of_memory(iterator):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert session._guarded_first_call(out_of_memory, None, fallback) == "fallback"  # pylint: disable=protected-access
    assert seen == {"handling": None} and session.state is State.FALLBACK and model.train_function is fallback


def test_a_placed_plan_that_runs_out_of_memory_is_refined_on_its_step_not_dropped_for_the_probes(monkeypatch):
    """ResNet-50 + Adam under 179 MiB: a calibrated plan placed 0.1 MiB under its limit ran out of memory in its
    first step and training fell back to the probe's plan (0.44 of the budget used). With a placement and the step's
    peaks it is now planned again, calibrated on that step at the budget, and the refined plan's first step runs
    guarded on the next batch; the variables are as they were before the failed step."""
    model = cnn()
    session = after_the_probe(model, 20 << 20, 18 << 20)
    peaks = {"peak_bytes_reserved": 63 << 20, "peak_bytes_in_use": 58 << 20}
    monkeypatch.setattr(session_module.devices, "device_memory_stats", lambda: dict(peaks))
    monkeypatch.setattr(session, "_placed_prediction", lambda: (56 << 20, 2 << 20))
    installed = []

    def install(measured, fallback, in_use, source, outcome="ran"):
        installed.append((measured, in_use, source, outcome))
        model.train_function = lambda iterator: "refined"

    monkeypatch.setattr(session, "_install_calibrated", install)
    before = [v.numpy() for v in model.trainable_variables]

    out_of_memory = updates_then_fails(model, tf.errors.ResourceExhaustedError, "OOM when allocating tensor")

    assert session._guarded_first_call(out_of_memory, None, lambda it: "fallback") == "refined"  # pylint: disable=protected-access
    assert installed == [(63 << 20, 58 << 20, State.CALIBRATED, "out_of_memory")]
    assert session.state is State.REFINED and session.control.refinements == 1
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))
    # without a placement to refine from, the probe's plan trains as before
    session.control.state = State.CALIBRATED
    monkeypatch.setattr(session, "_placed_prediction", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert session._guarded_first_call(out_of_memory, None, lambda it: "fallback") == "fallback"  # pylint: disable=protected-access
    assert session.state is State.FALLBACK and len(installed) == 1


def test_a_fall_back_that_runs_out_of_memory_too_restores_the_variables_and_refuses_the_budget():
    """ResNet-50 + Adam, batch 258 under 512 MiB: after the calibrated plan ran out of memory, the probe's plan ran
    out in the next step (the pool held what the failed plan left) and fit ended with the variables half updated.
    The fall-back's first call is guarded too: the variables are restored and the budget refused."""
    model = cnn()
    session = after_the_probe(model, 1 << 20, 1 << 20)
    before = [v.numpy() for v in model.trainable_variables]

    out_of_memory = updates_then_fails(model, tf.errors.ResourceExhaustedError, "OOM when allocating tensor")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(dymem_tf.BudgetTooSmallError, match="fell back to the least-memory plan"):
            session._guarded_first_call(out_of_memory, None, out_of_memory)  # pylint: disable=protected-access
    assert session.state is State.FALLBACK and model.train_function is out_of_memory
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_a_guarded_step_that_fails_otherwise_than_out_of_memory_restores_the_variables_and_raises():
    """An unexpected error of a guarded first step (the LSTM's least-memory plan under 7 MiB failed with an
    InvalidArgumentError after its updates could have run) leaves the variables as they were before it."""
    model = cnn()
    session = after_the_probe(model, 1 << 20, 1 << 20)
    before = [v.numpy() for v in model.trainable_variables]

    fails = updates_then_fails(model, tf.errors.InvalidArgumentError, "cannot compute OptionalHasValue")

    with pytest.raises(tf.errors.InvalidArgumentError, match="OptionalHasValue"):
        session._guarded_first_call(fails, None, lambda it: "fallback")  # pylint: disable=protected-access
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


@pytest.mark.skipif(not allocator.is_active(), reason="GTBM's mobility map needs the GTBM allocator")
def test_the_mobility_map_belongs_to_the_function_that_runs_and_is_cleared_when_the_fit_ends():
    """Suspected bug 3: the pass merged every plan's map into one, never cleared, installed whole on every apply: a
    fall-back ran with the calibrated plan's grouping, and a second callback's map replaced the first's."""
    x, y = images()
    sizes = []
    watch = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: sizes.append(
        allocator.mobility_map_size()))
    cb = dymem_tf.DymemCallback(None, min_swap_bytes=0, verbose=0)
    cnn().fit(x, y, batch_size=8, verbose=0, callbacks=[cb, watch])
    planned = len(cb.records[-1].plan.mobility)
    assert sizes and all(size == planned for size in sizes)  # this function's graph's map, while it trains
    assert allocator.mobility_map_size() == 0  # and none after the fit
    other = dymem_tf.DymemCallback(None, min_swap_bytes=0, verbose=0)
    sizes.clear()
    cnn(size=24).fit(*images(size=24), batch_size=8, verbose=0, callbacks=[other, watch])
    assert sizes and all(size == len(other.records[-1].plan.mobility) for size in sizes)


def test_without_deferred_updates_nothing_is_offloaded_under_a_budget():
    """Suspected bug 4: with defer_updates=False under a budget on the CPU the optimizer state and weights were
    moved to host memory, while the planner (which needs deferral to offload) brought nothing back and emitted no
    record for them."""
    config = DymemConfig.from_arguments("64MiB", defer_updates=False)
    assert config.offloading(64 << 20) == (False, False)
    x, y = images()
    model = cnn()
    resident = []
    watch = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: resident.append(
        variables.device_resident_bytes(model)))
    cb = dymem_tf.DymemCallback("64MiB", defer_updates=False, min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[cb, watch])
    assert resident and all(r == variables.persistent_bytes(model) for r in resident)
    assert not any(r.plan.offloaded_variables or r.plan.offloaded_weights for r in cb.records)


def test_a_fit_lets_go_of_its_graph_and_the_next_fit_reuses_its_plan():
    """Suspected bug 8: the pass kept every record (each with its step graph) and, under a budget, the last graph
    for the whole fit. Records now belong to a fit, the graph is let go when it ends, and the next fit of the same
    callback and model trains with the plan it ended with, untraced."""
    x, y = images()
    model = cnn()
    cb = dymem_tf.DymemCallback("64MiB", min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[cb])
    first = cb.session
    assert not cb.pass_.holds_graph
    assert [r.plan.params.stage for r in cb.records] == ["probe", "calibrated"]
    plan = cb.plan
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[cb])
    assert cb.session is not first and cb.session.state is first.state
    assert [r.plan for r in cb.records] == [plan]  # the plan it trains with; no probe, nothing planned again
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[cb])  # another batch size: planned for it
    assert [r.plan.params.stage for r in cb.records] == ["probe", "calibrated"] and cb.plan.batch_size == 4
