"""Recompute instead of keep or swap (issue #14, item 4): dymem_tf.planning.recompute, the planner's and the
simulator's "recompute" decisions and the rewrite's clone/reroute records."""
import numpy as np
import pytest

from dymem_tf.passes import graph_pass
from dymem_tf.planning import pipeline, planner, recompute, simulator
from dymem_tf.planning.analysis import StepGraph

MB = 1 << 20


def _block(reshaped_consumer: bool = False) -> StepGraph:
    """A ResNet block's shape: the convolution output ``x`` is kept for the batch-norm gradient (``bn_grad``, late),
    the ReLU output ``y = Relu(x * inv + c)`` for the next convolution's filter gradient and the ReLU gradient;
    ``inv`` and ``c`` are per-channel vectors. Two 100 MB tensors make the peaks in between."""
    spec = {
        "img": {"bytes": 4 * MB, "type": "IteratorGetNext"},
        "x": {"inputs": ["img"], "bytes": 16 * MB, "type": "Conv2D", "flops": 4e9},
        "inv": {"inputs": ["x"], "bytes": 4096, "type": "Rsqrt"},
        "c": {"inputs": ["inv"], "bytes": 4096, "type": "Sub"},
        "mul": {"inputs": ["x", "inv"], "bytes": 16 * MB, "type": "Mul"},
        "bn": {"inputs": ["mul", "c"], "bytes": 16 * MB, "type": "AddV2"},
        "y": {"inputs": ["bn"], "bytes": 16 * MB, "type": "Relu"},
        "z": {"inputs": ["y"], "bytes": 4 * MB, "type": "Conv2D", "flops": 4e9},
        "big": {"inputs": ["z"], "bytes": 100 * MB, "flops": 4e9},
        "loss": {"inputs": ["big"], "bytes": 4, "flops": 1e6},
        "gz": {"inputs": ["loss"], "bytes": 100 * MB, "backward": True, "flops": 4e9},
        "gy": {"inputs": ["gz"], "bytes": 16 * MB, "backward": True, "flops": 4e9},
        "dw": {"inputs": ["gy", "y"], "bytes": 4096, "backward": True, "type": "Conv2DBackpropFilter", "flops": 4e9},
        "gr": {"inputs": ["gy", "y"], "bytes": 16 * MB, "backward": True, "type": "ReluGrad"},
        "bn_grad": {"inputs": ["gr", "x", "inv"], "bytes": 16 * MB, "backward": True, "type": "Mul"},
    }
    if reshaped_consumer:  # the filter gradient reads y through a forward Reshape
        spec["ry"] = {"inputs": ["y"], "bytes": 16 * MB, "type": "Reshape"}
        spec["z"]["inputs"] = ["ry"]
        spec["dw"]["inputs"] = ["gy", "ry"]
    return StepGraph.from_spec(spec)


def test_a_relu_of_a_batch_norm_is_recomputable_from_the_kept_convolution_output():
    found = {r.tensor: r for r in recompute.find_recomputable(_block(), min_bytes=MB)}
    r = found["y:0"]
    assert r.ops == ("mul", "bn", "y") and set(r.leaves) == {"x:0", "inv:0", "c:0"}
    assert r.backward_consumers == ("dw", "gr") and not r.aliases
    route = recompute.route_of(_block(), r)
    assert route.ops == [["mul", []], ["bn", [[0, "mul"]]], ["y", [[0, "bn"]]]]
    assert "x:0" not in found  # its producer is no element-wise op
    assert "mul:0" not in found and "bn:0" not in found  # no backward consumer


def test_a_consumer_through_a_reshape_gets_a_copy_of_the_reshape():
    (r,) = [r for r in recompute.find_recomputable(_block(reshaped_consumer=True), MB) if r.tensor == "y:0"]
    assert r.aliases == ("ry",) and sorted(r.reroutes) == [("dw", "ry"), ("gr", "y")]


def test_no_recomputation_from_a_tensor_that_is_gone():
    sg = _block()
    sg.ops["bn_grad"].inputs = ["gr:0"]  # nothing keeps x for the backward pass any more
    sg = StepGraph(sg.ops.values(), sg.tensors.values())
    from dymem_tf.planning.analysis import analyse

    analyse(sg)
    assert "y:0" not in {r.tensor for r in recompute.find_recomputable(sg, MB)}


def _planner(sg):
    from dymem_tf.planning.cost_model import as_cost_model

    return planner._Planner(sg, as_cost_model("cpu"), MB, None, 3, None, (), recompute.find_recomputable(sg, MB))


