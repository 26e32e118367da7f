"""DymemCallback changes nothing but the train step, and only during its own ``fit``.

The Keras conformance run (``make keras-conformance``, docs/reliability.md) found:

* no ``log_dir``: nothing is written, in particular nothing into a Keras ``TensorBoard`` callback's log directory;
* ``jit_compile``: the model keeps the user's value; only the rewritten train function runs without XLA, the
  evaluate and predict functions traced during and after ``fit`` keep it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import dymem_tf

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


def tf_functions(fn, depth=0, seen=None) -> list:
    """The ``tf.function`` objects a Keras train/test/predict function calls (through closures and wrappers)."""
    seen = set() if seen is None else seen
    if fn is None or id(fn) in seen or depth > 8:
        return []
    seen.add(id(fn))
    fn = getattr(fn, "__wrapped__", fn)
    found = [fn] if hasattr(fn, "_jit_compile") and hasattr(fn, "get_concrete_function") else []
    fn = getattr(fn, "_python_function", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value):
            found += tf_functions(value, depth + 1, seen)
    return found


def xla(fn) -> set:
    """The ``jit_compile`` settings of the per-step ``tf.function`` under a Keras function."""
    return {f._jit_compile for f in tf_functions(fn) if f.__name__ == "one_step_on_data"}  # noqa: SLF001


# ------------------------------------------------------------------------------------------------- no log_dir
def test_without_log_dir_nothing_goes_into_a_keras_tensorboard_log_dir(tmp_path):
    model, x, y = model_and_data()
    cb = dymem_tf.DymemCallback(min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path)), cb])
    assert cb.plan is not None and cb.plan.swaps
    assert sorted(os.listdir(tmp_path)) == ["train"]  # Keras' own run only


# ------------------------------------------------------------------------------------------------- jit_compile
def test_jit_compile_stays_on_for_evaluate_and_predict():
    model, x, y = model_and_data(jit_compile=True)
    seen = {}

    def on_epoch_end(epoch, logs):
        seen["jit_compile"] = model.jit_compile
        seen["train"] = xla(model.train_function)
        seen["test"] = xla(model.test_function)

    cb = dymem_tf.DymemCallback(min_swap_bytes=0, verbose=0)
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
