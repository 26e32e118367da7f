"""bench/planned_placement.py (issue 48, item 1): traced allocations matched to a plan's buffers, static offsets
checked against live lifetimes. The matching and the offsets on hand-made instances, then on the real traces of a
small budgeted MLP (a fit of 5 steps in a subprocess: ~15 s)."""
from __future__ import annotations

import glob
import itertools
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import planned_placement as pp  # noqa: E402


def _planned(rows, keys, ops, graph_ops, forwarded=()):
    return {"rows": np.array(rows, dtype=np.int64), "keys": keys, "op": ops, "peak_bytes": 0,
            "forwarded": set(forwarded), "graph_ops": set(graph_ops), "inputs": [[] for _ in rows]}


def _row(lower, upper, size, op, group=1):
    return {"lower": lower, "upper": upper, "size": size, "group": group, "offset": 0, "op": op}


def test_allocations_match_the_buffer_their_node_plans_at_that_size_and_the_rest_is_sorted_out():
    planned = _planned(
        rows=[(0, 4, 100, 1), (1, 5, 200, 1), (6, 9, 100, 2), (2, 3, 5000, 1), (0, 10, 64, 0)],
        keys=[("out", "a:0"), ("out", "a:1"), ("in", "a:0", 0), ("tmp", "c"), ("out", "v:0")],
        ops=["a", "a", "a/dymem_swap_in_0_0", None, "v"],
        graph_ops={"a", "c", "v"})
    trace = [_row(0, 3, 200, "a"), _row(1, 4, 100, "a"), _row(2, 3, 100, "a"),  # the third: a temporary of a
             _row(5, 6, 5000, "c"), _row(6, 9, 100, "a/dymem_swap_in_0_0"), _row(7, 8, 48, "a/dymem_swap_out_0"),
             _row(8, 9, 40, ""), _row(9, 10, 64, "v")]
    m = pp.match(trace, planned)
    assert m["buffer"] == [1, 0, -1, -1, 2, -1, -1, -1]
    assert m["category"] == [pp.MATCHED, pp.MATCHED, pp.TEMPORARY, pp.TEMPORARY, pp.MATCHED, pp.DYMEM_EXTRA,
                             pp.OUTSIDE, pp.TEMPORARY]  # a kept variable (group 0) is allocated before the step
    assert m["region"] == [-1, -1, -1, 3, -1, -1, -1, -1]  # c's temporaries go to c's region, a has none
    assert m["unallocated"] == []
    spans = pp.unit_intervals(trace, m)
    assert spans == {0: (1, 4), 1: (0, 3), 2: (6, 9), 3: (5, 6)} and pp.units(planned) == [0, 1, 2, 3]
    summary = pp.match_summary(trace, planned, m)
    assert summary["categories"][pp.MATCHED] == {"count": 3, "bytes": 400}
    assert summary["in_temporaries_regions"] == {"count": 1, "bytes": 5000}
    assert summary["dynamic_peak_live"] == 100 and summary["regions_overflowing"]["count"] == 0
    # one planned output the step did not allocate (TF forwarded an input into it)
    m = pp.match(trace[1:], planned)
    assert m["unallocated"] == [1] and m["buffer"][0] == 0


def test_of_one_nodes_allocations_of_one_size_the_longest_lived_is_its_output():
    planned = _planned(rows=[(0, 9, 300, 1)], keys=[("out", "e:0")], ops=["e"], graph_ops={"e"})
    trace = [_row(0, 1, 300, "e"), _row(2, 9, 300, "e")]  # the kernel's temporary comes first and dies with it
    m = pp.match(trace, planned)
    assert m["buffer"] == [-1, 0] and m["category"] == [pp.TEMPORARY, pp.MATCHED]


