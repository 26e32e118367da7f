"""Monotone budgets (issue 48, item 3): does a smaller budget ever get a plan with a higher predicted peak, or
fewer bytes swapped?

Planning only: nothing trains and nothing is measured; every number is the planner's (the simulator's prediction
on the ``cpu`` profile). For each model (``bench/model_zoo.py``, random weights, synthetic data) the train step is
traced once (:func:`dymem_tf.keras.dry_run.trace_train_step`) and prepared as the callback's pass prepares a step
under a budget on the CPU device (:func:`dymem_tf.planning.pipeline.prepare_step`: update deferral, optimizer-state
and weight offloading, recomputation). Then :func:`dymem_tf.planning.planner.make_plan` (dymem policy, headroom 0:
the budget is the target) gives

* the least-memory plan's predicted peak ``L`` and the plain step's ``P`` (no swaps), and
* a plan at each of ``--budgets`` budgets evenly spaced from ``P`` down to ``L`` (largest first), each an
  independent ``make_plan`` call.

The table gives per budget the predicted peak, the bytes the plan takes off the device per step
(``Plan.swapped_bytes``: swapped feature maps, offloaded state and weights, recomputed tensors), of which copied
over the link (all but the recomputed), the decisions, the predicted step time, the planning seconds, and whether
the row is monotone against the previous one (peak not higher, bytes swapped not fewer; ``-`` for the first).

    python bench/budget_sweep.py                                   # ResNet-50 64px (Adam), BERT, DenseNet-121
    python bench/budget_sweep.py --models resnet50_adam --json /tmp/sweep.json
    python bench/budget_sweep.py --cache /tmp/sweep_cache          # keep the traced steps for the next run

``bert`` needs keras-hub (``pip install --no-build-isolation -e '.[bench]'``). ``--cache DIR`` pickles each
prepared step there and reuses it (tracing takes most of a run); ``--markdown`` prints the tables as Markdown;
``--profile`` plans for another device profile (``h200``, ``a100``, ...); ``--planner FILE`` plans with another copy
of the planner module (the "before" of docs/benchmarks.md's "Monotone budgets" section).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
#: model -> (zoo builder, image size or None for the zoo's, batch)
MODELS = {
    "resnet50_adam": ("ResNet50", 64, 32),
    "bert": ("bert", None, 16),
    "densenet121": ("DenseNet121", 32, 32),
}


def build(name: str, batch: int):
    """(model, x, y) of one batch of ``name``: a ``keras.applications`` model at its image size (``MODELS``) or a
    zoo entry."""
    sys.path.insert(0, HERE)
    import keras

    import model_zoo

    builder, size, _ = MODELS.get(name, (name, None, batch))
    if size is not None:
        opt = (lambda: keras.optimizers.Adam(1e-3)) if name.endswith("_adam") else model_zoo._sgd
        return model_zoo._application(builder, size, opt)(batch, batch, 0)
    return model_zoo.ZOO[builder](batch, batch, 0)


def prepare(model, x, y, batch: int):
    """The traced and prepared step of ``model`` at ``batch`` as the pass plans it under a budget on the CPU:
    ``(PreparedStep, persistent bytes)``."""
    from dymem_tf.keras import dry_run
    from dymem_tf.planning import pipeline

    traced = dry_run.trace_train_step(model, batch, x, y)
    if traced.unsupported:
        raise RuntimeError(f"the pass would leave this step unmodified: {traced.unsupported}")
    settings = pipeline.PlanSettings(budget_bytes=1, offload_variables=True, offload_weights=True,
                                     batch_size=batch, onednn_later=traced.onednn_later)
    return pipeline.prepare_step(traced.step_graph, settings, copy=True), traced.persistent_bytes


def plan(prepared, persistent: int, batch: int, budget: int | None, least_memory: bool = False, profile="cpu"):
    """``make_plan`` on a prepared step, as :func:`dymem_tf.planning.pipeline.finish_plan` calls it (headroom 0)."""
    from dymem_tf.planning import planner

    return planner.make_plan(
        prepared.graph, policy="dymem", budget_bytes=budget,
        persistent_bytes=max(persistent - prepared.modelled - prepared.modelled_weights, 0), profile=profile,
        batch_size=batch, swapin_ahead=1, headroom=0.0, least_memory=least_memory, weights=prepared.weights,
        recomputable=prepared.recomputable)


def use_planner(path: str) -> None:
    """Make :func:`plan` use the planner module in ``path`` (a copy of dymem_tf/planning/planner.py)."""
    import importlib.util

    import dymem_tf.planning

    spec = importlib.util.spec_from_file_location("dymem_tf.planning.planner_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    dymem_tf.planning.planner = module
    sys.modules["dymem_tf.planning.planner"] = module


def row_of(p, budget: int | None, seconds: float) -> dict:
    """What the table keeps of one plan."""
    return {"budget_bytes": budget, "peak_bytes": int(p.predicted.peak_bytes), "swapped_bytes": int(p.swapped_bytes),
            "copied_bytes": int(sum(s.bytes for s in p.swaps if s.kind != "recompute")), "swaps": len(p.swaps),
            "step_time_s": float(p.predicted.step_time_s), "mode": p.params.trigger_mode,
            "plan_seconds": round(seconds, 3)}


def sweep(prepared, persistent: int, batch: int, n: int, profile="cpu") -> dict:
    """The least-memory and plain peaks and a plan at ``n`` budgets evenly between them, largest first."""
    from dymem_tf.planning.planner import BudgetTooSmallError

    # the least-memory plan; it also prepares the simulator the plans below share
    least = plan(prepared, persistent, batch, None, least_memory=True, profile=profile)
    low, high = int(least.predicted.peak_bytes), int(least.predicted.no_swap_peak_bytes)
    budgets = [high - round(k * (high - low) / (n - 1)) for k in range(n)] if n > 1 else [high]
    rows, prev = [], None
    for budget in budgets:
        started = time.perf_counter()
        try:
            p = plan(prepared, persistent, batch, budget, profile=profile)
        except BudgetTooSmallError as err:
            rows.append({"budget_bytes": budget, "error": str(err)[:200],
                         "plan_seconds": round(time.perf_counter() - started, 3)})
            continue
        row = row_of(p, budget, time.perf_counter() - started)
        if prev is not None:
            row["monotone"] = row["peak_bytes"] <= prev["peak_bytes"] and row["swapped_bytes"] >= prev["swapped_bytes"]
        rows.append(row)
        prev = row
    return {"least_memory_peak_bytes": low, "plain_peak_bytes": high, "persistent_bytes": persistent,
            "least_memory_step_time_s": float(least.predicted.step_time_s), "rows": rows}


def table(name: str, batch: int, result: dict, markdown: bool = False) -> str:
    """One model's sweep as text (or Markdown)."""
    from tabulate import tabulate

    rows = []
    for r in result["rows"]:
        if "error" in r:
            rows.append([f"{r['budget_bytes'] / MiB:.1f}", "refused", "", "", "", "", f"{r['plan_seconds']:.2f}", ""])
            continue
        ok = {None: "-", True: "yes", False: "**NO**" if markdown else "NO"}[r.get("monotone")]
        rows.append([f"{r['budget_bytes'] / MiB:.1f}", f"{r['peak_bytes'] / MiB:.1f}",
                     f"{r['swapped_bytes'] / MiB:.1f}", f"{r['copied_bytes'] / MiB:.1f}", r["swaps"],
                     f"{1e3 * r['step_time_s']:.1f}", f"{r['plan_seconds']:.2f}", ok])
    head = ["budget MiB", "peak MiB", "swapped MiB/step", "copied MiB/step", "swaps", "step ms", "plan s", "monotone"]
    bad = sum(r.get("monotone") is False for r in result["rows"])
    title = (f"{name} (batch {batch}): least-memory peak {result['least_memory_peak_bytes'] / MiB:.1f} MiB, plain "
             f"peak {result['plain_peak_bytes'] / MiB:.1f} MiB, persistent {result['persistent_bytes'] / MiB:.1f} MiB;"
             f" {bad} non-monotone rows")
    return title + "\n\n" + tabulate(rows, head, tablefmt="github" if markdown else "simple",
                                     disable_numparse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--budgets", type=int, default=10, help="budgets per model (default 10)")
    ap.add_argument("--batch", type=int, default=None, help="batch size for every model (default: per model)")
    ap.add_argument("--json", default=None, help="save the results here")
    ap.add_argument("--cache", default=None, help="directory to keep the prepared steps in (pickled)")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    ap.add_argument("--profile", default="cpu", help="device profile the plans are made for (default cpu)")
    ap.add_argument("--planner", default=None, help="plan with this copy of dymem_tf/planning/planner.py instead "
                    "(the 'before' of a change: git show REV:dymem_tf/planning/planner.py > /tmp/planner.py)")
    args = ap.parse_args(argv)
    print("$ python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]), flush=True)
    sys.path.insert(0, REPO)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # as in every budgeted measurement here
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))  # pickling a large step graph
    import tensorflow  # noqa: F401  dymem_tf right after TensorFlow (its allocator), before the models
    import dymem_tf  # noqa: F401
    if args.planner:
        use_planner(args.planner)
    out = {"command": " ".join(sys.argv), "profile": args.profile, "headroom": 0.0, "models": {}}
    for name in [m for m in args.models.split(",") if m]:
        batch = args.batch or MODELS.get(name, (None, None, 16))[2]
        path = os.path.join(args.cache, f"{name}_b{batch}.pkl") if args.cache else None
        started = time.perf_counter()
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                prepared, persistent = pickle.load(f)
        else:
            prepared, persistent = prepare(*build(name, batch), batch)
            if path:
                os.makedirs(args.cache, exist_ok=True)
                with open(path, "wb") as f:
                    pickle.dump((prepared, persistent), f)
        traced_s = time.perf_counter() - started
        result = sweep(prepared, persistent, batch, args.budgets, args.profile)
        result.update(batch=batch, ops=len(prepared.graph.ops), trace_seconds=round(traced_s, 1))
        out["models"][name] = result
        print("\n" + table(name, batch, result, args.markdown), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nsaved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
