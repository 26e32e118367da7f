"""Swap planning policies on hand-made step graphs with known sizes and times (no TensorFlow step runs)."""
from __future__ import annotations

import json
import random

import pytest

from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.device_profiles import DeviceProfile, get_profile
from dymem_tf.planning.plan import Plan
from dymem_tf.planning.planner import BudgetTooSmallError, POLICIES, make_plan, validate_plan
from dymem_tf.planning.simulator import simulate

MB, KB = 1_000_000, 1_000
MS = 1e6  # flops of a 1 ms op on TOY
# 1 ms per MS flops, 1 ms per MB copied in each direction, no overheads: times are easy to compute by hand.
TOY = DeviceProfile("toy", flops_per_s=1e9, mem_bandwidth_bytes_per_s=1e18, h2d_bytes_per_s=1e9,
                    d2h_bytes_per_s=1e9, link="toy", memory_bytes=1 << 40, op_overhead_s=0.0, link_latency_s=0.0)


def train_chain(n: int = 6, extra: dict | None = None) -> StepGraph:
    """f1..fn (1 MB, Keras layers L1..Ln), dloss, then bn..b1 where b_i reads f_i; every op takes 1 ms.

    Layers: f_i -> i-1, dloss -> n, b_i -> 2n+1-i. Op at layer L runs during [L, L+1] ms.
    """
    spec: dict = {}
    prev = None
    for i in range(1, n + 1):
        spec[f"f{i}"] = {"inputs": [prev] if prev else [], "bytes": MB, "flops": MS, "type": "Conv2D",
                         "keras_layer": f"L{i}", "shape": (1, 500, 500)}
        prev = f"f{i}"
    spec["dloss"] = {"inputs": [prev], "bytes": KB, "flops": MS, "backward": True}
    grad = "dloss"
    for i in range(n, 0, -1):
        spec[f"b{i}"] = {"inputs": [grad, f"f{i}"], "bytes": KB, "flops": MS, "backward": True,
                         "keras_layer": f"L{i}"}
        grad = f"b{i}"
    for op, more in (extra or {}).items():
        spec[op]["inputs"] = spec[op]["inputs"] + more
    return StepGraph.from_spec(spec)


# ---------------------------------------------------------------------------------------------------- dymem
def test_dymem_swaps_exactly_the_tensors_worth_a_round_trip():
    sg = train_chain()
    plan = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    # f_i is released at i+1 ms (swap-out done) and read again at 13-i ms: a 2 ms round trip fits for i <= 5
    assert sorted(s.tensor for s in plan.swaps) == [f"f{i}:0" for i in range(1, 6)]
    assert validate_plan(sg, plan) == []
    for s in plan.swaps:
        i = int(s.producer[1:])
        (si,) = s.swap_ins
        assert si.consumers == [f"b{i}"]
        assert si.start_layer_of_consumers == 13 - i
        # the latest layer whose compute still hides the 1 ms copy: two layers ahead
        assert si.trigger_layer == 11 - i
        assert si.trigger_op == (f"b{i + 2}" if i <= 4 else "dloss")
        assert s.forward_consumers == ([f"f{i + 1}"])
    assert plan.predicted.stall_s == pytest.approx(0.0)
    assert plan.predicted.step_time_s == pytest.approx(plan.predicted.no_swap_step_time_s)
    assert plan.predicted.no_swap_peak_bytes == 6 * MB + 2 * KB
    assert plan.predicted.peak_bytes == 2 * MB + 2 * KB
    assert plan.mobility["f1"] == "mobile" and plan.mobility["f6"] == "transient"


def test_dymem_moves_triggers_earlier_when_the_h2d_channel_is_busy():
    sg = train_chain()
    slow = get_profile(TOY, h2d_bytes_per_s=0.5e9)  # 2 ms per swap-in: back-to-back copies overlap deadlines
    plan = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1)
    assert validate_plan(sg, plan) == []
    assert plan.predicted.stall_s == pytest.approx(0.0)
    lead = {s.producer: s.swap_ins[0].start_layer_of_consumers - s.swap_ins[0].trigger_layer for s in plan.swaps}
    # one copy per 1 ms consumer, 2 ms each: the later ones are queued behind the earlier ones
    assert max(lead.values()) > 3
    assert len(plan.swaps) < 5  # some candidates cannot be hidden next to the others and are dropped


def test_consumers_close_together_share_a_swap_in_far_ones_do_not():
    extra = {"b4": ["f1"], "b3": ["f1"]}  # f1 is read by b4 (layer 9), b3 (layer 10) and b1 (layer 12)
    sg = train_chain(extra=extra)
    near = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1, group_gap_layers=3)
    s = near.swap_for("f1:0")
    assert [si.consumers for si in s.swap_ins] == [["b4", "b3", "b1"]]
    far = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1, group_gap_layers=1)
    s = far.swap_for("f1:0")
    assert [si.consumers for si in s.swap_ins] == [["b4", "b3"], ["b1"]]
    assert validate_plan(sg, far) == [] and validate_plan(sg, near) == []
    for si in s.swap_ins:
        assert si.trigger_layer < si.start_layer_of_consumers


