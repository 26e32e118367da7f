"""Deferral of gradient-independent optimizer arithmetic (dymem_tf.planning.update_deferral)."""
from dymem_tf.planning import simulator
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.update_deferral import defer, find_deferrals

MB = 1 << 20


def sgd_momentum_step() -> StepGraph:
    """forward a -> backward g; update m_new = m * momentum - g * lr (the first product needs no gradient)."""
    return StepGraph.from_spec({
        "m": {"type": "ReadVariableOp", "bytes": MB, "persistent": True},
        "x": {"type": "Placeholder", "bytes": MB},
        "a": {"type": "Relu", "inputs": ["x"], "bytes": 4 * MB},
        "f1": {"type": "Relu", "inputs": ["a"], "bytes": 4 * MB},
        "f2": {"type": "Relu", "inputs": ["f1"], "bytes": 4 * MB},
        "g": {"type": "Conv2DBackpropFilter", "inputs": ["f2", "a"], "bytes": MB, "backward": True},
        "scaled_m": {"type": "Mul", "inputs": ["m"], "bytes": MB},
        "scaled_g": {"type": "Mul", "inputs": ["g"], "bytes": MB, "backward": True},
        "m_new": {"type": "Sub", "inputs": ["scaled_m", "scaled_g"], "bytes": MB, "backward": True},
        "assign": {"type": "AssignVariableOp", "inputs": ["m", "m_new"], "bytes": []},
    })


def test_state_only_update_op_is_deferred_after_its_gradient_partner():
    sg = sgd_momentum_step()
    sg.ops["scaled_m"].phase = "update"
    assert sg.ops["scaled_m"].layer == 1  # ready at the start of the step
    pairs = find_deferrals(sg, min_bytes=1)
    assert pairs == [("scaled_g", "scaled_m")]
    before = simulator.simulate(sg, None, "cpu").peak_bytes
    defer(sg, pairs)
    assert sg.ops["scaled_m"].layer > sg.ops["scaled_g"].layer
    assert simulator.simulate(sg, None, "cpu").peak_bytes <= before - MB  # the temporary no longer spans the step


def test_small_or_gradient_dependent_ops_are_left_alone():
    sg = sgd_momentum_step()
    sg.ops["scaled_m"].phase = "update"
    assert find_deferrals(sg, min_bytes=2 * MB) == []  # below the size threshold
    sg.ops["scaled_m"].phase = "forward"
    assert find_deferrals(sg, min_bytes=1) == []  # only optimizer arithmetic moves


def test_defer_on_a_copy_keeps_the_original():
    sg = sgd_momentum_step()
    sg.ops["scaled_m"].phase = "update"
    pairs = find_deferrals(sg, min_bytes=1)
    moved = defer(sg, pairs, copy=True)
    assert moved is not sg and moved.ops["scaled_m"].control_inputs == ["scaled_g"]
    assert sg.ops["scaled_m"].control_inputs == [] and sg.ops["scaled_m"].layer == 1


def test_a_graph_planned_again_gets_its_deferrals_again_when_planned_on_copies():
    """The calibrated re-plans (step_pass._placed_plan) plan one captured graph several times: planned in place, the
    second plan would find the first one's edges in the graph and hand the rewrite none to insert (ResNet-50 + SGD:
    the momentum products then ran at the step's start, 61 MiB held through the step); planned on copies, each
    plan carries the edges and the captured graph is left as it was."""
    from dymem_tf.planning import pipeline

    sg = sgd_momentum_step()
    sg.ops["scaled_m"].phase = "update"
    settings = pipeline.PlanSettings(policy="dymem", min_swap_bytes=1)
    first, second = (pipeline.plan_step(sg, settings, copy=True) for _ in range(2))
    assert ("scaled_g", "scaled_m") in first.deferrals and first.deferrals == second.deferrals
    assert sg.ops["scaled_m"].control_inputs == []
    in_place = pipeline.plan_step(sg, settings)
    assert ("scaled_g", "scaled_m") in in_place.deferrals
    assert ("scaled_g", "scaled_m") not in pipeline.plan_step(sg, settings).deferrals  # what the copies avoid
