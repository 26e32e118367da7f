"""``DymemCallback()``'s default, ``memory_budget="auto"``: a step that fits the device trains as compiled.

A step that fits runs the user's own train function (XLA included): no pass, no swap op, no probe. One that does
not fit is covered by ``tests/test_first_step.py`` (its first step runs out of the device, is planned for it and
trains bit-identically to a run without Dymem on a larger device).
"""
import inspect
import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import dymem_tf
from dymem_tf.keras import arguments, callback, fits_first

from conftest import proc_result, xla  # the tests folder is on sys.path (pytest's default import mode)


def _cnn(jit: bool) -> keras.Model:
    keras.backend.clear_session()
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    return model


def _fit(model, callbacks):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16, 16, 3)).astype("float32")
    return model.fit(x, np.arange(32) % 10, batch_size=8, epochs=2, shuffle=False, verbose=0,
                     callbacks=callbacks).history["loss"]


class _TrainFunctions(keras.callbacks.Callback):
    """The train function each batch ran with (Keras reads ``model.train_function`` at every step)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.train_function)


@pytest.fixture
def determinism(request):
    """Op determinism on, except for ``jit_compile=True``: Keras turns XLA off while it is on."""
    from tensorflow.python.framework import config as tf_config

    was_on = tf_config.is_op_determinism_enabled()
    if request.param:
        tf_config.enable_op_determinism()
    else:
        tf_config.disable_op_determinism()
    yield
    if was_on:
        tf_config.enable_op_determinism()
    else:
        tf_config.disable_op_determinism()


@pytest.mark.parametrize("jit,determinism", [(False, True), (True, False)], indirect=["determinism"])
def test_a_step_that_fits_trains_as_compiled_with_nothing_swapped(jit, determinism, capsys):
    plain = _fit(_cnn(jit), [])
    model, seen = _cnn(jit), _TrainFunctions()
    cb = dymem_tf.DymemCallback()
    losses = _fit(model, [cb, seen])
    assert losses == plain  # with jit_compile=True too: the step ran through XLA as the plain run did
    assert cb.records == [] and cb.plan is None and not cb.plan_request.probe  # no pass, so no swap op and no probe
    assert "the train step fits the device" in capsys.readouterr().out
    # from the second step on the model's own train function runs, not a wrapper
    assert not getattr(seen.seen[1], "_dymem_wrapped", False) and len({id(f) for f in seen.seen[1:4]}) == 1
    assert xla(seen.seen[1]) == {jit}  # with the XLA setting the user compiled it with


def test_one_batch_serves_the_first_batch_again_with_the_iterators_type():
    data = tf.data.Dataset.from_tensor_slices((np.arange(10, dtype="float32").reshape(5, 2), np.arange(5))).batch(2)
    iterator = iter(data)
    batch = fits_first.one_batch(iterator, 1)
    assert batch is not None
    again = batch()
    assert again.element_spec == iterator.element_spec  # the traced train function serves both
    first = next(again)
    assert np.array_equal(first[0], [[0, 1], [2, 3]]) and np.array_equal(batch().get_next()[1], [0, 1])
    assert np.array_equal(next(iterator)[1], [2, 3])  # the batch was taken off fit's iterator
    assert fits_first.one_batch(iterator, 2) is None and fits_first.one_batch([1, 2], 1) is None


def test_the_signature_reads_as_documented():
    params = inspect.signature(dymem_tf.DymemCallback).parameters
    assert params["memory_budget"].default == "auto"
    assert params["memory_budget"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name != "memory_budget")
    with pytest.raises(TypeError):
        dymem_tf.DymemCallback("auto", "dymem")  # pylint: disable=too-many-function-args


def test_device_is_the_former_name_of_profile(monkeypatch):
    monkeypatch.setattr(arguments, "_DEVICE_NAME_WARNED", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = dymem_tf.DymemCallback(device="h200")
        second = dymem_tf.DymemCallback(device="v100")
    assert first.profile.name == "h200" and second.profile.name == "v100"
    said = [w for w in caught if issubclass(w.category, FutureWarning) and "profile=" in str(w.message)]
    assert len(said) == 1  # once per process
    assert dymem_tf.DymemCallback(profile="a100").profile.name == "a100"
    with pytest.raises(ValueError, match="profile=... only"):
        dymem_tf.DymemCallback(profile="a100", device="h100")


def test_offloading_asked_for_on_a_gpu_says_that_it_does_nothing_there(monkeypatch):
    monkeypatch.setattr(callback.devices, "training_gpus", lambda: ["GPU:0"])
    cb = dymem_tf.DymemCallback(offload_optimizer_state=True)
    told = arguments.options_off_here(cb.config)  # what the callback warns about once, at its first fit
    assert "offload_optimizer_state=True has no effect on GPUs" in told
    assert arguments.options_off_here(dymem_tf.DymemCallback().config) is None  # the default (None): nothing to say
    assert cb.config.offloading(64 << 20) == (False, False)  # and it is off there


def test_the_pass_is_armed_with_an_immutable_request_and_holds_no_callback_state():
    import dataclasses

    from dymem_tf.planning import pipeline

    from dymem_tf.keras.config import DymemConfig

    cb = dymem_tf.DymemCallback("64MiB", min_swap_bytes=1 << 20)
    assert cb.plan_request.budget_bytes == 64 << 20 and not cb.plan_request.probe
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.plan_request.probe = True  # a session replaces its request whole, per state of the first step
    # one frozen configuration of the callback's arguments; the planner's settings are made from it, once
    assert isinstance(cb.config, DymemConfig) and cb.config.memory_budget == "64MiB"
    assert cb.config.budget_bytes == 64 << 20 and cb.memory_budget == "64MiB"  # as given, and in bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.config.min_swap_bytes = 0
    with pytest.raises(AttributeError):
        cb.min_swap_bytes = 0  # the callback's knobs read the configuration
    assert isinstance(cb.settings, pipeline.PlanSettings) and cb.pass_.settings is cb.settings
    assert cb.settings.min_swap_bytes == 1 << 20 and cb.settings.profile is cb.profile is cb.config.profile
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.settings.min_swap_bytes = 0
    # what changes during a fit lives in the request only: the shared settings keep no budget, and the pass
    # none of the request's fields
    assert cb.settings.budget_bytes is None and not cb.settings.least_memory and cb.settings.memory is None
    for name in ("probe", "calibration", "memory", "persistent_bytes", "default_batch_size", "budget_bytes",
                 "headroom", "refusal"):
        assert not hasattr(cb.pass_, name), name


def test_an_option_that_does_nothing_without_another_says_so():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dymem_tf.DymemCallback(trace_allocations=True)
        dymem_tf.DymemCallback(trace_allocations=True, log_dir="logs/x")
    said = [str(w.message) for w in caught if "trace_allocations" in str(w.message)]
    assert len(said) == 1 and "no log_dir was given" in said[0]


WEIGHTS_OVER_DEVICE = r"""
import hashlib, json, os, sys, warnings
import numpy as np, keras, tensorflow as tf
import dymem_tf
from dymem_tf.memory import allocator
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)
# 36 x 1 MiB of weights: with Adam's two slots each, 108 MiB of weights and state, more than the 96 MiB device
inp = keras.Input((512,))
h = inp
for _ in range(36):
    h = keras.layers.Dense(512, use_bias=False)(h)