def test_metadata_and_forward_consumers_stay_on_the_original():
    sg = StepGraph.from_spec({
        "a": {"bytes": MB, "flops": MS, "shape": (250, 1000)}, "b": {"inputs": ["a"], "bytes": KB, "flops": MS},
        "sh": {"type": "Shape", "inputs": ["a"], "backward": True, "bytes": 16},
        **{f"w{i}": {"inputs": [f"w{i - 1}" if i else "b"], "bytes": KB, "flops": MS} for i in range(6)},
        "g": {"inputs": ["w5", "a", "sh"], "backward": True, "flops": MS}})
    plan = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    s = plan.swap_for("a:0")
    assert s is not None
    assert sorted(s.forward_consumers) == ["b", "sh"] and s.backward_consumers == ["g"]


def test_tensors_made_in_a_conditional_branch_are_not_swapped():
    # a swap-out in a lowered branch is dead when the branch is not taken, and chained (seqadded) with the plan's
    # order it would stop every op after it
    chain = {f"w{i}": {"inputs": [f"w{i - 1}" if i else "b"], "bytes": KB, "flops": MS} for i in range(6)}
    spec = {"a": {"bytes": MB, "flops": MS, "shape": (250, 1000)}, "b": {"inputs": ["a"], "bytes": KB, "flops": MS},
            **chain, "g1": {"inputs": ["w5", "a"], "backward": True, "flops": MS}}
    assert make_plan(StepGraph.from_spec(spec), "dymem", profile=TOY, min_swap_bytes=1).swap_for("a:0") is not None
    branch = StepGraph.from_spec(spec)
    branch.ops["a"].conditional = True
    assert make_plan(branch, "dymem", profile=TOY, min_swap_bytes=1).swap_for("a:0") is None


def _gated_step(other_reader: bool = False, shared_output: bool = False, output_read_back: bool = False) -> StepGraph:
    """A lowered ``cond`` as the pass sees it: ``relu`` (the taken branch's value) is returned by the ``Merge``
    ``out`` and kept for the gradient's branch in an optional (``wrap`` -> ``merge_opt`` -> the gradient's
    ``Switch`` -> ``get``), which ``rgrad`` reads late in the backward pass; the step peaks at ``w3`` (5 MB).
    ``other_reader``: ``w0`` reads the optional too; ``shared_output``: the other branch keeps its own value in the
    same ``Merge`` (cond_v2 gives matching intermediates of both branches one output); ``output_read_back``: the
    gradient op ``fgrad`` reads ``out`` too (as the next convolution's filter gradient reads its input)."""
    chain = {f"w{i}": {"inputs": [f"w{i - 1}" if i else "out"], "bytes": 5 * MB if i == 3 else KB, "flops": MS}
             for i in range(6)}
    if other_reader:
        chain["w0"]["inputs"] = ["out", "merge_opt"]
    sg = StepGraph.from_spec({
        "x": {"bytes": KB, "type": "IteratorGetNext"}, "pred": {"inputs": ["x"], "bytes": 1, "flops": MS},
        "a": {"inputs": ["x"], "bytes": MB, "flops": MS, "shape": (250, 1000)},
        "sw": {"type": "Switch", "inputs": ["a", "pred"], "bytes": [MB, MB]},
        "relu": {"inputs": ["sw:1"], "bytes": MB, "flops": MS, "shape": (250, 1000)},
        "half": {"inputs": ["sw:0"], "bytes": MB, "flops": MS},
        "wrap": {"type": "OptionalFromValue", "inputs": ["relu"], "bytes": 0, "dtype": "variant"},
        "none": ({"type": "OptionalFromValue", "inputs": ["half"], "bytes": 0, "dtype": "variant"} if shared_output
                 else {"type": "OptionalNone", "bytes": 0, "dtype": "variant"}),
        "out": {"type": "Merge", "inputs": ["relu", "half"], "bytes": MB, "flops": MS},
        "merge_opt": {"type": "Merge", "inputs": ["wrap", "none"], "bytes": 0, "alias": True, "dtype": "variant"},
        **chain,
        "gin": {"inputs": ["w5"], "backward": True, "bytes": MB, "flops": MS},
        "bsw": {"type": "Switch", "inputs": ["merge_opt", "pred"], "bytes": [0, 0], "backward": True},
        "get": {"type": "OptionalGetValue", "inputs": ["bsw:1"], "bytes": MB, "backward": True},
        "rgrad": {"type": "ReluGrad", "inputs": ["gin", "get"], "backward": True, "bytes": MB, "flops": MS},
        **({"fgrad": {"inputs": ["gin", "out"], "backward": True, "bytes": KB, "flops": MS}} if output_read_back
           else {}),
    })
    for name in ("relu", "half", "wrap", "none", "get", "rgrad"):
        sg.ops[name].conditional = True
    return sg


