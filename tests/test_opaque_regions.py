"""Steps with constructs the planner cannot see into by itself (issue 47): calls TF does not inline, conditionals and
loops. Each is either seen into (its outputs sized and swapped like any op's) or planned around as one region, and
training stays bit-identical to plain training."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

import dymem_tf

tf.config.experimental.enable_op_determinism()

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def images(n: int, size: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.uniform(size=(n, size, size, 3)).astype("float32"), rng.integers(0, 10, size=(n,))


def fit(build, x, y, callbacks=(), batch_size=8):
    """(losses, weights) of one epoch of ``build()``'s model from seed 1."""
    keras.utils.set_random_seed(1)
    model = build()
    history = model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))
    return history.history["loss"], [w.numpy() for w in model.weights]


def assert_identical(plain, dymem):
    assert plain[0] == dymem[0]
    assert all(np.array_equal(a, b) for a, b in zip(plain[1], dymem[1]))


# ----------------------------------------------------------------------------------------------------------------
# Calls TF does not inline

def grouped_cnn() -> keras.Model:
    """Grouped convolutions, as in ConvNeXt: on the CPU Keras runs each as a ``tf.function(jit_compile=True)`` call
    that stays a StatefulPartitionedCall in the step graph."""
    inp = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.Conv2D(8, 3, padding="same", groups=8)(h)
    h = keras.layers.Activation("gelu")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", groups=4)(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=LOSS)
    return model


def test_the_outputs_of_a_call_tf_does_not_inline_are_sized_from_its_body_and_swapped():
    """The call's outputs (kept for its gradient) once had no shape, and the step was left unmodified."""
    x, y = images(32)
    plain = fit(grouped_cnn, x, y)
    cb = dymem_tf.DymemCallback(memory_budget=None, verbose=0)
    dymem = fit(grouped_cnn, x, y, [cb])
    assert not cb.skipped
    calls = [s for s in cb.plan.swaps if "/StatefulPartitionedCall:" in s.tensor]
    assert calls and all(s.bytes == 8 * 16 * 16 * 8 * 4 for s in calls)
    assert_identical(plain, dymem)
