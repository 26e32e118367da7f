"""Lowered conditionals in the memory model (dymem_tf.planning.branches): one branch of each conditional runs, so
the simulator counts the heavier one's tensors and leaves the other's out."""
from __future__ import annotations

from dymem_tf.planning import branches
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.planner import make_plan
from dymem_tf.planning.simulator import simulate

from test_planner import MB, MS, TOY, _gated_step  # the tests folder is on sys.path (pytest's default import mode)


def _cond(true_bytes: int, false_bytes: int, nested: bool = False) -> StepGraph:
    """``x`` switched on ``pred`` into a true branch (``t``) and a false branch (``f``), both read by the ``Merge``
    ``out`` and live together in a model that runs every op; the step peaks there. ``nested``: the true branch
    holds a conditional of its own (``tt`` / ``tf`` on ``pred2``)."""
    spec = {
        "x": {"bytes": MB, "type": "IteratorGetNext"}, "pred": {"inputs": ["x"], "bytes": 1, "flops": MS},
        "sw": {"type": "Switch", "inputs": ["x", "pred"], "bytes": [MB, MB]},
        "t": {"inputs": ["sw:1"], "bytes": true_bytes, "flops": MS},
        "f": {"inputs": ["sw:0"], "bytes": false_bytes, "flops": MS},
        "out": {"type": "Merge", "inputs": ["t", "f"], "bytes": MB, "flops": MS},
        "g": {"inputs": ["out"], "backward": True, "bytes": MB, "flops": MS},
    }
    if nested:
        spec.update({
            "pred2": {"inputs": ["t"], "bytes": 1, "flops": MS},
            "sw2": {"type": "Switch", "inputs": ["t", "pred2"], "bytes": [true_bytes, true_bytes]},
            "tt": {"inputs": ["sw2:1"], "bytes": 2 * MB, "flops": MS},
            "tf": {"inputs": ["sw2:0"], "bytes": 3 * MB, "flops": MS},
            "m2": {"type": "Merge", "inputs": ["tt", "tf"], "bytes": MB, "flops": MS},
        })
        spec["out"]["inputs"] = ["m2", "f"]
    return StepGraph.from_spec(spec)


def test_each_op_knows_its_branch_and_a_merge_leaves_it():
    paths = branches.branch_paths(_cond(4 * MB, 4 * MB, nested=True))
    assert paths["x"] == paths["sw"] == paths["out"] == paths["g"] == ()
    assert paths["t"] == paths["pred2"] == paths["m2"] == (("pred:0", 1),)
    assert paths["f"] == (("pred:0", 0),)
    assert paths["tt"] == (("pred:0", 1), ("pred2:0", 1)) and paths["tf"] == (("pred:0", 1), ("pred2:0", 0))


def test_the_lighter_branch_of_a_conditional_is_left_out_of_the_peak(monkeypatch):
    for true_bytes, false_bytes, left_out in ((4 * MB, 8 * MB, {"t"}), (8 * MB, 4 * MB, {"f"}),
                                              (4 * MB, 4 * MB, {"f"})):  # the false branch on a tie
        sg = _cond(true_bytes, false_bytes)
        assert branches.uncounted_ops(sg) == left_out
        peak = simulate(sg, [], TOY, timeline=False).peak_bytes
        with monkeypatch.context() as patch:  # the model before it knew branches: every op's tensors counted
            patch.setattr(branches, "counted_branches", lambda step_graph: (set(), {}))
            # a graph of its own: a simulator's preparation is kept with the graph it was made for
            both = simulate(_cond(true_bytes, false_bytes), [], TOY, timeline=False).peak_bytes
        assert both - peak == min(true_bytes, false_bytes)


def test_a_nested_conditional_counts_its_heavier_branch_inside_the_heavier_outer_one():
    sg = _cond(4 * MB, MB, nested=True)
    # true: t (4 MB) + tf (3 MB) + m2 ... outweighs f (1 MB); inside it tt (2 MB) is lighter than tf (3 MB)
    assert branches.uncounted_ops(sg) == {"f", "tt"}


