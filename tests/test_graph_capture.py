"""graph_capture on real Keras train steps traced in a tf.function (tracing only: no step is executed)."""
from __future__ import annotations

import json
import re

import keras
import pytest
import tensorflow as tf

from dymem_tf.passes.graph_capture import UnsupportedGraphError, capture_step_graph, infer_model_scope, keras_layer_of
from dymem_tf.planning.analysis import GRAPPLER_REMOVED_OP_TYPES, StepGraph
from dymem_tf.planning.planner import POLICIES, make_plan, validate_plan

BATCH, H, W, C, F, CLASSES = 4, 16, 16, 3, 8, 3


def residual_model() -> keras.Model:
    inp = keras.Input((H, W, C))
    x = keras.layers.Conv2D(F, 3, padding="same", name="c1")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    y = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.Add(name="add")([x, y])
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    out = keras.layers.Dense(CLASSES, name="head")(x)
    return keras.Model(inp, out)


def trace_train_step(model: keras.Model, input_shape: tuple = (H, W, C)) -> list:
    """The ops of a hand-written train step: forward, GradientTape gradients and Adam updates in one FuncGraph."""
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    cf = step.get_concrete_function(tf.TensorSpec([None, *input_shape]), tf.TensorSpec([None], tf.int32))
    return cf.graph.get_operations()


@pytest.fixture(scope="module")
def traced():
    model = residual_model()
    ops = trace_train_step(model)
    return model, ops, capture_step_graph(ops, batch_size=BATCH, layer_names=[l.name for l in model.layers])


def ops_of_type(sg: StepGraph, op_type: str) -> list:
    return [op for op in sg.ops.values() if op.type == op_type]


def test_graph_is_an_analysed_dag(traced):
    _, ops, sg = traced
    assert len(sg.ops) == len(ops)
    assert sg.num_layers > 10
    for u, v in sg.graph.edges:
        identity = sg.ops[u]
        if identity.type in GRAPPLER_REMOVED_OP_TYPES:
            # Grappler removes identities: a consumer is ordered after the producer of the input it reads through
            fed = [identity.inputs[k] for k, out in enumerate(identity.outputs) if out in sg.ops[v].inputs]
            for t in fed:
                assert sg.ops[sg.tensors[t].producer].layer < sg.ops[v].layer
        else:
            assert sg.ops[u].layer < sg.ops[v].layer
    assert sg.meta["model_scope"].startswith("functional")
    assert sg.meta["batch_size"] == BATCH


def test_phases_and_keras_layers(traced):
    _, _, sg = traced
    (conv,) = ops_of_type(sg, "Conv2D")
    assert not conv.is_backward and conv.phase == "forward" and conv.keras_layer == "c1"
    (dfilter,) = ops_of_type(sg, "Conv2DBackpropFilter")
    assert dfilter.is_backward and dfilter.phase == "backward" and dfilter.keras_layer == "c1"
    assert dfilter.name.startswith("gradient_tape/")
    # gradient aggregation outside the gradient_tape scope is still backward
    addn = ops_of_type(sg, "AddN")
    assert addn and all(op.is_backward for op in addn)
    updates = ops_of_type(sg, "AssignSubVariableOp")
    assert updates and all(op.is_backward and op.phase == "update" for op in updates)
    # the optimizer's own arithmetic (learning rate, bias corrections, slot reads) belongs to the update even
    # where it does not depend on a gradient
    # (the optimizer's scope is adam/, or adam_<k>/ when other tests built Adam optimizers first)
    adam = [op for op in sg.ops.values() if re.match(r"adam(_\d+)?/", op.name)]
    assert adam and all(op.phase == "update" for op in adam)
    assert any(not any(sg.ops[p].is_backward for p in sg.graph.predecessors(op.name)) for op in adam)
    layers = {op.keras_layer for op in sg.ops.values() if op.keras_layer}
    assert {"c1", "bn", "relu", "add", "gap", "head"} <= layers
    # no forward op depends on a backward one
    for name in sg.forward_ops():
        assert not any(sg.ops[p].is_backward for p in sg.graph.predecessors(name))


