"""Steps with constructs the planner cannot see into by itself (issue 47): calls TF does not inline, conditionals and
loops. Each is either seen into (its outputs sized and swapped like any op's) or planned around as one region, and
training stays bit-identical to plain training."""
from __future__ import annotations

import numpy as np
import pytest
import keras

import dymem_tf

pytestmark = pytest.mark.usefixtures("deterministic")  # bit-identity checks (conftest.deterministic)

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
    # min_swap_bytes 0: swap every candidate (the model's few 64 KiB maps save less than a pageblock)
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    dymem = fit(grouped_cnn, x, y, [cb])
    assert not cb.skipped
    calls = [s for s in cb.plan.swaps if "/StatefulPartitionedCall:" in s.tensor]
    assert calls and all(s.bytes > 0 for s in calls) and any(s.bytes == 8 * 16 * 16 * 8 * 4 for s in calls)
    assert_identical(plain, dymem)


# ----------------------------------------------------------------------------------------------------------------
# Loops

SEQ, FEATURES, UNITS = 12, 8, 16


def stacked_lstm() -> keras.Model:
    """Two LSTMs, the first returning sequences: on the CPU each runs as a lowered while loop whose accumulated
    lists (each step's gates and states, kept for the gradient loop) are most of the step's memory."""
    model = keras.Sequential([keras.Input((SEQ, FEATURES)), keras.layers.LSTM(UNITS, return_sequences=True),
                              keras.layers.LSTM(UNITS), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    return model


def sequences(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, SEQ, FEATURES)).astype("float32"), rng.integers(0, 10, n)


def test_the_lists_a_forward_loop_accumulates_are_sized_by_their_length_and_element():
    from dymem_tf.keras import dry_run

    traced = dry_run.trace_train_step(stacked_lstm(), 8)
    assert traced.unsupported is None  # once "control-flow": a loop left the step unmodified
    sg = traced.step_graph
    exits = [t for t in sg.tensors.values() if t.dtype == "variant" and sg.ops[t.producer].type == "Exit"]
    sized = [t for t in exits if t.bytes]
    # each loop accumulates its states (8 x 16 floats a step) for the gradient loop: SEQ of them per list
    assert sized and {t.shape for t in sized} >= {(SEQ, 8, UNITS)}
    assert all(t.bytes == 4 * np.prod(t.shape) and not t.persistent for t in sized)
    # a weight read in each iteration is the variable's buffer, stored again and again: no list is sized by it
    assert all(t.shape[1:] != (FEATURES, 4 * UNITS) and t.shape[1:] != (UNITS, 4 * UNITS) for t in sized)
    # the gradient loop's entries wait for its incoming gradient: the lists are read where the loop starts
    enters = [sg.ops[c] for t in sized for c in t.consumers]
    assert enters and all(op.type == "Enter" and op.is_backward for op in enters)
    assert min(op.layer for op in enters) > max(sg.ops[t.producer].layer for t in sized) + 5


def test_a_step_with_loops_is_planned_around_them_and_trains_identically():
    x, y = sequences(32)
    plain = fit(stacked_lstm, x, y)
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    dymem = fit(stacked_lstm, x, y, [cb])
    assert not cb.skipped
    lists = [s for s in cb.plan.swaps if "/while/exit/" in s.tensor]
    assert lists, [s.tensor for s in cb.plan.swaps]
    assert_identical(plain, dymem)


def one_lstm() -> keras.Model:
    """bench/model_zoo.py's LSTM: one LSTM returning its last state, then Dense (its loop's only way to the loss
    is the state carried through the loop's back edge)."""
    model = keras.Sequential([keras.Input((SEQ, FEATURES)), keras.layers.LSTM(UNITS), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    return model


def test_a_forward_loops_inputs_are_forward_ops_and_no_deferral_closes_a_cycle_through_a_loop():
    """The step graph leaves a loop's back edge out; without it the LSTM's input transpose fed nothing on the way
    to the gradients, counted as update arithmetic, and was deferred after Adam's update: a cycle in the graph TF
    ran, whose function then returned a float where Keras's Optional was (an InvalidArgumentError in
    OptionalHasValue, budget_reliability's LSTM under 7 MiB)."""
    from dymem_tf.keras import dry_run
    from dymem_tf.planning import analysis, pipeline

    sg = dry_run.trace_train_step(one_lstm(), 8).step_graph
    back = analysis.loop_back_edges(sg)
    assert back and all(sg.ops[a].type == "NextIteration" and sg.ops[b].type == "Merge" for a, b in back)
    feeding = [n for n, op in sg.ops.items() if op.type in ("Transpose", "TensorListFromTensor")
               and "gradient_tape" not in n and "lstm" in n]
    assert feeding and all(sg.ops[n].phase == "forward" for n in feeding)
    for anchor, op in pipeline.deferrals_for(sg, pipeline.PlanSettings(), always={n for n in sg.ops}):
        assert anchor not in analysis.descendants(sg.graph, [op], extra=back), (anchor, op)
    x, y = sequences(32)
    plain = fit(one_lstm, x, y)
    cb = dymem_tf.DymemCallback(memory_budget="1GiB", min_swap_bytes=0, verbose=0)
    assert_identical(plain, fit(one_lstm, x, y, [cb]))


def test_the_lists_a_gradient_loop_pops_are_streamed_through_host_memory_under_a_budget():
    """Under a budget the loops' accumulators live in host memory: each element is swapped out as it is pushed and
    swapped in as it is popped, inside the loops. The probe and the calibrated plan both stream them."""
    from dymem_tf.keras import dry_run
    from dymem_tf.planning import loop_lists

    sg = dry_run.trace_train_step(stacked_lstm(), 8).step_graph
    streamed = loop_lists.streamable_lists(sg)
    assert streamed and all(sg.tensors[x.tensor].bytes == x.bytes > 0 for x in streamed)
    for x in streamed:
        assert all(sg.ops[push].type == "TensorListPushBack" and sg.ops[push].frame for _, push in x.pushes)
        assert all(sg.ops[pop].type == "TensorListPopBack" and sg.ops[pop].is_backward and readers
                   for pop, *readers in x.pops)
    x, y = sequences(32)
    plain = fit(stacked_lstm, x, y)
    cb = dymem_tf.DymemCallback(memory_budget="1GiB", min_swap_bytes=0, verbose=0)
    dymem = fit(stacked_lstm, x, y, [cb])
    assert [len(r.plan.streamed_lists) for r in cb.records] == [len(streamed)] * 2  # the probe, the calibrated plan
    pushes = sum(len(x.pushes) for x in streamed)
    assert cb.records[-1].report.streamed_lists == len(streamed)
    assert len(cb.records[-1].report.swap_out_ops) >= pushes + sum(len(x.pops) for x in streamed)
    assert_identical(plain, dymem)
