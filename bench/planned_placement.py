"""Planned placement (issue 48, item 1): could GTBM serve a planned step's allocations at offsets fixed ahead of time?

Static memory planning (XLA's buffer assignment, TVM's memory planner) gives every buffer of a step an offset before
the step runs. GTBM sees only ``(bytes, alignment)`` and the name of the kernel allocating, so it could serve a
planned step at fixed offsets only if (1) each allocation maps to a planned buffer, (2) the buffers live in the
order the plan simulated, or at least in the same order every step, and (3) offsets assigned from the simulated
lifetimes never overlap in address two buffers that are live together in the real step. For each model this runs a
budgeted ``fit`` (``memory_budget="auto"`` on a GTBM device capped between the persistent bytes and the plain peak,
so the plan swaps), traces two later steps of the calibrated plan with GTBM, and measures:

1. **match rate**: the traced allocations (count, bytes) that map to a planned buffer -- an op output of that size,
   kept or swapped, or a swap-in / recomputation / variable swap-in of the plan (by the rewrite's node names) --
   and what does not: an op's allocations beyond its planned outputs (kernel temporaries, outputs the model takes as
   forwarded into an input), the swap ops' extras, allocations from outside the step graph; and planned buffers
   the step never allocated.
2. **order**: Kendall distance between the live and the simulated allocation order of the matched buffers; the
   pairs of them live together in the step but not in the simulation (and their bytes); and across the two traced
   steps, whether the allocation sequence (op, size) and the live-together pairs repeat exactly.
3. **static offsets**: greedy best-fit offsets (largest first as XLA's ``GlobalDecreasingSizeBestFit``, best of
   four orders) from (a) the simulated lifetimes, (a') the same for buffers of 64 KiB and more only, (b) the
   simulated lifetimes with the pairs the first traced step showed live together, (c) the first traced step's own
   lifetimes (record and replay), (d) the simulated lifetimes with TF's forwarding as the first traced step did it;
   each checked against both traced steps: conflicts (two buffers live together given overlapping addresses), and
   the arena (and its resident pageblocks) against GTBM's reserved bytes. Each op's kernel temporaries get one
   region, sized as the probe measured them (``MeasuredMemory.temporaries``); what no buffer or region holds is left
   to a dynamic group (its peak live bytes: "rest"). The variables the plan keeps and the buffers an update adopts
   (both GTBM's persistent group) are not placed.

Each model trains once per execution order (``--execution-orders``, default the planned order and the strict one),
the traced steps being the fit's last two. Step times are the median of the untraced steps from the fourth on.

Usage::

    python bench/planned_placement.py [--models small_cnn resnet50_sgd transformer_encoder] [--fraction F]
                                      [--execution-orders planned strict] [--steps 8]
                                      [--json docs/planned_placement.json] [--keep DIR]

Each model runs in fresh interpreters (the no-swap peak, then one budgeted fit per order), oneDNN off. The results:
docs/benchmarks.md, "Planned placement".
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
ALIGN = 64  # GTBM's alignment
#: buffers from this size on are "large" (memory_model.MIN_TEMPORARY_BYTES: smaller ones are noise in a step)
LARGE = 64 * 1024
#: SimResult.allocations groups: a variable the plan keeps on the device; a kept variable's next buffer (adopted)
PERSISTENT, ADOPTED = 0, 3
#: batch per model (small: seconds per step on 2 cores)
BATCH = {"small_cnn": 16, "resnet50_sgd": 16, "transformer_encoder": 16, "tiny_mlp": 4096}
#: budget per model: persistent + FRACTION x (plain peak - persistent), low enough that the calibrated plan swaps
FRACTION = {"small_cnn": 0.6, "resnet50_sgd": 0.3, "transformer_encoder": 0.6, "tiny_mlp": 0.6}
#: the models measured by default (tiny_mlp is the test's)
MODELS = ("small_cnn", "resnet50_sgd", "transformer_encoder")
#: categories of a traced allocation
MATCHED, TEMPORARY, FORWARDED, DYMEM_EXTRA, OUTSIDE = ("matched", "temporary", "forwarded in the model",
                                                       "swap-op extra", "outside the graph")


# ------------------------------------------------------------------------------------------------ planned buffers
def planned_buffers(sg, plan, profile, temporaries=None) -> dict:
    """The simulated step of ``plan`` as named buffers: ``{"rows": (n, 4) int64 (lower, upper, bytes, group) in
    the simulated event order (``SimResult.allocations``), "keys": per row ("out", tensor) / ("in", tensor, k) /
    ("tmp", op) / ("kept", tensor), "op": the node that allocates it live, "peak_bytes": the simulated peak}``.

    The rows' order is the simulator's own (kept tensors, swapped originals, kernel temporaries, swap-ins:
    ``Simulator._timeline``); its schedule and memory events are recomputed here to name them."""
    from dymem_tf.passes import graph_pass
    from dymem_tf.planning import simulator

    sim = simulator.prepared(sg, simulator.as_cost_model(profile), temporaries)
    swaps = list(plan.swaps)
    result = sim.run(swaps, plan.persistent_bytes, timeline=True)
    sched = sim._schedule(swaps)  # noqa: SLF001 -- the row order of _timeline, to name the rows
    mem = sim._memory_events(swaps, sched)  # noqa: SLF001
    names = np.array(sim.t_names, dtype=object)
    keys = [("out", t) for t in names[mem.keep].tolist()]
    keys += [("out", sim.t_names[i]) for i in mem.mob_idx]
    keys += [("tmp", sim.order[p]) for p in sim.tmp_pos.tolist()]
    keys += [("in", swaps[i].tensor, k) for i, k, *_ in sched.swap_ins]
    keys += [("kept", swaps[i].tensor) for i in mem.kept_of]  # the kept rows of partial swaps
    rows = np.asarray(result.allocations, dtype=np.int64).reshape(-1, 4)
    if len(keys) != len(rows):
        raise RuntimeError(f"{len(keys)} names for {len(rows)} simulated buffers: the simulator's row order changed")
    by_tensor = {s.tensor: s for s in swaps}
    ops = []
    for key in keys:
        if key[0] == "out":
            ops.append(sg.tensors[key[1]].producer)
        elif key[0] == "tmp":
            ops.append(None)  # one aggregate per op: no allocation of its own
        elif key[0] == "kept":
            ops.append(graph_pass.swap_out_name(key[1]))  # a partial swap-out allocates its kept rows
        else:
            s, k = by_tensor[key[1]], key[2]
            kind = getattr(s, "kind", "tensor")
            if kind == "variable":
                ops.append(graph_pass.variable_op_names(s.tensor)[1])
            elif kind == "weight":
                ops.append(graph_pass.weight_op_names(s.tensor)["in_fwd" if k == 0 else "in_bwd"])
            elif kind == "recompute":
                ops.append(graph_pass.recompute_op_name(s.recompute.ops[-1][0]))
            else:
                ops.append(graph_pass.swap_in_name(s.tensor, k))
    forwarded = set(sim.buffer_root) | {n for n, t in sg.tensors.items() if t.alias_of is not None}
    # per output buffer: the rows of its op's inputs of the same size (a buffer TF may forward into the output)
    rows_of: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        if key[0] != "tmp":
            rows_of.setdefault(key[1], []).append(i)
    inputs = []
    for i, key in enumerate(keys):
        same = []
        if key[0] == "out":
            for inp in sg.ops[ops[i]].inputs:
                if inp in sg.tensors:
                    owner = sg.buffer_of(inp)
                    owner = sim.buffer_root.get(owner, owner)
                    same += [j for j in rows_of.get(owner, []) if j != i and rows[j, 2] == rows[i, 2]]
        inputs.append(same)
    outputs_of = {name: [(t, sg.tensors[t].bytes) for t in op.outputs] for name, op in sg.ops.items()}
    return {"rows": rows, "keys": keys, "op": ops, "peak_bytes": int(result.peak_bytes), "forwarded": forwarded,
            "graph_ops": set(sg.ops), "inputs": inputs, "outputs_of": outputs_of}


def read_trace(path: str) -> list[dict]:
    """A GTBM trace CSV (:func:`dymem_tf.memory.allocator.dump_trace`) as rows of ints (op a string)."""
    with open(path, newline="") as f:
        return [{"lower": int(r["lower"]), "upper": int(r["upper"]), "size": int(r["size"]), "group": int(r["group"]),
                 "offset": int(r["offset"]), "op": r["op"]} for r in csv.DictReader(f)]


def match(trace: list[dict], planned: dict) -> dict:
    """Map each traced allocation to a planned buffer allocated by the same node with the same size, else a
    category; an op's allocations beyond its outputs go to the op's temporaries region where the simulation has one.
    Of one node's allocations of one size, the longest-lived are taken for its outputs (a kernel frees its
    temporaries when it ends; ``memory_model._unmatched`` takes the first ones, which mistakes the output of a
    kernel that allocates a same-size temporary first: the einsum gradients of a transformer). Returns
    ``{"buffer": per trace row the planned row or -1, "region": per trace row the temporaries row or -1,
    "category": per trace row, "unallocated": named planned rows no allocation matched}``."""
    rows = planned["rows"]
    free: dict[str, list[int]] = {}
    for i, op in enumerate(planned["op"]):
        if op is not None and rows[i, 2] > 0 and rows[i, 3] != PERSISTENT:
            free.setdefault(op, []).append(i)
    tmp_of = {key[1]: i for i, key in enumerate(planned["keys"]) if key[0] == "tmp" and rows[i, 2] > 0}
    outputs_of = planned.get("outputs_of", {})
    buffer, region, category = [-1] * len(trace), [-1] * len(trace), [""] * len(trace)
    for r in sorted(range(len(trace)), key=lambda r: (trace[r]["op"], -trace[r]["upper"], trace[r]["lower"])):
        op, size = trace[r]["op"], trace[r]["size"]
        cands = free.get(op, [])
        hit = next((k for k, i in enumerate(cands) if rows[i, 2] == size), None)
        if hit is not None:
            buffer[r] = cands.pop(hit)
            category[r] = MATCHED
        elif "/dymem_" in op:
            category[r] = DYMEM_EXTRA
        elif op in planned["graph_ops"]:
            fwd = any(t in planned["forwarded"] and b == size for t, b in outputs_of.get(op, ()))
            category[r] = FORWARDED if fwd else TEMPORARY
            if not fwd:
                region[r] = tmp_of.get(op, -1)
        else:
            category[r] = OUTSIDE
    matched = {b for b in buffer if b >= 0}
    unallocated = [i for i in units(planned) if planned["op"][i] is not None and i not in matched]
    return {"buffer": buffer, "region": region, "category": category, "unallocated": unallocated}


def match_summary(trace: list[dict], planned: dict, m: dict) -> dict:
    """Counts and bytes per category of the traced allocations, the planned buffers never allocated, and the peak
    live bytes of what no planned buffer or temporaries region holds."""
    out = {"allocations": len(trace), "bytes": int(sum(r["size"] for r in trace)), "categories": {}}
    for cat in (MATCHED, TEMPORARY, FORWARDED, DYMEM_EXTRA, OUTSIDE):
        rows = [r for r, c in zip(trace, m["category"]) if c == cat]
        out["categories"][cat] = {"count": len(rows), "bytes": int(sum(r["size"] for r in rows))}
    matched = out["categories"][MATCHED]
    out["matched_share"] = matched["count"] / max(len(trace), 1)
    out["matched_bytes_share"] = matched["bytes"] / max(out["bytes"], 1)
    in_region = [r for r, g in zip(trace, m["region"]) if g >= 0]
    out["in_temporaries_regions"] = {"count": len(in_region), "bytes": int(sum(r["size"] for r in in_region))}
    un = m["unallocated"]
    rows = planned["rows"]
    out["planned"] = int(sum(1 for i in units(planned) if planned["op"][i] is not None))
    out["planned_unallocated"] = {"count": len(un), "bytes": int(rows[un, 2].sum()) if un else 0}
    out["unmatched_peak_live"] = peak_live([(r["lower"], r["upper"], r["size"])
                                            for r, c in zip(trace, m["category"]) if c != MATCHED])
    out["dynamic_peak_live"] = peak_live([(r["lower"], r["upper"], r["size"])
                                          for r, b, g in zip(trace, m["buffer"], m["region"])
                                          if b < 0 and g < 0 and r["group"] != PERSISTENT])
    adopted = [r for r, b in zip(trace, m["buffer"]) if b >= 0 and planned["rows"][b, 3] == ADOPTED]
    out["adopted"] = {"count": len(adopted), "bytes": int(sum(r["size"] for r in adopted))}
    # an op whose temporaries at once exceed what the simulation holds for it
    by_region: dict[int, list] = {}
    for r, g in zip(trace, m["region"]):
        if g >= 0:
            by_region.setdefault(g, []).append((r["lower"], r["upper"], r["size"]))
    over = [g for g, allocs in by_region.items() if peak_live(allocs) > rows[g, 2]]
    out["regions_overflowing"] = {"count": len(over), "regions": len(by_region)}
    return out


# ------------------------------------------------------------------------------------------------------- order
def peak_live(intervals) -> int:
    """The most bytes of ``(lower, upper, size)`` half-open intervals live at once (frees before allocations at
    one event)."""
    from dymem_tf.planning import memory_model

    return memory_model.peak_live([(s, lo, up) for lo, up, s in intervals])


def overlaps(lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """Boolean matrix: buffers i and j (i != j) live together (half-open intervals)."""
    o = (lower[:, None] < upper[None, :]) & (lower[None, :] < upper[:, None])
    np.fill_diagonal(o, False)
    return o


def inversions(a, b) -> float:
    """Share of the pairs that keys ``a`` and ``b`` order differently (normalised Kendall distance; ``a`` without
    ties), in O(n log n)."""
    n = len(a)
    if n < 2:
        return 0.0
    by_a = np.asarray(b)[np.argsort(np.asarray(a), kind="stable")]
    ranks = np.searchsorted(np.unique(by_a), by_a) + 1
    tree = [0] * (int(ranks.max()) + 1)
    count = 0
    for seen, r in enumerate(ranks.tolist()):  # earlier in a, later in b
        k, below = r, 0
        while k > 0:
            below += tree[k]
            k -= k & -k
        count += seen - below
        k = r
        while k < len(tree):
            tree[k] += 1
            k += k & -k
    return count / (n * (n - 1) / 2)


def units(planned: dict) -> list[int]:
    """The planned rows that get an offset: the step's named buffers and the ops' temporaries regions (not zero
    bytes; not the variables the plan keeps, allocated before the step, nor their next buffers, which outlive it:
    both are GTBM's persistent group)."""
    rows = planned["rows"]
    return [i for i, (op, key) in enumerate(zip(planned["op"], planned["keys"]))
            if rows[i, 2] > 0 and rows[i, 3] not in (PERSISTENT, ADOPTED) and (op is not None or key[0] == "tmp")]


def unit_intervals(trace: list[dict], m: dict) -> dict[int, tuple[int, int]]:
    """Planned row -> its traced ``(lower, upper)`` in one step: the matched allocation's, or for a temporaries
    region the span of the op's temporaries."""
    out: dict[int, tuple[int, int]] = {}
    for r, (b, g) in enumerate(zip(m["buffer"], m["region"])):
        lo, up = trace[r]["lower"], trace[r]["upper"]
        if b >= 0:
            out[b] = (lo, up)
        elif g >= 0:
            a = out.get(g)
            out[g] = (lo, up) if a is None else (min(a[0], lo), max(a[1], up))
    return out


def pairs(mask: np.ndarray, sizes: np.ndarray, large: int = LARGE) -> dict:
    """Pairs of a symmetric boolean matrix: how many, the buffers in them and their bytes, and the same among the
    buffers of at least ``large`` bytes."""
    iu = np.triu_indices(len(mask), 1)
    hit = mask[iu]
    i, j = iu[0][hit], iu[1][hit]
    involved = np.unique(np.concatenate([i, j]))
    big = (sizes[i] >= large) & (sizes[j] >= large)
    big_involved = np.unique(np.concatenate([i[big], j[big]]))
    return {"pairs": int(hit.sum()), "buffers": int(len(involved)), "bytes": int(sizes[involved].sum()),
            "large_pairs": int(big.sum()), "large_buffers": int(len(big_involved)),
            "large_bytes": int(sizes[big_involved].sum())}


# ------------------------------------------------------------------------------------------------ static offsets
def best_fit(sizes: np.ndarray, conflict: np.ndarray, lifetimes: np.ndarray | None = None,
             starts: np.ndarray | None = None) -> np.ndarray:
    """Offsets for buffers of ``sizes`` (aligned to 64) such that no two with ``conflict[i, j]`` overlap in address:
    each, in turn, into the smallest gap between the already placed buffers it conflicts with that holds it (the
    lowest such gap), else above them. Three orders are tried (largest first as XLA's GlobalDecreasingSizeBestFit,
    ties longest-lived first; longest-lived first; largest size x lifetime first) and the smallest arena kept."""
    n = len(sizes)
    aligned = -(-sizes // ALIGN) * ALIGN
    life = lifetimes if lifetimes is not None else np.zeros(n, dtype=np.int64)
    start = starts if starts is not None else np.zeros(n, dtype=np.int64)
    orders = [sorted(range(n), key=lambda i: (-aligned[i], -life[i], i)),
              sorted(range(n), key=lambda i: (-life[i], -aligned[i], i)),
              sorted(range(n), key=lambda i: (-aligned[i] * max(int(life[i]), 1), i)),
              sorted(range(n), key=lambda i: (start[i], -aligned[i], i))]
    best_offsets = None
    for order in orders:
        offsets = _fit(order, aligned, conflict)
        if best_offsets is None or arena(offsets, sizes) < arena(best_offsets, sizes):
            best_offsets = offsets
    return best_offsets


def _fit(order, aligned: np.ndarray, conflict: np.ndarray) -> np.ndarray:
    """Best-fit offsets placing the buffers in ``order``."""
    offsets = np.full(len(aligned), -1, dtype=np.int64)
    placed = np.zeros(len(aligned), dtype=bool)
    for i in order:
        nb = np.flatnonzero(conflict[i] & placed)
        spans = sorted(zip(offsets[nb].tolist(), (offsets[nb] + aligned[nb]).tolist()))
        best, best_gap, top = None, None, 0
        for lo, hi in spans:
            if lo > top:
                gap = lo - top
                if gap >= aligned[i] and (best_gap is None or gap < best_gap):
                    best, best_gap = top, gap
            top = max(top, hi)
        offsets[i] = best if best is not None else top
        placed[i] = True
    return offsets


def address_conflicts(offsets: np.ndarray, sizes: np.ndarray, live: np.ndarray) -> dict:
    """Pairs live together (``live``) whose address ranges overlap."""
    ends = offsets + sizes
    addr = (offsets[:, None] < ends[None, :]) & (offsets[None, :] < ends[:, None])
    return pairs(addr & live, sizes)


def arena(offsets: np.ndarray, sizes: np.ndarray) -> int:
    """The highest byte the offsets use (aligned sizes)."""
    return int((offsets + -(-sizes // ALIGN) * ALIGN).max()) if len(sizes) else 0


def resident(offsets: np.ndarray, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray, block: int) -> int:
    """Peak bytes of the arena's ``block``-sized pageblocks that hold a live buffer (free pageblocks given back, as
    GTBM does), over the lifetimes ``[lower, upper)``."""
    if not len(sizes):
        return 0
    first, last = offsets // block, (offsets + np.maximum(sizes, 1) - 1) // block
    count = np.zeros(int(last.max()) + 1, dtype=np.int64)
    events = sorted([(int(up), 0, k) for k, up in enumerate(upper)] + [(int(lo), 1, k) for k, lo in enumerate(lower)])
    held = peak = 0
    for _, alloc, k in events:
        span = slice(int(first[k]), int(last[k]) + 1)
        if alloc:
            held += int((count[span] == 0).sum())
            count[span] += 1
        else:
            count[span] -= 1
            held -= int((count[span] == 0).sum())
        peak = max(peak, held)
    return peak * block


def analyse(traces: list[list[dict]], planned: dict, block: int = 2 * MiB) -> dict:
    """Everything this benchmark reports for two traced steps of one plan."""
    matches = [match(t, planned) for t in traces]
    rows = planned["rows"]
    out = {"simulated_peak_bytes": planned["peak_bytes"], "planned_buffers": int(len(rows)),
           "steps": [match_summary(t, planned, m) for t, m in zip(traces, matches)]}
    unit = units(planned)
    spans = [unit_intervals(t, m) for t, m in zip(traces, matches)]
    common = [u for u in unit if all(u in s for s in spans)]  # planned order
    at = {u: k for k, u in enumerate(unit)}
    idx = np.array([at[u] for u in common], dtype=np.int64)
    sizes_all, sizes = rows[unit, 2], rows[common, 2]
    sim_all = overlaps(rows[unit, 0], rows[unit, 1])
    sim = sim_all[np.ix_(idx, idx)]
    live_lo = [np.array([s[u][0] for u in common], dtype=np.int64) for s in spans]
    lives = [overlaps(lo, np.array([s[u][1] for u in common], dtype=np.int64)) for lo, s in zip(live_lo, spans)]
    out["units"] = {"planned": len(unit), "live_in_both_steps": len(common),
                    "regions": int(sum(1 for u in unit if planned["keys"][u][0] == "tmp"))}
    out["order"] = [{"kendall_distance": inversions(lo, rows[common, 0]), "live_pairs": pairs(live, sizes),
                     "live_not_simulated": pairs(live & ~sim, sizes),
                     "simulated_not_live": pairs(sim & ~live, sizes)} for lo, live in zip(live_lo, lives)]
    seqs = [[(r["op"], r["size"]) for r in sorted(t, key=lambda r: r["lower"])] for t in traces]
    big = [[x for x in q if x[1] >= LARGE] for q in seqs]
    out["repeat"] = {"same_allocation_sequence": seqs[0] == seqs[1], "allocations": [len(q) for q in seqs],
                     "same_large_sequence": big[0] == big[1], "large_allocations": [len(q) for q in big],
                     "large_first_difference": next((k for k, (x, y) in enumerate(zip(*big)) if x != y), None),
                     "first_difference": next((k for k, (x, y) in enumerate(zip(*seqs)) if x != y), None),
                     "same_event_order": _event_sequence(traces[0]) == _event_sequence(traces[1]),
                     "live_pairs_differing": pairs(lives[0] ^ lives[1], sizes),
                     "kendall_distance": inversions(live_lo[0], live_lo[1])}
    # static offsets, four ways, each checked against both traced steps; what a plan places no offset for is left
    # to a dynamic group (its peak live bytes in the step: "rest")
    life = rows[unit, 1] - rows[unit, 0]
    with_live = sim_all.copy()
    with_live[np.ix_(idx, idx)] |= lives[0]
    large = np.flatnonzero(sizes_all >= LARGE)
    start = rows[unit, 0]
    big_sim = best_fit(sizes_all[large], sim_all[np.ix_(large, large)], life[large], start[large])
    first = spans[0]
    plans = {"simulated": (np.arange(len(unit)), best_fit(sizes_all, sim_all, life, start)),
             f"simulated, >= {LARGE // 1024} KiB only": (large, big_sim),
             "simulated + first step's overlaps": (np.arange(len(unit)), best_fit(sizes_all, with_live, life, start)),
             "first step's lifetimes": (idx, best_fit(sizes, lives[0],
                                                      np.array([first[u][1] - first[u][0] for u in common]),
                                                      live_lo[0]))}
    # the simulation with TF's forwarding as the first step did it: an output the step never allocated lives in an
    # input buffer of its op of the same size (the one the simulation frees closest to the output's allocation)
    fwd = rows.copy()
    dropped = set()
    for i in matches[0]["unallocated"]:
        cands = [j for j in planned["inputs"][i] if j not in dropped]
        if cands:
            j = min(cands, key=lambda j: abs(int(fwd[j, 1]) - int(fwd[i, 0])))
            fwd[j, 1] = max(fwd[j, 1], fwd[i, 1])
            dropped.add(i)
    kept = np.array([k for k, u in enumerate(unit) if u not in dropped], dtype=np.int64)
    fwd_units = [unit[k] for k in kept]
    lifetimes = {"simulated": (rows[unit, 0], rows[unit, 1]),
                 "first step's lifetimes": (live_lo[0], np.array([first[u][1] for u in common]))}
    lifetimes[f"simulated, >= {LARGE // 1024} KiB only"] = (rows[unit, 0][large], rows[unit, 1][large])
    lifetimes["simulated + first step's overlaps"] = lifetimes["simulated"]
    lifetimes["simulated, TF's forwarding"] = (fwd[fwd_units, 0], fwd[fwd_units, 1])
    plans["simulated, TF's forwarding"] = (kept, best_fit(rows[fwd_units, 2], overlaps(fwd[fwd_units, 0],
                                                                                         fwd[fwd_units, 1]),
                                                          fwd[fwd_units, 1] - fwd[fwd_units, 0], fwd[fwd_units, 0]))
    out["forwarded_live"] = {"count": len(dropped), "bytes": int(rows[sorted(dropped), 2].sum()) if dropped else 0}
    out["static"] = {}
    for name, (placed, offsets) in plans.items():
        placed_units = [unit[k] for k in placed]
        checked = np.array([k for k, u in enumerate(common) if u in set(placed_units)], dtype=np.int64)
        where = {u: k for k, u in enumerate(placed_units)}
        sub = offsets[[where[common[k]] for k in checked]]
        out["static"][name] = {
            "arena_bytes": arena(offsets, rows[placed_units, 2]), "placed": len(placed_units),
            "resident_bytes": resident(offsets, rows[placed_units, 2], *lifetimes[name], block),
            "rest_peak_live": [_rest(t, m, set(placed_units)) for t, m in zip(traces, matches)],
            "conflicts": [address_conflicts(sub, sizes[checked], live[np.ix_(checked, checked)])
                          for live in lives]}
    out["lower_bound_simulated"] = peak_live([(int(rows[i, 0]), int(rows[i, 1]), int(rows[i, 2])) for i in unit])
    return out


def _rest(trace: list[dict], m: dict, placed: set[int]) -> int:
    """Peak live bytes of a step's allocations in no placed buffer or region (GTBM's persistent group aside)."""
    return peak_live([(r["lower"], r["upper"], r["size"]) for r, b, g in zip(trace, m["buffer"], m["region"])
                      if (b if b >= 0 else g) not in placed and r["group"] != PERSISTENT])


def _event_sequence(trace: list[dict]) -> list[tuple]:
    """The trace's allocations and frees in event order, each as (kind, op, size)."""
    events = [(r["lower"], "a", r["op"], r["size"]) for r in trace] + \
             [(r["upper"], "f", r["op"], r["size"]) for r in trace]
    events.sort()  # buffers live at the dump all end at the last event + 1: those in (op, size) order
    return [e[1:] for e in events]


# ------------------------------------------------------------------------------------------------ child process
def small_cnn(batch: int, samples: int, seed: int, size: int = 64, convs: int = 8):
    """``convs`` 3x3 convolutions of 32 channels with ReLU at 64px, global pooling, a dense head; Adam."""
    import keras

    inp = keras.Input((size, size, 3))
    h = inp
    for _ in range(convs):
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.uniform(size=(samples, size, size, 3)).astype("float32"), rng.integers(0, 10, size=(samples,))


def tiny_mlp(batch: int, samples: int, seed: int, width: int = 256, depth: int = 12):
    """``depth`` dense layers of ``width`` with ReLU (feature maps, no kernel workspaces: 4 MiB each at batch
    4096); Adam. The test's model: seconds per fit."""
    import keras

    inp = keras.Input((width,))
    h = inp
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(seed)
    return model, rng.random((samples, width), dtype=np.float32), rng.integers(0, 10, size=(samples,))


def _build(name: str, batch: int, samples: int):
    import gc

    import keras

    sys.path.insert(0, HERE)
    from model_zoo import ZOO

    keras.backend.clear_session()
    gc.collect()
    keras.utils.set_random_seed(3)
    if name == "tiny_mlp":
        return tiny_mlp(batch, samples, 3)
    return (small_cnn if name == "small_cnn" else ZOO[name])(batch, samples, 3)


class StepTracer:
    """A Keras callback (made lazily: keras is imported in the child only) tracing GTBM during the steps in
    ``steps`` and recording every step's reserved peak."""

    @staticmethod
    def make(steps: list[int], folder: str):
        import keras

        from dymem_tf.memory import allocator

        class _Tracer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.peaks, self.in_use, self.paths, self.persistent, self.persistent_peak = [], [], {}, {}, {}
                self.groups, self.block_size, self.seconds = {}, 0, []

            def on_train_batch_begin(self, batch, logs=None):
                self.t0 = time.perf_counter()
                allocator.reset_peak_stats()
                if batch in steps:
                    groups = allocator.memory_stats().get("groups", {})
                    self.persistent[batch] = int(groups.get("persistent", {}).get("reserved", 0))
                    allocator.start_trace()

            def on_train_batch_end(self, batch, logs=None):
                if batch in steps:
                    allocator.stop_trace()
                    path = os.path.join(folder, f"step{batch}.csv")
                    info = allocator.dump_trace(path)
                    if info["dropped"]:
                        raise RuntimeError(f"the trace of step {batch} dropped {info['dropped']} allocations")
                    self.paths[batch] = path
                self.seconds.append(time.perf_counter() - self.t0)  # the trace's own cost included where traced
                stats = allocator.memory_stats()
                if batch in steps:
                    groups = stats.get("groups", {})
                    self.persistent_peak[batch] = int(groups.get("persistent", {}).get("peak_reserved", 0))
                    self.groups[batch] = {g: int(v.get("peak_reserved", 0)) for g, v in groups.items()}
                    self.block_size = int(stats.get("block_size") or 0)
                self.peaks.append(int(stats["peak_bytes_reserved"]))
                self.in_use.append(int(stats["peak_bytes_in_use"]))

        return _Tracer()


def child(name: str, args) -> dict:
    import tensorflow as tf  # noqa: F401

    import dymem_tf
    from dymem_tf.keras import variables
    from dymem_tf.memory import allocator

    batch = BATCH[name]
    if args.phase == "p0":
        model, x, y = _build(name, batch, batch * 2)
        peaks = []
        for step in range(2):
            allocator.reset_peak_stats()
            model.train_on_batch(x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch])
            peaks.append(int(allocator.memory_stats()["peak_bytes_reserved"]))
        return {"p0": max(peaks), "persistent": variables.persistent_bytes(model)}
    model, x, y = _build(name, batch, batch * args.steps)
    allocator.set_memory_limit(args.budget_bytes)
    steps = [args.steps - 2, args.steps - 1]
    with tempfile.TemporaryDirectory(prefix="planned_placement_") as tmp:
        tracer = StepTracer.make(steps, tmp)
        cb = dymem_tf.DymemCallback(memory_budget="auto", execution_order=args.execution_order, verbose=0)
        t0 = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=args.steps, shuffle=False, verbose=0,
                  callbacks=[cb, tracer])
        seconds = time.perf_counter() - t0
        traces = [read_trace(tracer.paths[s]) for s in steps]
        if args.keep:
            import shutil

            os.makedirs(args.keep, exist_ok=True)
            for s in steps:
                shutil.copy(tracer.paths[s], os.path.join(args.keep, f"{name}_{args.execution_order}_step{s}.csv"))
    # the plan that trained the traced steps: the last one made, or the probe's after a fall-back
    state = str(cb.session.state) if cb.session is not None else ""
    record = cb.records[0] if state == "fallback" else cb.records[-1]
    plan, sg = record.plan, record.step_graph
    memory = cb.plan_request.memory
    # each op's own measured temporaries (not what the executor's threads held beside them): one region per op
    temporaries = dict(memory.temporaries) if memory is not None else None
    planned = planned_buffers(sg, plan, cb.config.profile, temporaries)
    out = {"model": name, "batch": batch, "budget": args.budget_bytes, "fit_seconds": seconds,
           "stages": [r.plan.params.stage for r in cb.records], "state": state,
           "trained_stage": record.plan.params.stage, "swaps": len(plan.swaps),
           "swap_kinds": dict(Counter(getattr(s, "kind", "tensor") for s in plan.swaps)),
           "swapped_bytes": int(plan.swapped_bytes), "ops": len(sg.ops), "traced_steps": steps,
           "peaks": tracer.peaks, "in_use": tracer.in_use, "step_seconds": tracer.seconds,
           "step_time_s": float(np.median(tracer.seconds[3:-2])) if len(tracer.seconds) > 5 else None,
           "persistent_reserved": [tracer.persistent[s] for s in steps],
           "persistent_peak_reserved": [tracer.persistent_peak[s] for s in steps],
           "group_peak_reserved": [tracer.groups[s] for s in steps], "block_size": tracer.block_size,
           "execution_order": args.execution_order,
           "calibrated_predicted": plan.predicted.calibrated_peak_bytes}
    if args.keep:
        import pickle

        with open(os.path.join(args.keep, f"{name}_{args.execution_order}_planned.pkl"), "wb") as f:
            pickle.dump({**planned, "rows": planned["rows"].tolist(), "order": sg.execution_order(),
                         "swaps": [(s.tensor, getattr(s, "kind", "tensor")) for s in plan.swaps]}, f)
    out.update(analyse(traces, planned, tracer.block_size or 2 * MiB))
    out["gtbm_replay_of_simulated"] = replayed(planned, tracer.block_size)
    return out


def replayed(planned: dict, block_size: int) -> int:
    """Bytes GTBM's placer reserves (peak) for the simulated step's own buffers (transient and mobile groups),
    replayed in the simulated order (what :func:`dymem_tf.memory.placement.place` predicts for the step)."""
    from dymem_tf.memory.replay import replay_buffers

    rows = planned["rows"]
    own = rows[(rows[:, 3] == 1) | (rows[:, 3] == 2)]
    if not len(own):
        return 0
    return int(replay_buffers(own, "gtbm", block_size=block_size or 2 * MiB, alignment=ALIGN,
                              groups="trace").footprint)


# ----------------------------------------------------------------------------------------------- parent process
def _run_child(name: str, args, *extra) -> dict:
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", DYMEM_DEVICE_MEMORY_LIMIT="16GiB",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(args.steps), *extra]
    cmd += ["--keep", os.path.abspath(args.keep)] if args.keep else []
    cmd += ["--execution-order", args.execution_order]
    sys.path.insert(0, HERE)
    from budget_reliability import child_result

    return child_result(cmd, env, args.timeout, tail=1500)


def run_model(name: str, args) -> list[dict]:
    """The no-swap peak of ``name``, then one budgeted fit per execution order."""
    p0 = _run_child(name, args, "--phase", "p0")
    if "error" in p0:
        return [{"model": name, "error": f"p0: {p0['error']}"}]
    fraction = FRACTION[name] if args.fraction is None else args.fraction
    budget = int(p0["persistent"] + fraction * (p0["p0"] - p0["persistent"]))
    budget = -(-budget // MiB) * MiB
    runs = []
    for order in args.execution_orders:
        args.execution_order = order
        out = _run_child(name, args, "--phase", "run", "--budget-bytes", str(budget))
        runs.append({**p0, "budget": budget, "fraction": fraction, "execution_order": order, **out, "model": name})
    return runs


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _pairs(p: dict) -> str:
    return f"{p['pairs']} / {p['large_pairs']} ({_mib(p['large_bytes'])})"


def table(r: dict) -> str:
    """One model's results as text (Markdown tables)."""
    if "error" in r:
        return (f"{r['model']}: plain peak {_mib(r.get('p0'))} MiB, persistent {_mib(r.get('persistent'))} MiB, "
                f"budget {_mib(r.get('budget'))} MiB: error {r['error']}")
    steps = r["traced_steps"]
    lines = [f"**{r['model']}**, execution_order={r['execution_order']!r} (batch {r['batch']}; budget "
             f"{_mib(r['budget'])} MiB = persistent "
             f"{_mib(r['persistent'])} + {r['fraction']} x (plain peak {_mib(r['p0'])} - persistent); plans "
             f"{' -> '.join(r['stages'])}, the {r['trained_stage']} plan trains ({r['state']}); {r['swaps']} swaps "
             f"({', '.join(f'{n} {k}' for k, n in r['swap_kinds'].items())}), {_mib(r['swapped_bytes'])} MiB; "
             f"{r['ops']} ops, "
             f"{r['units']['planned']} planned buffers of which {r['units']['regions']} temporaries regions; "
             f"GTBM reserved peak of steps {steps[0]}, {steps[1]}: "
             f"{', '.join(_mib(r['peaks'][s]) for s in steps)} MiB)", "",
             "| step | allocations (MiB) | matched | matched MiB | temporaries (MiB) | in a region (MiB) "
             "| forwarded in the model | swap-op extra | outside the graph | planned, not allocated "
             "| unmatched peak live MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for step, s in zip(steps, r["steps"]):
        c = s["categories"]

        def cell(cat):
            return f"{c[cat]['count']} ({_mib(c[cat]['bytes'])})"

        lines.append(f"| {step} | {s['allocations']} ({_mib(s['bytes'])}) | {s['matched_share']:.1%} "
                     f"| {s['matched_bytes_share']:.1%} | {cell(TEMPORARY)} | {s['in_temporaries_regions']['count']} "
                     f"({_mib(s['in_temporaries_regions']['bytes'])}) | {cell(FORWARDED)} | {cell(DYMEM_EXTRA)} "
                     f"| {cell(OUTSIDE)} | {s['planned_unallocated']['count']} "
                     f"({_mib(s['planned_unallocated']['bytes'])}) | {_mib(s['unmatched_peak_live'])} |")
    lines += ["", f"Order of the {r['units']['live_in_both_steps']} planned buffers live in both steps (pairs: "
                  f"all / both >= {LARGE // 1024} KiB (MiB of those buffers)):", "",
              "| step | Kendall distance to simulated | pairs live together | live together, not simulated "
              "| simulated together, not live |", "| --- | --- | --- | --- | --- |"]
    for step, o in zip(steps, r["order"]):
        lines.append(f"| {step} | {o['kendall_distance']:.4f} | {_pairs(o['live_pairs'])} "
                     f"| {_pairs(o['live_not_simulated'])} | {_pairs(o['simulated_not_live'])} |")
    rep = r["repeat"]
    lines += ["", f"Step {steps[0]} against step {steps[1]}: same allocation sequence (op, size): "
                  f"{rep['same_allocation_sequence']} ({rep['allocations'][0]} / {rep['allocations'][1]} "
                  f"allocations, first difference at allocation {rep['first_difference']}); of those >= "
                  f"{LARGE // 1024} KiB: {rep['same_large_sequence']} ({rep['large_allocations'][0]} / "
                  f"{rep['large_allocations'][1]}, first difference at {rep['large_first_difference']}); "
                  "same event order: "
                  f"{rep['same_event_order']}; pairs live together in one step only: "
                  f"{_pairs(rep['live_pairs_differing'])}; Kendall distance {rep['kendall_distance']:.4f}.", "",
              f"| static offsets from | buffers placed | arena MiB | resident MiB | dynamic rest MiB "
              f"| arena + rest MiB | conflicts in step {steps[0]} | conflicts in step {steps[1]} |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rest = max(s["dynamic_peak_live"] for s in r["steps"])
    for name, st in r["static"].items():
        c0, c1 = st["conflicts"]
        total = st["arena_bytes"] + max(st["rest_peak_live"])
        lines.append(f"| {name} | {st['placed']} | {_mib(st['arena_bytes'])} | {_mib(st['resident_bytes'])} "
                     f"| {_mib(max(st['rest_peak_live']))} | {_mib(total)} | {_pairs(c0)} | {_pairs(c1)} |")
    own = [(r["peaks"][s] - p, r["peaks"][s] - q)
           for s, p, q in zip(steps, r["persistent_peak_reserved"], r["persistent_reserved"])]
    lines += ["", f"GTBM live, the step's own reserved bytes (its reserved peak less the persistent group at its "
                  f"peak ... at the step's start): {', '.join(_mib(a) + ' ... ' + _mib(b) for a, b in own)} MiB; "
                  "GTBM's placer replaying the simulated step: "
                  f"{_mib(r['gtbm_replay_of_simulated'])} MiB; the planned buffers' lower bound (simulated): "
                  f"{_mib(r['lower_bound_simulated'])} MiB.", "",
              f"Simulated peak {_mib(r['simulated_peak_bytes'])} MiB in use; measured peaks in use "
                  f"{', '.join(_mib(r['in_use'][s]) for s in steps)} MiB; persistent group "
                  f"{_mib(max(r['persistent_reserved']))} MiB reserved at the step's start, "
                  f"{_mib(max(r['persistent_peak_reserved']))} MiB at its peak (variables' next buffers matched: "
                  f"{r['steps'][0]['adopted']['count']}, {_mib(r['steps'][0]['adopted']['bytes'])} MiB); "
                  "dynamic rest (allocations in no planned "
                  f"buffer or region) {_mib(rest)} MiB at its peak; regions overflowing "
                  f"{', '.join(str(s['regions_overflowing']['count']) for s in r['steps'])} of "
                  f"{r['steps'][0]['regions_overflowing']['regions']}."]
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """One line per model and execution order: the answers to the three questions."""
    lines = ["| model | order | allocations matched (bytes) | unmatched, outside regions: peak MiB | Kendall to "
             "simulated | pairs live together, not simulated (>= 64 KiB) | steps repeat | conflicts: simulated "
             "offsets (>= 64 KiB) | conflicts: the first traced step's offsets in the second (>= 64 KiB) "
             "| arena / resident MiB (simulated; first traced step's) | GTBM step reserved MiB | step s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('execution_order', '')} | error | | | | | | | | | |")
            continue
        s0, o = r["steps"][0], r["order"]
        sim, rec = r["static"]["simulated"], r["static"]["first step's lifetimes"]
        own = [r["peaks"][s] - p for s, p in zip(r["traced_steps"], r["persistent_reserved"])]
        lines.append(
            f"| {r['model']} | {r['execution_order']} | {s0['matched_share']:.0%} ({s0['matched_bytes_share']:.0%}) "
            f"| {_mib(max(s['dynamic_peak_live'] for s in r['steps']))} "
            f"| {max(x['kendall_distance'] for x in o):.4f} "
            f"| {max(x['live_not_simulated']['pairs'] for x in o)} "
            f"({max(x['live_not_simulated']['large_pairs'] for x in o)}) "
            f"| {'yes' if r['repeat']['same_event_order'] else 'no'} "
            f"| {max(c['pairs'] for c in sim['conflicts'])} ({max(c['large_pairs'] for c in sim['conflicts'])}) "
            f"| {rec['conflicts'][1]['pairs']} ({rec['conflicts'][1]['large_pairs']}) "
            f"| {_mib(sim['arena_bytes'])} / {_mib(sim['resident_bytes'])}; {_mib(rec['arena_bytes'])} / "
            f"{_mib(rec['resident_bytes'])} | {_mib(max(own))} "
            f"| {'-' if r.get('step_time_s') is None else format(r['step_time_s'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(BATCH))
    ap.add_argument("--fraction", type=float, default=None,
                    help="budget = persistent + fraction x (plain peak - persistent) (default: FRACTION's)")
    ap.add_argument("--steps", type=int, default=8,
                    help="steps of the fit; the last two are traced, those from the fourth on before them timed")
    ap.add_argument("--json", default=None, help="write the results here (e.g. docs/planned_placement.json)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--execution-orders", nargs="+", default=["planned", "strict"],
                    choices=("planned", "strict", "free"), help="DymemCallback's execution_order, one fit each")
    ap.add_argument("--execution-order", default="planned", help=argparse.SUPPRESS)
    ap.add_argument("--keep", default=None, help="save the traces and the named simulated buffers in this folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="run", help=argparse.SUPPRESS)
    ap.add_argument("--budget-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT" + json.dumps(child(args.child, args)), flush=True)
        return 0
    print("$ python bench/planned_placement.py " + " ".join(sys.argv[1:] if argv is None else argv), flush=True)
    results = []
    for name in args.models:
        for r in run_model(name, args):
            results.append(r)
            print(table(r), flush=True)
            print(flush=True)
    print(summary(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python bench/planned_placement.py " + " ".join(sys.argv[1:]),
                       "steps": args.steps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