def test_a_branch_value_kept_in_an_optional_is_swapped_through_it():
    # cond's gradient keeps the taken branch's ReLU output in an optional until its ReluGrad: the swap-out's host
    # copy goes into the optional and ReluGrad reads the swap-in, both inside their branches
    sg = _gated_step()
    assert sg.optional_readers("relu:0") == ("wrap", {"rgrad": "get"})
    assert sg.optional_chain("wrap") == {"wrap", "merge_opt", "bsw", "get"}
    plan = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    s = plan.swap_for("relu:0")
    assert s is not None and s.optional_wrap == "wrap" and s.alias_reads == [["rgrad", "get"]]
    assert s.forward_consumers == ["out"] and [si.consumers for si in s.swap_ins] == [["rgrad"]]
    assert validate_plan(sg, plan) == []
    kept = simulate(sg, [d for d in plan.swaps if d.tensor != "relu:0"], TOY, timeline=False)
    assert simulate(sg, plan, TOY, timeline=False).peak_bytes <= kept.peak_bytes - MB
    from dymem_tf.passes.graph_pass import encode_plan, swap_in_name, swap_out_name

    records = encode_plan([s]).splitlines()[1:]  # after the version line
    out, swap_in = swap_out_name("relu:0"), swap_in_name("relu:0", 0)
    assert records[:2] == [f"out\trelu\t0\t{out}\t0", f"reroute\twrap\trelu\t0\t{out}"]
    assert records[-1] == f"reroute\trgrad\tget\t0\t{swap_in}"
    s.optional_wrap = ""  # without the optional's reroute nothing serves rgrad
    assert validate_plan(sg, plan)
    # another reader of the optional, or the other branch's value in the same output: no candidate (a swap of one
    # branch's value would feed the other branch's gradient too)
    for other in (_gated_step(other_reader=True), _gated_step(shared_output=True)):
        assert other.optional_readers("relu:0") is None
        assert make_plan(other, "dymem", profile=TOY, min_swap_bytes=1).swap_for("relu:0") is None


def test_alias_consumers_keep_the_buffer():
    chain = {f"w{i}": {"inputs": [f"w{i - 1}" if i else "b"], "bytes": KB, "flops": MS} for i in range(6)}
    # a late backward read through an alias op (Reshape) reads a copy of it on the swap-in
    late = StepGraph.from_spec({
        "a": {"bytes": MB, "flops": MS, "shape": (250, 1000)}, "r": {"type": "Reshape", "inputs": ["a"], "bytes": MB},
        "b": {"inputs": ["a"], "bytes": KB, "flops": MS}, **chain,
        "g1": {"inputs": ["w5", "a"], "backward": True, "flops": MS, "bytes": KB},
        "g2": {"inputs": ["g1", "r"], "backward": True, "flops": MS}})
    plan = make_plan(late, "dymem", profile=TOY, min_swap_bytes=1)
    s = plan.swap_for("a:0")
    assert s is not None and s.alias_reads == [["g2", "r"]]
    assert sorted(c for si in s.swap_ins for c in si.consumers) == ["g1", "g2"]
    assert validate_plan(late, plan) == []
    # ... but not through an alias of an alias: that read pins the buffer, swapping a would save nothing
    nested = StepGraph.from_spec({
        "a": {"bytes": MB, "flops": MS, "shape": (250, 1000)}, "r": {"type": "Reshape", "inputs": ["a"], "bytes": MB},
        "r2": {"type": "Reshape", "inputs": ["r"], "bytes": MB},
        "b": {"inputs": ["a"], "bytes": KB, "flops": MS}, **chain,
        "g1": {"inputs": ["w5", "a"], "backward": True, "flops": MS, "bytes": KB},
        "g2": {"inputs": ["g1", "r2"], "backward": True, "flops": MS}})
    assert nested.alias_readers("a:0") is None
    assert make_plan(nested, "dymem", profile=TOY, min_swap_bytes=1).swap_for("a:0") is None
    # an early (forward) read through an alias only delays the release; the decision lists direct consumers
    early = StepGraph.from_spec({
        "a": {"bytes": MB, "flops": MS, "shape": (250, 1000)}, "r": {"type": "Reshape", "inputs": ["a"], "bytes": MB},
        "b": {"inputs": ["r"], "bytes": KB, "flops": MS}, **chain,
        "g1": {"inputs": ["w5", "a"], "backward": True, "flops": MS}})
    plan = make_plan(early, "dymem", profile=TOY, min_swap_bytes=1)
    s = plan.swap_for("a:0")
    assert s is not None and s.forward_consumers == ["r"] and s.backward_consumers == ["g1"]
    assert validate_plan(early, plan) == []
    res = simulate(early, plan, TOY)
    (ev,) = res.swap_events
    off = [t + m for (time, _, t, m) in res.timeline if ev.out_end < time < ev.in_start]
    assert off and max(off) < MB  # the buffer is off the device between swap-out and swap-in


# ---------------------------------------------------------------------------------------------------- budget
def test_budget_is_respected_with_fewer_swaps():
    sg = train_chain()
    full = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    budget = 4 * MB + 500 * KB + 1 * MB  # persistent 1 MB included
    plan = make_plan(sg, "dymem", profile=TOY, budget_bytes=budget, persistent_bytes=MB, min_swap_bytes=1)
    assert plan.predicted.peak_bytes <= budget
    assert 0 < len(plan.swaps) < len(full.swaps)
    assert plan.predicted.peak_by_group["persistent"] == MB
    assert validate_plan(sg, plan) == []
    assert simulate(sg, plan, TOY).peak_bytes == plan.predicted.peak_bytes


