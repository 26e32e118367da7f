"""The executor made to follow the planned order (dymem_tf.planning.sequencing): which ops are chained, when the
swap ops join, the bands, and that a chained step repeats its peak (under a budget, whatever the executor's thread
count)."""
import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest

import dymem_tf
from dymem_tf.planning import pipeline, sequencing
from dymem_tf.planning.analysis import StepGraph

MB = 1 << 20
CPU, GPU = "/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:GPU:0"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_graph(device: str = CPU) -> StepGraph:
    """Two independent forward branches, a conditional op, a loop op, a control-flow op, an op on another device
    and the step's result."""
    spec = {
        "x": {"type": "Placeholder", "bytes": MB},
        "a": {"type": "Relu", "inputs": ["x"], "bytes": MB},
        "b": {"type": "Tanh", "inputs": ["x"], "bytes": MB},
        "c": {"type": "Add", "inputs": ["a", "b"], "bytes": MB},
        "cond": {"type": "Mul", "inputs": ["c"], "bytes": MB},
        "merge": {"type": "Merge", "inputs": ["cond", "c"], "bytes": MB},
        "loop": {"type": "Neg", "inputs": ["c"], "bytes": MB},
        "host": {"type": "Shape", "inputs": ["c"], "bytes": 16},
        "g": {"type": "ReluGrad", "inputs": ["merge", "a"], "bytes": MB, "backward": True},
        "out": {"type": "_Retval", "inputs": ["g"], "bytes": []},
    }
    sg = StepGraph.from_spec(spec)
    for op in sg.ops.values():
        op.device = device
    sg.ops["cond"].conditional = True
    sg.ops["loop"].frame = "while"
    sg.ops["host"].device = CPU if device == GPU else GPU
    return sg


def test_the_sequence_is_the_simulators_order_less_what_cannot_take_an_edge():
    sg = step_graph()
    seq = sequencing.find_sequence(sg)
    chainable = {"a", "b", "c", "g"}
    assert list(seq.ops) == [n for n in sg.execution_order() if n in chainable]


def test_a_gradient_sum_accumulated_in_place_stays_in_tfs_order():
    # Grappler's memory optimizer lowers an AddN of 3+ inputs into a temporary variable and one AssignAdd per input:
    # the sum's rounding follows the order they run in, so the chain must not order them (InceptionV3's weights
    # differed after one step when it did)
    spec = {
        "x": {"type": "Placeholder", "bytes": MB},
        "g0": {"type": "Relu", "inputs": ["x"], "bytes": MB, "backward": True},
        "g1": {"type": "Tanh", "inputs": ["x"], "bytes": MB, "backward": True},
        "g2": {"type": "Neg", "inputs": ["x"], "bytes": MB, "backward": True},
        "sum/tmp_var": {"type": "TemporaryVariable", "control": ["g2"], "bytes": MB, "backward": True},
        "sum/tmp_var_zeros": {"type": "ZerosLike", "inputs": ["g2"], "bytes": MB, "backward": True},
        "sum/tmp_var_initializer": {"type": "Assign", "inputs": ["sum/tmp_var", "sum/tmp_var_zeros"], "bytes": MB,
                                    "backward": True},
        **{f"sum/tmp_var_accum_{i}": {"type": "AssignAdd", "inputs": ["sum/tmp_var_initializer", f"g{i}"],
                                      "bytes": MB, "backward": True} for i in range(3)},
        "sum": {"type": "DestroyTemporaryVariable", "inputs": ["sum/tmp_var_initializer"], "bytes": MB,
                "control": [f"sum/tmp_var_accum_{i}" for i in range(3)], "backward": True},
        "out": {"type": "Mul", "inputs": ["sum"], "bytes": MB, "backward": True},
    }
    sg = StepGraph.from_spec(spec)
    for op in sg.ops.values():
        op.device = CPU
    seq = sequencing.find_sequence(sg)
    assert set(seq.ops) == {"g0", "g1", "g2", "sum/tmp_var_zeros", "out"}
    # and the plan says that the sum's order is TF's threads' race
    planned = pipeline.plan_step(sg, pipeline.PlanSettings(), copy=True)
    assert any(n.startswith("1 gradient sum is accumulated in place") for n in planned.plan.notes)
    assert not sequencing.accumulation_note(step_graph())


