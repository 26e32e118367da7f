"""DymemCallback changes nothing but the train step, and only during its own ``fit``.

The Keras conformance run (``make keras-conformance``, docs/reliability.md) found:

* no ``log_dir``: nothing is written, in particular nothing into a Keras ``TensorBoard`` callback's log directory.
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


# ------------------------------------------------------------------------------------------------- no log_dir
def test_without_log_dir_nothing_goes_into_a_keras_tensorboard_log_dir(tmp_path):
    model, x, y = model_and_data()
    cb = dymem_tf.DymemCallback(min_swap_bytes=0, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path)), cb])
    assert cb.plan is not None and cb.plan.swaps
    assert sorted(os.listdir(tmp_path)) == ["train"]  # Keras' own run only
