"""Modelled step time and stall per model and policy (the planner's simulator, no training).

Run in a fresh process by ``bench/run_all.py``::

    python bench/modelled.py --models resnet50,densenet121 --batch 64 --profile h200 --json-out out.json

For every model it builds the ``keras.applications`` network (random weights), traces its train step symbolically
(:func:`dymem_tf.keras.dry_run.trace_train_step`) and plans it under every policy (:func:`dymem_tf.keras.dry_run.plan_all`) for
the device profile, in two scenarios: ``unbounded`` (no budget: each policy swaps its whole candidate set) and
``equal_budget`` (the largest of the swapping policies' unbounded peaks plus ``EQUAL_BUDGET_HEADROOM``: a budget every
swapping policy reached without one, so each swaps what it needs to fit it and the step times compare at equal
memory; the headroom keeps the greedy budgeted search off the exact edge), plus a ``sweep`` of equal budgets from
just above vDNN's no-budget peak (every feature map swapped: the least memory vDNN reaches) up towards the no-swap
peak, at the fractions ``SWEEP_FRACTIONS`` of that range; and ``vdnn_memory``: vdnn as published (no budget)
against dymem planned to exactly vdnn's resulting peak. Nothing here is measured: every number is the cost
model's and simulator's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

EQUAL_BUDGET_HEADROOM = 0.03
#: Budgets of the sweep: vdnn's no-budget peak + f * (no-swap peak - vdnn's no-budget peak).
SWEEP_FRACTIONS = (0.02, 0.1, 0.25, 0.5, 0.75)
MODEL_IMAGE_SIZES = {"vgg16": 224, "resnet50": 224, "densenet121": 224, "inception_v3": 299}


def _plan_row(plan) -> dict:
    if isinstance(plan, Exception):
        return {"error": f"{type(plan).__name__}: {plan}"}
    pred = plan.predicted
    return {
        "swaps": len(plan.swaps),
        "swapped_bytes": int(sum(s.bytes for s in plan.swaps)),
        "peak_bytes": int(pred.peak_bytes),
        "step_time_s": float(pred.step_time_s),
        "stall_s": float(pred.stall_s),
        "compute_time_s": float(pred.compute_time_s),
        "no_swap_peak_bytes": int(pred.no_swap_peak_bytes or 0),
        "no_swap_step_time_s": float(pred.no_swap_step_time_s or 0.0),
        "notes": list(plan.notes),
    }


def sweep(traced, unbounded: dict, profile: str) -> list[dict]:
    """Equal-budget plans of the swapping policies at the budgets of ``SWEEP_FRACTIONS`` (see the module doc)."""
    from dymem_tf.keras import dry_run

    vdnn, none = unbounded.get("vdnn"), unbounded.get("none")
    if isinstance(vdnn, Exception) or isinstance(none, Exception) or vdnn is None or none is None:
        return []
    low, high = int(vdnn.predicted.peak_bytes), int(none.predicted.peak_bytes)
    rows = []
    for f in SWEEP_FRACTIONS:
        budget = int(low + f * (high - low))
        plans = dry_run.plan_all(traced, [p for p in unbounded if p != "none"], budget, profile, headroom=0.0)
        rows.append({"fraction": f, "budget_bytes": budget, "policies": {p: _plan_row(v) for p, v in plans.items()}})
    return rows


def model_one(name: str, image_size: int, batch: int, profile: str) -> dict:
    from dymem_tf.keras import dry_run
    from dymem_tf.planning import planner

    t0 = time.perf_counter()
    model = dry_run.build_model(name, image_size)
    traced = dry_run.trace_train_step(model, batch)
    t1 = time.perf_counter()
    unbounded = dry_run.plan_all(traced, planner.POLICIES, None, profile)
    out = {
        "model": name, "image_size": image_size, "batch": batch, "profile": profile,
        "num_ops": traced.num_ops, "num_layers": len(traced.step_graph.layers) if traced.step_graph is not None else None,
        "persistent_bytes": int(traced.persistent_bytes),
        "scenarios": {"unbounded": {"budget_bytes": None,
                                    "policies": {p: _plan_row(v) for p, v in unbounded.items()}}},
    }
    peaks = [int(v.predicted.peak_bytes) for p, v in unbounded.items()
             if p != "none" and not isinstance(v, Exception)]
    if peaks:
        mib = 1 << 20
        budget = -(-int(max(peaks) * (1 + EQUAL_BUDGET_HEADROOM)) // mib) * mib  # rounded up to a MiB
        # headroom 0: every policy plans against exactly this budget (the callback keeps a share free for the
        # allocator; that would only shift all policies alike).
        budgeted = dry_run.plan_all(traced, planner.POLICIES, budget, profile, headroom=0.0)
        out["scenarios"]["equal_budget"] = {"budget_bytes": budget, "margin": EQUAL_BUDGET_HEADROOM,
                                            "planner_headroom": 0.0,
                                            "policies": {p: _plan_row(v) for p, v in budgeted.items()}}
        out["sweep"] = sweep(traced, unbounded, profile)
        vdnn = unbounded.get("vdnn")
        if vdnn is not None and not isinstance(vdnn, Exception):
            # vdnn as published (no budget: all feature maps) vs dymem planned to the same peak memory
            at_vdnn = int(vdnn.predicted.peak_bytes)
            dymem = dry_run.plan_all(traced, ["dymem"], at_vdnn, profile, headroom=0.0)["dymem"]
            out["scenarios"]["vdnn_memory"] = {
                "budget_bytes": at_vdnn, "planner_headroom": 0.0,
                "policies": {"none": _plan_row(unbounded["none"]), "vdnn": _plan_row(vdnn),
                             "dymem": _plan_row(dymem)}}
    out["trace_s"] = t1 - t0
    out["plan_s"] = time.perf_counter() - t1
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16,resnet50,densenet121,inception_v3")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=0, help="0: 224 (inception_v3: 299)")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # noqa: F401
    import dymem_tf  # noqa: F401

    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        size = args.image_size or MODEL_IMAGE_SIZES.get(name, 224)
        try:
            row = model_one(name, size, args.batch, args.profile)
        except Exception as err:  # noqa: BLE001 -- reported in the benchmark, not hidden
            row = {"model": name, "image_size": size, "batch": args.batch, "profile": args.profile,
                   "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
        print(f"  modelled {name}: " + (row.get("error") or f"{row['num_ops']} ops, trace {row['trace_s']:.0f}s, "
                                        f"plan {row['plan_s']:.0f}s"), flush=True)
        results.append(row)
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
