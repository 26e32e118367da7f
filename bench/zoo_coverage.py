"""Every ``keras.applications`` model through the dry run and the pass: planned or why not, swaps, peaks, times.

    python bench/zoo_coverage.py --json docs/zoo_coverage.json --write     # all 40 models, one interpreter each
    python bench/zoo_coverage.py --models mobilenet,resnet50               # a quick look, writes nothing
    python bench/zoo_coverage.py --models densenet201 --dry-run-only --pythonpath ../old   # another checkout's dry run

Each model (random weights, SGD with momentum, batch 4, oneDNN off as in the other pass benchmarks) is built at the
smallest of ``--sizes`` it accepts (64 px, else 96, ...) and runs in a fresh interpreter (Keras keeps models alive),
under ``--timeout``:

* *dry run*: ``dymem_tf.dry_run(model, batch_size=4, memory_budget=None)`` end to end, the first thing the
  interpreter does after building the model (what ``dymem plan`` costs a user);
* *pass*: the step traced again, and the callback's pass run on the instantiated graph as ``DymemCallback(
  memory_budget=None)`` runs it (reading, capturing, planning and the C++ rewrite; the step is then cancelled):
  ``TraceRecord.pass_seconds``, the time ``bench/pass_time.py`` and ``bench/pass_scaling.py`` report;
* *planned*: whether the least-memory plan (the first step's probe under a budget) was made of that trace, or the
  kind and reason of the skip; its swaps and its predicted peak against the plain plan's (``policy="none"``);
* *TF s*: of the second trace, the seconds until TensorFlow offered the instantiated graph (Keras' trace of the
  step and TensorFlow's optimization of it, Grappler included): the part of a dry run that is not Dymem's.

``--dry-run-only`` times the dry run alone (``dry_run``'s API is the same in older checkouts, which
``--pythonpath DIR`` runs the children against); ``--optimizer adam`` compiles with Adam instead of SGD. With
``--json`` the results are saved (``--merge`` keeps the entries of models not run); with ``--write`` the
"Model zoo coverage" section of docs/benchmarks.md is written between its markers. ``--from-json`` renders the
section of saved results without running anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- zoo-coverage:begin -->", "<!-- zoo-coverage:end -->"
SIZES = (64, 96, 128, 160, 224, 299, 331)  # image sizes tried in order: the smallest a model builds at is used
BATCH = 4
PASS_TARGET_S = 3.0  # the bound on a pass
DRY_TARGET = 3.0  # the bound on a dry run, in passes


def build_smallest(name: str, sizes=SIZES, optimizer: str = "sgd"):
    """``(model, size, refused)``: the compiled model at the smallest of ``sizes`` it builds at (None when none),
    and why each smaller size was refused; compiled with SGD with momentum, or Adam (``optimizer="adam"``)."""
    import keras

    from dymem_tf.keras import dry_run

    refused = {}
    for size in sizes:
        try:
            model = dry_run.build_model(name, size)
            if optimizer == "adam":
                model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
            return model, size, refused
        except Exception as err:  # pylint: disable=broad-except  (a size the model refuses: try the next)
            refused[size] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return None, None, refused


def measure_model(name: str, sizes=SIZES, batch: int = BATCH, optimizer: str = "sgd",
                  dry_run_only: bool = False) -> dict:
    """Everything the table reports of one model, in this interpreter (see the module docstring); only the dry
    run's time with ``dry_run_only``."""
    import keras

    keras.utils.set_random_seed(0)
    model, size, refused = build_smallest(name, sizes, optimizer)
    out: dict = {"model": name, "image_size": size, "batch": batch, "optimizer": optimizer, "refused_sizes": refused}
    if model is None:
        out.update(planned=False, why="no size builds")
        return out
    out.update(time_dry_run(model, batch))
    if not dry_run_only:
        out.update(time_pass_and_plans(model, batch))
    out["load"] = round(os.getloadavg()[0], 1)  # the machine's 1-minute load average as the model finished
    return out