def test_tight_budget_trades_stalls_for_memory():
    sg = train_chain()
    slow = get_profile(TOY, h2d_bytes_per_s=0.5e9)  # 2 ms per swap-in: not every copy can be hidden
    free = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1)
    assert free.predicted.stall_s == pytest.approx(0.0)
    budget = free.predicted.peak_bytes - MB // 2
    tight = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1, budget_bytes=budget)
    assert tight.predicted.peak_bytes <= budget
    assert tight.predicted.stall_s > 0 and tight.params.trigger_mode in ("isolated", "jit")
    assert any("stalls expected" in n for n in tight.notes)
    tflms = make_plan(sg, "tflms", profile=slow, min_swap_bytes=1, budget_bytes=budget)
    assert tight.predicted.stall_s < tflms.predicted.stall_s
    # dymem's last resort (triggers right before the consumers) reaches the memory of the latest-trigger policy
    lowest = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1, budget_bytes=2 * MB)
    assert lowest.predicted.peak_bytes <= 2 * MB
    assert validate_plan(sg, tight) == [] and validate_plan(sg, lowest) == []


def test_a_greedy_plan_within_the_stall_tolerance_ends_the_search(monkeypatch):
    # pruning and exchanging simulate the whole step per trial: not worth it for a stall the cost model cannot
    # resolve; a stall above the tolerance is searched as before
    from dymem_tf.planning import planner as planner_mod

    sg = train_chain()
    slow = get_profile(TOY, h2d_bytes_per_s=0.5e9)
    budget = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1).predicted.peak_bytes - MB // 2
    searched = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1, budget_bytes=budget)
    stall = searched.predicted.step_time_s / searched.predicted.no_swap_step_time_s - 1
    assert stall > 0 and not any("not searched further" in n for n in searched.notes)
    monkeypatch.setattr(planner_mod, "SEARCH_STALL_TOLERANCE", 1.0)
    greedy = make_plan(sg, "dymem", profile=slow, min_swap_bytes=1, budget_bytes=budget)
    assert greedy.predicted.peak_bytes <= budget and validate_plan(sg, greedy) == []
    assert any("not searched further" in n for n in greedy.notes)


def test_headroom_plans_below_the_budget_and_errors_name_the_budget():
    sg = train_chain()
    full = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1).predicted
    budget = (full.peak_bytes + full.no_swap_peak_bytes) // 2
    exact = make_plan(sg, "dymem", budget_bytes=budget, profile=TOY, min_swap_bytes=1)
    roomy = make_plan(sg, "dymem", budget_bytes=budget, profile=TOY, min_swap_bytes=1, headroom=0.1)
    assert exact.predicted.peak_bytes <= budget
    assert roomy.predicted.peak_bytes <= 0.9 * budget and len(roomy.swaps) >= len(exact.swaps)
    tight = int(full.peak_bytes * 1.05)  # fits exactly, not with 10% kept free
    make_plan(sg, "dymem", budget_bytes=tight, profile=TOY, min_swap_bytes=1)
    with pytest.raises(BudgetTooSmallError, match="keeps 10% of it free") as info:
        make_plan(sg, "dymem", budget_bytes=tight, profile=TOY, min_swap_bytes=1, headroom=0.1)
    assert info.value.budget_bytes == tight
    with pytest.raises(ValueError, match="headroom"):
        make_plan(sg, "dymem", budget_bytes=tight, profile=TOY, headroom=1.5)
    # below 0 (a calibration measured the simulator over-predicting): planned beyond the budget, keeping more
    beyond = make_plan(sg, "dymem", budget_bytes=budget, profile=TOY, min_swap_bytes=1, headroom=-0.2)
    assert beyond.predicted.peak_bytes <= 1.2 * budget and len(beyond.swaps) <= len(exact.swaps)
    assert any("over the budget" in n for n in beyond.notes)
    with pytest.raises(ValueError, match="headroom"):
        make_plan(sg, "dymem", budget_bytes=tight, profile=TOY, headroom=-1.5)


def test_budget_that_fits_without_swapping():
    sg = train_chain()
    plan = make_plan(sg, "dymem", profile=TOY, budget_bytes=10 * MB, min_swap_bytes=1)
    assert plan.swaps == [] and any("without swapping" in n for n in plan.notes)


def test_budget_too_small_reports_minimum_and_suggests_a_batch():
    sg = train_chain()
    with pytest.raises(BudgetTooSmallError) as err:
        make_plan(sg, "dymem", profile=TOY, budget_bytes=MB + MB // 2, persistent_bytes=MB, batch_size=32,
                  min_swap_bytes=1)
    e = err.value
    assert isinstance(e, ValueError)
    assert e.min_peak_bytes > e.budget_bytes
    assert "at least" in str(e) and "batch size from 32" in str(e)
    assert e.suggested_batch is not None and 0 <= e.suggested_batch < 32


def test_budget_below_persistent_bytes():
    with pytest.raises(ValueError, match="smaller than the model's persistent tensors"):
        make_plan(train_chain(), "dymem", profile=TOY, budget_bytes=5 * MB, persistent_bytes=10 * MB)


def test_unknown_policy():
    with pytest.raises(ValueError) as err:
        make_plan(train_chain(), "lru")
    assert all(p in str(err.value) for p in POLICIES)


