"""Dependency layers, graph helpers and serialisation of dymem_tf.planning.analysis (pure Python, no TF step)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

from dymem_tf.planning.analysis import CycleError, StepGraph, analyse


def layer_names(sg: StepGraph) -> list[list[str]]:
    return [list(layer) for layer in sg.layers]


def test_chain_layers():
    sg = StepGraph.from_spec({"a": {"bytes": 4}, "b": {"inputs": ["a"], "bytes": 4},
                              "c": {"inputs": ["b"], "bytes": 4}, "d": {"inputs": ["c"]}})
    assert layer_names(sg) == [["a"], ["b"], ["c"], ["d"]]
    assert sg.num_layers == 4
    assert [sg.ops[n].layer for n in "abcd"] == [0, 1, 2, 3]


def test_diamond_layers():
    sg = StepGraph.from_spec({"a": {"bytes": 4}, "b": {"inputs": ["a"], "bytes": 4},
                              "c": {"inputs": ["a"], "bytes": 4}, "d": {"inputs": ["b", "c"]}})
    assert layer_names(sg) == [["a"], ["b", "c"], ["d"]]


def test_residual_block_layers():
    # x -> conv1 -> bn -> relu -> conv2 -> add(x, conv2) -> out: the skip edge does not shorten the add's layer
    sg = StepGraph.from_spec({
        "x": {"bytes": 4}, "conv1": {"inputs": ["x"], "bytes": 4}, "bn": {"inputs": ["conv1"], "bytes": 4},
        "relu": {"inputs": ["bn"], "bytes": 4}, "conv2": {"inputs": ["relu"], "bytes": 4},
        "add": {"inputs": ["x", "conv2"], "bytes": 4}, "out": {"inputs": ["add"]}})
    assert layer_names(sg) == [["x"], ["conv1"], ["bn"], ["relu"], ["conv2"], ["add"], ["out"]]


def test_inception_like_branches():
    # branches of length 1, 2 and 3 from one input; the concat sits after the longest branch
    sg = StepGraph.from_spec({
        "in": {"bytes": 4},
        "b1": {"inputs": ["in"], "bytes": 4},
        "b2a": {"inputs": ["in"], "bytes": 4}, "b2b": {"inputs": ["b2a"], "bytes": 4},
        "b3a": {"inputs": ["in"], "bytes": 4}, "b3b": {"inputs": ["b3a"], "bytes": 4},
        "b3c": {"inputs": ["b3b"], "bytes": 4},
        "concat": {"inputs": ["b1", "b2b", "b3c"], "bytes": 4}})
    assert layer_names(sg) == [["in"], ["b1", "b2a", "b3a"], ["b2b", "b3b"], ["b3c"], ["concat"]]


def test_control_edges_count_for_layers():
    sg = StepGraph.from_spec({"a": {"bytes": 4}, "b": {"bytes": 4}, "c": {"inputs": ["b"], "control": ["a"]},
                              "d": {"control": ["c"]}})
    assert layer_names(sg) == [["a", "b"], ["c"], ["d"]]
    assert sg.graph.edges["a", "c"]["kind"] == "control"
    assert sg.graph.edges["b", "c"]["kind"] == "data"


def test_cycle_is_reported_with_its_ops():
    spec = {"x": {"bytes": 4}, "a": {"inputs": ["x", "c"], "bytes": 4}, "b": {"inputs": ["a"], "bytes": 4},
            "c": {"inputs": ["b"], "bytes": 4}}
    with pytest.raises(CycleError) as err:
        StepGraph.from_spec(spec)
    msg = str(err.value)
    assert "not a DAG" in msg and "cycle" in msg
    for name in ("a", "b", "c"):
        assert name in msg
    assert "x" not in msg.split("cycle:")[1]
    assert isinstance(err.value, ValueError)


def test_the_cycle_reported_is_the_same_under_any_hash_seed():
    """Python hashes strings with a new seed in each process; a subgraph view walks its nodes in a set's order, so
    the cycle once started at a different op from run to run."""
    script = textwrap.dedent("""
        import networkx as nx
        from dymem_tf.planning.analysis import find_cycle_message
        g = nx.DiGraph([(f"x{i}", f"x{i + 1}") for i in range(10)] + [("x10", "a"), ("a", "b"), ("b", "c"),
                                                                       ("c", "a")])
        print(find_cycle_message(g))
    """)
    seen = set()
    for seed in range(4):
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        seen.add(out.stdout.strip())
    assert seen == {"a -> b -> c -> a"}


def test_a_copy_keeps_each_ops_inputs_in_their_order():
    # tie-breaks read an op's predecessors in order (backward_ordering): a copied graph must list them the same way
    sg = StepGraph.from_spec({"y": {"bytes": 4}, "x": {"bytes": 4}, "z": {"inputs": ["y", "x"], "bytes": 4},
                              "w": {"inputs": ["z", "x"], "control": ["y"]}})
    copy = sg.copy()
    for name in sg.ops:
        assert list(copy.graph.predecessors(name)) == list(sg.graph.predecessors(name))
        assert list(copy.graph.successors(name)) == list(sg.graph.successors(name))
    assert list(copy.graph.predecessors("z")) == ["y", "x"]
    copy.graph.edges["y", "z"]["kind"] = "changed"  # the edge's attributes are the copy's own, shared by both views
    assert copy.graph.pred["z"]["y"]["kind"] == "changed" and sg.graph.edges["y", "z"]["kind"] == "data"


def test_unknown_input_is_rejected():
    with pytest.raises(ValueError, match="unknown tensor"):
        StepGraph.from_spec({"a": {"inputs": ["nope"]}})


def test_helpers_lifetime_and_phases():
    sg = StepGraph.from_spec({
        "f1": {"bytes": 8}, "f2": {"inputs": ["f1"], "bytes": 8},
        "g2": {"inputs": ["f2"], "bytes": 8, "backward": True},
        "g1": {"inputs": ["g2", "f1"], "bytes": 8, "backward": True}})
    assert sg.forward_ops() == ["f1", "f2"]
    assert sg.backward_ops() == ["g2", "g1"]
    assert sg.producer_layer("f1:0") == 0
    assert sg.consumer_layers("f1:0") == [1, 3]
    assert sg.lifetime("f1:0") == (0, 3)
    assert sg.lifetime("g1:0") == (3, 3)  # no consumers: dies where it is born
    assert sg.execution_order() == ["f1", "f2", "g2", "g1"]
    assert sg.position("g2") == 2


def test_aliases_share_buffers():
    sg = StepGraph.from_spec({
        "a": {"bytes": 64}, "r": {"type": "Reshape", "inputs": ["a"], "bytes": 64},
        "i": {"type": "Identity", "inputs": ["r"], "bytes": 64}, "u": {"inputs": ["i"]},
        "v": {"inputs": ["a"]}})
    assert sg.tensors["r:0"].alias_of == "a:0"
    assert sg.buffer_of("i:0") == "a:0"
    assert sorted(sg.aliases()["a:0"]) == ["i:0", "r:0"]
    assert sorted(sg.buffer_consumers("a:0")) == ["i", "r", "u", "v"]
    assert sg.ops["r"].bytes_accessed == 0


def test_switch_and_optionals_forward_their_input_buffer():
    # a lowered cond: Switch forwards to both outputs, cond's gradient keeps the branch's value in an Optional
    sg = StepGraph.from_spec({
        "p": {"bytes": 1}, "a": {"bytes": 64}, "s": {"type": "Switch", "inputs": ["a", "p"], "bytes": [64, 64]},
        "relu": {"inputs": ["s:1"], "bytes": 64},
        "opt": {"type": "OptionalFromValue", "inputs": ["relu"], "bytes": 0},
        "get": {"type": "OptionalGetValue", "inputs": ["opt"], "bytes": 64, "backward": True},
        "grad": {"inputs": ["get"], "bytes": 64, "backward": True}})
    assert sg.buffer_of("s:0") == sg.buffer_of("s:1") == "a:0"
    assert sg.buffer_of("get:0") == "relu:0"
    assert "grad" in sg.buffer_consumers("relu:0")
    assert sg.ops["s"].bytes_accessed == 0


def test_dict_round_trip_is_json_serialisable():
    sg = StepGraph.from_spec({
        "a": {"bytes": 16, "shape": (2, 2), "keras_layer": "dense", "flops": 10.0},
        "b": {"inputs": ["a"], "bytes": [4, 8], "backward": True, "control": ["a"]},
        "c": {"inputs": ["b:1"], "persistent": True, "bytes": 4}})
    text = json.dumps(sg.to_dict())
    back = StepGraph.from_dict(json.loads(text))
    assert back.layers == sg.layers
    assert back.ops == sg.ops
    assert back.tensors == sg.tensors
    assert back.tensors["a:0"].shape == (2, 2)
    assert set(back.graph.edges) == set(sg.graph.edges)


def test_analyse_is_required_for_layer_queries():
    sg = StepGraph.from_spec({"a": {"bytes": 4}, "b": {"inputs": ["a"]}}, analysed=False)
    with pytest.raises(RuntimeError, match="analyse"):
        sg.execution_order()
    assert analyse(sg) is sg
    assert sg.num_layers == 2


def random_spec(rng: random.Random, n: int) -> dict:
    spec: dict = {}
    names: list[str] = []
    for i in range(n):
        name = f"op{i}"
        k = rng.randint(0, min(3, len(names)))
        inputs = rng.sample(names, k) if k else []
        control = rng.sample(names, 1) if names and rng.random() < 0.1 else []
        spec[name] = {"inputs": inputs, "control": control, "bytes": rng.randint(0, 1000)}
        names.append(name)
    return spec


@pytest.mark.parametrize("seed", range(8))
def test_random_dags_layers_are_longest_paths(seed):
    rng = random.Random(seed)
    spec = random_spec(rng, rng.randint(5, 80))
    sg = StepGraph.from_spec(spec)
    g = sg.graph
    for u, v in g.edges:
        assert sg.ops[u].layer < sg.ops[v].layer
    for n in g.nodes:
        preds = list(g.predecessors(n))
        expected = 1 + max(sg.ops[p].layer for p in preds) if preds else 0
        assert sg.ops[n].layer == expected
    # ops of one layer are mutually independent
    for layer in sg.layers:
        for a in layer[:4]:
            for b in layer[:4]:
                if a != b:
                    assert not nx.has_path(g, a, b)
    assert sorted(sum(sg.layers, [])) == sorted(spec)


def random_spec_with_identities(rng: random.Random, n: int) -> dict:
    """A random DAG where about a quarter of the ops are Identity/IdentityN (chains of them included), some with
    control inputs, some read through several outputs."""
    spec: dict = {}
    names: list[str] = []
    for i in range(n):
        name = f"op{i}"
        kind = rng.random()
        k = rng.randint(1 if names else 0, min(3, len(names)))
        inputs = [f"{p}:0" for p in rng.sample(names, k)] if k else []
        control = rng.sample(names, 1) if names and rng.random() < 0.15 else []
        if kind < 0.15 and inputs:
            spec[name] = {"type": "Identity", "inputs": inputs[:1], "control": control, "bytes": 4}
        elif kind < 0.25 and inputs:
            spec[name] = {"type": "IdentityN", "inputs": inputs, "control": control, "bytes": [4] * len(inputs)}
        else:
            spec[name] = {"inputs": inputs, "control": control, "bytes": 8}
        names.append(name)
    for name, d in spec.items():  # read any output of an IdentityN producer
        d["inputs"] = [f"{i.split(':')[0]}:{rng.randrange(len(spec[i.split(':')[0]]['bytes']))}"
                       if isinstance(spec[i.split(":")[0]].get("bytes"), list) else i for i in d["inputs"]]
    return spec


def reference_layers(sg: StepGraph) -> list[list[str]]:
    """The dependency layers as the first implementation computed them: a copy of the graph with every identity's
    out-edges replaced (outermost first), then networkx's topological generations."""
    g = sg.graph
    bypass = [n for n, op in sg.ops.items() if op.type in ("Identity", "IdentityN")]
    h = g.copy()
    for name in reversed(list(nx.topological_sort(g.subgraph(bypass)))):
        op = sg.ops[name]
        sources = {sg.tensors[t].producer for t in op.inputs} | set(op.control_inputs)
        for c in list(h.successors(name)):
            cop = sg.ops[c]
            fed = {op.inputs[k] for k, out in enumerate(op.outputs) if out in cop.inputs and k < len(op.inputs)}
            for p in ({sg.tensors[t].producer for t in fed} if fed else sources):
                h.add_edge(p, c)
            h.remove_edge(name, c)
    program = {n: i for i, n in enumerate(sg.ops)}
    return [sorted(gen, key=program.__getitem__) for gen in nx.topological_generations(h)]