def test_tensor_sizes_and_flops(traced):
    _, _, sg = traced
    (conv,) = ops_of_type(sg, "Conv2D")
    out = sg.tensors[conv.outputs[0]]
    assert out.shape == (BATCH, H, W, F) and out.bytes == BATCH * H * W * F * 4 and out.shape_known
    conv_flops = 2.0 * BATCH * H * W * F * 3 * 3 * C
    assert conv.flops == conv_flops
    (dfilter,) = ops_of_type(sg, "Conv2DBackpropFilter")
    assert dfilter.flops == conv_flops
    matmuls = {op.name: op for op in ops_of_type(sg, "MatMul")}
    fwd = next(op for op in matmuls.values() if not op.is_backward)
    assert fwd.flops == 2.0 * BATCH * F * CLASSES
    assert all(op.flops == 2.0 * BATCH * F * CLASSES for op in matmuls.values())
    assert conv.bytes_accessed > out.bytes


def test_variable_reads_are_persistent_and_never_swapped(traced):
    _, _, sg = traced
    reads = ops_of_type(sg, "ReadVariableOp")
    assert reads and all(sg.tensors[t].persistent for op in reads for t in op.outputs)
    assert sg.meta["variable_read_bytes"] > 0
    for policy in POLICIES:
        plan = make_plan(sg, policy, profile="h200", min_swap_bytes=1, batch_size=BATCH)
        assert validate_plan(sg, plan) == []
        assert all(not sg.tensors[s.tensor].persistent for s in plan.swaps)
        assert all(plan.mobility[op.name] == "persistent" for op in reads)
        if policy == "dymem":
            swapped = {s.producer for s in plan.swaps}
            assert any(sg.ops[p].keras_layer == "c1" for p in swapped)  # the conv output feeds BN's backward


def test_unknown_batch_gives_unknown_sizes(traced):
    _, ops, _ = traced
    sg = capture_step_graph(ops)
    (conv,) = ops_of_type(sg, "Conv2D")
    out = sg.tensors[conv.outputs[0]]
    assert out.bytes == 0 and not out.shape_known
    assert sg.meta["unknown_shape_tensors"] > 0
    assert conv.flops == 0.0


def test_step_graph_json_round_trip(traced):
    _, _, sg = traced
    back = StepGraph.from_dict(json.loads(json.dumps(sg.to_dict())))
    assert back.layers == sg.layers and back.ops == sg.ops


def test_sequential_names_and_scope_inference():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="dense_a"),
                              keras.layers.Dense(2, name="dense_b")])
    sg = capture_step_graph(trace_train_step(model, (8,)), batch_size=2)
    assert sg.meta["model_scope"].startswith("sequential")
    fwd = [op for op in ops_of_type(sg, "MatMul") if not op.is_backward]
    assert sorted(op.keras_layer.rstrip("_0123456789") for op in fwd) == ["dense_a", "dense_b"]


def test_name_helpers():
    names = ["functional_1/conv1_conv/convolution", "gradient_tape/functional_1/conv1_conv/convolution/X",
             "functional_1/conv1_conv/convolution/ReadVariableOp",
             "gradient_tape/loss/a/b", "gradient_tape/loss/a/c", "loss/a/b", "loss/a/c",
             "adam/Sub_1/ReadVariableOp", "adam/Sub_2/ReadVariableOp", "adam/Sub_3/ReadVariableOp"]
    # gradients exclude the optimizer; variable reads tell the model from the loss
    assert infer_model_scope(names) == "functional_1"
    assert keras_layer_of(names[1], "functional_1") == "conv1_conv"
    assert keras_layer_of("functional_1/conv1_conv_1/convolution", "functional_1", frozenset({"conv1_conv"})) \
        == "conv1_conv"
    assert keras_layer_of("functional_1/Cast", "functional_1") is None
    assert keras_layer_of("adam/Sub_1", "functional_1") is None


