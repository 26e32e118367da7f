"""The measured memory model (dymem_tf.planning.memory_model) and the simulator's use of it."""
import csv

import pytest

from dymem_tf.memory import allocator
from dymem_tf.planning import memory_model, simulator
from dymem_tf.planning.analysis import StepGraph

MB = 1 << 20


def two_grads() -> StepGraph:
    """Two convolution gradients of one dependency layer (independent: the executor may run them together)."""
    return StepGraph.from_spec({
        "x": {"type": "Placeholder", "bytes": 4 * MB},
        "dy": {"type": "Relu", "inputs": ["x"], "bytes": 4 * MB, "backward": True},
        "dw": {"type": "Conv2DBackpropFilter", "inputs": ["x", "dy"], "bytes": MB, "backward": True},
        "dx": {"type": "Conv2DBackpropInput", "inputs": ["dy"], "bytes": 4 * MB, "backward": True},
        "sum": {"type": "AddN", "inputs": ["dx"], "bytes": 4 * MB, "backward": True},
    })


def _row(op, size, lower, upper):
    return {"op": op, "size": str(size), "lower": str(lower), "upper": str(upper)}


def test_temporaries_are_the_allocations_that_are_not_outputs_and_their_overlap_is_measured():
    sg = two_grads()
    rows = [
        _row("dw", 3 * MB, 0, 3), _row("dw", MB, 1, 9),  # a 3 MB workspace, then the output
        _row("dx", 2 * MB, 2, 4), _row("dx", 2 * MB, 5, 6), _row("dx", 4 * MB, 6, 9),  # two 2 MB in turn
        _row("dy", 4 * MB, 0, 9), _row("elsewhere", 50 * MB, 0, 1), _row("dx", 9 * MB, -5, -4),
    ]
    mm = memory_model.from_trace(rows, sg, first_event=0)
    assert mm.temporaries == {"dw": 3 * MB, "dx": 2 * MB}  # peak live, not the sum; outputs and others left out
    assert mm.concurrency == 2  # dw's and dx's workspaces overlapped (events 2..3)
    # each op holds its own and, as they share a layer, the other's
    assert mm.held_during(sg) == {"dw": 5 * MB, "dx": 5 * MB}
    assert memory_model.MeasuredMemory(mm.temporaries, 1).held_during(sg) == mm.temporaries
    assert "2 ops" in mm.summary()


def test_each_op_holds_the_temporaries_measured_beside_its_own_not_its_layers_largest():
    """dw and dx share a dependency layer but ran one after the other: each holds only its own; the old rule (the
    layer's largest besides) would have held 5 MB for both. ``dy`` (another layer) overlapped dx: dx holds both."""
    sg = two_grads()
    rows = [_row("dw", 3 * MB, 0, 2), _row("dw", MB, 1, 9),
            _row("dx", 2 * MB, 3, 5), _row("dy", 4 * MB, 0, 9), _row("dy", MB, 4, 6), _row("dx", 4 * MB, 6, 9)]
    mm = memory_model.from_trace(rows, sg, first_event=0)
    assert mm.temporaries == {"dw": 3 * MB, "dx": 2 * MB, "dy": MB}
    assert mm.overlap == {"dw": 3 * MB, "dx": 3 * MB, "dy": 3 * MB}
    assert mm.held_during(sg) == mm.overlap
    assert memory_model.MeasuredMemory(mm.temporaries, 2).held_during(sg) == {"dw": 5 * MB, "dx": 5 * MB, "dy": MB}


def test_the_simulator_holds_temporaries_while_their_op_runs():
    sg = two_grads()
    plain = simulator.simulate(sg, None)
    held = simulator.simulate(sg, None, temporaries={"dx": 10 * MB})
    assert plain.peak_bytes == 9 * MB and plain.peak_op == "dw"  # x, dy and dw's output
    assert held.peak_bytes == 18 * MB and held.peak_op == "dx"  # dy, dx's output and its 10 MB
    assert any(b.tensor == "dx (temporaries)" and b.bytes == 10 * MB for b in held.peak_buffers)
    # nothing is held after the op: the step's end is as before
    assert held.timeline[-1][2:] == plain.timeline[-1][2:]


@pytest.mark.skipif(not allocator.is_active(), reason="needs the GTBM allocator")
def test_record_step_joins_a_running_trace_and_says_where_the_block_starts(tmp_path):
    import tensorflow as tf

    allocator.start_trace()
    try:
        tf.zeros((256, 1024)).numpy()
        with allocator.record_step(tmp_path / "step.csv") as info:
            tf.ones((512, 1024)).numpy()
        assert allocator.trace_info()["active"]  # the outer trace goes on
    finally:
        allocator.stop_trace()
    with open(tmp_path / "step.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert info["first_event"] > 0 and info["dropped"] == 0
    inside = [int(r["size"]) for r in rows if int(r["lower"]) >= info["first_event"]]
    before = [int(r["size"]) for r in rows if int(r["lower"]) < info["first_event"]]
    assert 512 * 1024 * 4 in inside and 256 * 1024 * 4 in before
    with allocator.record_step(tmp_path / "own.csv") as own:
        tf.ones((128, 1024)).numpy()
    assert own["first_event"] == 0 and not allocator.trace_info()["active"]
