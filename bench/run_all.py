"""The benchmark suite: writes docs/benchmarks.md, docs/benchmarks.json and docs/img/bench_*.png.

    python bench/run_all.py            # full: 4 models x 4 policies, 2 rounds, ~30 min on 2 cores (make bench)
    python bench/run_all.py --quick    # 2 models, 1 round, coarse searches: a few minutes (make bench-quick)

Sections (every number in the generated file comes from the run that wrote it):

1. ``matrix``   measured, CPU: {vgg16, resnet50, densenet121, inception_v3} x {none, vdnn, tflms, dymem}, each in a
   fresh process (``examples/common.run_in_subprocess``): device peak, reserved pool, reserved overhead, host peak,
   step time relative to ``none`` measured interleaved (policy order rotated every round, median of the rounds).
2. ``bfc``      measured, CPU: the ``none`` run once more on TensorFlow's BFC allocator
   (``TF_CPU_ALLOCATOR_USE_BFC=true DYMEM_GTBM=0``) against GTBM's peak reserved.
3. ``maxbatch`` measured, CPU: largest ResNet-50 batch under a 512 MiB budget, no Dymem vs ``memory_budget="auto"``.
   Full mode reads the searches of ``bench/largest_batch.py`` (docs/largest_batch.json: trials of 20 steps on
   2,000+ samples, 15+ min per search, run separately); ``--quick`` runs 2-3 two-step trials per policy around an
   estimate (``examples/find_max_batch``), which a run that lasts may not confirm.
4. ``modelled`` simulator, h200 profile: ``dry_run.trace_train_step`` + ``plan_all``; no training.
5. ``replay``   GTBM vs best fit vs first fit vs the lower bound on traces recorded from training steps
   (``bench/record_traces.py``, cached in ``build/traces``) and on the public DSA instances.

``--sections matrix,replay`` runs a subset (the others are left out of the file, which says so);
``--render-only docs/benchmarks.json`` regenerates the markdown and plots from a saved run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

import report  # noqa: E402  (bench/report.py)


def _library_units():
    """``dymem_tf/units.py`` loaded by path: the library's byte parser without ``import dymem_tf`` (TensorFlow)."""
    spec = importlib.util.spec_from_file_location("dymem_units", os.path.join(REPO, "dymem_tf", "units.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


units = _library_units()  # budgets ("512MiB", "600MB") and TF's log sizes read exactly as dymem_tf reads them

SECTIONS = ("matrix", "bfc", "maxbatch", "traces", "modelled", "replay")
POLICIES = report.POLICIES

FULL = {
    "models": {"vgg16": {"image_size": 64, "batch": 16}, "resnet50": {"image_size": 64, "batch": 16},
               "densenet121": {"image_size": 64, "batch": 16}, "inception_v3": {"image_size": 96, "batch": 16}},
    "steps": 4, "rounds": 2,
    "bfc_models": ("vgg16", "resnet50", "inception_v3"),  # densenet121's extra run would cost ~1 min more
    "max_batch": {"model": "resnet50", "image_size": 64, "budget": "512MiB", "steps": 20,
                  "policies": ("none", "dymem"), "search": "saved", "optimizer": "sgd"},
    "traces": {"models": ("resnet50", "densenet121", "inception_v3"), "batch": 16, "warmup": 1, "steps": 2,
               "policy": "dymem"},
    "modelled": {"models": ("vgg16", "resnet50", "densenet121", "inception_v3"), "batch": 64, "profile": "h200"},
    "dsa_time_box_s": 120.0,
}
QUICK = {
    "models": {"vgg16": {"image_size": 64, "batch": 8}, "resnet50": {"image_size": 64, "batch": 8}},
    "steps": 3, "rounds": 1,
    "bfc_models": ("resnet50",),
    "max_batch": {"model": "resnet50", "image_size": 64, "budget": "512MiB", "steps": 2,
                  "policies": ("none", "dymem"), "search": "coarse"},
    "traces": {"models": ("resnet50",), "batch": 8, "warmup": 1, "steps": 2, "policy": "dymem"},
    "modelled": {"models": ("resnet50",), "batch": 64, "profile": "h200"},
    "dsa_time_box_s": 30.0,
}


# ----------------------------------------------------------------------------------------------------------------
# Progress.

class Progress:
    """One line per finished job: index, label, status, its wall time, elapsed and a rough ETA."""

    def __init__(self, total: int, stream=None):
        self.total = max(total, 1)
        self.done = 0
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stdout

    @staticmethod
    def _clock(seconds: float) -> str:
        seconds = int(max(seconds, 0))
        return f"{seconds // 60:d}:{seconds % 60:02d}"

    def add(self, n: int) -> None:
        self.total += n

    def step(self, label: str, status: str, wall_s: float) -> None:
        self.done += 1
        self.total = max(self.total, self.done)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done:>3}/{self.total}] {label:<44} {status:<8} {wall_s:6.1f}s   elapsed "
              f"{self._clock(elapsed)}  eta ~{self._clock(eta)}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        print(f"      {text}", file=self.stream, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Machine description.

