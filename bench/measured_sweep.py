"""Monotone budgets, measured (issue 48, item 3): as the budget falls from the plain peak to the least the probe
passes, does the measured steady peak ever rise, or the bytes swapped per step ever fall?

``bench/budget_sweep.py`` answers this for the planner's predictions; here each budget trains. For each model
(``bench/model_zoo.py`` at ``bench/budget_reliability.py``'s batch sizes), in fresh interpreters as
budget_reliability runs them (oneDNN off, op determinism, a GTBM device of the budget's size,
``memory_budget="auto"``):

1. the plain step's peak ``P0`` (two steps, no Dymem);
2. the least-memory plan's measured first-step peak, from a run at the lowest of budget_reliability's fractions
   (its probe), and from it the least budget that probe passes (``first_step.least_budget``), or a pageblock above
   the bytes the built model holds before ``fit`` where that is more: ``L``;
3. ``--budgets`` budgets evenly spaced from ``P0`` down to ``L`` (whole MiB, largest first), each a ``fit`` of
   ``--steps`` steps.

Per budget the table gives the outcome, the steady peak (the highest of the steps the trained plan ran after its
own first step, as budget_reliability counts it) over the budget, the bytes the trained plan swaps per step, and
whether the row keeps the rule against the nearest larger budget that trained: the steady peak not higher (beyond
``--tolerance`` pageblocks, the step-to-step jitter of one plan) and the bytes swapped not fewer. A row that fell
back to the probe's plan is a reference like any other (a smaller budget that then settles on a plan of its own
peaks higher: that breaks the rule).

    python bench/measured_sweep.py --models resnet50_adam,bert,densenet121 --write
    python bench/measured_sweep.py --models densenet121 --budgets 4 --steps 6 --json /tmp/s.json
    python bench/measured_sweep.py --report-from /tmp/s.json --write   # the section from a saved run

With ``--write`` the tables go to docs/benchmarks.md (section "measured-sweep") and the runs to
docs/measured_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- measured-sweep:begin -->", "<!-- measured-sweep:end -->"
MiB = 1 << 20
BLOCK = 2 * MiB  # GTBM's default pageblock (a run records its own): a plan's reserved peak moves in whole blocks


def budgets(p0: int, least: int, n: int) -> list[int]:
    """``n`` budgets from ``p0`` down to ``least`` (whole MiB, largest first, no repeats)."""
    if n < 2 or least >= p0:
        return [-(-p0 // MiB) * MiB]
    out = []
    for k in range(n):
        b = -(-int(p0 - k * (p0 - least) / (n - 1)) // MiB) * MiB
        if not out or b < out[-1]:
            out.append(b)
    return out


def steady(auto: dict) -> int | None:
    """The steady peak of a run that trained (budget_reliability's :func:`_trained_peaks`), else None."""
    from budget_reliability import _trained_peaks

    return max(_trained_peaks(auto)) if auto.get("outcome") == "trained" and auto.get("peaks") else None


def broken(prev: dict, cur: dict, tolerance: int) -> list[str]:
    """How row ``cur`` (a smaller budget) breaks the rule against ``prev``: its steady peak higher by more than
    ``tolerance`` pageblocks, or fewer bytes swapped per step."""
    out = []
    block = int(cur.get("auto", {}).get("block_size") or BLOCK)  # the run's own pageblock (its device's size)
    if prev["steady"] is not None and cur["steady"] is not None and cur["steady"] > prev["steady"] + tolerance * block:
        out.append(f"steady peak {cur['steady'] / MiB:.0f} > {prev['steady'] / MiB:.0f} MiB")
    if (prev.get("swapped_bytes") or 0) > (cur.get("swapped_bytes") or 0) and cur["outcome"] == "trained":
        out.append(f"swapped {(cur.get('swapped_bytes') or 0) / MiB:.1f} < {prev['swapped_bytes'] / MiB:.1f} MiB")
    return out


def sweep_model(name: str, args) -> dict:
    """The plain peak, the least budget and every budget's run of one model."""
    from budget_reliability import BATCH, _run_child
    from dymem_tf.planning import first_step

    child_args = types.SimpleNamespace(steps=args.steps, samples=args.samples, identity_steps=3, timeout=args.timeout)
    base = _run_child(name, child_args, "--phase", "p0")
    if "error" in base:
        return {"model": name, "error": f"p0: {base['error']}"}
    p0, persistent = base["p0"], base["persistent"]
    low = -(-int(persistent + args.probe_fraction * (p0 - persistent)) // MiB) * MiB
    probe_run = _run_child(name, child_args, "--phase", "budget", "--mode", "auto", "--budget-bytes", str(low),
                           device=low)
    if "error" in probe_run or not probe_run.get("probe_measured"):
        return {"model": name, "p0": p0, "error": f"probe: {probe_run.get('error', probe_run.get('outcome'))}"}
    # the device must also hold the model as Keras built it, before fit (ResNet-50's weights: 90 MiB, more than
    # the 74 MiB its least-memory plan measured with them in host memory)
    least = max(first_step.least_budget(probe_run["probe_measured"]),
                -(-int(probe_run.get("start_in_use", 0)) // MiB) * MiB + BLOCK)
    rows = []
    for budget in budgets(p0, least, args.budgets):
        auto = _run_child(name, child_args, "--phase", "budget", "--mode", "auto", "--budget-bytes", str(budget),
                          device=budget)
        if "error" in auto:
            auto = {"outcome": "error", "error": auto["error"][-300:], "peaks": []}
        row = {"budget": budget, "outcome": auto["outcome"], "steady": steady(auto),
               "swapped_bytes": auto.get("swapped_bytes"), "fallback": auto.get("fallback"),
               "over_budget_steps": auto.get("over_budget_steps", 0), "auto": auto}
        trained = [r for r in rows if r["steady"] is not None]  # an errored row is no reference
        row["broken"] = broken(trained[-1], row, args.tolerance) if trained else []
        rows.append(row)
        print(f"  {name} B={budget / MiB:.0f} MiB: {row['outcome']}, steady "
              f"{(row['steady'] or 0) / MiB:.0f} MiB, swapped {(row['swapped_bytes'] or 0) / MiB:.1f} MiB"
              f"{'; ' + '; '.join(row['broken']) if row['broken'] else ''}", flush=True)
    return {"model": name, "batch": BATCH[name], "p0": p0, "persistent": persistent,
            "probe_measured": probe_run["probe_measured"], "least_budget": least, "rows": rows}


def rule(row: dict) -> str:
    """A row's rule cell: how it breaks the rule, ``kept``, or ``–`` where it did not train."""
    return "; ".join(row["broken"]) or ("kept" if row["steady"] is not None else "–")


def report(results: list[dict], args, seconds: float, commit: str) -> str:
    """The markdown section for docs/benchmarks.md."""
    lines = [BEGIN, "## Monotone budgets, measured (issue 48)", "",
             f"`python bench/measured_sweep.py {' '.join(args.argv)}` at commit {commit or '?'} on this 2-core CPU "
             f"machine ({seconds / 60:.0f} min): {args.steps} steps on {args.samples} samples per budget, oneDNN off, "
             "a GTBM device of the budget's size, `memory_budget=\"auto\"`. Budgets evenly spaced from the plain "
             "peak P0 down to the least budget the least-memory plan's measured first step passes. *Steady* is the "
             "highest reserved peak of the trained plan's steps after its own first step; a row breaks the rule when "
             f"its steady peak is more than {args.tolerance} pageblock(s) above the row before (a larger budget) or "
             "it swaps fewer bytes per step.", ""]
    for r in results:
        if "error" in r:
            lines += [f"**{r['model']}**: {r['error']}", ""]
            continue
        lines += [f"**{r['model']}**: P0 {r['p0'] / MiB:.0f} MiB, least-memory first step "
                  f"{r['probe_measured'] / MiB:.0f} MiB, least budget {r['least_budget'] / MiB:.1f} MiB", "",
                  "| B MiB | outcome | steady MiB | steady / B | MiB swapped per step | steps over B | rule |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
        for row in r["rows"]:
            st = row["steady"]
            outcome = row["outcome"] + (", fell back to the probe's plan" if row.get("fallback") else "")
            lines.append(f"| {row['budget'] / MiB:.0f} | {outcome} | {st / MiB if st else 0:.0f} | "
                         f"{st / row['budget'] if st else 0:.3f} | {(row['swapped_bytes'] or 0) / MiB:.1f} | "
                         f"{row['over_budget_steps']} | {rule(row)} |")
        lines.append("")
    trained = [[row for row in r.get("rows", []) if row["steady"] is not None] for r in results]
    kept = sum(not row["broken"] for rows in trained for row in rows[1:])
    pairs = sum(max(len(rows) - 1, 0) for rows in trained)
    lines += [f"{kept} of {pairs} budget steps keep the rule. Raw runs: "
              "[docs/measured_sweep.json](measured_sweep.json).", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50_adam,bert,densenet121")
    parser.add_argument("--budgets", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--probe-fraction", type=float, default=0.35,
                        help="the budget B = W + f (P0 - W) whose probe measures the least-memory plan")
    parser.add_argument("--tolerance", type=int, default=1, help="pageblocks a steady peak may rise by (jitter)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json", help="save the runs here")
    parser.add_argument("--write", action="store_true", help="write docs/measured_sweep.json and the docs section")
    parser.add_argument("--report-from", help="re-render the section from a saved run (with --write: write it)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.budgets < 2 or args.steps < 4:
        parser.error("--budgets at least 2 and --steps at least 4 (the steady peak starts at step 3)")
    sys.path.insert(0, HERE)
    sys.path.insert(0, REPO)
    from largest_batch import _commit, write_section

    if args.report_from:  # the saved run's command line, settings, duration and commit
        with open(args.report_from) as fh:
            saved = json.load(fh)
        args.argv, args.steps, args.samples = saved["argv"], saved["steps"], saved["samples"]
        args.tolerance = saved.get("tolerance", args.tolerance)
        section = report(saved["results"], args, saved["seconds"], saved["commit"])
        print(section)
        if args.write:
            write_section(section, BEGIN, END, saved, "measured_sweep.json")
        return 0
    t0 = time.perf_counter()
    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        print(f"{name} ...", flush=True)
        results.append(sweep_model(name, args))
    seconds, commit = time.perf_counter() - t0, _commit()
    section = report(results, args, seconds, commit)
    print(section)
    saved = {"argv": args.argv, "steps": args.steps, "samples": args.samples, "tolerance": args.tolerance,
             "seconds": seconds, "commit": commit, "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(saved, fh, indent=1)
    if args.write:
        write_section(section, BEGIN, END, saved, "measured_sweep.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