model = keras.Model(inp, keras.layers.Dense(10)(h))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(64, 512)).astype("float32")
callbacks = [dymem_tf.DymemCallback(verbose=1)] if sys.argv[1] == "auto" else []
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hist = model.fit(x, np.arange(64) % 10, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
out = {"loss": hist.history["loss"],
       "weights": hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.weights)).hexdigest(),
       "limit": allocator.get_memory_limit()}
print("RESULT" + json.dumps(out), flush=True)
"""


def test_weights_and_state_larger_than_the_device_are_offloaded_not_a_crash(python_subprocess):
    # Regression: the optimizer's build on the device ran out of memory midway, Keras had marked it built, and the
    # first step failed with "'Adam' object has no attribute '_momentums'". Now the step is planned for the device
    # with the state in host memory, and trains as a plain run on a device large enough does.
    auto, plain, said = _auto_on_96_mib_and_plain(python_subprocess, WEIGHTS_OVER_DEVICE)
    assert "do not fit the device" in said, said[-2000:]
    assert auto["limit"] == 96 * 2**20
    assert auto["loss"] == plain["loss"] and auto["weights"] == plain["weights"]


def _auto_on_96_mib_and_plain(python_subprocess, script: str) -> tuple[dict, dict, str]:
    """``script``'s results with ``memory_budget="auto"`` on a 96 MiB device and plain on a 1 GiB one, and what
    the auto run printed."""
    procs = {mode: python_subprocess(script.replace("sys.argv[1]", repr(mode)),
                                     env={"DYMEM_DEVICE_MEMORY_LIMIT": limit, "TF_ENABLE_ONEDNN_OPTS": "0"})
             for mode, limit in (("auto", "96MiB"), ("plain", "1GiB"))}
    return proc_result(procs["auto"]), proc_result(procs["plain"]), procs["auto"].stdout


def test_weights_and_state_within_the_step_slack_of_the_device_are_planned_for_before_the_state_is_packed(
        python_subprocess):
    # Regression: DenseNet-121 32px + SGD on a 56 MiB device (53.5 MiB of variables) packed its state onto the
    # device, ran out midway, and the plan made after it found 1 MiB more of the persistent group reserved than a
    # plan made at once (its refined plans missed the budget's allowance, and the probe's plan trained). Variables
    # that leave less than the step's slack free mean a plain step that is planned for the device anyway: it is
    # planned before anything is packed, and trains as a plain run on a device large enough does.
    from dymem_tf.planning import first_step
    mib = 2**20
    variable_bytes = 30 * 3 * mib  # 30 x 1 MiB of weights with Adam's two slots each: 90 MiB, under the 96 MiB
    assert 96 * mib - first_step.slack_bytes(96 * mib) < variable_bytes < 96 * mib  # device, within its slack
    auto, plain, said = _auto_on_96_mib_and_plain(python_subprocess,
                                                  WEIGHTS_OVER_DEVICE.replace("range(36)", "range(30)"))
    assert "leave less than the step's slack free of the device's" in said, said[-2000:]
    assert "did not fit the device's" not in said  # the state was never packed onto the device
    assert auto["loss"] == plain["loss"] and auto["weights"] == plain["weights"]


def test_state_built_for_a_first_plain_step_leaves_no_pageblock_behind_when_offloaded():
    # Regression: the state was built on the device, each slot's 200-byte handle next to it; once a plan offloaded
    # the state, those handles (and small variables packed into their pageblocks) kept the state's pageblocks
    # reserved (MobileNetV2 32px + Adam after its plain step ran out of a 50 MiB device: 12 MiB reserved for
    # 2.3 MiB in use, the probe measured 10 MiB more and the budget was refused). Built by fits_first, the state
    # takes the device for the plain step and leaves no pageblock behind when a plan offloads it.
    from dymem_tf.memory import allocator
    from dymem_tf.keras import variables

    if not allocator.is_active():
        pytest.skip("needs GTBM on the CPU device")
    keras.backend.clear_session()
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=3)
    model.compile(optimizer="adam", loss="mse")
    state = variables.optimizer_state_bytes(model)

    def persistent():
        return allocator.memory_stats()["groups"]["persistent"]

    before = persistent()
    assert fits_first._build_optimizer(model) is False  # pylint: disable=protected-access  (made in the host arena)
    assert persistent()["in_use"] - before["in_use"] < state
    assert fits_first._place_state(model)  # pylint: disable=protected-access  (the first call places it)
    assert persistent()["in_use"] - before["in_use"] >= state  # on the device, as Keras would build it
    assert variables.offload_optimizer_state(model, 1 << 16) > 0
    variables.compact_weights(model)
    # built on the device, 4 MiB more than before the build stayed reserved here
    assert persistent()["reserved"] <= before["reserved"], (before, persistent())
    variables.bring_back_offloaded(model)


PLAIN_STEP_OUT_OF_MEMORY = r"""
import gc, json, weakref
import numpy as np, keras
import dymem_tf
from dymem_tf.keras import fits_first, session, variables
from dymem_tf.memory import allocator, placement
keras.utils.set_random_seed(0)
inp = keras.Input((64, 64, 3))
h = inp
for _ in range(6):  # 16 MiB feature maps at batch 32: the plain step needs more than the 96 MiB device
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
h = keras.layers.Dense(8192)(keras.layers.GlobalAveragePooling2D()(h))  # 1.3 MiB of weights, 2.6 MiB of Adam
model = keras.Model(inp, keras.layers.Dense(10)(h))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
plain, seen = [], {}
wrap = fits_first.first_call_function
fits_first.first_call_function = lambda cb, fn, cap, **kw: (plain.append(weakref.ref(fn)), wrap(cb, fn, cap, **kw))[1]
begin = session.FitSession._plan
def planning(self, *args, **kwargs):
    gc.collect()
    seen["plain_alive_while_planning"] = bool(plain) and plain[0]() is not None
    begin(self, *args, **kwargs)
    seen["cap"], seen["device"] = allocator.get_memory_limit(), 96 << 20
    seen["budget_and_others"] = self.budget_bytes + self.others_bytes
    stats = allocator.memory_stats()
    seen["persistent_reserved"] = stats["groups"]["persistent"]["reserved"]
    seen["persistent_needed"] = placement.PersistentGroup(0, 0, stats["block_size"]).reserved_with(
        variables.device_resident_bytes(model))
