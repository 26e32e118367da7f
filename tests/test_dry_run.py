"""``dymem_tf.dry_run``: the plan of any compiled in-memory model, without training."""
import numpy as np
import pytest
import keras

import dymem_tf
from dymem_tf.keras import dry_run
from dymem_tf.planning import planner
from test_fits_first import _cnn  # the tests folder is on sys.path (pytest's default import mode)


def _two_headed() -> keras.Model:
    """A functional model with dict inputs and dict outputs (a sparse and a dense loss); four convolutions, whose
    feature maps at batch 64 save more than a pageblock when swapped (below it nothing is swapped without a
    budget)."""
    keras.utils.set_random_seed(0)
    image, meta = keras.Input((16, 16, 3), name="image"), keras.Input((4,), name="meta")
    h = image
    for _ in range(4):
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(h), meta])
    model = keras.Model({"image": image, "meta": meta},
                        {"cls": keras.layers.Dense(10, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)})
    model.compile(optimizer="adam", loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                          "reg": "mse"})
    return model


def _state(model) -> list[np.ndarray]:
    return [v.numpy().copy() for v in model.variables + model.optimizer.variables]


def test_a_dict_input_model_is_planned_without_training_or_changing_a_variable():
    model = _two_headed()
    least = dymem_tf.dry_run(model, 64, memory_budget=None, profile="cpu")
    before = _state(model)
    fits = dymem_tf.dry_run(model, 64)  # "auto": this machine's device, which the step fits
    assert least.swaps and least.batch_size == 64
    assert least.predicted.no_swap_peak_bytes - least.predicted.peak_bytes >= planner.MIN_PEAK_SAVING
    # at batch 16 every swap together saves less than a pageblock: nothing is swapped, and the plan says why; with
    # min_swap_bytes 0 every candidate is
    small = dymem_tf.dry_run(model, 16, memory_budget=None, profile="cpu")
    assert not small.swaps and any(n.startswith("nothing swapped: the ") for n in small.notes)
    assert dymem_tf.dry_run(model, 16, memory_budget=None, profile="cpu", min_swap_bytes=0).swaps
    assert not fits.swaps and "dymem_tf plan" in fits.summary()
    after = _state(model)
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(before, after))
    assert int(model.optimizer.iterations) == 0
    # a budget between the least-memory plan and the no-swap step: the plan swaps to fit it
    budget = int((least.predicted.peak_bytes + fits.predicted.peak_bytes) / 2 / (1 - 0.1))
    between = dymem_tf.dry_run(model, 64, memory_budget=budget, profile="cpu")
    assert between.swaps and between.predicted.peak_bytes <= budget


def test_the_sample_batch_follows_the_model_and_its_losses():
    x, y = dry_run.sample_batch(_two_headed(), 5)
    assert set(x) == {"image", "meta"} and x["image"].shape == (5, 16, 16, 3) and x["meta"].shape == (5, 4)
    assert y["cls"].shape == (5,) and y["cls"].dtype == np.int64  # sparse labels for the sparse loss
    assert y["reg"].shape == (5, 1) and y["reg"].dtype == np.float32


def test_a_subclassed_model_needs_a_batch_and_bad_arguments_say_what_to_do():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="pass a batch as x=... and y=..."):
        dymem_tf.dry_run(net, 4)
    plan = dymem_tf.dry_run(net, 4, memory_budget=None, x=np.zeros((4, 8), "float32"), y=np.zeros((4, 3), "float32"))
    assert plan.batch_size == 4
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        dymem_tf.dry_run(_two_headed(), 0)
    with pytest.raises(ValueError, match="unknown policy"):
        dymem_tf.dry_run(_two_headed(), 4, policy="fastest")
    uncompiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compile the model first"):
        dymem_tf.dry_run(uncompiled, 4)


def _decisions(plan) -> list:
    return [(s.tensor, s.kind, [(i.trigger_op, tuple(i.consumers)) for i in s.swap_ins]) for s in plan.swaps]


@pytest.mark.parametrize("jit_compile", [True, "auto"])
def test_a_model_compiled_for_xla_is_planned_as_the_callback_plans_it(jit_compile):
    """The callback plans the step without XLA (an XLA cluster would swallow its gradient ops); so does the dry run,
    which gives the callback's plan, leaves the model's own train function and XLA setting as they were."""
    model = _cnn(jit_compile)  # the XLA tests' model
    own, asked = model.make_train_function() or model.train_function, model.jit_compile
    planned = dymem_tf.dry_run(model, 8, memory_budget=None, min_swap_bytes=0)
    assert planned.swaps and model.train_function is own and model.jit_compile == asked
    cb = dymem_tf.DymemCallback(None, min_swap_bytes=0, verbose=0)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 16, 16, 3)).astype("float32"), np.arange(8) % 10, batch_size=8, verbose=0,
              callbacks=[cb])
    assert _decisions(cb.plan) == _decisions(planned)
    assert cb.plan.predicted.peak_bytes == planned.predicted.peak_bytes