def test_only_a_branch_leaves_its_tensors_out():
    sg = _gated_step()
    assert branches.uncounted_ops(sg) == {"half"}  # the false branch's value ties with relu's: left out
    plain = StepGraph.from_spec({"a": {"bytes": MB, "flops": MS}, "b": {"inputs": ["a"], "bytes": MB, "flops": MS}})
    assert branches.uncounted_ops(plain) == set()


def test_a_merge_passes_on_the_buffer_of_the_branch_the_model_counts(monkeypatch):
    assert branches.counted_merge_inputs(_cond(MB, MB)) == {"out": "t:0"}  # the false branch is lighter on a tie
    assert branches.counted_merge_inputs(_cond(MB, 2 * MB)) == {"out": "f:0"}
    # the true branch holds a conditional of its own: with it, it outweighs the false one
    assert branches.counted_merge_inputs(_cond(MB, 2 * MB, nested=True)) == {"out": "m2:0", "m2": "tf:0"}
    returned = StepGraph.from_spec({  # the false branch returns its input: it makes nothing, so it is the lighter
        "x": {"bytes": MB, "type": "IteratorGetNext"}, "pred": {"inputs": ["x"], "bytes": 1, "flops": MS},
        "sw": {"type": "Switch", "inputs": ["x", "pred"], "bytes": [MB, MB]},
        "t": {"inputs": ["sw:1"], "bytes": MB, "flops": MS},
        "out": {"type": "Merge", "inputs": ["sw:0", "t"], "bytes": MB, "flops": MS}})
    assert branches.counted_merge_inputs(returned) == {"out": "t:0"}
    assert branches.counted_merge_inputs(StepGraph.from_spec({"a": {"bytes": MB, "flops": MS}})) == {}
    # TF's Merge outputs the taken branch's buffer: where the branch's value is read after the Merge too (here by
    # the gradient g, as a branch's intermediate kept for its gradient is), the step holds one buffer, not two
    def kept() -> StepGraph:
        return StepGraph.from_spec({
            "x": {"bytes": MB, "type": "IteratorGetNext"}, "pred": {"inputs": ["x"], "bytes": 1, "flops": MS},
            "sw": {"type": "Switch", "inputs": ["x", "pred"], "bytes": [MB, MB]},
            "t": {"inputs": ["sw:1"], "bytes": MB, "flops": MS}, "f": {"inputs": ["sw:0"], "bytes": MB, "flops": MS},
            "out": {"type": "Merge", "inputs": ["t", "f"], "bytes": MB, "flops": MS},
            "g": {"inputs": ["out", "t"], "backward": True, "bytes": MB, "flops": MS}})

    peak = simulate(kept(), [], TOY, timeline=False).peak_bytes
    with monkeypatch.context() as patch:
        counted = branches.counted_branches
        patch.setattr(branches, "counted_branches", lambda step_graph: (counted(step_graph)[0], {}))
        apart = simulate(kept(), [], TOY, timeline=False).peak_bytes
    assert apart - peak == MB


def test_a_branch_value_and_its_merge_are_freed_only_when_both_are_swapped():
    sg = _gated_step(output_read_back=True)  # relu is kept for rgrad in an optional and, as out, for fgrad
    plan = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    both = [s for s in plan.swaps if s.tensor in ("relu:0", "out:0")]
    assert sorted(s.tensor for s in both) == ["out:0", "relu:0"]
    peak = {name: simulate(sg, swaps, TOY, timeline=False).peak_bytes
            for name, swaps in (("none", []), ("out", [s for s in both if s.tensor == "out:0"]),
                                ("relu", [s for s in both if s.tensor == "relu:0"]), ("both", both))}
    # one swap leaves the buffer to the readers of the other tensor; both free it (and add their swap-ins later)
    assert peak["out"] == peak["relu"] == peak["none"]
    assert peak["both"] <= peak["none"] - MB