@pytest.mark.parametrize("device, with_added", [(CPU, True), (GPU, False)])
def test_swap_ops_join_the_chain_only_where_their_copies_are_synchronous(device, with_added):
    assert sequencing.find_sequence(step_graph(device)).with_added is with_added


@pytest.mark.parametrize("settings, chained", [
    (dict(), True),
    (dict(execution_order="strict"), True),
    (dict(execution_order="free"), False),
    (dict(policy="vdnn"), False),
    (dict(policy="none"), False),
])
def test_only_the_dymem_policy_with_the_planned_order_chains_the_ops(settings, chained):
    planned = pipeline.plan_step(step_graph(), pipeline.PlanSettings(**settings), copy=True)
    assert bool(planned.sequence.ops) is chained
    assert any("chained in the planned order" in n for n in planned.plan.notes) is chained


@pytest.mark.parametrize("device, onednn_later, chained", [(CPU, True, False), (GPU, True, True), (CPU, False, True)])
def test_a_cpu_step_that_onednn_rewrites_after_the_plan_keeps_tfs_order_and_says_why(device, onednn_later, chained):
    """oneDNN's layout pass fuses only ops no other edge leaves: run after the plan, a chain would change the
    numbers on the CPU (a GPU's ops are not oneDNN's). Planned after it (the pass's default stage with oneDNN on),
    the chain stays."""
    planned = pipeline.plan_step(step_graph(device), pipeline.PlanSettings(onednn_later=onednn_later), copy=True)
    assert bool(planned.sequence.ops) is chained
    assert any("oneDNN's layout pass" in n for n in planned.plan.notes) is not chained


def _banded_graph(conv_window: int = 1) -> StepGraph:
    """Small independent ops early (far below the peak), then three 8 MB feature maps built up to the peak and
    freed by their gradients; ``c2``, a convolution of ``conv_window`` (kernel height x width), reads one."""
    spec = {"x": {"type": "Placeholder", "bytes": MB}}
    spec.update({f"s{i}": {"type": "Relu", "inputs": ["x"], "bytes": 1024} for i in range(4)})
    spec["w"] = {"type": "Const", "bytes": 36, "shape": (conv_window, 1, 3, 3)}
    spec["f1"] = {"type": "Relu", "inputs": ["x", "s0", "s1", "s2", "s3"], "bytes": 8 * MB}
    spec["c2"] = {"type": "Conv2D", "inputs": ["f1", "w"], "bytes": 8 * MB, "shape": (16, 32, 32, 128)}
    spec["f3"] = {"type": "Relu", "inputs": ["c2"], "bytes": 8 * MB}
    spec["g3"] = {"type": "ReluGrad", "inputs": ["f3", "c2"], "bytes": MB, "backward": True}
    spec["g2"] = {"type": "ReluGrad", "inputs": ["g3", "f1"], "bytes": MB, "backward": True}
    spec["out"] = {"type": "_Retval", "inputs": ["g2"], "bytes": []}
    return StepGraph.from_spec(spec)


def _bands(sg: StepGraph, contractions_alone: bool = True) -> dict[str, int]:
    from dymem_tf.planning.simulator import simulate

    seq = sequencing.find_sequence(sg)
    return dict(zip(seq.ops, sequencing.find_bands(sg, seq.ops, simulate(sg, None), contractions_alone)))


