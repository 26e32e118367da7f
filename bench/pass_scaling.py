"""How the Dymem pass's time grows with the train step: seconds per stage on models from ~2k to ~50k ops.

    python bench/pass_scaling.py --write              # every model: no budget, then under a budget (~25 min)
    python bench/pass_scaling.py --models vgg16,resnet50 --modes none   # a quick look, writes nothing

Each model (``keras.applications``, random weights, Adam, a few synthetic batches) trains in a fresh interpreter,
oneDNN off as in every budgeted measurement here, on an 8 GiB GTBM device:

* ``none``: ``fit`` with ``DymemCallback(memory_budget=None)``: one pass, timed by the pass itself
  (``TraceRecord.pass_seconds``, the graph handed over to the rewritten graph handed back) and per stage
  (``TraceRecord.stage_times``, :mod:`dymem_tf.planning.stages`; ``verbose=2`` prints the same);
* ``budget``: a second ``fit`` under ``memory_budget = --budget-fraction`` of the no-budget plan's predicted peak
  without swapping: every pass of its first step (the probe's least-memory plan, the calibrated plan and any
  refinement) is summed, and compared with the no-budget pass of the same process (*budget / none*).

The table gives, per model, the ops of the step graph after Grappler, its dependency layers, the swaps of the
no-budget plan, the seconds of each stage, the total, and seconds per 1,000 ops (the number that stays flat when
the pass is linear in the step). ``--pythonpath DIR`` runs the children against another checkout of dymem_tf (the
"before" column of docs/benchmarks.md was measured so, against the commit the issue was filed at). With ``--write``
the results go to docs/pass_scaling.json and the "Pass time by model size" section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- pass-scaling:begin -->", "<!-- pass-scaling:end -->"
MODES = ("none", "budget")
#: model -> (keras.applications builder, image size, batch): from ~2k to ~50k ops after Grappler
MODELS = {
    "vgg16": ("VGG16", 64, 4),
    "mobilenetv2": ("MobileNetV2", 64, 4),
    "resnet50": ("ResNet50", 64, 4),
    "densenet121": ("DenseNet121", 64, 4),
    "resnet152": ("ResNet152", 64, 4),
    "efficientnetb7": ("EfficientNetB7", 64, 4),
    "nasnetlarge": ("NASNetLarge", 96, 4),
}
#: the stages printed as columns, in pipeline order (dymem_tf.planning.stages.STAGES; the rest add up as "other")
COLUMNS = ("read", "capture", "defer", "order", "hold", "simulate", "placement", "rewrite")


def run_child(args) -> dict:
    """Both modes for one model, in this interpreter."""
    import keras
    import numpy as np

    import dymem_tf

    builder, size, batch = MODELS[args.child]
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, builder)(weights=None, input_shape=(size, size, 3), classes=10)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(batch * 2, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch * 2,))
    out: dict = {"model": args.child, "image_size": size, "batch": batch}
    budget = None
    for mode in args.modes:
        if mode == "budget":
            if budget is None:
                break  # the budget is a share of the no-budget plan's peak
        cb = dymem_tf.DymemCallback(memory_budget=budget if mode == "budget" else None, verbose=0)
        started = time.perf_counter()
        outcome = "trained"
        try:
            model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0, callbacks=[cb])
        except dymem_tf.BudgetTooSmallError as err:
            outcome = f"refused: {str(err)[:160]}"
        passes = [_pass_record(r) for r in cb.records]
        out[mode] = {"outcome": outcome, "budget_bytes": budget, "fit_seconds": round(time.perf_counter() - started, 1),
                     "passes": passes}
        if mode == "none" and cb.records:
            plan = cb.records[0].plan
            budget = int(args.budget_fraction * plan.predicted.no_swap_peak_bytes)
        print(mode, json.dumps(out[mode]), flush=True)
    return out


def _pass_record(record) -> dict:
    """What the table needs of one pass (a checkout without stage times gives none)."""
    times = getattr(record, "stage_times", None)
    sg = record.step_graph
    return {"stage": record.plan.params.stage or "plan", "pass_seconds": round(record.pass_seconds, 3),
            "ops": len(sg.ops), "layers": sg.num_layers, "swaps": len(record.plan.swaps),
            "stages": times.as_dict() if times is not None else {}}


def run(args) -> dict:
    """Every model in a fresh interpreter (each big step graph holds several GiB while TF optimizes it)."""
    results = {}
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
    for name in args.models:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--modes", ",".join(args.modes),
               "--budget-fraction", str(args.budget_fraction)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            results[name] = {"model": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        else:
            results[name] = json.loads(lines[-1])
        print(name, json.dumps(results[name])[:400], flush=True)
    return results


def summarize(entry: dict) -> dict | None:
    """One table row from a child's results: the no-budget pass and the budgeted first step's planning."""
    none = (entry.get("none") or {}).get("passes") or []
    if not none:
        return None
    p = none[0]
    row = {"model": entry["model"], "ops": p["ops"], "layers": p["layers"], "swaps": p["swaps"],
           "seconds": p["pass_seconds"], "per_kop": 1000 * p["pass_seconds"] / max(p["ops"], 1),
           "stages": p["stages"]}
    budget = entry.get("budget") or {}
    if budget.get("passes"):
        first = [q for q in budget["passes"] if q["stage"] in ("probe", "calibrated", "refined")]
        row["budget_seconds"] = sum(q["pass_seconds"] for q in first)
        row["budget_passes"] = len(first)
        row["budget_ratio"] = row["budget_seconds"] / max(p["pass_seconds"], 1e-9)
        row["budget_outcome"] = budget["outcome"]
    return row


def report(results: dict, args, seconds: float, commit: str, before: dict | None = None) -> str:
    """The markdown section for docs/benchmarks.md (``before``: results of the same script at an older commit)."""
    rows = [r for r in (summarize(e) for e in results.values()) if r is not None]
    lines = [BEGIN, "## Pass time by model size (measured on the CPU)", "",
             f"`python bench/pass_scaling.py {' '.join(args.argv)}` at commit {commit or '?'} on this 2-core CPU "
             f"machine ({seconds / 60:.1f} min). `keras.applications` models, Adam, oneDNN off; one `fit` per mode in "
             "a fresh interpreter. Seconds are the pass's own (`TraceRecord.pass_seconds`: the graph handed over to "
             "the rewritten graph handed back), split by `TraceRecord.stage_times`; *budget* sums every pass of the "
             f"first step under `memory_budget` = {args.budget_fraction:.2f} x the plain plan's predicted peak "
             "(probe, calibrated plan, refinements).", "",
             "| model | ops | dependency layers | swaps | " + " | ".join(COLUMNS) +
             " | other | pass s | s per 1k ops | budget: passes, s | budget / none |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: r["ops"]):
        st = r["stages"]
        other = max(r["seconds"] - sum(st.get(c, 0.0) for c in COLUMNS), 0.0) if st else None
        cells = [f"{st[c]:.2f}" if c in st else "-" for c in COLUMNS]
        budget = (f"{r['budget_passes']}, {r['budget_seconds']:.2f}" if "budget_seconds" in r else "-")
        ratio = f"{r['budget_ratio']:.2f}x" if "budget_ratio" in r else "-"
        lines.append(f"| {r['model']} | {r['ops']:,} | {r['layers']:,} | {r['swaps']} | " + " | ".join(cells) +
                     f" | {'-' if other is None else f'{other:.2f}'} | {r['seconds']:.2f} | {r['per_kop']:.3f} | "
                     f"{budget} | {ratio} |")
    if rows:
        per = [r["per_kop"] for r in rows]
        lines += ["", f"Seconds per 1,000 ops: {min(per):.3f} to {max(per):.3f} ({max(per) / min(per):.2f}x between "
                      "the models)."]
    failed = [f"{name}: {e['error']}" for name, e in results.items() if "error" in e]
    if failed:
        lines += ["", "Failed: " + "; ".join(failed)]
    if before:
        lines += ["", f"Before and after (pass seconds; before: {before.get('commit', '?')}, the same script on that "
                      "checkout); *budget* is the first step's planning under the budget:", "",
                  "| model | ops | before s | after s | speed-up | budget before s | budget after s | "
                  "budget / none before | budget / none after |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        old = {r["model"]: r for r in (summarize(e) for e in before.get("results", {}).values()) if r}
        for r in sorted(rows, key=lambda r: r["ops"]):
            if r["model"] in old:
                b = old[r["model"]]
                budget = [f"{x['budget_seconds']:.2f}" if "budget_seconds" in x else "-" for x in (b, r)]
                ratio = [f"{x['budget_ratio']:.2f}x" if "budget_ratio" in x else "-" for x in (b, r)]
                lines.append(f"| {r['model']} | {r['ops']:,} | {b['seconds']:.2f} | {r['seconds']:.2f} | "
                             f"{b['seconds'] / max(r['seconds'], 1e-9):.1f}x | {' | '.join(budget)} | "
                             f"{' | '.join(ratio)} |")
    lines += ["", "Raw results: [docs/pass_scaling.json](pass_scaling.json).", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget-fraction", type=float, default=0.85,
                        help="the budget mode's memory_budget as a share of the no-budget plan's predicted peak")
    parser.add_argument("--device-limit", default="8GiB", help="the GTBM device's size (DYMEM_DEVICE_MEMORY_LIMIT)")
    parser.add_argument("--pythonpath", default="", help="run the children against the dymem_tf in this folder")
    parser.add_argument("--before", default="", help="a JSON file of an earlier --out run, shown as 'before'")
    parser.add_argument("--out", default="", help="also save the results to this JSON file")
    parser.add_argument("--write", action="store_true", help="write docs/pass_scaling.json and the docs section")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES] + [m for m in args.models if m not in MODELS]
    if bad or not 0.0 < args.budget_fraction < 1.0 or not args.modes or args.modes[0] != "none":
        parser.error(f"--modes: none, then optionally budget; --models from {', '.join(MODELS)}; "
                     "--budget-fraction in (0, 1)")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("DYMEM_DEVICE_MEMORY_LIMIT", args.device_limit)
    if args.child:
        print(json.dumps(run_child(args)), flush=True)
        return 0
    sys.path.insert(0, HERE)
    from largest_batch import _commit, write_section

    t0 = time.perf_counter()
    results = run(args)
    before = json.load(open(args.before, encoding="utf-8")) if args.before else None
    commit = _commit()
    section = report(results, args, time.perf_counter() - t0, commit, before)
    print(section)
    saved = {"commit": commit, "argv": args.argv, "results": results}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(saved, fh, indent=1)
    if args.write:
        if before:
            saved["before"] = before
        write_section(section, BEGIN, END, saved, "pass_scaling.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