def time_dry_run(model, batch: int) -> dict:
    """``dymem_tf.dry_run(model, batch, memory_budget=None)`` end to end: its seconds and swaps, or its error."""
    import dymem_tf

    started = time.perf_counter()
    try:
        plan = dymem_tf.dry_run(model, batch_size=batch, memory_budget=None)
    except ValueError as err:  # a step the callback leaves unmodified, a refusal
        return {"dry_run_s": round(time.perf_counter() - started, 2), "dry_run_error": _short(err)}
    return {"dry_run_s": round(time.perf_counter() - started, 2), "dry_run_swaps": len(plan.swaps)}


def time_pass_and_plans(model, batch: int) -> dict:
    """Trace the step again with the callback's pass (``memory_budget=None``) run on it, then make the least-memory
    and the plain plan of the same trace."""
    from dymem_tf.keras import dry_run, variables
    from dymem_tf.keras.config import DymemConfig
    from dymem_tf.passes import caches, step_pass
    from dymem_tf.planning import pipeline

    settings = DymemConfig.from_arguments(None, verbose=0).plan_settings()
    pass_ = step_pass.StepPass(settings, verbose=0, plans=caches.PlanCache())  # its own cache: nothing cached
    variables.build_optimizer(model)  # as the callback does before its first step (the dry run did already)
    request = step_pass.PlanRequest(default_batch_size=batch, persistent_bytes=variables.persistent_bytes(model))
    collected, offered = step_pass.ArmedCall(), {}

    def the_pass(call):
        offered["at"] = time.perf_counter()
        pass_(call, request, collected)
        offered["pass_wall_s"] = time.perf_counter() - offered["at"]

    started = time.perf_counter()
    traced = dry_run.trace_train_step(model, batch, also=the_pass)
    out = {"ops": traced.num_ops, "trace_s": round(time.perf_counter() - started, 2),
           "tf_s": round(offered["at"] - started, 2) if "at" in offered else None}
    collected.close()
    if collected.records:
        record = collected.records[0]
        out.update(pass_s=round(record.pass_seconds, 3), pass_stages=record.stage_times.as_dict(),
                   pass_swaps=len(record.plan.swaps), layers=record.step_graph.num_layers)
    if collected.skipped:
        out["pass_skipped"] = f"{collected.skipped[0].kind}: {collected.skipped[0].reason}"
    request = step_pass.PlanRequest(persistent_bytes=traced.persistent_bytes, default_batch_size=batch)
    # the probe's request: the pass plans least memory for it (it sets least_memory from the request, not settings)
    least = _plan(traced, pipeline.PlanSettings(), dataclasses.replace(request, probe=True))
    plain = _plan(traced, pipeline.PlanSettings(policy="none"), request)
    out["planned"] = not isinstance(least, str)
    if out["planned"]:
        out.update(swaps=len(least.swaps), least_peak=least.predicted.peak_bytes)
    else:
        out["why"] = traced.unsupported or least
    if not isinstance(plain, str):
        out["plain_peak"] = plain.predicted.peak_bytes
    return out


def _plan(traced, settings, request):
    """The plan of ``traced`` with ``settings``, or why there is none (a string)."""
    from dymem_tf.keras import dry_run

    try:
        return dry_run.plan_traced(traced, settings, request)
    except ValueError as err:  # left unmodified, or refused
        return _short(err)


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}"