def test_bands_group_the_ops_far_from_the_peak_and_chain_those_near_it():
    # the peak is 25 MB (x, the three maps, g3). The small ops and f1 reach 9 MB at most in any order; the
    # convolution c2 is a band of its own; f3 starts one at 16 MB, and with g3 it would reach 25 + 8 MB; g2 writes
    # into g3's buffer, so g3 and g2 stay within the peak together
    assert _bands(_banded_graph()) == {"s0": 0, "s1": 0, "s2": 0, "s3": 0, "f1": 0, "c2": 1, "f3": 2, "g3": 3,
                                       "g2": 3}


def test_the_planned_order_comes_in_bands_and_the_strict_one_op_by_op():
    planned = pipeline.plan_step(_banded_graph(), pipeline.PlanSettings(), copy=True)
    strict = pipeline.plan_step(_banded_graph(), pipeline.PlanSettings(execution_order="strict"), copy=True)
    assert planned.sequence.ops == strict.sequence.ops
    assert planned.sequence.band_count() == 3 and strict.sequence.band_count() == len(strict.sequence.ops)
    assert any("in 3 bands" in n for n in planned.plan.notes)
    assert not any(" bands " in n for n in strict.plan.notes)


def test_a_budgeted_plan_whose_buffers_exceed_the_allowance_is_chained_op_by_op():
    """The executor's order inside a band places a buffer differently from step to step; one larger than the
    allowance a placed plan keeps free (first_step.placed_allowance) can then not fit in a later step (ResNet-50 +
    Adam, batch 258 under 512 MiB, 64.5 MiB feature maps: a refined plan measured 494 MiB in its first step and ran
    out in its sixth). Such a plan is chained one op at a time; one whose buffers fit the allowance keeps its bands."""
    from dymem_tf.planning import first_step

    assert first_step.placed_allowance(40 * MB) < 8 * MB < first_step.placed_allowance(1024 * MB)
    tight = pipeline.plan_step(_banded_graph(), pipeline.PlanSettings(budget_bytes=40 * MB), copy=True)
    roomy = pipeline.plan_step(_banded_graph(), pipeline.PlanSettings(budget_bytes=1024 * MB), copy=True)
    assert tight.sequence.ops == roomy.sequence.ops
    assert tight.sequence.band_count() == len(tight.sequence.ops)
    assert roomy.sequence.band_count() < len(roomy.sequence.ops)


def _with_early_contractions() -> StepGraph:
    """:func:`_banded_graph` whose early small ops are convolutions: workspaces of unknown size."""
    sg = _banded_graph()
    for name in ("s0", "s1", "s2", "s3"):
        sg.ops[name].type = "Conv2D"
    return sg


def test_under_a_budget_a_contraction_is_a_band_of_its_own():
    assert sequencing.is_contraction("Conv2DBackpropFilter") and sequencing.is_contraction("_MklMatMul")
    assert not sequencing.is_contraction("ReluGrad")
    bands = _bands(_with_early_contractions(), contractions_alone=True)
    assert [bands[n] for n in ("s0", "s1", "s2", "s3", "f1")] == [0, 1, 2, 3, 4]
    assert len(set(bands.values())) == len(bands) - 1  # only g3 and g2 share a band


def test_without_a_budget_contractions_share_bands_within_the_peak():
    bands = _bands(_with_early_contractions(), contractions_alone=False)
    # every op bound alike: the convolutions s0..s3 and c2 join the small ops (17 MB at most, under the 25 MB peak)
    assert bands == {"s0": 0, "s1": 0, "s2": 0, "s3": 0, "f1": 0, "c2": 0, "f3": 1, "g3": 2, "g2": 2}


@pytest.mark.parametrize("settings, alone", [
    (pipeline.PlanSettings(), False),  # no budget: the convolutions share band 0 with f1
    (pipeline.PlanSettings(budget_bytes=64 * MB), True),  # a budget to keep
    (pipeline.PlanSettings(least_memory=True), True),  # the first step's probe, made for a budget
])
def test_the_plan_keeps_contractions_alone_only_where_it_keeps_a_budget(settings, alone):
    sequence = pipeline.plan_step(_with_early_contractions(), settings, copy=True).sequence
    sizes = collections.Counter(sequence.bands)
    convolutions = [b for n, b in zip(sequence.ops, sequence.bands) if n in ("s0", "s1", "s2", "s3", "c2")]
    assert all(sizes[b] == 1 for b in convolutions) is alone, sequence