# ---------------------------------------------------------------------------------------------- vdnn, tflms
def test_vdnn_prefetches_one_keras_layer_ahead():
    sg = train_chain()
    plan = make_plan(sg, "vdnn", profile=TOY, min_swap_bytes=1)
    assert validate_plan(sg, plan) == []
    by = {s.producer: s for s in plan.swaps}
    assert set(by) == {f"f{i}" for i in range(1, 7)}
    for i in range(1, 6):
        (si,) = by[f"f{i}"].swap_ins
        assert si.trigger_op == f"b{i + 1}"  # the backward of the Keras layer before L_i in backward order
        assert si.trigger_layer == si.start_layer_of_consumers - 1
    # a 1 ms copy started 1 ms-op ahead cannot be hidden; dymem starts it early enough
    dymem = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    assert plan.predicted.stall_s > 1e-3
    assert dymem.predicted.step_time_s < plan.predicted.step_time_s


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_tflms_triggers_swapin_ahead_levels_early(ahead):
    sg = train_chain()
    plan = make_plan(sg, "tflms", profile=TOY, min_swap_bytes=1, swapin_ahead=ahead)
    assert validate_plan(sg, plan) == []
    for s in plan.swaps:
        if s.producer in ("f1", "f2", "f3"):
            (si,) = s.swap_ins
            assert si.trigger_layer == si.start_layer_of_consumers - ahead
            assert sg.ops[si.trigger_op].layer == si.trigger_layer


def test_tflms_respects_its_size_threshold():
    sg = train_chain()
    assert make_plan(sg, "tflms", profile=TOY, min_swap_bytes=2 * MB).swaps == []
    assert len(make_plan(sg, "tflms", profile=TOY, min_swap_bytes=MB).swaps) >= 5


def nonlinear_toy(profile: DeviceProfile) -> StepGraph:
    """conv -> (long 4-conv branch | short branch) -> add -> loss; the conv output is read by both branches'
    backward. vDNN prefetches it one Keras layer ahead: behind the tiny backward of ``add`` and of ``long2``."""
    ms = profile.flops_per_s * 1e-3
    big, small = 8 * 2**20, 1024
    spec = {
        "x": {"type": "Placeholder", "bytes": small},
        "c1": {"inputs": ["x"], "bytes": big, "flops": 0.2 * ms, "type": "Conv2D", "keras_layer": "c1"},
        "l1": {"inputs": ["c1"], "bytes": small, "flops": ms, "type": "Conv2D", "keras_layer": "long1"},
        "l2": {"inputs": ["l1"], "bytes": small, "flops": ms, "type": "Conv2D", "keras_layer": "long2"},
        "l3": {"inputs": ["l2"], "bytes": small, "flops": ms, "type": "Conv2D", "keras_layer": "long3"},
        "l4": {"inputs": ["l3"], "bytes": small, "flops": ms, "type": "Conv2D", "keras_layer": "long4"},
        "s1": {"inputs": ["c1"], "bytes": small, "flops": 0.05 * ms, "type": "Conv2D", "keras_layer": "short"},
        "add": {"inputs": ["l4", "s1"], "bytes": small, "flops": 0.01 * ms, "type": "AddV2", "keras_layer": "add"},
        "loss": {"inputs": ["add"], "bytes": 4, "flops": 0.01 * ms},
        "dloss": {"inputs": ["loss"], "bytes": 4, "flops": 0.01 * ms, "backward": True},
        "dadd": {"inputs": ["dloss"], "bytes": small, "flops": 0.01 * ms, "backward": True, "keras_layer": "add"},
        "ds1": {"inputs": ["dadd", "c1"], "bytes": small, "flops": 0.05 * ms, "backward": True,
                "keras_layer": "short"},
        "dl4": {"inputs": ["dadd", "l3"], "bytes": small, "flops": ms, "backward": True, "keras_layer": "long4"},
        "dl3": {"inputs": ["dl4", "l2"], "bytes": small, "flops": ms, "backward": True, "keras_layer": "long3"},
        "dl2": {"inputs": ["dl3", "l1"], "bytes": small, "flops": ms, "backward": True, "keras_layer": "long2"},
        "dl1": {"inputs": ["dl2", "c1"], "bytes": small, "flops": ms, "backward": True, "keras_layer": "long1"},
        "dc1": {"inputs": ["ds1", "dl1", "x"], "bytes": small, "flops": 0.2 * ms, "backward": True,
                "keras_layer": "c1"},
    }
    return StepGraph.from_spec(spec)


def test_dymem_beats_vdnn_on_a_nonlinear_network():
    prof = get_profile("v100")
    sg = nonlinear_toy(prof)
    dymem = make_plan(sg, "dymem", profile=prof)
    vdnn = make_plan(sg, "vdnn", profile=prof)
    assert [s.tensor for s in dymem.swaps] == ["c1:0"] and [s.tensor for s in vdnn.swaps] == ["c1:0"]
    assert len(vdnn.swaps[0].swap_ins) == 2  # one per consumer Keras layer (short, long1)
    assert len(dymem.swaps[0].swap_ins) == 1
    assert dymem.predicted.stall_s == pytest.approx(0.0, abs=1e-9)
    assert vdnn.predicted.stall_s > 0.5e-3
    assert dymem.predicted.step_time_s < vdnn.predicted.step_time_s
    for plan in (dymem, vdnn):
        assert validate_plan(sg, plan) == []