@pytest.mark.parametrize("order", [("tower_b", "tower_a"), ("tower_a", "tower_b")])
def test_a_tie_between_model_scopes_goes_to_the_first_in_the_graph(order):
    """Two scopes with as many variable reads and gradient ops: the inference takes the one the graph lists first,
    not the first of a set of names (whose order Python's per-process hash seed decides)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant(1.0, name="x")
        for scope in order:
            tf.identity(x, name=f"{scope}/dense/ReadVariableOp")
            tf.identity(x, name=f"{scope}/dense/MatMul")
            tf.identity(x, name=f"gradient_tape/{scope}/dense/MatMul")
    sg = capture_step_graph(graph.get_operations(), batch_size=1)
    assert sg.meta["model_scope"] == order[0]


def test_capture_and_plan_from_inside_an_autograph_trace():
    # the pass runs while the train step is traced; AutoGraph must call the analysis as plain Python
    model = residual_model()
    opt = keras.optimizers.SGD()
    opt.build(model.trainable_variables)
    captured = {}

    @tf.function  # AutoGraph on
    def step(x, y):
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations())
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                               from_logits=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        sg = capture_step_graph(graph.get_operations()[start:], batch_size=BATCH)
        captured["plan"] = make_plan(sg, "dymem", min_swap_bytes=1)
        captured["sg"] = sg
        return loss

    step.get_concrete_function(tf.TensorSpec([None, H, W, C]), tf.TensorSpec([None], tf.int32))
    assert captured["plan"].swaps and validate_plan(captured["sg"], captured["plan"]) == []


def test_empty_op_list_is_unsupported():
    with pytest.raises(UnsupportedGraphError):
        capture_step_graph([])


def test_reach_follows_edges_down_or_up_from_every_seed():
    import networkx as nx

    from dymem_tf.passes.graph_capture import reach

    g = nx.DiGraph([("a", "b"), ("b", "c"), ("x", "c"), ("c", "d"), ("y", "z")])
    assert reach(g, ["b", "y"], "down") == {"b", "c", "d", "y", "z"}
    assert reach(g, ["c"], "up") == {"a", "b", "c", "x"}
    assert reach(g, ["d", "z"], "up") == {"a", "b", "c", "d", "x", "y", "z"}
    assert reach(g, [], "down") == set()


def test_an_op_fed_through_a_branch_identity_is_in_the_branch_whatever_its_layer():
    """The execution order bypasses identities: ``v`` reads the branch's pivot ``u`` but takes the Switch's layer,
    ahead of ``u`` (which waits for a deep op), so walking that order met ``v`` before ``u`` and left ``v`` out of
    the branch; a dead op marked live may join the chain and kill the step."""
    from dymem_tf.passes import graph_capture

    sg = StepGraph.from_spec({
        "x": {"bytes": 8}, "pred": {"bytes": 1},
        "d1": {"inputs": ["x:0"], "bytes": 8}, "d2": {"inputs": ["d1:0"], "bytes": 8},
        "d3": {"inputs": ["d2:0"], "bytes": 8},
        "s": {"type": "Switch", "inputs": ["x:0", "pred:0"], "bytes": [8, 8]},
        "u": {"type": "Identity", "inputs": ["s:0"], "control": ["d3"], "bytes": 8},
        "v": {"inputs": ["u:0"], "bytes": 8},
        "m": {"type": "Merge", "inputs": ["v:0", "s:1"], "bytes": 8},
        "g": {"inputs": ["m:0"], "bytes": 8, "backward": True},
    })
    order = sg.execution_order()
    assert order.index("v") < order.index("u")  # the case: v's layer is the Switch's, u's is after d3
    graph_capture._mark_conditional(sg)
    assert sg.ops["u"].conditional and sg.ops["v"].conditional
    assert not sg.ops["g"].conditional and not sg.ops["d3"].conditional