session.FitSession._plan = planning
x = np.random.default_rng(0).normal(size=(64, 64, 64, 3)).astype("float32")
cb = dymem_tf.DymemCallback(verbose=1)
hist = model.fit(x, np.arange(64) % 10, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
seen["trained"] = len(hist.history["loss"]) == 1
seen["stages"] = [r.plan.params.stage for r in cb.records]
print("RESULT" + json.dumps(seen), flush=True)
"""


def test_a_plain_first_step_that_ran_out_of_memory_is_let_go_before_the_step_is_planned(python_subprocess):
    # Regression: the plan for the device was made, and its probe run, inside the except block of the failed
    # plain step, whose traceback kept that step's function and state alive: a TemporaryVariable Grappler had made
    # for a gradient sum (8 MiB at ResNet-50 64px batch 258) stayed on the device through the probe, which then
    # measured 485 MiB of a 512 MiB device and refused batch 258 (largest_batch: 258 trained at 18b349f).
    proc = python_subprocess(PLAIN_STEP_OUT_OF_MEMORY, env={"DYMEM_DEVICE_MEMORY_LIMIT": "96MiB",
                                                           "TF_ENABLE_ONEDNN_OPTS": "0"})
    result = proc_result(proc)
    assert "ran out of the device" in proc.stdout, proc.stdout[-2000:]
    assert result["plain_alive_while_planning"] is False
    # Regression: the state was placed on the device before fit's iterator and the plain step's instantiation
    # made their long-lived small tensors, which went into the pageblocks above the state and kept them reserved
    # once the plan offloaded it (U-Net under 53 MiB: the probe measured one pageblock more and was refused)
    assert result["persistent_reserved"] <= result["persistent_needed"], result
    assert result["trained"] and result["stages"][0] == "probe"
    # planned for the device: its budget and what else it holds, measured together, make up the device's cap
    assert result["budget_and_others"] == result["cap"] == result["device"], result


BELOW_THE_PAGEBLOCK_FLOOR = r"""
import json
import numpy as np, keras
import dymem_tf
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6, 8)), keras.layers.LSTM(16), keras.layers.Dense(10)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = [w.numpy() for w in model.weights]
from dymem_tf.memory import allocator
allocator.set_memory_limit(3 << 20)  # the device shrunk under GTBM's 2 MiB pageblocks (its block size is kept)
try:
    model.fit(np.ones((16, 6, 8), "float32"), np.arange(16) % 10, batch_size=8, verbose=0,
              callbacks=[dymem_tf.DymemCallback(verbose=1)])
    outcome = "trained"