# ------------------------------------------------------------------------------------------------ plan data
def test_plan_json_round_trip_summary_and_diff(tmp_path):
    sg = train_chain()
    plan = make_plan(sg, "dymem", profile=TOY, budget_bytes=5 * MB, persistent_bytes=MB, batch_size=8,
                     min_swap_bytes=1)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert isinstance(back.params.profile, DeviceProfile) and back.measured is None
    json.loads(plan.to_json())  # plain JSON
    # a plan.json written before the results were typed: dicts, an empty measurement, keys this version lacks
    old = json.loads(plan.to_json())
    old["measured"], old["params"]["retired_setting"] = {}, 1
    old["predicted"] = {"peak_bytes": 7, "stall_s": 0.5, "calibration": {
        "budget_bytes": 9, "predicted_peak_bytes": 7, "measured_peak_bytes": 8, "persistent_bytes": 1,
        "headroom": 0.1, "removed_field": True}}
    loaded = Plan.from_dict(old)
    assert loaded.measured is None and loaded.params.min_swap_bytes == plan.params.min_swap_bytes
    assert (loaded.predicted.peak_bytes, loaded.predicted.stall_s, loaded.predicted.step_time_s) == (7, 0.5, None)
    assert loaded.predicted.calibration.measured_peak_bytes == 8
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    text = plan.summary()
    assert "policy=dymem" in text and "device=toy" in text
    assert f"swapped tensors : {len(plan.swaps)}" in text
    assert f"{plan.predicted.peak_bytes / 2**20:.1f} MiB" in text
    assert f"{5 * MB / 2**20:.1f} MiB" in text and "[fits]" in text
    assert f"{plan.predicted.step_time_s * 1e3:.3f} ms" in text and "stall" in text
    assert plan.swaps[0].tensor in text
    assert plan.diff(back) == []
    other = make_plan(sg, "dymem", profile=TOY, persistent_bytes=MB, batch_size=8, min_swap_bytes=1)
    d = plan.diff(other)
    assert any(line.startswith("budget_bytes") for line in d)
    assert any(line.startswith("- swap") for line in d)


def test_a_plan_saved_with_keys_this_version_lacks_loads_without_them():
    """``Plan.from_dict`` leaves out the keys it does not know, as its docstring says, at every level: the plan's own
    fields, each swap, its swap-ins and its routes (a plan.json written by another version loads; nothing unknown
    reaches a dataclass's constructor)."""
    plan = make_plan(train_chain(), "dymem", profile=TOY, budget_bytes=5 * MB, persistent_bytes=MB, batch_size=8,
                     min_swap_bytes=1)
    assert len(plan.swaps) >= 2
    old = json.loads(plan.to_json())
    old["format_revision"] = 3
    first, second = old["swaps"][0], old["swaps"][1]
    first["retired_flag"], first["swap_ins"][0]["queue"] = True, "h2d"
    first["route"] = {"reads": ["w/read"], "writes": ["w/update"], "fused": []}
    second["recompute"] = {"ops": [["relu", []]], "leaves": ["conv"], "cost_s": 0.1}
    loaded = Plan.from_dict(old)
    assert loaded.swaps[0].route.reads == ["w/read"] and loaded.swaps[0].route.writes == ["w/update"]
    assert loaded.swaps[1].recompute.ops == [["relu", []]] and loaded.swaps[1].recompute.leaves == ["conv"]
    loaded.swaps[0].route = loaded.swaps[1].recompute = None
    assert loaded == plan  # everything else as saved, the unknown keys left out
    assert "format_revision" not in loaded.to_dict() and "retired_flag" not in loaded.to_dict()["swaps"][0]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan  # a current plan is unchanged by the filtering


def test_mobility_groups():
    sg = StepGraph.from_spec({
        "w": {"type": "ReadVariableOp", "bytes": 64, "persistent": True},
        "a": {"inputs": ["w"], "bytes": MB, "flops": MS, "shape": (250, 1000)},
        **{f"m{i}": {"inputs": [f"m{i - 1}" if i else "a"], "bytes": KB, "flops": MS} for i in range(6)},
        "g": {"inputs": ["m5", "a", "w"], "backward": True, "flops": MS},
        "sink": {"inputs": ["g"], "bytes": []}})
    plan = make_plan(sg, "dymem", profile=TOY, min_swap_bytes=1)
    assert [s.tensor for s in plan.swaps] == ["a:0"]
    assert plan.mobility["w"] == "persistent"
    assert plan.mobility["a"] == "mobile"
    assert plan.mobility["m0"] == "transient"
    assert "sink" not in plan.mobility  # no outputs


def test_new_variable_values_are_persistent():
    # m_new = m * momentum - g * lr ; AssignVariableOp(m, m_new) adopts m_new's buffer (in-place Sub chain)
    sg = StepGraph.from_spec({
        "h": {"type": "VarHandleOp", "bytes": 8, "persistent": True},
        "m": {"type": "ReadVariableOp", "inputs": ["h"], "bytes": KB, "persistent": True},
        "g": {"type": "Conv2DBackpropFilter", "bytes": KB, "backward": True, "flops": MS},
        "scaled_m": {"type": "Mul", "inputs": ["m"], "bytes": KB},
        "scaled_g": {"type": "Mul", "inputs": ["g"], "bytes": KB, "backward": True},
        "m_new": {"type": "Sub", "inputs": ["scaled_m", "scaled_g"], "bytes": KB, "backward": True},
        "assign": {"type": "AssignVariableOp", "inputs": ["h", "m_new"], "bytes": []},
        "add": {"type": "AssignAddVariableOp", "inputs": ["h", "scaled_g"], "bytes": []}})
    plan = make_plan(sg, "none", profile=TOY)
    assert plan.mobility["m_new"] == plan.mobility["scaled_m"] == "persistent"
    assert plan.mobility["m"] == "persistent"
    # AssignAdd copies into the variable, and Sub reuses its first input's buffer: the gradient path stays transient
    assert plan.mobility["scaled_g"] == plan.mobility["g"] == "transient"