def test_best_fit_never_overlaps_buffers_that_conflict_and_conflicts_are_counted():
    rng = np.random.default_rng(0)
    lower = rng.integers(0, 100, 60)
    upper = lower + rng.integers(1, 30, 60)
    sizes = rng.integers(1, 5000, 60)
    live = pp.overlaps(lower, upper)
    offsets = pp.best_fit(sizes, live, upper - lower, lower)
    assert pp.address_conflicts(offsets, sizes, live)["pairs"] == 0
    bound = pp.peak_live(list(zip(lower, upper, -(-sizes // pp.ALIGN) * pp.ALIGN)))
    assert bound <= pp.arena(offsets, sizes) <= 2 * bound
    # the same offsets against lifetimes where two buffers sharing addresses overlap
    i, j = next((i, j) for i, j in itertools.combinations(range(60), 2)
                if not live[i, j] and offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i])
    other = live.copy()
    other[i, j] = other[j, i] = True
    found = pp.address_conflicts(offsets, sizes, other)
    assert found["pairs"] == 1 and found["buffers"] == 2 and found["bytes"] == sizes[i] + sizes[j]


def test_kendall_distance_and_resident_pageblocks():
    rng = np.random.default_rng(1)
    a, b = rng.permutation(40), rng.permutation(40)
    brute = sum((a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in itertools.combinations(range(40), 2)) / (40 * 39 / 2)
    assert pp.inversions(a, b) == pytest.approx(brute) and pp.inversions(a, a) == 0
    # two 1-block buffers at blocks 0 and 2, never live together: one block resident at a time
    assert pp.resident(np.array([0, 200]), np.array([100, 100]), np.array([0, 5]), np.array([5, 9]), 100) == 100
    assert pp.resident(np.array([0, 50]), np.array([100, 100]), np.array([0, 1]), np.array([5, 9]), 100) == 200


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """The bench on the tiny MLP, strict order: its JSON, traces and named simulated buffers."""
    tmp = tmp_path_factory.mktemp("planned_placement")
    env = {k: v for k, v in os.environ.items() if k not in ("DYMEM_GTBM", "TF_CPU_ALLOCATOR_USE_BFC")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "planned_placement.py"), "--models",
                           "tiny_mlp", "--execution-orders", "strict", "--steps", "5", "--keep", str(tmp),
                           "--json", str(tmp / "out.json")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = json.loads((tmp / "out.json").read_text())["results"]
    assert "error" not in result, result["error"]
    with open(tmp / "tiny_mlp_strict_planned.pkl", "rb") as f:
        planned = pickle.load(f)
    planned["rows"] = np.array(planned["rows"], dtype=np.int64)
    traces = [pp.read_trace(p) for p in sorted(glob.glob(str(tmp / "tiny_mlp_strict_step*.csv")))]
    return result, planned, traces


def test_a_traced_step_maps_to_the_plans_buffers_swap_ins_included(mlp_run):
    result, planned, traces = mlp_run
    assert len(traces) == 2 and result["swaps"] > 0  # under the budget the plan swaps
    swap_ins = [i for i, key in enumerate(planned["keys"]) if key[0] == "in"]
    assert swap_ins
    for trace in traces:
        m = pp.match(trace, planned)
        matched = {b for b in m["buffer"] if b >= 0}
        # every swap-in the plan makes is allocated by the rewrite's node of that name, at the planned size
        assert set(swap_ins) <= matched
        for row, b in zip(trace, m["buffer"]):
            if b >= 0:
                assert row["op"] == planned["op"][b] and row["size"] == planned["rows"][b, 2]
            else:  # an MLP's kernels take no workspaces: what no plan names is small
                assert row["size"] < pp.LARGE, row
        assert sum(b >= 0 for b in m["buffer"]) >= 0.9 * len(trace)
    s = result["steps"][0]
    assert s["matched_bytes_share"] > 0.99 and s["categories"][pp.MATCHED]["count"] == sum(
        b >= 0 for b in pp.match(traces[0], planned)["buffer"])


def test_in_strict_order_the_steps_repeat_and_offsets_from_one_serve_the_next(mlp_run):
    result, _, _ = mlp_run
    assert result["repeat"]["same_allocation_sequence"] and result["repeat"]["same_event_order"]
    assert all(o["kendall_distance"] < 0.01 for o in result["order"])
    replayed = result["static"]["first step's lifetimes"]
    assert [c["pairs"] for c in replayed["conflicts"]] == [0, 0]
    # the arena holds at least the peak of the buffers it places
    assert replayed["arena_bytes"] >= result["lower_bound_simulated"] * 0.9