def machine_info() -> dict:
    info = {"cores": os.cpu_count(), "python": platform.python_version(), "os": platform.platform(terse=True)}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        info["cpu_model"] = platform.processor() or "unknown"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal"):
                    info["memory"] = f"{int(line.split()[1]) / 2**20:.0f} GiB"
                    break
    except OSError:
        pass
    from importlib import metadata

    for pkg in ("tensorflow", "keras", "numpy", "matplotlib"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


# ----------------------------------------------------------------------------------------------------------------
# Sections.

def _run_args(model_cfg: dict, steps: int, budget=None) -> types.SimpleNamespace:
    return types.SimpleNamespace(batch=model_cfg["batch"], image_size=model_cfg["image_size"], steps=steps,
                                 classes=10, seed=0, budget=budget, profile=None, deterministic=False)


def _quietly(fn, *args, **kwargs):
    """Call ``fn`` with its stdout (the ``$ command`` echo of run_in_subprocess) swallowed."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


def run_matrix(cfg: dict, progress: Progress, save) -> dict:
    import common

    models = cfg["models"]
    out = {"config": {"models": models, "steps": cfg["steps"], "rounds": cfg["rounds"], "policies": list(POLICIES)},
           "runs": []}
    for rnd in range(cfg["rounds"]):
        order = list(POLICIES[rnd % len(POLICIES):]) + list(POLICIES[:rnd % len(POLICIES)])
        for model, mcfg in models.items():
            for policy in order:
                t0 = time.perf_counter()
                summary = _quietly(common.run_in_subprocess, model, _run_args(mcfg, cfg["steps"]), policy)
                wall = time.perf_counter() - t0
                summary.update(round=rnd, wall_s=wall)
                out["runs"].append(summary)
                detail = summary.get("status")
                if summary.get("status") == "ok" and summary.get("peak_bytes_in_use"):
                    detail = "ok"
                    progress.step(f"{model} {policy} (round {rnd + 1})", detail, wall)
                    progress.note(f"peak {report.mib(summary['peak_bytes_in_use'])} MiB, reserved "
                                  f"{report.mib(summary.get('peak_bytes_reserved'))} MiB, step "
                                  f"{summary.get('step_time_s') or 0:.3f}s")
                else:
                    progress.step(f"{model} {policy} (round {rnd + 1})", str(detail), wall)
                    progress.note(str(summary.get("error", ""))[:200])
                save()
    return out


_BFC_TOTAL_RE = re.compile(r"Total allocated bytes:\s*([0-9.]+\s*[KMGT]?i?B)\b")


def parse_bfc_pool_bytes(log_text: str) -> int | None:
    """The last ``Total allocated bytes: 510.00MiB`` that TF's bfc_allocator.cc logs (VLOG 1), in bytes."""
    sizes = _BFC_TOTAL_RE.findall(log_text)
    return units.parse_bytes(sizes[-1]) if sizes else None


def run_bfc(cfg: dict, matrix: dict | None, progress: Progress, save) -> dict:
    import common

    out = {"runs": []}
    summary = report.summarize_matrix(matrix) if matrix else {}
    for model in cfg["bfc_models"]:
        mcfg = cfg["models"].get(model) or FULL["models"][model]
        args = _run_args(mcfg, cfg["steps"])
        gtbm = summary.get(model, {}).get("none")
        if not gtbm or not gtbm.get("peak_bytes_reserved"):
            t0 = time.perf_counter()
            g = _quietly(common.run_in_subprocess, model, args, "none")
            progress.step(f"{model} none (GTBM, for BFC)", g.get("status", "?"), time.perf_counter() - t0)
            gtbm = g if g.get("status") == "ok" else None
        env = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "DYMEM_GTBM": "0", "TF_CPP_MIN_LOG_LEVEL": "0",
               "TF_CPP_VMODULE": "bfc_allocator=1"}
        b, pool, wall = _run_on_bfc(common, model, args, "none", env)
        # the paper's system-level comparison: vDNN's schedule on TF's allocator against Dymem's on GTBM
        v, vpool, vwall = _run_on_bfc(common, model, args, "vdnn", env)
        progress.step(f"{model} vdnn (TF BFC allocator)", v.get("status", "?"), vwall)
        dymem = summary.get(model, {}).get("dymem") or {}
        if not dymem.get("peak_bytes_reserved"):  # section 1 did not run in this invocation: measure it here
            t0 = time.perf_counter()
            dymem = _quietly(common.run_in_subprocess, model, args, "dymem")
            progress.step(f"{model} dymem (GTBM, for the whole-systems row)", dymem.get("status", "?"),
                          time.perf_counter() - t0)
        row = {"model": model, "batch": mcfg["batch"], "image_size": mcfg["image_size"],
               "status": "ok" if b.get("status") == "ok" and gtbm else (b.get("status") or "failed"),
               "error": b.get("error", ""), "allocator": b.get("allocator"),
               "gtbm": None if not gtbm else {k: gtbm.get(k) for k in ("peak_bytes_in_use", "peak_bytes_reserved")},
               "bfc": {"peak_bytes_in_use": b.get("peak_bytes_in_use"), "pool_bytes": pool,
                       "step_time_s": b.get("step_time_s")},
               "bfc_vdnn": {"status": v.get("status"), "peak_bytes_in_use": v.get("peak_bytes_in_use"),
                            "pool_bytes": vpool},
               "gtbm_dymem": {k: dymem.get(k) for k in ("peak_bytes_in_use", "peak_bytes_reserved")}}
        if b.get("status") == "ok" and b.get("allocator") != "tf_bfc":
            row["status"] = "failed"
            row["error"] = f"the run did not use TF's BFC allocator (allocator: {b.get('allocator')})"
        out["runs"].append(row)
        progress.step(f"{model} none (TF BFC allocator)", row["status"], wall)
        progress.note(f"BFC peak in use {report.mib(b.get('peak_bytes_in_use'))} MiB, pool {report.mib(pool)} MiB; "
                      f"GTBM peak reserved {report.mib((gtbm or {}).get('peak_bytes_reserved'))} MiB")
        save()
    return out


