"""Largest batch under a device budget, trials that last: ResNet-50 at 64x64 under 512 MiB, SGD and Adam.

    python bench/largest_batch.py --write                    # both optimizers, modes plain, none, auto
    python bench/largest_batch.py --optimizers adam --modes auto --write    # one cell; adds to the saved runs
    python bench/largest_batch.py --optimizers sgd --steps 5 --samples 500  # quicker, writes nothing

Each trial is a fresh interpreter (Keras keeps every model it built alive until exit) with the GTBM device capped at
``--budget`` (oneDNN off, so running out of memory raises instead of crashing) that trains ``--steps`` steps on a
data set of ``max(--samples, batch x steps)`` NumPy samples. A batch *fits* when every step trained and every
step's measured device peak (GTBM ``peak_bytes_reserved``) stayed under the budget. A refusal
(``BudgetTooSmallError``) or an out-of-memory error is a batch that does not fit. Modes:

* ``plain``: no Dymem callback (GTBM is still the allocator, so the peak is measured the same way);
* ``none``: ``DymemCallback(memory_budget=None)``: every eligible tensor swapped, no budget;
* ``auto``: ``DymemCallback(memory_budget="auto")``: the budget is the device (the product's promise).

The search doubles from ``--start`` until a batch fails, then bisects to within ~3% of the answer. With ``--write``
the results are added to docs/largest_batch.json (per optimizer and mode) and the "Largest batch" section of
docs/benchmarks.md (between its markers) is written from everything saved there.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- largest-batch:begin -->", "<!-- largest-batch:end -->"
MODES = ("plain", "none", "auto")
OPTIMIZERS = ("sgd", "adam")
MiB = 1 << 20


def trial(batch: int, optimizer: str, mode: str, args) -> dict:
    """Run one trial in a fresh interpreter; its JSON result (``outcome`` trained / refused / oom / failed)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--batch", str(batch), "--optimizer", optimizer,
           "--mode", mode, "--steps", str(args.steps), "--samples", str(args.samples), "--image-size",
           str(args.image_size), "--budget", args.budget]
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", DYMEM_DEVICE_MEMORY_LIMIT=args.budget)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {
        "outcome": "failed", "error": " | ".join((proc.stderr or "").strip().splitlines()[-3:])}
    result.update(batch=batch, seconds=round(time.perf_counter() - t0, 1))
    return result


def late_oom(result: dict) -> bool:
    """The trial ran out of memory after at least one step had trained."""
    return result.get("outcome") == "oom" and (result.get("steps_run") or 0) > 0


def fits(result: dict, budget_bytes: int, steps: int) -> bool:
    """Trained every step with every step's measured peak under the budget."""
    return (result.get("outcome") == "trained" and result.get("steps_run") == steps
            and max(result.get("peaks") or [budget_bytes + 1]) <= budget_bytes)