def run(args) -> dict:
    """Every model in a fresh interpreter, one after another: ``{name: result}`` (an ``error`` where the child
    failed or ran past ``--timeout``)."""
    results = {}
    env = dict(os.environ)
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.pythonpath, env.get("PYTHONPATH")]))
    for name in args.models:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--sizes", ",".join(map(str, args.sizes)),
               "--optimizer", args.optimizer] + (["--dry-run-only"] if args.dry_run_only else [])
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results[name] = {"model": name, "error": f"timed out after {args.timeout} s"}
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                results[name] = {"model": name, "error": f"exit {proc.returncode}: {tail[0][:300]}"}
            else:
                results[name] = json.loads(lines[-1])
        results[name]["child_s"] = round(time.perf_counter() - started, 1)
        print(name, json.dumps(results[name])[:600], flush=True)
        if args.json:  # after every model: a long run interrupted keeps what it measured
            save(args, results)
    return results


def save(args, results: dict) -> None:
    """Write ``results`` to ``--json`` (with ``--merge``, over the entries already there)."""
    models = dict(load(args.json).get("models", {})) if args.merge and os.path.exists(args.json) else {}
    models.update(results)
    payload = {"command": "python bench/zoo_coverage.py " + " ".join(args.argv), "commit": args.commit,
               "batch": BATCH, "sizes": list(args.sizes), "optimizer": args.optimizer, "models": models}
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1)


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def row(entry: dict) -> str:
    """One table row of a model's result."""
    name = entry["model"]
    if "error" in entry:
        return f"| {name} | - | - | error: {_why(entry['error'])} | - | - | - | - | - | - | - | - |"
    least, plain = entry.get("least_peak"), entry.get("plain_peak")
    ratio = f"{least / plain:.2f}" if least and plain else "-"
    planned = "-" if "planned" not in entry else "yes" if entry["planned"] else f"no: {_why(entry.get('why', ''))}"
    pass_s, dry_s = entry.get("pass_s"), entry.get("dry_run_s")
    dry_per_pass = f"{dry_s / pass_s:.1f}x" if pass_s and dry_s else "-"
    ops = f"{entry['ops']:,}" if entry.get("ops") else "-"
    cells = [name, entry.get("image_size") or "-", ops, planned, entry.get("swaps", "-"),
             f"{_mib(least)} / {_mib(plain)}", ratio, _seconds(pass_s, 2), _seconds(dry_s, 1), dry_per_pass,
             _seconds(entry.get("tf_s"), 1), _seconds(entry.get("trace_s"), 1)]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _seconds(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _why(text: str, limit: int = 90) -> str:
    """The skip's kind and the start of its reason, fit for a table cell."""
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def report(payload: dict, seconds: float | None = None) -> str:
    """The markdown section for docs/benchmarks.md from saved results (:func:`save`'s payload)."""
    models = payload.get("models", {})
    entries = sorted(models.values(), key=lambda e: (e.get("ops") or 0, e["model"]))
    took = f" ({seconds / 60:.1f} min)" if seconds else ""
    optimizer = "Adam" if payload.get("optimizer") == "adam" else "SGD with momentum"
    command = payload.get("command", "python bench/zoo_coverage.py")
    lines = [BEGIN, "## Model zoo coverage: every `keras.applications` model, dry run and pass (measured on the CPU)",
             "", f"`{command}` at commit {payload.get('commit') or '?'} on this 2-core CPU machine{took}. Random "
             f"weights, {optimizer}, batch {payload.get('batch', BATCH)}, oneDNN off, one fresh interpreter per "
             "model, at the smallest image size each model builds at "
             f"({', '.join(map(str, payload.get('sizes', SIZES)))}). *planned*: the least-memory plan was made (else "
             "why not); *swaps*: its tensors swapped; *peaks*: its predicted peak / the plain plan's, MiB; *pass s*: "
             "`TraceRecord.pass_seconds` of the callback's pass without a budget; *dry run s*: `dymem_tf.dry_run("
             "model, batch_size=4, memory_budget=None)` end to end, first in its interpreter; *TF s*: Keras' trace "
             "and TensorFlow's optimization of the step before the graph reaches the pass (in a second trace); "
             "*trace s*: that second trace in all.", "",
             "| model | px | ops | planned | swaps | least / plain peak MiB | ratio | pass s | dry run s | "
             "dry / pass | TF s | trace s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [row(e) for e in entries]
    lines += ["", summary(entries), "", "Raw results: [docs/zoo_coverage.json](zoo_coverage.json).", END]
    return "\n".join(lines)


def summary(entries: list) -> str:
    """The sentence under the table: how many planned, and the targets (passes within 3 s, dry runs within 3x)."""
    done = [e for e in entries if "error" not in e]
    planned = [e for e in done if e.get("planned")]
    slow = [e["model"] for e in done if e.get("pass_s") is not None and e["pass_s"] > PASS_TARGET_S]
    dry = [e["dry_run_s"] / e["pass_s"] for e in done if e.get("pass_s") and e.get("dry_run_s")]
    tf = [e["tf_s"] / e["dry_run_s"] for e in done if e.get("tf_s") and e.get("dry_run_s")]
    text = f"{len(planned)} of {len(entries)} models planned"
    failed = [e["model"] for e in entries if "error" in e]
    if failed:
        text += f" ({len(failed)} did not finish: {', '.join(failed)})"
    text += (f"; passes over {PASS_TARGET_S:.0f} s: {', '.join(slow) if slow else 'none'}")
    if dry:
        within = sum(r <= DRY_TARGET for r in dry)
        text += (f"; dry run / pass: median {statistics.median(dry):.1f}x, {min(dry):.1f}x to {max(dry):.1f}x "
                 f"({within} of {len(dry)} within {DRY_TARGET:.0f}x)")
    if tf:
        text += f"; TensorFlow's trace and optimization are a median {statistics.median(tf):.0%} of a dry run's time"
    loads = [e["load"] for e in done if e.get("load") is not None]
    if loads:
        text += (f"; 1-minute load average as each model finished: {min(loads):.1f} to {max(loads):.1f} "
                 f"(median {statistics.median(loads):.1f})")
    return text + "."


def write_section(section: str) -> None:
    """Put ``section`` between the markers in docs/benchmarks.md (after the pass-time section when absent)."""
    path = os.path.join(REPO, "docs", "benchmarks.md")
    text = open(path, encoding="utf-8").read()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        anchor = "<!-- pass-time:end -->"
        at = text.index(anchor) + len(anchor) if anchor in text else len(text)
        text = text[:at] + "\n\n" + section + text[at:]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _commit() -> str:
    """The short commit hash of the checkout ("" outside git)."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="", help="comma-separated names (default: all keras.applications)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="image sizes to try, smallest first")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per model")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--dry-run-only", action="store_true", help="time the dry run alone")
    parser.add_argument("--pythonpath", default="", help="run the children against the dymem_tf in this folder")
    parser.add_argument("--json", default="", help="save the results here (e.g. docs/zoo_coverage.json)")
    parser.add_argument("--merge", action="store_true", help="keep the --json entries of the models not run")
    parser.add_argument("--write", action="store_true", help="write the docs/benchmarks.md section")
    parser.add_argument("--from-json", default="", help="render the section of this results file; run nothing")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    if args.child:
        print(json.dumps(measure_model(args.child, args.sizes, optimizer=args.optimizer,
                                       dry_run_only=args.dry_run_only)), flush=True)
        return 0
    if args.from_json:
        section = report(load(args.from_json))
        print(section)
        if args.write:
            write_section(section)
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.models:
        args.models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    else:
        from dymem_tf.keras import dry_run

        args.models = dry_run.application_names()
    args.commit = _commit()
    started = time.perf_counter()
    results = run(args)
    payload = load(args.json) if args.json else {"command": "python bench/zoo_coverage.py " + " ".join(args.argv),
                                                "commit": args.commit, "batch": BATCH, "sizes": list(args.sizes),
                                                "optimizer": args.optimizer, "models": results}
    section = report(payload, time.perf_counter() - started)
    print(section)
    if args.write:
        write_section(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