def _run_on_bfc(common, model: str, args, policy: str, env: dict) -> tuple[dict, int | None, float]:
    """One run of ``policy`` on TF's BFC allocator: its summary, BFC's pool bytes (from its log) and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "stderr.txt")
        t0 = time.perf_counter()
        out = _quietly(common.run_in_subprocess, model, args, policy, extra_env=env, stderr_path=log)
        wall = time.perf_counter() - t0
        with open(log) as fh:
            pool = parse_bfc_pool_bytes(fh.read())
    return out, pool, wall


def estimate_max_batch(summary: dict | None, budget_bytes: int) -> int | None:
    """Largest batch a measured run's per-sample memory suggests for ``budget_bytes`` (None without data)."""
    if not summary or not summary.get("peak_bytes_in_use") or not summary.get("batch"):
        return None
    persistent = summary.get("persistent_bytes") or 0
    per_sample = (summary["peak_bytes_in_use"] - persistent) / summary["batch"]
    if per_sample <= 0 or budget_bytes <= persistent:
        return None
    return max(1, int((budget_bytes - persistent) / per_sample))


#: What bench/largest_batch.py writes: per optimizer, per mode, the largest batch and every trial.
LARGEST_BATCH_JSON = os.path.join(REPO, "docs", "largest_batch.json")