def test_the_values_a_step_returns_are_persistent():
    """Keras's step returns its logs wrapped in an optional; the buffers it wraps outlive the step (the caller holds
    them until the next step's replace them), so they go with the long-lived tensors: in the transient group a
    4-byte loss pinned a 2 MiB block through the next step and moved that step's reserved peak by a block."""
    from dymem_tf.planning.simulator import returned_values

    sg = StepGraph.from_spec({
        "x": {"bytes": MB, "flops": MS},
        "total": {"type": "Sum", "inputs": ["x"], "bytes": 4, "flops": MS},
        "loss": {"type": "DivNoNan", "inputs": ["total"], "bytes": 4},  # writes into total's buffer, its sole reader
        "loss_id": {"type": "Identity", "inputs": ["loss"], "bytes": 4},
        "count": {"type": "Size", "inputs": ["x"], "bytes": 4},
        "metric": {"type": "DivNoNan", "inputs": ["count"], "bytes": 4},  # count has another reader below
        "act": {"type": "Relu", "inputs": ["x"], "bytes": MB, "flops": MS},  # x is read by total too
        "other": {"type": "Mul", "inputs": ["count"], "bytes": 4},
        "optional": {"type": "OptionalFromValue", "inputs": ["loss_id", "metric", "act"], "dtype": "variant",
                     "persistent": True},  # the analysis aliases it to its first input only
        "ret": {"type": "_Retval", "inputs": ["optional"], "bytes": []}})
    # every wrapped value; through loss_id (an alias: it allocates nothing) to loss and the buffer it writes into;
    # not count, nor x: another op reads them, so TF may not write the returned value into their buffers
    assert returned_values(sg) == {"loss", "total", "metric", "act"}
    plan = make_plan(sg, "none", profile=TOY)
    assert all(plan.mobility[n] == "persistent" for n in ("loss", "total", "metric", "act"))
    assert plan.mobility["x"] == plan.mobility["count"] == plan.mobility["other"] == "transient"