def largest(optimizer: str, mode: str, args, budget_bytes: int, log) -> tuple[int, list[dict]]:
    """The largest batch that fits (0 when even ``--start`` does not), and every trial run to find it."""
    trials = []

    def ok(batch: int) -> bool:
        result = trial(batch, optimizer, mode, args)
        trials.append(result)
        good = fits(result, budget_bytes, args.steps)
        peak = max(result.get("peaks") or [0]) / MiB
        log(f"  {optimizer:4s} {mode:5s} batch {batch:4d}: {'fits' if good else result.get('outcome')} "
            f"(max step peak {peak:.0f} MiB, {result['seconds']:.0f} s)")
        return good

    return search(args.start, args.limit, ok, lambda lo: max(1, lo // 32)), trials


def search(start: int, limit: int, ok, tolerance) -> int:
    """The largest n with ``ok(n)``: double from ``start`` (up to ``limit``) until one fails, then bisect until the
    bracket is within ``tolerance(lo)``; 0 when even ``start`` fails."""
    lo, hi, n = 0, None, start
    while n <= limit:
        if not ok(n):
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        return lo
    while hi - lo > tolerance(lo):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def report(results: dict, args, seconds: float) -> str:
    """The Markdown section for docs/benchmarks.md."""
    cmd = "python bench/largest_batch.py --optimizers O --modes M --start S --write"
    lines = [BEGIN, "## Largest batch under a 512 MiB device: trials that last", "",
             f"`{cmd}`, run per optimizer and mode (the last run took {seconds / 60:.0f} min on this 2-core CPU "
             f"machine; GTBM is the emulated device, oneDNN off). ResNet-50 at {args.image_size}x{args.image_size}, device capped at {args.budget}; every trial "
             f"is a fresh process that trains {args.steps} steps on max({args.samples}, batch x {args.steps}) "
             "samples and fits when every step trained with its measured peak under the budget. *plain*: no "
             "callback; *none*: `DymemCallback(memory_budget=None)`; *auto*: `DymemCallback(memory_budget=\"auto\")`.",
             "", "| optimizer | plain | none | auto | auto / plain | trials | out of memory after step 1 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    late = []
    for optimizer, by_mode in results.items():
        got = {m: by_mode[m]["largest"] for m in by_mode}
        ratio = f"{got['auto'] / got['plain']:.2f}x" if got.get("plain") and "auto" in got else "-"
        n = sum(len(by_mode[m]["trials"]) for m in by_mode)
        ooms = [(m, t) for m in by_mode for t in by_mode[m]["trials"] if late_oom(t)]
        late += [(optimizer, m, t) for m, t in ooms]
        failed = ", ".join(f"{m} batch {t['batch']} (step {t['steps_run'] + 1})" for m, t in ooms) or "none"
        lines.append(f"| {optimizer} | {got.get('plain', '-')} | {got.get('none', '-')} | {got.get('auto', '-')} "
                     f"| {ratio} | {n} | {failed} |")
    starts = ", ".join(f"{o} {m} {by_mode[m].get('start', 24)}" + (f" (commit {by_mode[m]['commit']})"
                                                                      if by_mode[m].get("commit") else "")
                       for o, by_mode in results.items() for m in by_mode)
    lines += ["", f"Searches started at S = {starts}. Largest batch per mode; the trials (batch, outcome, every "
              "step's peak) are in [docs/largest_batch.json](largest_batch.json)."]
    if any(m != "plain" for _, m, _ in late):
        lines += ["", "**The budget did not hold for every run:** a trial under Dymem ran out of memory after its "
                  "first step had fitted (the last column; the step that failed). The search treats it as a batch "
                  "that does not fit, so the largest batch above is below it; the promise \"no out-of-memory error "
                  "after the first step\" is broken there."]
    lines.append(END)
    return "\n".join(lines)


def merged_results(results: dict, path: str) -> dict:
    """``results`` on top of those saved at ``path`` (per optimizer and mode), so that runs of a few modes each add
    up to one table."""
    saved = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    for optimizer, by_mode in results.items():
        saved.setdefault(optimizer, {}).update(by_mode)
    return saved


def write_docs(section: str, results: dict) -> None:
    write_section(section, BEGIN, END, results, "largest_batch.json")


def write_section(section: str, begin: str, end: str, results: dict, json_name: str) -> None:
    """Put ``section`` between ``begin`` and ``end`` in docs/benchmarks.md (appended when absent) and save
    ``results`` as docs/``json_name``."""
    path = os.path.join(REPO, "docs", "benchmarks.md")
    text = open(path, encoding="utf-8").read()
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    with open(os.path.join(REPO, "docs", json_name), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--start", type=int, default=16, help="first batch tried")
    parser.add_argument("--limit", type=int, default=1024, help="largest batch tried")
    parser.add_argument("--write", action="store_true",
                        help="add the results to docs/largest_batch.json and write the docs section from all saved")
    # one trial (internal)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    from dymem_tf.units import parse_bytes

    optimizers = [o.strip() for o in args.optimizers.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    for value, allowed, flag in ((optimizers, OPTIMIZERS, "--optimizers"), (modes, MODES, "--modes")):
        bad = [v for v in value if v not in allowed]
        if bad:
            parser.error(f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    budget_bytes = parse_bytes(args.budget)
    t0 = time.perf_counter()
    results: dict = {}
    for optimizer in optimizers:
        results[optimizer] = {}
        for mode in modes:
            print(f"ResNet-50 {args.image_size}px, {optimizer}, mode {mode}, device {args.budget}:", flush=True)
            best, trials = largest(optimizer, mode, args, budget_bytes, lambda s: print(s, flush=True))
            results[optimizer][mode] = {"largest": best, "trials": trials, "start": args.start,
                                        "commit": _commit()}
    seconds = time.perf_counter() - t0
    if args.write:  # add to the saved runs (same settings), then render them all
        results = merged_results(results, os.path.join(REPO, "docs", "largest_batch.json"))
    section = report(results, args, seconds)
    print(section)
    if args.write:
        write_docs(section, results)
    return 0


def _commit() -> str:
    """The short commit hash of the checkout ("" outside git)."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def run_child(args) -> dict:
    """One trial in this fresh interpreter (see the module docstring)."""
    import dymem_tf
    import keras

    sys.path.insert(0, HERE)
    from model_zoo import _application, _sgd

    keras.utils.set_random_seed(0)
    optimizer = _sgd if args.optimizer == "sgd" else (lambda: keras.optimizers.Adam(1e-3))
    samples = max(args.samples, args.batch * args.steps)
    model, x, y = _application("ResNet50", args.image_size, optimizer)(args.batch, samples, 0)

    callback = None if args.mode == "plain" else dymem_tf.DymemCallback(
        memory_budget="auto" if args.mode == "auto" else None, verbose=0)
    result = measured_fit(model, x, y, args.batch, args.steps, callback)
    result["samples"] = samples
    return result


def measured_fit(model, x, y, batch: int, steps: int, callback=None) -> dict:
    """Train ``steps`` steps (with ``callback`` when given) and record every step's device peak: ``outcome``
    trained / refused / oom, ``steps_run``, ``peaks`` and the error's first line."""
    import tensorflow as tf

    import dymem_tf

    sys.path.insert(0, HERE)
    from model_zoo import StepPeaks

    from dymem_tf.memory import allocator

    peaks = StepPeaks()
    callbacks = [peaks] if callback is None else [callback, peaks]
    result = {"outcome": "trained"}
    try:
        model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                  callbacks=callbacks)
    except dymem_tf.BudgetTooSmallError as err:
        result.update(outcome="refused", error=str(err)[:300])
    except tf.errors.ResourceExhaustedError as err:
        result.update(outcome="oom", error=(err.message or "").splitlines()[0][:200])
    overflow = allocator.memory_stats()["overflow_to_host_bytes"]
    if overflow and result["outcome"] == "trained":
        # the device refused memory that TF cannot do without (a tensor from a Python value, e.g. the model's
        # initial weights) and GTBM served it from host memory: a device of this budget would not have held it
        result.update(outcome="overflow", error=f"{overflow} bytes the device refused were served from host memory")
    result.update(steps_run=len(peaks.peaks), peaks=peaks.peaks, overflow_to_host_bytes=overflow)
    return result

if __name__ == "__main__":
    sys.exit(main())
