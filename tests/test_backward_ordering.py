"""Gradient ops that are ready early held until their consumers near (dymem_tf.planning.backward_ordering)."""
import keras
import numpy as np

import dymem_tf
from dymem_tf.planning import pipeline, simulator
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.backward_ordering import find_holds

MB = 1 << 20


def gelu_step(x_read_late: bool = False, chain_bytes: int = 2 * MB) -> StepGraph:
    """GELU's shape: the gradient squares the forward input ``x`` and exponentiates it (``sq`` -> ``ex``) as soon
    as ``x`` exists, but only ``dx`` (late in the backward pass, after the incoming gradient ``g3``) reads it.
    ``x_read_late``: the backward reads ``x`` itself too (then the hold extends nothing)."""
    spec = {
        "x": {"type": "Placeholder", "bytes": 2 * MB},
        "f1": {"type": "Relu", "inputs": ["x"], "bytes": 2 * MB},
        "f2": {"type": "Relu", "inputs": ["f1"], "bytes": 2 * MB},
        "f3": {"type": "Relu", "inputs": ["f2"], "bytes": 2 * MB},
        "sq": {"type": "Square", "inputs": ["x"], "bytes": chain_bytes, "backward": True},
        "ex": {"type": "Exp", "inputs": ["sq"], "bytes": chain_bytes, "backward": True},
        "g1": {"type": "ReluGrad", "inputs": ["f3"], "bytes": 2 * MB, "backward": True},
        "g2": {"type": "ReluGrad", "inputs": ["g1", "f2"], "bytes": 2 * MB, "backward": True},
        "g3": {"type": "ReluGrad", "inputs": ["g2", "f1"], "bytes": 2 * MB, "backward": True},
        "dx": {"type": "Mul", "inputs": ["g3", "ex"] + (["x"] if x_read_late else []), "bytes": 2 * MB,
               "backward": True},
    }
    return StepGraph.from_spec(spec)


def test_an_early_gradient_chain_is_held_until_its_consumer_nears():
    pairs = find_holds(gelu_step())
    assert sorted(pairs) == [("g3", "ex"), ("g3", "sq")]  # the whole chain, after the op dx waits for


def test_holding_the_chain_lowers_the_simulated_peak():
    sg = gelu_step(x_read_late=True)
    before = simulator.simulate(sg, []).peak_bytes
    planned = pipeline.plan_step(gelu_step(x_read_late=True), pipeline.PlanSettings(policy="dymem", min_swap_bytes=1 << 40))
    assert ("g3", "sq") in planned.deferrals and ("g3", "ex") in planned.deferrals
    assert any("held until their consumers near" in n for n in planned.plan.notes)
    after = simulator.simulate(planned.step_graph, []).peak_bytes
    assert after <= before - 2 * MB, (before, after)


def test_no_hold_that_keeps_a_bigger_input_alive_or_is_small():
    # x (2 MiB) would live into the backward pass in place of a 1 MiB chain: not worth it
    assert find_holds(gelu_step(chain_bytes=MB)) == []
    assert find_holds(gelu_step(), min_bytes=4 * MB) == []


def test_no_hold_without_slack_or_for_the_none_policy():
    sg = StepGraph.from_spec({
        "x": {"type": "Placeholder", "bytes": 2 * MB},
        "sq": {"type": "Square", "inputs": ["x"], "bytes": 2 * MB, "backward": True},
        "g": {"type": "Relu", "inputs": ["x"], "bytes": 2 * MB, "backward": True},
        "dx": {"type": "Mul", "inputs": ["g", "sq"], "bytes": 2 * MB, "backward": True},
    })
    assert find_holds(sg) == []  # sq already runs next to its consumer
    assert pipeline.holds_for(gelu_step(), pipeline.PlanSettings(policy="none")) == []
    assert pipeline.holds_for(gelu_step(), pipeline.PlanSettings(defer_updates=False)) == []


def _mlp(seed: int = 3):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((64,))
    h = inp
    for _ in range(3):
        h = keras.layers.Dense(512, activation="gelu")(h)  # 64 x 512 floats: 128 KiB per tensor
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.standard_normal((128, 64)).astype("float32"), rng.integers(0, 10, 128)


def test_a_gelu_net_holds_its_gradient_chains_and_trains_bit_identically(deterministic):
    model, x, y = _mlp()
    plain = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0).history["loss"]
    plain_weights = [w.numpy() for w in model.weights]
    model, x, y = _mlp()
    cb = dymem_tf.DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    losses = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[cb]).history["loss"]
    assert any("held until their consumers near" in n for n in cb.plan.notes), cb.plan.notes
    assert losses == plain
    for a, b in zip(plain_weights, [w.numpy() for w in model.weights]):
        np.testing.assert_array_equal(a, b)


def test_a_tie_between_first_consumers_is_broken_in_graph_order():
    """The held op's first consumer among consumers of one layer is the one the graph lists first (it was the
    first a set of names yielded, which changed with PYTHONHASHSEED: NASNetLarge's holds differed between
    processes)."""
    big = 256 * 1024
    spec = {
        "x": {"bytes": big},
        "loss": {"inputs": ["x"], "bytes": 4},
        "g": {"inputs": ["x"], "bytes": big, "backward": True},  # ready at once, used late
        "b1": {"inputs": ["loss"], "bytes": big, "backward": True},
        "b2": {"inputs": ["b1"], "bytes": big, "backward": True},
        "b3": {"inputs": ["b2"], "bytes": big, "backward": True},
        "p1": {"inputs": ["b3"], "bytes": big, "backward": True},
        "p2": {"inputs": ["b3"], "bytes": big, "backward": True},
        "c2": {"inputs": ["g", "p2"], "bytes": 4, "backward": True},
        "c1": {"inputs": ["g", "p1"], "bytes": 4, "backward": True},
    }
    for order in (list(spec), [k for k in spec if k != "c2"] + ["c2"]):
        sg = StepGraph.from_spec({k: spec[k] for k in order})
        first = next(c for c in order if c in ("c1", "c2"))
        assert find_holds(sg) == [("p2" if first == "c2" else "p1", "g")]