# -------------------------------------------------------------------------------------------- random graphs
def random_train_step(rng: random.Random, n: int) -> StepGraph:
    """A random forward DAG with variable reads, a loss, and its mirrored gradient graph (like autodiff)."""
    spec: dict = {}
    fwd: list[str] = []
    for j in range(3):
        spec[f"w{j}"] = {"type": "ReadVariableOp", "bytes": rng.choice([64, 4096]), "persistent": True}
    for i in range(n):
        name = f"f{i}"
        k = rng.randint(1, min(2, len(fwd))) if fwd else 0
        inputs = rng.sample(fwd, k) + ([f"w{rng.randrange(3)}"] if rng.random() < 0.4 else [])
        size = rng.choice([0, 16, 4 * KB, 100 * KB, MB])
        spec[name] = {"inputs": inputs, "bytes": size, "shape": (size // 4,) if size else (),
                      "flops": rng.uniform(0.1, 2) * MS, "type": rng.choice(["Conv2D", "Relu", "AddV2"]),
                      "keras_layer": f"K{i // 2}"}
        fwd.append(name)
    consumers: dict[str, list[str]] = {f: [] for f in fwd}
    for f in fwd:
        for inp in spec[f]["inputs"]:
            if inp in consumers:
                consumers[inp].append(f)
    spec["dloss"] = {"inputs": [fwd[-1]], "bytes": 4, "flops": MS, "backward": True}
    for f in reversed(fwd):
        grads = [f"d{c}" for c in consumers[f]] or ["dloss"]
        saved = [i for i in spec[f]["inputs"]] + ([f] if rng.random() < 0.5 else [])
        spec[f"d{f}"] = {"inputs": grads + saved, "bytes": spec[f]["bytes"], "flops": spec[f]["flops"],
                         "backward": True, "keras_layer": spec[f]["keras_layer"]}
    return StepGraph.from_spec(spec)


@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_give_valid_plans(seed):
    rng = random.Random(seed)
    sg = random_train_step(rng, rng.randint(8, 40))
    for policy in POLICIES:
        for profile in (TOY, "h200", get_profile(TOY, h2d_bytes_per_s=1e7)):
            plan = make_plan(sg, policy, profile=profile, min_swap_bytes=1)
            assert validate_plan(sg, plan) == []
            for s in plan.swaps:
                assert not sg.tensors[s.tensor].persistent
                assert not sg.ops[s.producer].is_backward
                for si in s.swap_ins:
                    assert sg.ops[si.trigger_op].layer < min(sg.ops[c].layer for c in si.consumers)
            if policy != "none":
                budget = (plan.predicted.no_swap_peak_bytes + plan.predicted.peak_bytes) // 2
                try:
                    tight = make_plan(sg, policy, profile=profile, budget_bytes=budget, min_swap_bytes=1)
                except BudgetTooSmallError as err:
                    assert err.min_peak_bytes > budget
                else:
                    assert tight.predicted.peak_bytes <= budget
                    assert validate_plan(sg, tight) == []


# ---------------------------------------------------------------------------------------------- pruning
def test_prune_keeps_the_budget_and_the_speed_and_drops_late_tensors():
    from dymem_tf.planning import planner as planner_mod
    from dymem_tf.planning.cost_model import as_cost_model

    sg = train_chain(8)
    pl = planner_mod._Planner(sg, as_cost_model(TOY), 1, None, 3)
    pool = pl.candidates("tflms", relaxed=True)
    full = pl.run(pl.decisions("tflms", pool, "queue"), 0)
    budget = full.peak_bytes + 3 * MB  # room for three more tensors on the device
    kept, res = pl.prune("tflms", "queue", pool, budget, 0, full)
    assert 0 < len(kept) < len(pool)
    assert res.peak_bytes <= budget and res.step_time_s <= full.step_time_s
    again = pl.run(pl.decisions("tflms", kept, "queue"), 0)  # the returned result belongs to the returned set
    assert (again.peak_bytes, again.step_time_s) == (res.peak_bytes, res.step_time_s)
    # latest produced go first: on this chain the last tensors (read first in the backward pass) are dropped
    latest = max(pool, key=lambda c: c.prod_pos)
    assert latest.tensor not in {c.tensor for c in kept}
    # a pool that fits with nothing to spare keeps everything it needs
    tight, tight_res = pl.prune("tflms", "queue", pool, full.peak_bytes, 0, full)
    assert tight_res.peak_bytes <= full.peak_bytes and len(tight) >= len(kept)


@pytest.mark.slow
def test_tight_budget_on_resnet50_h200_keeps_the_schedule_fast():
    """Regression: just above vDNN's all-swap peak the greedy addition stalls (the D2H channel is the bottleneck at
    the end of the forward pass) and used to fall back to swapping all 212 eligible tensors one layer ahead
    (242 ms vs 76 ms without swaps); pruning a fitting full set finds a plan that keeps nearly all the speed."""
    from dymem_tf.keras import dry_run

    traced = dry_run.trace_train_step(dry_run.build_model("resnet50", 224), 64)
    unbounded = dry_run.plan_all(traced, ["vdnn"], None, "h200")["vdnn"]
    budget = int(unbounded.predicted.peak_bytes * 1.006)
    plans = dry_run.plan_all(traced, ["dymem", "vdnn"], budget, "h200", headroom=0.0)
    dymem, vdnn = plans["dymem"], plans["vdnn"]
    assert dymem.predicted.peak_bytes <= budget and vdnn.predicted.peak_bytes <= budget
    assert dymem.predicted.step_time_s <= 1.1 * dymem.predicted.no_swap_step_time_s
    assert vdnn.predicted.step_time_s >= 1.1 * dymem.predicted.step_time_s  # 102 vs 79 ms when written


def test_exchange_only_accepts_faster_plans_that_fit():
    from dymem_tf.planning import planner as planner_mod
    from dymem_tf.planning.cost_model import as_cost_model

    sg = train_chain(8)
    pl = planner_mod._Planner(sg, as_cost_model(get_profile(TOY, h2d_bytes_per_s=0.5e9)), 1, None, 3)
    pool = pl.candidates("dymem", relaxed=True)
    # the last forward tensor, read right after the forward pass: its 2 ms swap-in cannot be hidden and stalls
    start = [max(pool, key=lambda c: c.prod_pos)]
    res = pl.run(pl.decisions("dymem", start, "isolated"), 0)
    assert res.stall_s > 0
    budget = res.peak_bytes
    kept, out = pl.exchange("dymem", "isolated", start, pool, budget, 0, res)
    # an earlier tensor, whose copy has time to come back, took its place: faster, within the same budget
    assert out.peak_bytes <= budget and out.step_time_s < res.step_time_s
    assert len(kept) == 1 and kept[0].prod_pos < start[0].prod_pos
    again = pl.run(pl.decisions("dymem", kept, "isolated"), 0)
    assert (again.peak_bytes, again.step_time_s) == (out.peak_bytes, out.step_time_s)
    # nothing to gain without stalls
    calm, calm_res = pl.exchange("dymem", "isolated", [], pool, budget, 0, pl.run([], 0))
    assert calm == []


@pytest.mark.parametrize("batch, budget, peak, persistent, margin, expected", [
    (64, 500, 900, 100, 0.0, 32),    # 400 of step memory room for 800 at batch 64
    (64, 500, 900, 100, 0.2, 24),    # the margin comes off the budget: room 300
    (64, 1000, 900, 100, 0.0, None),  # already fits
    (None, 500, 900, 100, 0.0, None),  # batch unknown
    (64, 500, 100, 100, 0.0, None),  # no step memory to scale
    (8, 100, 10_000, 120, 0.0, 0),   # the budget is below the persistent bytes
])
def test_suggested_batch_scales_the_step_memory_to_the_budget(batch, budget, peak, persistent, margin, expected):
    from dymem_tf.planning.planner import suggested_batch

    assert suggested_batch(batch, budget, peak, persistent, margin) == expected
