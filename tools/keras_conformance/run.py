"""Keras's own tests as dymem_tf's conformance suite: run them without and with the injected ``DymemCallback``.

    python -m tools.keras_conformance [--quick] [--module keras.src....] [--json out.json]

Runs the chosen test modules that the keras wheel ships (``keras/src/**/*_test.py``) with ``KERAS_BACKEND=tensorflow``
twice, one pytest process each way, one after the other: plain Keras, then with the plugin
:mod:`tools.keras_conformance.inject_dymem` that appends
``DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)`` to every
``fit``. Exits 1 when a test passes without the callback and fails with it (or when a run produces no results),
else 0. Prints the counts: tests run and passed each way, injected fits, fits that swapped, the traces the pass
left unmodified by reason (those without gradient ops, which have nothing to plan, apart), and those traces per test
(``traces_unmodified_by_test`` in the JSON summary).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = "tools.keras_conformance.inject_dymem"
OUTCOMES = "tools.keras_conformance.outcomes"
#: where pytest starts: the stand-in for the conftest.py at the root of a Keras checkout, and no conftest of ours
ROOTDIR = os.path.join(REPO, "tools", "keras_conformance", "rootdir")

#: trainers, every callbacks test that runs offline, and the models (orbax_checkpoint_test needs orbax, which is
#: not a dependency of keras or dymem_tf; remote_monitor_test posts to localhost or a mock only)
FULL = (
    "keras.src.trainers.trainer_test",
    "keras.src.callbacks.backup_and_restore_test",
    "keras.src.callbacks.callback_test",
    "keras.src.callbacks.csv_logger_test",
    "keras.src.callbacks.early_stopping_test",
    "keras.src.callbacks.lambda_callback_test",
    "keras.src.callbacks.learning_rate_scheduler_test",
    "keras.src.callbacks.model_checkpoint_test",
    "keras.src.callbacks.monitor_callback_test",
    "keras.src.callbacks.reduce_lr_on_plateau_test",
    "keras.src.callbacks.remote_monitor_test",
    "keras.src.callbacks.swap_ema_weights_test",
    "keras.src.callbacks.tensorboard_test",
    "keras.src.callbacks.terminate_on_nan_test",
    "keras.src.models.model_test",
    "keras.src.models.functional_test",
    "keras.src.models.sequential_test",
)
#: what a module imports beyond keras and tensorflow
NEEDS = {"keras.src.trainers.trainer_test": "jax"}
#: what tests/test_keras_conformance.py runs: the callbacks the issue found broken, and functional models
QUICK = (
    "keras.src.callbacks.tensorboard_test",
    "keras.src.callbacks.swap_ema_weights_test",
    "keras.src.callbacks.model_checkpoint_test",
    "keras.src.callbacks.early_stopping_test",
    "keras.src.models.functional_test",
)


def run_pytest(modules, out: str, inject: bool, record: str | None, timeout: float) -> tuple[int, str]:
    """One pytest process over ``modules``; returns its exit status and the tail of its output."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    paths = [REPO, ROOTDIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ROOTDIR,
           # Keras's tests, not ours: no ini file of this project (its testpaths and markers do not apply)
           "-c", os.devnull,
           "-p", OUTCOMES, f"--outcomes={out}", "--pyargs", *modules]
    if inject:
        cmd[3:3] = ["-p", PLUGIN] + ([f"--dymem-record={record}"] if record else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOTDIR, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        text = err.stdout or b""
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        return -1, f"timed out after {timeout:.0f} s\n{text[-3000:]}"
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def outcomes(path: str) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` as :mod:`tools.keras_conformance.outcomes` wrote it."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fit_rows(record: str) -> list[dict]:
    if not os.path.exists(record):
        return []
    with open(record, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def fits_of(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "test" in row]


#: kinds of ``callback.skipped`` where the step has nothing to plan: without gradient ops no feature map is kept for
#: a backward pass, so the best plan is empty (counted apart from the steps the pass could not plan)
NOTHING_TO_PLAN = frozenset({"no-gradients"})


def summarize(plain: dict, injected: dict, fits: list[dict]) -> dict:
    regressions = sorted(t for t, o in plain.items() if o == "passed" and injected.get(t, "missing") != "passed")
    skipped_reasons = collections.Counter(kind for row in fits for kind in row["skipped"]
                                          if kind not in NOTHING_TO_PLAN)
    nothing = collections.Counter(kind for row in fits for kind in row["skipped"] if kind in NOTHING_TO_PLAN)
    by_test = collections.Counter((kind, row["test"]) for row in fits for kind in row["skipped"])
    unmodified = [row for row in fits if not row["swapped"]]
    why = collections.Counter(_why_not_swapped(row) for row in unmodified)
    return {
        "plain": {"run": len(plain), "passed": sum(o == "passed" for o in plain.values()),
                  "failed": sum(o == "failed" for o in plain.values()),
                  "skipped": sum(o == "skipped" for o in plain.values())},
        "injected": {"run": len(injected), "passed": sum(o == "passed" for o in injected.values()),
                     "failed": sum(o == "failed" for o in injected.values()),
                     "skipped": sum(o == "skipped" for o in injected.values())},
        "fail_only_with_callback": regressions,
        "pass_only_with_callback": sorted(t for t, o in injected.items()
                                          if o == "passed" and plain.get(t) == "failed"),
        "fail_both_ways": sorted(t for t, o in plain.items() if o == "failed" and injected.get(t) == "failed"),
        "fits": {"injected": len(fits), "swapped": sum(row["swapped"] for row in fits),
                 "raised": sum(bool(row["raised"]) for row in fits)},
        "fits_not_swapped_by_cause": dict(why.most_common()),
        "traces_unmodified_by_reason": dict(skipped_reasons.most_common()),
        "traces_nothing_to_plan": dict(nothing.most_common()),
        # one row per (reason, test): the traces of that test's injected fits the pass left unmodified
        "traces_unmodified_by_test": [{"reason": kind, "test": test, "traces": n}
                                      for (kind, test), n in sorted(by_test.items(), key=_by_reason_and_test)],
        "fits_not_swapped": [{"test": row["test"], "cause": _why_not_swapped(row),
                              "reasons": row.get("skipped_reasons", [])} for row in unmodified],
    }


def _by_reason_and_test(item) -> tuple:
    (kind, test), _ = item
    return (kind in NOTHING_TO_PLAN, kind, test or "")


def _why_not_swapped(row: dict) -> str:
    if row["eager"]:
        return "run_eagerly (no graph to rewrite)"
    unplanned = sorted(set(row["skipped"]) - NOTHING_TO_PLAN)
    if unplanned:
        return "left unmodified: " + ", ".join(unplanned)
    if row["skipped"]:
        return "nothing to plan: " + ", ".join(sorted(set(row["skipped"]))) + " (no backward pass)"
    if row["traces"]:
        return "planned, no swap worth making"
    if row["raised"]:
        return f"fit raised {row['raised']} before a step was traced"
    return "no train step traced (no batches, or epochs <= initial_epoch)"


def report(summary: dict, seconds: dict) -> str:
    p, i, f = summary["plain"], summary["injected"], summary["fits"]
    lines = [
        f"modules: {len(summary['modules'])}; dymem_tf from {summary['dymem_tf']}",
        f"without the callback: {p['run']} tests, {p['passed']} passed, {p['failed']} failed, "
        f"{p['skipped']} skipped ({seconds['plain']:.0f} s)",
        f"with the callback:    {i['run']} tests, {i['passed']} passed, {i['failed']} failed, "
        f"{i['skipped']} skipped ({seconds['injected']:.0f} s)",
        f"injected fits: {f['injected']}, swapped: {f['swapped']}, raised (as the test expects or not): {f['raised']}",
    ]
    if summary["fits_not_swapped_by_cause"]:
        lines.append("fits that did not swap, by cause:")
        lines += [f"  {n:4d}  {cause}" for cause, n in summary["fits_not_swapped_by_cause"].items()]
    reasons, nothing = summary["traces_unmodified_by_reason"], summary["traces_nothing_to_plan"]
    lines.append("traces left unmodified, by reason: "
                 + (", ".join(f"{kind} {n}" for kind, n in reasons.items()) if reasons else "none")
                 + "; with nothing to plan: "
                 + (", ".join(f"{kind} {n}" for kind, n in nothing.items()) if nothing else "none"))
    if summary["traces_unmodified_by_test"]:
        lines.append("traces left unmodified (or with nothing to plan), by test:")
        lines += [f"  {row['reason']:<14} {row['traces']:2d}  {row['test']}"
                  for row in summary["traces_unmodified_by_test"]]
    if summary["fail_both_ways"]:
        lines.append(f"failing both ways (not the callback's doing): {len(summary['fail_both_ways'])}")
        lines += [f"  {t}" for t in summary["fail_both_ways"]]
    if summary["pass_only_with_callback"]:
        lines.append("passing only with the callback:")
        lines += [f"  {t}" for t in summary["pass_only_with_callback"]]
    bad = summary["fail_only_with_callback"]
    lines.append(f"FAIL: {len(bad)} tests pass without the callback and fail with it:" if bad
                 else "OK: no test fails only with the callback")
    lines += [f"  {t}" for t in bad]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.keras_conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the quick set ({len(QUICK)} modules) instead of "
                        f"the full one ({len(FULL)})")
    parser.add_argument("--module", action="append", default=None,
                        help="a Keras test module to run instead of a set (repeatable)")
    parser.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds each pytest run may take")
    args = parser.parse_args(argv)
    modules = tuple(args.module) if args.module else (QUICK if args.quick else FULL)
    missing = [f"{name} (for {module})" for module, name in NEEDS.items()
               if module in modules and importlib.util.find_spec(name) is None]
    if missing:
        print(f"not installed: {', '.join(missing)}; `make keras-conformance` installs it", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="keras-conformance-") as tmp:
        results, seconds = {}, {}
        record = os.path.join(tmp, "fits.jsonl")
        for way, inject in (("plain", False), ("injected", True)):
            out = os.path.join(tmp, f"{way}.json")
            start = time.monotonic()
            rc, tail = run_pytest(modules, out, inject, record if inject else None, args.timeout)
            seconds[way] = time.monotonic() - start
            results[way] = outcomes(out)
            if not results[way]:
                print(f"the {way} run produced no test results (pytest exit status {rc}):\n{tail}", file=sys.stderr)
                return 1
        rows = fit_rows(record)
        summary = summarize(results["plain"], results["injected"], fits_of(rows))
    summary["modules"] = list(modules)
    summary["dymem_tf"] = next((row["dymem_tf"] for row in rows if "dymem_tf" in row), None)
    summary["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    print(report(summary, seconds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 1 if summary["fail_only_with_callback"] else 0


if __name__ == "__main__":
    sys.exit(main())