except dymem_tf.BudgetTooSmallError as err:
    outcome = str(err)
unchanged = all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))
print("RESULT" + json.dumps({"outcome": outcome, "unchanged": unchanged}), flush=True)
"""


def test_a_device_below_gtbms_pageblock_floor_is_refused_before_the_plain_step(python_subprocess):
    # Regression: the plain first step of "auto" ran before the pageblock-floor check of a planned step, and on a
    # 3 MiB device TF's iterator failed instead ("Cannot parse tensor from proto", budget_reliability's LSTM)
    proc = python_subprocess(BELOW_THE_PAGEBLOCK_FLOOR, env={"DYMEM_DEVICE_MEMORY_LIMIT": "1GiB",
                                                            "TF_ENABLE_ONEDNN_OPTS": "0"})
    result = proc_result(proc)
    assert "smaller than the least GTBM can train in: 6.0 MiB" in result["outcome"], result
    assert result["unchanged"]


PACKING_OUT_OF_MEMORY = r"""
import hashlib, json, sys
import numpy as np, keras, tensorflow as tf
import dymem_tf
from dymem_tf.keras import fits_first, variables
from dymem_tf.memory import allocator
from dymem_tf.ops import swap_ops
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
seen = {}
if sys.argv[1] == "auto":
    place = fits_first._place_state
    def squeezed(m):
        # the device shrinks while the state is packed: what the pageblocks other groups held did on DenseNet-121
        # under 56 MiB (53.5 MiB of variables on a 55.9 MiB device); the packing runs out of GTBM's budget midway
        limit = allocator.get_memory_limit()
        half = variables.optimizer_state_bytes(m) // 2
        allocator.set_memory_limit(int(allocator.memory_stats()["bytes_reserved"]) + half)
        try:
            seen["placed"] = place(m)
        finally:
            allocator.set_memory_limit(limit)
        seen["weights_offloaded_after"] = sum(swap_ops.variable_is_offloaded(v) for v in model.variables)
        return seen["placed"]
    fits_first._place_state = squeezed
