"""Time of the Dymem pass on a ResNet-50 224px train step: reading the graph, planning and rewriting, after Grappler.

    python bench/pass_time.py --write                # batch 8, SGD, no budget and 768 MiB; 3 fits each
    python bench/pass_time.py --image-size 96 --repeats 1   # quicker, writes nothing

The pass runs inside TensorFlow while it instantiates the train step (``dymem_tf/passes/step_pass.py``), so it is
timed there: ``TraceRecord.pass_seconds`` is the wall time from the graph handed over to the rewritten graph handed
back (capture, analysis, deferral, planning and the C++ insertion; under a budget also the calibrated plan's
placement re-plans). Modes:

* ``none``: ``memory_budget=None``, one plan per fit;
* ``budget``: ``memory_budget=--budget`` (the callback caps the GTBM device at it): the probe's least-memory plan
  and the calibrated plan (and refined ones, where a plan did not hold), each a pass of its own.

Each fit runs in a fresh interpreter, after an untimed fit of a small model in the same mode (the pass's one-time
imports), so that it plans from nothing: within one process the pass keeps the graph it read and the plans it made
(``dymem_tf/passes/caches.py``), and a second fit of the same model would only read and rewrite. The report gives,
per fit, the first step's passes under the budget together over the no-budget pass of the same repeat (issue 48:
at most 2.5x). oneDNN off (as in every budgeted measurement here); the batch only scales the sizes in the plan, not
the graph the pass reads. With ``--write`` the results go to docs/pass_time.json and the "Pass time" section of
docs/benchmarks.md (between its markers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- pass-time:begin -->", "<!-- pass-time:end -->"
MODES = ("none", "budget")


def run_child(args) -> dict:
    """One fit of ``args.child`` mode in this fresh interpreter: ``{"outcome": ..., "passes": [...]}``."""
    import keras
    import numpy as np

    import dymem_tf
    from dymem_tf.units import parse_bytes

    budget = parse_bytes(args.budget) if args.child == "budget" else None

    def fit(model, size, batch):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * 2, size, size, 3)).astype("float32")
        y = rng.integers(0, 10, size=(batch * 2,))
        cb = dymem_tf.DymemCallback(memory_budget=budget, verbose=0)
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0, callbacks=[cb])
        return cb

    keras.utils.set_random_seed(0)
    small = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    small.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(small, 16, 4)  # the pass's imports, untimed
    model = keras.applications.ResNet50(weights=None, input_shape=(args.image_size, args.image_size, 3),
                                        classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy())
    outcome, cb = "trained", None
    try:
        cb = fit(model, args.image_size, args.batch)
    except dymem_tf.BudgetTooSmallError as err:
        outcome = f"refused: {str(err)[:160]}"
    records = cb.records if cb is not None else []
    return {"outcome": outcome, "passes": [
        {"stage": r.plan.params.stage or "plan", "pass_seconds": round(r.pass_seconds, 3),
         "ops": len(r.step_graph.ops) if hasattr(r.step_graph, "ops") else None,
         "swaps": len(r.plan.swaps), "stages": r.stage_times.as_dict()} for r in records]}


def run(args) -> dict:
    """Every fit's pass times per mode and stage: ``{mode: [{"outcome": ..., "passes": [...]}, ...]}``, each fit in
    a child process, the modes taking turns."""
    from budget_reliability import child_result

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results: dict = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--image-size", str(args.image_size),
                   "--batch", str(args.batch), "--budget", args.budget]
            out = child_result(cmd, env, timeout=1800)
            if "error" in out:
                out = {"outcome": f"failed: {out['error'][-160:]}", "passes": []}
            results[mode].append(out)
            print(mode, json.dumps(out), flush=True)
    return results


def ratios(results: dict) -> list[float]:
    """Per repeat, the budget fit's passes together over the no-budget fit's pass (repeats where both trained)."""
    out = []
    for none, budget in zip(results.get("none", []), results.get("budget", [])):
        plain = sum(p["pass_seconds"] for p in none["passes"])
        if none["outcome"] == budget["outcome"] == "trained" and plain > 0:
            out.append(sum(p["pass_seconds"] for p in budget["passes"]) / plain)
    return out


def report(results: dict, args, seconds: float, commit: str) -> str:
    """The markdown section for docs/benchmarks.md."""
    lines = [BEGIN, "## Pass time: planning and rewriting after Grappler (measured on the CPU)", "",
             f"`python bench/pass_time.py {' '.join(args.argv)}` at commit {commit or '?'} on this 2-core CPU machine "
             f"({seconds / 60:.1f} min). Keras ResNet-50, {args.image_size}x{args.image_size}, batch {args.batch}, "
             f"SGD with momentum, {args.repeats} fit{'s' if args.repeats > 1 else ''} per mode; *budget* is "
             f"`memory_budget={args.budget}` on a {args.device_limit} device. Each time is "
             "`TraceRecord.pass_seconds`: the pass from the graph TF hands over to the rewritten graph handed back, "
             "each fit in a fresh process after an untimed fit of a small model (so it plans from nothing).", "",
             "| mode | stage | ops in the step graph | swaps | pass seconds per fit | median |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for mode in args.modes:
        stages: dict = {}
        for fit in results.get(mode, []):
            for p in fit["passes"]:
                stages.setdefault(p["stage"], []).append(p)
        for stage, passes in stages.items():
            times = [p["pass_seconds"] for p in passes]
            lines.append(f"| {mode} | {stage} | {passes[0]['ops'] or '-'} | {passes[0]['swaps']} | "
                         f"{', '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} |")
        refused = [f["outcome"] for f in results.get(mode, []) if f["outcome"] != "trained"]
        if refused:
            lines.append(f"| {mode} | - | - | - | {len(refused)} fit(s) refused: {refused[0]} | - |")
    both = ratios(results)
    if both:
        lines += ["", f"The first step's passes under the budget together, over the no-budget pass of the same repeat: "
                  f"{', '.join(f'{r:.2f}x' for r in both)} (median **{statistics.median(both):.2f}x**)."]
    lines += ["", "Raw times, with each pass's seconds per stage: [docs/pass_time.json](pass_time.json).", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="768MiB",
                        help="memory_budget of the budget mode (768 MiB: batch 8 needs a few swaps under it)")
    parser.add_argument("--device-limit", default="8GiB", help="the GTBM device's size (DYMEM_DEVICE_MEMORY_LIMIT)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write docs/pass_time.json and the docs section")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or args.repeats < 1:
        parser.error(f"--modes: choose from {', '.join(MODES)}; --repeats at least 1")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("DYMEM_DEVICE_MEMORY_LIMIT", args.device_limit)
    sys.path.insert(0, HERE)
    if args.child:
        print("RESULT" + json.dumps(run_child(args)), flush=True)
        return 0
    from largest_batch import _commit, write_section

    t0 = time.perf_counter()
    results = run(args)
    section = report(results, args, time.perf_counter() - t0, _commit())
    print(section)
    if args.write:
        write_section(section, BEGIN, END, results, "pass_time.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
