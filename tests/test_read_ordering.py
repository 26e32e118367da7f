"""Variable updates ordered after the uses of their reads (dymem_tf.planning.read_ordering)."""
import csv

import keras
import numpy as np
import pytest

import dymem_tf
from dymem_tf.memory import allocator
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.read_ordering import find_read_orderings, is_in_place_update

MB = 1 << 20


def conv_step(update_type: str = "AssignAddVariableOp") -> StepGraph:
    """A kernel ``w`` read once, used by the forward conv and by the backward's input gradient; its update needs only
    the filter gradient, so it may run while ``dx`` still reads the kernel. ``later`` reads the updated kernel."""
    return StepGraph.from_spec({
        "h": {"type": "_Arg", "bytes": [8]},
        "x": {"type": "Placeholder", "bytes": 4 * MB},
        "w": {"type": "ReadVariableOp", "inputs": ["h"], "bytes": MB, "persistent": True},
        "w_id": {"type": "Identity", "inputs": ["w"], "bytes": MB, "persistent": True},
        "y": {"type": "Conv2D", "inputs": ["x", "w"], "bytes": 4 * MB},
        "dy": {"type": "Relu", "inputs": ["y"], "bytes": 4 * MB, "backward": True},
        "dw": {"type": "Conv2DBackpropFilter", "inputs": ["x", "dy"], "bytes": MB, "backward": True},
        "dx": {"type": "Conv2DBackpropInput", "inputs": ["w_id", "dy"], "bytes": 4 * MB, "backward": True},
        "update": {"type": update_type, "inputs": ["h", "dw"], "bytes": [], "phase": "update"},
        "again": {"type": "ReadVariableOp", "inputs": ["h"], "control": ["update"], "bytes": MB, "persistent": True},
        "later": {"type": "Mul", "inputs": ["again", "dx"], "bytes": MB, "backward": True},
    })


@pytest.mark.parametrize("update_type", ["AssignAddVariableOp", "AssignSubVariableOp", "ResourceApplyAdam"])
def test_update_waits_for_every_use_of_the_value_read_before_it(update_type):
    sg = conv_step(update_type)
    pairs = find_read_orderings(sg, min_bytes=1)
    # the forward conv and, through the Identity, the input gradient; not the read after the update, nor its user
    assert pairs == [("y", "update"), ("dx", "update")]


def test_no_edge_that_would_close_a_cycle_or_for_small_variables():
    sg = conv_step()
    sg.ops["dx"].control_inputs.append("update")  # dx now runs after the update: ordering it before would cycle
    sg = StepGraph.from_dict(sg.to_dict())
    assert find_read_orderings(sg, min_bytes=1) == [("y", "update")]
    assert find_read_orderings(conv_step(), min_bytes=2 * MB) == []


def test_update_op_types():
    assert is_in_place_update("AssignAddVariableOp") and is_in_place_update("ResourceApplyKerasMomentum")
    assert not is_in_place_update("ReadVariableOp") and not is_in_place_update("ResourceGather")


def _assign_bytes(path) -> int:
    """Bytes that Assign*VariableOp kernels allocated in a GTBM trace (copies of a shared variable buffer)."""
    with open(path, newline="") as f:
        return sum(int(r["size"]) for r in csv.DictReader(f) if "AssignAdd" in r["op"].rsplit("/", 1)[-1]
                   or "AssignSub" in r["op"].rsplit("/", 1)[-1])


@pytest.mark.skipif(not allocator.is_active(), reason="needs the GTBM allocator")
def test_weights_are_updated_in_place_under_the_callback(tmp_path):
    """A conv net with SGD momentum under the callback: no weight is copied by its update in a traced step."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
                              keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
                              keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((64, 16, 16, 3), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, 64)
    trace = tmp_path / "step.csv"

    class TraceThirdStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:
                allocator.start_trace()

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                allocator.stop_trace()
                allocator.dump_trace(trace)

    cb = dymem_tf.DymemCallback(memory_budget=None, verbose=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb, TraceThirdStep()])
    notes = " ".join(cb.plan.notes)
    assert "variable updates ordered after the last use of their reads" in notes
    assert _assign_bytes(trace) == 0