@pytest.mark.parametrize("seed", range(20))
def test_layers_bypass_identities_as_the_graph_copy_did(seed):
    rng = random.Random(seed)
    sg = StepGraph.from_spec(random_spec_with_identities(rng, rng.randint(5, 120)))
    assert layer_names(sg) == reference_layers(sg)


@pytest.mark.parametrize("seed", range(6))
def test_generations_match_networkx_and_paths_match_has_path(seed):
    from dymem_tf.planning.analysis import Reachability, is_acyclic_with, topological_generations

    rng = random.Random(100 + seed)
    sg = StepGraph.from_spec(random_spec_with_identities(rng, rng.randint(5, 60)))
    g = sg.graph
    assert topological_generations(g) == [list(gen) for gen in nx.topological_generations(g)]
    assert sg.topological_order() == list(nx.topological_sort(g))
    paths = Reachability(g)
    for u in g.nodes:
        for v in g.nodes:
            assert paths.has_path(u, v) == nx.has_path(g, u, v), (u, v)
    u, v = rng.choice(list(g.edges))
    assert not is_acyclic_with(g, [(v, u)])
    assert is_acyclic_with(g, [(u, v)])
    with pytest.raises(CycleError):
        topological_generations(g, [(v, u)])


def test_reachability_is_dropped_when_the_graph_is_analysed_again():
    from dymem_tf.planning import update_deferral

    sg = StepGraph.from_spec({"a": {"bytes": 4}, "b": {"inputs": ["a"], "bytes": 4}, "c": {"bytes": 4},
                              "d": {"inputs": ["c"]}})
    assert not sg.reachability().has_path("b", "d")
    update_deferral.defer(sg, [("b", "c")])
    assert sg.reachability().has_path("b", "d")
    assert sg.topological_order() == ["a", "b", "c", "d"]


@pytest.mark.parametrize("seed", range(4))
def test_copy_equals_a_round_trip_and_is_independent(seed):
    from dymem_tf.planning import update_deferral

    rng = random.Random(200 + seed)
    sg = StepGraph.from_spec(random_spec_with_identities(rng, 40))
    before = json.dumps(sg.to_dict())
    twin = sg.copy()
    assert json.dumps(twin.to_dict()) == before
    assert set(twin.graph.edges) == set(sg.graph.edges)
    last, first = sg.execution_order()[-1], sg.execution_order()[0]
    moved = update_deferral.defer(sg, [(first, last)], copy=True)
    assert moved is not sg and moved.graph.has_edge(first, last)
    twin.tensors[next(iter(twin.tensors))].variable = True
    assert json.dumps(sg.to_dict()) == before  # neither the deferral nor the marking reached the original
