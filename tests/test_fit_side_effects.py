"""DymemCallback changes nothing but the train step, and only during its own ``fit``, however that ``fit`` ends.

The Keras conformance run (``make keras-conformance``, docs/reliability.md) found the first two; the third is what a
``fit`` that raises used to leave behind:

* no ``log_dir``: nothing is written, in particular nothing into a Keras ``TensorBoard`` callback's log directory;
* ``jit_compile``: the model keeps the user's value; only the rewritten train function runs without XLA, the
  evaluate and predict functions traced during and after ``fit`` keep it;
* a ``fit`` that raises (in a step, in another callback's ``on_epoch_end``, in the validation run) still takes the
  pass off ``train_step``, drops the wrapped train function, closes the summary writer and stops the allocator
  trace: the next plain ``fit`` runs Keras's own step.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import dymem_tf
from dymem_tf.keras import fit_guard
from dymem_tf.memory import allocator, host_pool

from conftest import xla  # the tests folder is on sys.path (pytest's default import mode)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class FailOnLargeInput(keras.layers.Layer):
    """Identity that fails the step (InvalidArgumentError) when an input value is above 100."""

    def call(self, x):
        tf.debugging.assert_less(tf.reduce_max(x), 100.0, message="a poisoned batch")
        return x


def model_and_data(n=16, poisoned_batch=None, jit_compile=False, batch=8):
    keras.utils.set_random_seed(1)
    inp = keras.Input((8, 8, 3))
    h = FailOnLargeInput()(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(h)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss=LOSS, jit_compile=jit_compile)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 8, 8, 3)).astype("float32")
    if poisoned_batch is not None:
        x[poisoned_batch * batch] = 1e6
    return model, x, np.arange(n) % 10


def assert_left_nothing_behind(model, cb, jit_compile=False):
    assert "train_step" not in model.__dict__
    # the model's train function is Keras' own again (or none): nothing of Dymem's wraps it
    train_function = model.train_function
    assert train_function is None or not (getattr(train_function, "_dymem_wrapped", False)
                                          or hasattr(train_function, "_dymem_guard"))
    assert model.jit_compile is jit_compile
    assert cb._writer is None and cb._exit_guard is None  # pylint: disable=protected-access
    assert not [name for name, value in vars(model).items() if hasattr(value, "_dymem_guard")]


def assert_plain_fit_runs_the_unmodified_step(model, x, y, cb):
    records, swaps_before = len(cb.records), host_pool.host_pool_stats()["num_swap_outs"]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(cb.records) == records
    assert host_pool.host_pool_stats()["num_swap_outs"] == swaps_before
    assert not getattr(model.train_function, "_dymem_wrapped", False)
    assert not hasattr(model.train_function, "_dymem_guard")


# ------------------------------------------------------------------------------------------------- no log_dir
def test_without_log_dir_nothing_goes_into_a_keras_tensorboard_log_dir(tmp_path):
    model, x, y = model_and_data()
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path)), cb])
    assert cb.plan is not None and cb.plan.swaps
    assert sorted(os.listdir(tmp_path)) == ["train"]  # Keras' own run only


# ------------------------------------------------------------------------------------------------- jit_compile
@pytest.fixture(autouse=True)
def without_op_determinism():
    """Keras turns XLA off while op determinism is on (other test modules enable it at import): these tests need
    ``jit_compile`` to mean what the user set, so determinism is off while each runs."""
    from tensorflow.python.framework import config as tf_config

    was_on = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    yield
    if was_on:
        tf_config.enable_op_determinism()


def test_jit_compile_stays_on_for_evaluate_and_predict():
    model, x, y = model_and_data(jit_compile=True)
    seen = {}

    def on_epoch_end(epoch, logs):
        seen["jit_compile"] = model.jit_compile
        seen["train"] = xla(model.train_function)
        seen["test"] = xla(model.test_function)

    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y),
              callbacks=[cb, keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)])
    assert cb.plan.swaps  # the train step was rewritten: it ran without XLA ...
    assert seen == {"jit_compile": True, "train": {False}, "test": {True}}  # ... and only it
    assert model.jit_compile is True
    model.predict(x, verbose=0)
    model.evaluate(x, y, verbose=0)
    assert xla(model.predict_function) == {True} and xla(model.test_function) == {True}
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # a plain fit after it trains with XLA again
    assert xla(model.train_function) == {True}


# ------------------------------------------------------------------------------------------- fit that raises
def test_a_step_that_raises_leaves_nothing_behind(tmp_path):
    model, x, y = model_and_data(n=24, poisoned_batch=2)
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0, log_dir=str(tmp_path),
                                trace_allocations=allocator.is_active())
    with pytest.raises(tf.errors.InvalidArgumentError, match="a poisoned batch"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    assert cb.plan is not None and cb.plan.swaps  # two steps ran rewritten before the third failed
    assert_left_nothing_behind(model, cb)
    if allocator.is_active():
        assert not allocator.trace_info()["active"]
        assert os.path.exists(tmp_path / "dymem" / "plugins" / "dymem" / "trace.csv")
    good = np.where(x > 100.0, 0.0, x).astype("float32")
    assert_plain_fit_runs_the_unmodified_step(model, good, y, cb)


@pytest.mark.parametrize("position", ["before", "after"])
def test_a_callback_raising_in_on_epoch_end_leaves_nothing_behind(position):
    model, x, y = model_and_data(jit_compile=True)

    def on_epoch_end(epoch, logs):
        raise RuntimeError("stop here")

    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    raiser = keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)
    callbacks = [raiser, cb] if position == "before" else [cb, raiser]
    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    assert cb.plan.swaps
    assert_left_nothing_behind(model, cb, jit_compile=True)
    assert_plain_fit_runs_the_unmodified_step(model, x, y, cb)


def test_a_train_function_replaced_during_fit_is_guarded_too():
    """A train function installed during ``fit`` (after a first step, say) is guarded from the next step on."""
    model, x, y = model_and_data(n=32, poisoned_batch=3)

    class Replace(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                model.make_train_function(force=True)  # a new function, traced from the (rewritten) train_step

    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="a poisoned batch"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[cb, Replace()])
    assert_left_nothing_behind(model, cb)
    good = np.where(x > 100.0, 0.0, x).astype("float32")
    assert_plain_fit_runs_the_unmodified_step(model, good, y, cb)


def test_a_validation_run_that_raises_leaves_nothing_behind():
    model, x, y = model_and_data()
    _, vx, vy = model_and_data(poisoned_batch=0)
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="a poisoned batch"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(vx, vy), callbacks=[cb])
    assert cb.plan.swaps
    assert_left_nothing_behind(model, cb)
    assert not hasattr(model.test_function, "_dymem_guard")
    assert_plain_fit_runs_the_unmodified_step(model, x, y, cb)


@pytest.mark.parametrize("failure", ["step", "on_epoch_end", "validation"])
def test_a_failed_fit_closes_the_summary_writer_and_stops_the_allocator_trace(tmp_path, failure):
    """Whatever raises, the run's writer is closed (its files flushed, ``meta.json`` marked closed) and the
    allocator trace stops recording and is saved in the run."""
    import json

    model, x, y = model_and_data(n=24, poisoned_batch=2 if failure == "step" else None)
    _, vx, vy = model_and_data(poisoned_batch=0)
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0, log_dir=str(tmp_path),
                                trace_allocations=allocator.is_active())
    writers = []

    def on_epoch_end(epoch, logs):
        raise RuntimeError("stop here")

    callbacks = [cb, keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: writers.append(cb._writer))]
    kwargs = {}
    if failure == "on_epoch_end":
        callbacks.append(keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end))
    elif failure == "validation":
        kwargs["validation_data"] = (vx, vy)
    with pytest.raises((tf.errors.InvalidArgumentError, RuntimeError), match="a poisoned batch|stop here"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks, **kwargs)
    assert_left_nothing_behind(model, cb)
    writer = writers[0]
    assert writer is not None and writer._closed  # pylint: disable=protected-access
    assert writer._steps_fh is None and writer._tf_writer is None  # pylint: disable=protected-access
    plugin = tmp_path / "dymem" / "plugins" / "dymem"
    with open(plugin / "meta.json", encoding="utf-8") as fh:
        assert "closed" in json.load(fh)
    if allocator.is_active():
        assert not writer._tracing and not allocator.trace_info()["active"]  # pylint: disable=protected-access
        assert os.path.getsize(plugin / "trace.csv") > 0


def test_the_guard_lets_the_end_of_an_epoch_through_and_is_released_after_training():
    model, x, y = model_and_data()
    cleanups = []

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            model.make_train_function(force=True)
            self.guard = fit_guard.FitGuard(self, lambda: cleanups.append(True)).arm()

        def on_train_end(self, logs=None):
            self.guard.release()

    probe = Probe()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # ends each epoch with OutOfRangeError
    model.fit(dataset, epochs=2, verbose=0, callbacks=[probe])
    assert probe.guard.callback_list is not None and not probe.guard.fired and cleanups == []
    assert not [k for k in vars(probe.guard.callback_list) if k.startswith("on_")]
    assert not hasattr(model.train_function, "_dymem_guard")