def saved_max_batch(cfg: dict, path: str = LARGEST_BATCH_JSON) -> dict:
    """Section 3 from ``bench/largest_batch.py``'s saved searches (``cfg["max_batch"]["optimizer"]``, modes *plain*
    and *auto*) in this section's shape: *none* is no Dymem, *dymem* is ``memory_budget="auto"``."""
    mb = cfg["max_batch"]
    out = {"model": mb["model"], "image_size": mb["image_size"], "budget": mb["budget"], "steps": mb["steps"],
           "policies": {}, "source": f"bench/largest_batch.py --optimizers {mb['optimizer']} ({os.path.relpath(path, REPO)})"}
    try:
        with open(path) as fh:
            saved = json.load(fh).get(mb["optimizer"], {})
    except (OSError, ValueError) as err:
        out["error"] = f"no saved searches: {err}"
        return out
    for policy, mode in (("none", "plain"), ("dymem", "auto")):
        search = saved.get(mode)
        if not search:
            continue
        budget = units.parse_bytes(mb["budget"])
        trials = [(t["batch"], t.get("outcome") == "trained" and t.get("steps_run") == mb["steps"]
                   and max(t.get("peaks") or [budget + 1]) <= budget) for t in search.get("trials", [])]
        how = f"largest_batch.py --modes {mode}" + (f" at commit {search['commit']}" if search.get("commit") else "")
        out["policies"][policy] = {"max_batch": search.get("largest"), "exact": True, "trials": trials, "how": how}
    out["search"] = out["source"]
    return out


def run_max_batch(cfg: dict, matrix: dict | None, progress: Progress, save) -> dict:
    import find_max_batch

    mb = cfg["max_batch"]
    if mb["search"] == "saved":
        out = saved_max_batch(cfg)
        progress.note(f"section 3 read from {out['source']}")
        return out
    budget_bytes = units.parse_bytes(mb["budget"])
    summary = report.summarize_matrix(matrix) if matrix else {}
    out = {"model": mb["model"], "image_size": mb["image_size"], "budget": mb["budget"], "steps": mb["steps"],
           "policies": {}}
    trials: list[tuple[int, bool]] = []
    original_fits = find_max_batch.fits

    def recording_fits(model, batch, args):
        t0 = time.perf_counter()
        ok = _quietly(original_fits, model, batch, args)
        trials.append((batch, ok))
        progress.step(f"{model} {args.policy} batch {batch} under {mb['budget']}", "fits" if ok else "no",
                      time.perf_counter() - t0)
        save()
        return ok

    find_max_batch.fits = recording_fits
    try:
        for policy in mb["policies"]:
            trials.clear()
            ns = types.SimpleNamespace(image_size=mb["image_size"], steps=mb["steps"], budget=mb["budget"],
                                       profile=None, policy=policy)
            model_sum = summary.get(mb["model"], {}).get(policy)
            same_size = model_sum and model_sum.get("image_size") == mb["image_size"]
            est = estimate_max_batch(model_sum if same_size else None, budget_bytes)
            if mb["search"] == "bisect":
                start = max(1, int(est * 0.85)) if est else 16
                value = find_max_batch.max_batch(mb["model"], ns, start=start, limit=4096)
                exact = True
                how = f"find_max_batch.max_batch from {start}"
            else:
                cands = sorted({max(1, int(est * f)) for f in (1.0, 1.4, 1.96)}) if est else [8, 16, 32]
                value, exact = 0, False
                for c in cands:
                    if recording_fits(mb["model"], c, ns):
                        value = c
                    else:
                        break
                if value == 0 and cands[0] > 1:  # even the smallest guess failed: one step down
                    half = cands[0] // 2
                    cands.append(half)
                    if recording_fits(mb["model"], half, ns):
                        value = half
                how = f"coarse: tried {', '.join(map(str, cands))} upwards, stopping at the first that does not fit"
            out["policies"][policy] = {"max_batch": value, "exact": exact, "trials": list(trials),
                                       "estimate": est, "how": how}
            progress.note(f"{policy}: largest batch {'' if exact else '>= '}{value} ({how})")
    finally:
        find_max_batch.fits = original_fits
    searches = {p["how"] for p in out["policies"].values()}
    out["search"] = "; ".join(sorted(searches)) + (
        " (doubling, then bisection to ~6% of the answer)" if mb["search"] == "bisect" else
        " (each figure is a lower bound)")
    return out