cbs = [dymem_tf.DymemCallback(verbose=1)] if sys.argv[1] == "auto" else []
x = np.random.default_rng(0).normal(size=(64, 16, 16, 3)).astype("float32")
hist = model.fit(x, np.arange(64) % 10, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=cbs)
seen.update(loss=hist.history["loss"], steps=len(hist.history["loss"]),
            weights=hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.weights)).hexdigest(),
            stages=[r.plan.params.stage for r in cbs[0].records] if cbs else None)
print("RESULT" + json.dumps(seen), flush=True)
"""


def test_state_that_runs_out_of_the_device_while_packed_is_planned_for_not_refused(python_subprocess):
    # Regression: DenseNet-121 32px + SGD on a 56 MiB device was refused ("the optimizer's state ran out of the
    # device") while 42 MiB trained: packing the state made in host memory onto the device ran out midway. Now the
    # weights come back, the step is planned for the device with the state in host memory, and it trains on the
    # same batches bit-identically to a plain run.
    env = {"DYMEM_DEVICE_MEMORY_LIMIT": "64MiB", "TF_ENABLE_ONEDNN_OPTS": "0"}
    auto = python_subprocess(PACKING_OUT_OF_MEMORY.replace("sys.argv[1]", "'auto'"), env=env)
    result = proc_result(auto)
    assert result["placed"] is False, result
    assert result["weights_offloaded_after"] == 0, result  # the weights the packing left in host memory are back
    assert "did not fit the device's" in auto.stdout and "planned for the device" in auto.stdout, auto.stdout[-2000:]
    assert result["stages"][0] == "probe", result
    plain = proc_result(python_subprocess(PACKING_OUT_OF_MEMORY.replace("sys.argv[1]", "'plain'"), env=env))
    assert result["steps"] == plain["steps"] == 1
    assert result["loss"] == plain["loss"] and result["weights"] == plain["weights"]