def test_the_simulator_frees_the_tensor_between_its_uses_and_charges_the_chain():
    sg = _block()
    pl = _planner(sg)
    (cand,) = [c for c in pl.candidates("dymem", relaxed=True) if c.kind == "recompute"]
    (decision,) = pl.decisions("dymem", [cand], "jit")
    assert decision.kind == "recompute" and decision.recompute.leaves
    base = simulator.simulate(sg, [], "cpu")
    rec = simulator.simulate(sg, [decision], "cpu")
    # y's 16 MB leave the peak; the 4 KiB vector c, a small leaf nothing else kept, now lives across it
    assert base.peak_bytes - rec.peak_bytes == 16 * MB - 4096, (base.peak_bytes, rec.peak_bytes)
    assert rec.step_time_s > base.step_time_s  # the copies of mul, bn and y run again
    assert rec.peak_by_group["mobile"] == 0  # nothing travels
    encoded = graph_pass.encode_plan([decision]).splitlines()[1:]  # after the version line
    assert encoded[:3] == ["clone\tmul\tmul/dymem_recompute\t", "clone\tbn\tbn/dymem_recompute\t0:mul/dymem_recompute",
                           "clone\ty\ty/dymem_recompute\t0:bn/dymem_recompute"]
    assert "reroute\tdw\ty\t0\ty/dymem_recompute" in encoded and "reroute\tgr\ty\t0\ty/dymem_recompute" in encoded
    trigger = decision.swap_ins[0].trigger_op
    assert {f"ctrl\t{trigger}\t{op}/dymem_recompute" for op in ("mul", "bn", "y")} <= set(encoded)


def test_a_recomputation_gives_way_to_a_swap_of_its_leaf():
    sg = _block()
    pl = _planner(sg)
    relaxed = pl.candidates("dymem", relaxed=True)
    rec = [c for c in relaxed if c.kind == "recompute"]
    swap_x = [c for c in relaxed if c.kind == "tensor" and c.tensor == "x:0"]
    assert rec and swap_x
    assert [d.kind for d in pl.decisions("dymem", rec + swap_x, "jit")] == ["tensor"]


def test_the_planner_recomputes_where_copies_cannot_make_room_in_time():
    """On an H200 the 16 MB copies take longer than the compute between the peaks: no swap makes room there, but
    recomputing y does (a few element-wise ops); on this CPU's profile the copies hide and the planner swaps."""
    no_swap = simulator.simulate(_block(), [], "h200").peak_bytes
    settings = dict(budget_bytes=no_swap - 4 * MB, headroom=0.0, min_swap_bytes=MB, profile="h200")
    planned = pipeline.plan_step(_block(), pipeline.PlanSettings(**settings))
    assert [(s.tensor, s.kind) for s in planned.plan.swaps] == [("y:0", "recompute")]
    assert planned.plan.predicted.peak_bytes <= no_swap - 4 * MB
    assert "recomputed      : 1 feature maps" in planned.plan.summary()
    assert any("could be recomputed" in n for n in planned.plan.notes)
    assert planner.validate_plan(planned.step_graph, planned.plan) == []
    with pytest.raises(planner.BudgetTooSmallError):  # without recomputation nothing fits
        pipeline.plan_step(_block(), pipeline.PlanSettings(**settings, recompute=False))
    cpu = simulator.simulate(_block(), [], "cpu").peak_bytes
    on_cpu = pipeline.plan_step(_block(), pipeline.PlanSettings(budget_bytes=cpu - 4 * MB, headroom=0.0,
                                                                min_swap_bytes=MB))
    assert [s.kind for s in on_cpu.plan.swaps] == ["tensor"]


# ------------------------------------------------------------------------------------------- rewrite, real step
def _gelu_model(seed=2):
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((32,))
    h = inp
    h = keras.layers.Dense(512, activation="gelu")(h)  # GELU: its output from two tensors its gradient keeps
    for _ in range(2):  # ReLU(batch norm): from the dense output the batch-norm gradient keeps
        h = keras.layers.BatchNormalization()(keras.layers.Dense(512)(h))
        h = keras.layers.Activation("relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.standard_normal((256, 32)).astype("float32"), rng.integers(0, 10, 256)


class _RecomputeEverything:
    """A graph-pass listener that plans the step as the callback does, then recomputes every recomputable tensor
    (the planner picks recomputation only where a budget needs it; this exercises the rewrite of each)."""

    def __init__(self):
        self.decisions = []

    def __call__(self, call):
        from dymem_tf.passes import graph_def_view, step_pass
        from dymem_tf.planning.cost_model import as_cost_model

        graph = call.graph()
        ((_, ops),) = step_pass.replica_ops(graph)
        sg, problem = step_pass.capture(ops, 64)
        assert problem is None, problem
        planned = pipeline.plan_step(sg, pipeline.PlanSettings(min_swap_bytes=1 << 16))
        graph_after = planned.step_graph
        pl = planner._Planner(graph_after, as_cost_model("cpu"), 1 << 16, 1, 3, None, (),
                              recompute.find_recomputable(graph_after, 1 << 16))
        cands = [c for c in pl.candidates("dymem", relaxed=True) if c.kind == "recompute"]
        self.decisions = pl.decisions("dymem", cands, "jit")
        simulator.simulate(graph_after, self.decisions, "cpu")  # raises for a plan that cannot run
        call.apply(graph_pass.encode_plan(self.decisions, planned.deferrals))


def test_recomputed_feature_maps_train_bit_identically(deterministic):
    model, x, y = _gelu_model()
    plain = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0).history["loss"]
    plain_w = [w.numpy() for w in model.weights]
    model, x, y = _gelu_model()
    listener = _RecomputeEverything()
    with graph_pass.armed(listener):
        losses = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0).history["loss"]
    model.train_function = None
    chains = [[op for op, _ in d.recompute.ops] for d in listener.decisions]
    assert len(chains) >= 3 and max(map(len, chains)) >= 2, chains
    assert losses == plain
    for a, b in zip(plain_w, [w.numpy() for w in model.weights]):
        np.testing.assert_array_equal(a, b)