def run_traces(cfg: dict, trace_dir: str, reuse: bool, progress: Progress, save) -> list[dict]:
    import record_traces

    tc = cfg["traces"]
    metas = []
    for model in tc["models"]:
        size = (cfg["models"].get(model) or FULL["models"].get(model, {"image_size": 64}))["image_size"]
        t0 = time.perf_counter()
        meta = record_traces.record(model, trace_dir, tc["policy"], tc["batch"], size, tc["warmup"], tc["steps"],
                                    reuse=reuse)
        metas.append(meta)
        progress.step(f"record trace {model}", meta["status"], time.perf_counter() - t0)
        if meta["status"] == "failed":
            progress.note(meta.get("error", "")[:200])
        else:
            progress.note(f"{meta.get('records')} allocations -> {os.path.relpath(meta['path'], REPO)}")
        save()
    return metas


def run_modelled(cfg: dict, progress: Progress) -> dict:
    import subprocess

    mc = cfg["modelled"]
    out = {"profile": mc["profile"], "batch": mc["batch"], "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "modelled.json")
        cmd = [sys.executable, os.path.join(HERE, "modelled.py"), "--models", ",".join(mc["models"]),
               "--batch", str(mc["batch"]), "--profile", mc["profile"], "--json-out", path]
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
            err = "" if proc.returncode == 0 else " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        except subprocess.TimeoutExpired:
            err = "timed out after 1200s"
        if os.path.exists(path):
            with open(path) as fh:
                out["models"] = json.load(fh)
        if err and not out["models"]:
            out["error"] = err[:300]
        status = "ok" if out["models"] and not any(m.get("error") for m in out["models"]) else "failed"
        progress.step(f"modelled ({mc['profile']}): {', '.join(mc['models'])}", status, time.perf_counter() - t0)
        for m in out["models"]:
            if m.get("error"):
                progress.note(f"{m['model']}: {m['error'][:200]}")
    return out


def run_replay(metas: list[dict], dsa_dir: str, time_box: float, progress: Progress) -> dict:
    import replay_suite

    t0 = time.perf_counter()
    traces = replay_suite.replay_traces(metas)
    progress.step(f"replay {len(traces)} recorded trace(s)", "ok", time.perf_counter() - t0)
    t0 = time.perf_counter()
    dsa = replay_suite.replay_dsa(dsa_dir, time_box_s=time_box)
    progress.step(f"replay {len(dsa['rows'])} public DSA instance(s)", "ok" if dsa["rows"] else "skipped",
                  time.perf_counter() - t0)
    if dsa.get("note"):
        progress.note(dsa["note"])
    return {"traces": traces, "trace_meta": metas, "dsa": dsa}


# ----------------------------------------------------------------------------------------------------------------
# Main.

def write_outputs(results: dict, out_md: str, out_json: str, img_dir: str) -> dict:
    derived = report.derive(results)
    results = dict(results, derived=derived)
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    report.make_plots(results, img_dir, derived)
    kept = _kept_sections(out_md)
    with open(out_md, "w") as fh:
        fh.write(report.render_markdown(results, derived) + kept)
    return results


#: Sections other scripts write into the same file between their markers, carried over when this suite rewrites it.
KEPT_SECTIONS = ("budget-reliability", "largest-batch", "transformer-depth", "backward-ordering", "offload-step-time",
                 "pass-time")


def _kept_sections(path: str) -> str:
    """The sections of :data:`KEPT_SECTIONS` found in ``path`` (``bench/budget_reliability.py``,
    ``bench/largest_batch.py``, ``bench/transformer_depth.py``, ``bench/backward_ordering.py``,
    ``bench/offload_step_time.py``, ``bench/pass_time.py``), each between its markers."""
    text = open(path).read() if os.path.exists(path) else ""
    kept = ""
    for name in KEPT_SECTIONS:
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin in text and end in text:
            kept += "\n" + text[text.index(begin):text.index(end) + len(end)] + "\n"
    return kept


def _estimate_jobs(cfg: dict, sections: set[str]) -> int:
    n = 0
    if "matrix" in sections:
        n += len(cfg["models"]) * len(POLICIES) * cfg["rounds"]
    if "bfc" in sections:
        n += len(cfg["bfc_models"])
    if "maxbatch" in sections and cfg["max_batch"]["search"] != "saved":
        n += len(cfg["max_batch"]["policies"]) * (6 if cfg["max_batch"]["search"] == "bisect" else 3)
    if "traces" in sections:
        n += len(cfg["traces"]["models"])
    if "modelled" in sections:
        n += 1
    if "replay" in sections:
        n += 2
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 models, 1 round, coarse searches (a few minutes)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"), help="markdown to write")
    parser.add_argument("--json", default=None, help="results JSON (default: next to --out, .json)")
    parser.add_argument("--img-dir", default=None, help="plots directory (default: img/ next to --out)")
    parser.add_argument("--trace-dir", default=os.path.join(REPO, "build", "traces"))
    parser.add_argument("--reuse-traces", action="store_true",
                        help="replay traces already in --trace-dir with the same settings instead of recording")
    parser.add_argument("--dsa-dir", default=os.path.join(os.path.dirname(REPO), "shared", "benchmarks", "dsa"),
                        help="public DSA instances (MiniMalloc, idealloc); skipped with a note when missing")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=None, help="override the number of interleaved rounds")
    parser.add_argument("--render-only", metavar="JSON", default=None,
                        help="regenerate the markdown and plots from a saved results JSON (no runs)")
    args = parser.parse_args(argv)
    out_md = os.path.abspath(args.out)
    out_json = os.path.abspath(args.json or os.path.splitext(out_md)[0] + ".json")
    img_dir = os.path.abspath(args.img_dir or os.path.join(os.path.dirname(out_md), "img"))
    if args.render_only:
        with open(args.render_only) as fh:
            results = json.load(fh)
        results.pop("derived", None)
        write_outputs(results, out_md, out_json, img_dir)
        print(f"wrote {out_md}, {out_json} and plots in {img_dir}")
        return 0
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")
    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds:
        cfg["rounds"] = args.rounds
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv_shown = sys.argv[1:] if argv is None else list(argv)
    command = "python bench/run_all.py" + (" " + shlex.join(argv_shown) if argv_shown else "")
    results: dict = {"meta": {"command": command, "mode": "quick" if args.quick else "full",
                              "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                              "machine": machine_info(), "sections": sorted(sections), "notes": [],
                              "config": json.loads(json.dumps(cfg))}}
    t_start = time.perf_counter()

    partial = out_json + ".partial"

    def save():  # progress so far, next to the final file (which is only replaced when the run completes)
        results["meta"]["runtime_s"] = time.perf_counter() - t_start
        os.makedirs(os.path.dirname(out_json), exist_ok=True)
        with open(partial, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    progress = Progress(_estimate_jobs(cfg, sections))
    print(f"{command}: sections {', '.join(s for s in SECTIONS if s in sections)}; about {progress.total} jobs, "
          "one fresh process per training run", flush=True)
    if "matrix" in sections:
        results["matrix"] = run_matrix(cfg, progress, save)
    if "bfc" in sections:
        results["bfc"] = run_bfc(cfg, results.get("matrix"), progress, save)
    if "maxbatch" in sections:
        results["max_batch"] = run_max_batch(cfg, results.get("matrix"), progress, save)
    metas: list[dict] = []
    if "traces" in sections or "replay" in sections:
        if "traces" in sections:
            metas = run_traces(cfg, args.trace_dir, args.reuse_traces, progress, save)
            if args.reuse_traces and any(m.get("status") == "reused" for m in metas):
                results["meta"]["notes"].append(
                    "some traces were reused from an earlier recording in the trace cache (--reuse-traces)")
        else:
            import record_traces

            tc = cfg["traces"]
            for model in tc["models"]:
                size = (cfg["models"].get(model) or FULL["models"].get(model, {"image_size": 64}))["image_size"]
                metas.append(record_traces.record(model, args.trace_dir, tc["policy"], tc["batch"], size,
                                                  tc["warmup"], tc["steps"], reuse=True))
            if any(m.get("status") == "reused" for m in metas):
                results["meta"]["notes"].append("the traces section did not run: the replayed traces come from the "
                                                "trace cache, recorded by an earlier run")
    if "modelled" in sections:
        results["modelled"] = run_modelled(cfg, progress)
        save()
    if "replay" in sections:
        results["replay"] = run_replay(metas, args.dsa_dir, cfg["dsa_time_box_s"], progress)
    results["meta"]["runtime_s"] = time.perf_counter() - t_start
    results = write_outputs(results, out_md, out_json, img_dir)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"\nwrote {os.path.relpath(out_md, REPO)}, {os.path.relpath(out_json, REPO)} and plots in "
          f"{os.path.relpath(img_dir, REPO)} ({results['meta']['runtime_s'] / 60:.1f} min)")
    _print_headline(results)
    return 0


def _print_headline(results: dict) -> None:
    a = results.get("derived", {}).get("anchors", {})
    lines = []
    for m, v in a.get("memory_vs_vdnn", {}).items():
        lines.append(f"  {m}: dymem peak reserved {-v['reserved']:+.1%} vs vdnn (measured, CPU)")
    for m, v in a.get("throughput_vs_vdnn_measured", {}).items():
        lines.append(f"  {m}: dymem throughput vs vdnn {v:+.0%} (vdnn step / dymem step - 1; measured, CPU)")
    for scen, vals in a.get("throughput_vs_vdnn_modelled", {}).items():
        for m, v in vals.items():
            lines.append(f"  {m}: modelled h200 ({scen}) dymem speed-up over vdnn {v:+.0%}")
    if a.get("max_batch_ratio") is not None:
        lines.append(f"  largest batch dymem / none: {a['max_batch_ratio']:.2f}x (measured, CPU)")
    for b in a.get("bfc", []):
        lines.append(f"  {b['model']}: GTBM peak reserved / BFC pool = {b['reserved_ratio']:.2f}x (measured, CPU)")
    if lines:
        print("headline:")
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