def test_the_callback_stores_execution_order_as_given_and_refuses_unknown_values():
    assert dymem_tf.DymemCallback(memory_budget=None, execution_order="free", verbose=0).execution_order == "free"
    with pytest.raises(ValueError, match="execution_order 'random'.*planned, strict, free"):
        dymem_tf.DymemCallback(memory_budget=None, execution_order="random")


_PEAKS_SCRIPT = textwrap.dedent("""
    import json, sys
    import keras, numpy as np, tensorflow as tf
    import dymem_tf
    from dymem_tf.memory import devices
    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16, 16, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    b = keras.layers.Conv2D(8, 5, padding="same", activation="relu")(inputs)
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, out)
    model.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            devices.reset_device_peaks()

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(int(devices.device_memory_stats()["peak_bytes_in_use"]))

    x, y = np.random.rand(96, 16, 16, 3).astype("float32"), np.random.rand(96, 4).astype("float32")
    order, budget = sys.argv[1], None if sys.argv[2] == "none" else sys.argv[2]
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[dymem_tf.DymemCallback(memory_budget=budget, verbose=0, min_swap_bytes=1024,
                                                 execution_order=order), Peaks()])
    print("PEAKS" + json.dumps(peaks))
""")


def _step_peaks(order: str, interop_threads: int | None, budget: str = "none") -> list[int]:
    """In-use peaks of each of the 6 steps of a small two-branch convnet trained with Dymem under ``budget``, in a
    fresh interpreter."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    if interop_threads is not None:
        env["TF_NUM_INTEROP_THREADS"] = str(interop_threads)
    out = subprocess.run([sys.executable, "-c", _PEAKS_SCRIPT, order, budget], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return json.loads(out.rsplit("PEAKS", 1)[1])


def test_under_a_budget_a_chained_step_repeats_its_peak_whatever_the_executors_thread_count():
    """The planned order is the order: under a budget the steps after the first two (the probe's and the calibrated
    plan's first) peak at the same bytes in use to within 1%, with the default inter-op threads and with one (where
    TF's executor, left free, runs depth-first instead of layer by layer). Not to the byte: the ops of a band may
    take their turns in any order, under the band's bound."""
    default, one_thread = _step_peaks("planned", None, "48MiB"), _step_peaks("planned", 1, "48MiB")
    assert len(default) == len(one_thread) == 6
    steady = default[2:] + one_thread[2:]
    assert max(steady) <= 1.01 * min(steady), (default, one_thread)


def test_without_a_budget_contractions_overlap_only_as_the_threads_allow():
    """Without a budget contractions share bands. With one inter-op thread they never run at once, and every step
    repeats its peak. With two, the convolution gradients' im2col working sets (TF's target: 30 MiB each) coexist
    when the executor happens to run two at once: in most steps (54.7 MB), not in all (28.0 MB in one of five in
    one run), so the peak is bounded, not repeated: at most one working set above the one-thread peak."""
    one = _step_peaks("planned", 1)[1:]
    assert max(one) <= 1.01 * min(one), one
    two = _step_peaks("planned", None)[1:]
    assert 0.99 * min(one) <= min(two) and max(two) <= 1.01 * max(one) + 30 * 2**20, (one, two)


def test_a_step_inside_a_loop_keeps_tfs_order():
    """steps_per_execution > 1 runs the whole step in one loop frame: the chain could order one iteration only."""
    sg = step_graph()
    for op in sg.ops.values():
        op.frame = "while"
    seq = sequencing.find_sequence(sg)
    assert seq.ops == () and seq.skipped == sequencing.LOOP_SKIP
