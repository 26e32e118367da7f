"""Budget reliability: does "fit into this budget" hold on models outside the benchmark four?

For every model of ``bench/model_zoo.py``, in a fresh interpreter (GTBM on the CPU is the emulated device, oneDNN
off so that running out of memory raises instead of crashing):

Each measurement runs in a fresh interpreter (Keras keeps every model it built alive until exit).

1. **Same results**: 3 steps with op determinism on, without and with ``DymemCallback(memory_budget=None)``: losses and every
   weight
   compared bit for bit, with oneDNN's CPU kernels off and again with them on (``TF_ENABLE_ONEDNN_OPTS``).
2. **No-swap peak** ``P0`` of a plain step and the persistent bytes ``W`` (weights and optimizer state).
3. **Budgets** ``B = W + f * (P0 - W)`` for each fraction ``f``: a GTBM device of ``B`` bytes (its pageblocks
   in proportion: at least 256 of them, see docs/configuration.md; phases 1-2 run on a 16 GiB one) and the model trains
   ``--steps`` steps on ``--samples`` samples with ``memory_budget="auto"``; every run must either train with
   every step's measured peak <= B or be refused before its first update, never run out of memory after its first
   step. The same budget with ``memory_budget=None`` is run too: "auto" may refuse only where None fails as well.
   The probe's predicted and measured peaks give the simulator's raw error; the calibrated plan's prediction
   (scaled by the calibration) against its measured steady peak gives the calibrated error.

``python bench/budget_reliability.py`` writes the "Budget reliability" section of docs/benchmarks.md (between its
markers) and prints it; ``--quick`` runs fewer steps on fewer samples and writes nothing unless ``--write``.
``--identity-only`` runs step 1 alone and writes its own section ("Bit-identity with oneDNN on and off") and
docs/identity.json.
The ``bert``, ``bert_base`` and ``gpt2`` models need keras-hub (``pip install --no-build-isolation -e '.[bench]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- budget-reliability:begin -->", "<!-- budget-reliability:end -->"
#: the section and the saved run of ``--of-peak`` (budgets as shares of the plain peak, the issues' targets)
PEAK_BEGIN, PEAK_END = "<!-- budget-of-peak:begin -->", "<!-- budget-of-peak:end -->"
#: the section and the saved run of ``--identity-only``
IDENTITY_BEGIN, IDENTITY_END = "<!-- identity:begin -->", "<!-- identity:end -->"
#: what the identity phase reports with each oneDNN setting
IDENTITY_KEYS = ("identical", "identical_budgeted", "repeatable", "skipped")
#: batch size per model (small images: seconds per step on 2 cores)
BATCH = {"vgg16": 32, "resnet50_sgd": 32, "resnet50_adam": 32, "densenet121": 32, "inception_v3": 16,
         "mobilenet_v2": 32, "efficientnet_b0": 32, "transformer_encoder": 32, "gpt_decoder": 16, "unet": 8,
         "gan": 64, "lstm": 64, "bert": 16, "bert_base": 4, "gpt2": 16,
         "gated_cnn": 32, "resnet152": 4, "convnext_tiny": 16, "lstm_text": 64, "gated_cnn_wide": 64}
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------ child process
def _child(name: str, args) -> dict:
    """One phase (``args.phase``) of one model's measurements, in a fresh interpreter."""
    import gc

    import numpy as np
    import tensorflow as tf
    import keras

    import dymem_tf
    from dymem_tf.keras import variables

    sys.path.insert(0, HERE)
    from model_zoo import ZOO, StepPeaks as Peaks

    tf.config.experimental.enable_op_determinism()
    batch = BATCH[name]

    def build(samples):
        keras.backend.clear_session()
        gc.collect()
        keras.utils.set_random_seed(3)
        return ZOO[name](batch, samples, 3)

    def fit(model, x, y, steps, callbacks):
        kwargs = dict(batch_size=batch, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0,
                      callbacks=callbacks)
        return model.fit(x, **kwargs) if y is None else model.fit(x, y, **kwargs)

    def same_results():
        model, x, y = build(batch * args.identity_steps)
        base = fit(model, x, y, args.identity_steps, []).history["loss"]
        base_w = [w.numpy() for w in model.weights]
        model, x, y = build(batch * args.identity_steps)  # control: does the plain run repeat itself?
        again = fit(model, x, y, args.identity_steps, []).history["loss"]
        repeatable = again == base and all(np.array_equal(a, b) for a, b in zip(base_w, model.weights))
        model, x, y = build(batch * args.identity_steps)
        cb = dymem_tf.DymemCallback(memory_budget=None, verbose=0)
        loss = fit(model, x, y, args.identity_steps, [cb]).history["loss"]
        identical = loss == base and all(np.array_equal(a, b) for a, b in zip(base_w, model.weights))
        # under a budget the first step is the probe: the least-memory plan, with every feature map swapped and
        # optimizer state and weights offloaded; the budget is the whole (uncapped) device, so later steps run the
        # calibrated plan that swaps nothing
        model, x, y = build(batch * args.identity_steps)
        budgeted = dymem_tf.DymemCallback(memory_budget="8GiB", verbose=0)
        loss_b = fit(model, x, y, args.identity_steps, [budgeted]).history["loss"]
        probe = budgeted.records[0].plan if budgeted.records else None
        return {"identical": identical, "repeatable": repeatable,
                "identical_budgeted": loss_b == base and all(np.array_equal(a, b)
                                                             for a, b in zip(base_w, model.weights)),
                "probe_kinds": [len(probe.feature_maps), len(probe.offloaded_variables),
                                len(probe.offloaded_weights)] if probe is not None else None,
                "swaps": len(cb.plan.swaps) if cb.plan is not None else 0,
                "skipped": [s.kind for s in cb.skipped]}

    def plain_digest():
        import hashlib

        model, x, y = build(batch * args.identity_steps)
        loss = fit(model, x, y, args.identity_steps, []).history["loss"]
        return {"loss": loss, "digest": hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()}

    def no_swap_peak():
        model, x, y = build(batch * 2)
        peaks = Peaks()
        fit(model, x, y, 2, [peaks])
        return {"p0": max(peaks.peaks), "persistent": variables.persistent_bytes(model)}

    def no_budget_peak():
        # the same steps with Dymem and no budget (every tensor worth swapping swapped), on the uncapped device; in
        # its own interpreter: a model built before in this one would still hold its variables on the device
        model, x, y = build(batch * 2)
        peaks = Peaks()
        fit(model, x, y, 2, [peaks, dymem_tf.DymemCallback(memory_budget=None, verbose=0)])
        return {"p_dymem": max(peaks.peaks)}

    if args.phase == "identity":
        return same_results()
    if args.phase == "digest":
        return plain_digest()
    if args.phase == "p0":
        return no_swap_peak()
    if args.phase == "p_dymem":
        return no_budget_peak()
    memory_budget = "auto" if args.mode == "auto" else None
    return _budget_run(build, fit, Peaks, args.budget_bytes, memory_budget, args)


def _budget_run(build, fit, Peaks, budget: int, memory_budget, args) -> dict:
    """One fit on a device of ``budget`` bytes: outcome, per-step peaks, predictions."""
    import numpy as np
    import tensorflow as tf

    import dymem_tf
    from dymem_tf.memory import allocator
    from dymem_tf.planning import first_step
    from dymem_tf.planning.first_step_control import State

    below = {"outcome": "below the model", "peaks": [], "steps_run": 0, "over_budget_steps": 0}
    try:
        model, x, y = build(args.samples)
    except tf.errors.ResourceExhaustedError:  # a device of the budget's size cannot hold what Keras builds
        return below
    state = {v.path: v.numpy() for v in list(model.variables) + list(getattr(model.optimizer, "variables", []))}
    start_in_use = int(allocator.memory_stats()["bytes_in_use"])  # the built model's variables
    if start_in_use >= budget:  # no device of this size could have held the model Keras built
        return {**below, "start_in_use": start_in_use}
    allocator.set_memory_limit(budget)
    cb, peaks = dymem_tf.DymemCallback(memory_budget=memory_budget, verbose=0), Peaks()
    result = {"outcome": "trained", "start_in_use": start_in_use,
              "block_size": int(allocator.memory_stats().get("block_size") or 0)}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(model, x, y, args.steps, [cb, peaks])
    except dymem_tf.BudgetTooSmallError as err:
        changed = [k for k, v in state.items() if not np.array_equal(v, _value(model, k))]
        result.update(outcome="refused", message=str(err)[:300], changed_variables=len(changed))
    except tf.errors.ResourceExhaustedError:
        result["outcome"] = "oom"
    result["seconds"] = time.perf_counter() - t0
    result["steps_run"] = len(peaks.peaks)
    result["peaks"] = peaks.peaks
    result["over_budget_steps"] = sum(p > budget for p in peaks.peaks)
    records = [r for r in cb.records]
    if records and records[0].plan.params.stage == "probe" and peaks.peaks:
        result["probe_predicted"] = int(records[0].plan.predicted.peak_bytes)
        result["probe_measured"] = peaks.peaks[0]
    calibrated = [r for r in records if r.plan.params.stage in ("calibrated", "refined")]
    first = len(calibrated)  # the last calibrated plan ran from this step on (the probe ran step 0)
    if calibrated and len(peaks.peaks) > first:
        plan = calibrated[-1].plan
        cal = plan.predicted.calibration
        result["calibrated_predicted"] = plan.predicted.calibrated_peak_bytes or \
            first_step.calibrated_prediction(cal, int(plan.predicted.peak_bytes))
        result["placed"] = plan.predicted.calibrated_peak_bytes is not None  # predicted by the plan's placement
        result["calibration_margin"] = cal.margin
        result["placement_residual"] = cal.placement_residual_bytes
        result["calibrated_measured"] = max(peaks.peaks[first:])
        result["calibrated_first"] = peaks.peaks[first]
        result["calibrated_in_use"] = plan.measured.peak_bytes_in_use if plan.measured is not None else None
        result["in_use_predicted"] = int(plan.predicted.peak_bytes)
        result["calibrated_swaps"] = len(plan.swaps)
        result["refined"] = len(calibrated) > 1
        result["refinements"] = len(calibrated) - 1  # a placed plan may be refined twice
    result["fallback"] = any("goes on with the first step's" in str(w.message) for w in caught) or (
        cb.session is not None and cb.session.control.state is State.FALLBACK)  # also the ones said, not warned
    if records and peaks.peaks:  # the plan that trained: the probe's after a fall-back, else the last one made
        trained = records[0].plan if result["fallback"] else records[-1].plan
        result["swapped_bytes"] = int(trained.swapped_bytes)
    del model, cb
    return result


def _value(model, path):
    for v in list(model.variables) + list(getattr(model.optimizer, "variables", [])):
        if v.path == path:
            return v.numpy()
    return None


# ----------------------------------------------------------------------------------------------- parent process
def _run_child(name: str, args, *extra, onednn: str = "0", device: int | None = None) -> dict:
    """One phase of one model in a fresh interpreter (Keras keeps every model it built alive until exit, so each
    measurement starts from an empty device), oneDNN off unless ``onednn`` is "1", on a GTBM device of ``device``
    bytes (default 16 GiB: a device of the budget's size has pageblocks in proportion, see docs/configuration.md);
    its RESULT, or ``{"error": ...}``."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2",
               DYMEM_DEVICE_MEMORY_LIMIT=str(device) if device else "16GiB",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(args.steps),
           "--samples", str(args.samples), "--identity-steps", str(args.identity_steps), *extra]
    return child_result(cmd, env, args.timeout)


def child_result(cmd: list[str], env: dict, timeout: float, tail: int = 600) -> dict:
    """The JSON a child process ``cmd`` printed on its last ``RESULT`` line, or ``{"error": ...}`` (a time-out, a
    failed exit, no result: the last ``tail`` characters of its stderr)."""
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode}: {proc.stderr[-tail:]}"}
    return json.loads(lines[-1][len("RESULT"):])


def same_results(name: str, args, onednn: str) -> dict:
    """The identity phase of one model with oneDNN off ("0") or on ("1"); where Dymem's run differs and two plain
    runs of one process agreed, two more in two processes (TensorFlow's CPU kernels may not repeat)."""
    out = _run_child(name, args, "--phase", "identity", onednn=onednn)
    if "error" not in out and out["repeatable"] and _differs(out):
        a, b = (_run_child(name, args, "--phase", "digest", onednn=onednn) for _ in range(2))
        if "error" not in a and "error" not in b and (a["digest"], a["loss"]) != (b["digest"], b["loss"]):
            out["repeatable"] = False
    return out


def run_model(name: str, args) -> dict:
    """All phases of one model: same results (oneDNN off and on), the no-swap peak, and each budget with "auto" and
    with None; with ``--identity-only`` the first alone, with ``--budgets-only`` all but the first."""
    out = {"model": name, "batch": BATCH[name]}
    for onednn in () if getattr(args, "budgets_only", False) else ("0", "1"):
        result = same_results(name, args, onednn)
        if "error" in result:
            return {**out, "error": f"identity (oneDNN {'on' if onednn == '1' else 'off'}): {result['error']}"}
        if onednn == "0":
            out.update(result)
        else:
            out["onednn_on"] = {k: result.get(k) for k in IDENTITY_KEYS}
    if getattr(args, "identity_only", False):
        return out
    for phase in ("p0", "p_dymem"):
        result = _run_child(name, args, "--phase", phase)
        if "error" in result:
            return {**out, "error": f"{phase}: {result['error']}"}
        out.update(result)
    runs = []
    for f in args.fractions:
        budget = int(f * out["p0"] if args.of_peak else out["persistent"] + f * (out["p0"] - out["persistent"]))
        budget = -(-budget // MiB) * MiB
        run = {"fraction": f, "budget": budget}
        for mode in ("auto", "none"):
            if mode == "none" and run["auto"]["outcome"] == "trained":
                run[mode] = {"outcome": "not run", "peaks": [], "steps_run": 0, "over_budget_steps": 0}
                continue  # None matters only where "auto" refused: was that a batch None could train?
            run[mode] = _run_child(name, args, "--phase", "budget", "--mode", mode, "--budget-bytes", str(budget),
                                   device=budget)
            if "error" in run[mode]:
                run[mode] = {"outcome": "error", "error": run[mode]["error"], "peaks": [], "steps_run": 0,
                             "over_budget_steps": 0}
        runs.append(run)
    out["runs"] = runs
    return out


def _differs(result: dict) -> bool:
    """Whether Dymem's run of an identity phase differed from the plain run, without or under a budget."""
    return not (result.get("identical") and result.get("identical_budgeted", True))


def _identity(result: dict) -> str:
    """One identity phase: bit-identical without / under a budget, and why a difference may not be Dymem's."""
    def yes(flag):
        return "–" if flag is None else "yes" if flag else "**no**"

    text = f"{yes(result.get('identical'))} / {yes(result.get('identical_budgeted'))}"
    if result.get("repeatable") is False:
        text = f"{text.replace('**', '')}, but two plain runs differ too"
    if result.get("skipped"):
        text += f" (unmodified: {', '.join(sorted(set(result['skipped'])))})"
    return text


def _identity_cell(r: dict) -> str:
    """Bit-identity without / under a budget, oneDNN off, then (when measured) on."""
    on = r.get("onednn_on")
    return _identity(r) if on is None else f"off: {_identity(r)}; on: {_identity(on)}"


def identity_report(results: list[dict], args, seconds: float) -> str:
    """The markdown section of ``--identity-only``."""
    lines = [IDENTITY_BEGIN, "## Bit-identity with oneDNN on and off", "",
             f"`python bench/budget_reliability.py{' ' + ' '.join(args.argv) if args.argv else ''}` on this 2-core "
             f"CPU machine{f' ({seconds / 60:.1f} min)' if seconds else ''}. Each model and setting in a fresh "
             f"process: {args.identity_steps} steps with op determinism on, losses and every weight compared bit "
             "for bit against a plain run, without a budget and under one (whose first step, the probe, swaps every "
             "feature map and offloads optimizer state and weights); oneDNN's CPU kernels off "
             "(`TF_ENABLE_ONEDNN_OPTS=0`) and on (`=1`). With oneDNN on, the pass plans the partition oneDNN "
             "rewrote (docs/onednn.md).", "",
             "| model | batch | Dymem swaps | no budget / budget, oneDNN off | no budget / budget, oneDNN on |",
             "| --- | ---: | ---: | --- | --- |"]
    differ = []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | – | – | error: {r['error'][:120]!r} | |")
            continue
        on = r.get("onednn_on")
        lines.append(f"| {r['model']} | {r['batch']} | {r['swaps']} | {_identity(r)} | "
                     f"{_identity(on) if on else '–'} |")
        for label, result in (("off", r), ("on", on)):
            if result and _differs(result) and result.get("repeatable") is not False:
                differ.append(f"{r['model']} (oneDNN {label})")
    lines += ["", f"- Runs that differ from a plain run that repeats itself: {len(differ)}"
              + (": " + ", ".join(differ) + "." if differ else "."), IDENTITY_END, ""]
    return "\n".join(lines)


def _mib(n) -> str:
    return f"{n / MiB:.1f}" if n is not None else "–"


def report(results: list[dict], args, seconds: float) -> str:
    """The markdown section."""
    of_peak = getattr(args, "of_peak", False)
    lines = [PEAK_BEGIN if of_peak else BEGIN,
             "## Budgets as shares of the plain peak" if of_peak else "## Budget reliability", "",
             "Written by `bench/budget_reliability.py` (the planning and rewriting after Grappler, budgets "
             "calibrated by a first-step probe); the sections above come from `bench/run_all.py`, at the commit "
             "named at the top.", "",
             f"`python bench/budget_reliability.py{' ' + ' '.join(args.argv) if args.argv else ''}` on this 2-core "
             f"CPU machine{f' ({seconds / 60:.1f} min)' if seconds else ''}. Each model in a fresh process; the CPU device capped by GTBM is "
             f"the emulated device (oneDNN off). Budgets "
             f"{'B = f x P0' if of_peak else 'B = W + f x (P0 - W)'}, W = weights + optimizer state, "
             f"P0 = the measured no-swap peak; each budgeted run trains {args.steps} steps on {args.samples} "
             "samples. *auto* is `memory_budget=\"auto\"`; *none* is `memory_budget=None` under the same cap, run where "
             "*auto* refused. *Bit-identical* compares losses and every weight after 3 steps with op determinism on, "
             "against a plain run: without a budget, and under a budget, whose first step (the probe) swaps every "
             "feature map and offloads optimizer state and weights (*probe offloads*: feature maps / state / "
             "weights).", "",
             "| model | batch | bit-identical (3 steps): no budget / budget, oneDNN off; on | probe offloads | swaps | "
             "W MiB | P0 MiB | f | B MiB | auto | auto max peak MiB | none | probe pred./meas. MiB | calibrated pred./meas. MiB |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |"]
    raw_err, cal_err, first_err, use_err, violations, placed = [], [], [], [], [], 0
    med_err, spread = [], []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | – | error: {r['error'][:120]!r} |" + " |" * 11)
            continue
        ident = _identity_cell(r)
        for run in r["runs"]:
            auto, none = run["auto"], run["none"]
            peak = max(auto["peaks"]) if auto["peaks"] else None
            probe = f"{_mib(auto.get('probe_predicted'))} / {_mib(auto.get('probe_measured'))}"
            cal = f"{_mib(auto.get('calibrated_predicted'))} / {_mib(auto.get('calibrated_measured'))}"
            kinds = " / ".join(map(str, r["probe_kinds"])) if r.get("probe_kinds") else "–"
            lines.append(f"| {r['model']} | {r['batch']} | {ident} | {kinds} | {r['swaps']} | {_mib(r['persistent'])} | "
                         f"{_mib(r['p0'])} | {run['fraction']} | {_mib(run['budget'])} | {_outcome(auto)} | "
                         f"{_mib(peak)} | {_outcome(none)} | {probe} | {cal} |")
            if auto.get("probe_measured"):
                raw_err.append(abs(auto["probe_predicted"] - auto["probe_measured"]) / auto["probe_measured"])
            placed += bool(auto.get("placed"))
            if auto.get("calibrated_measured"):
                cal_err.append(abs(auto["calibrated_predicted"] - auto["calibrated_measured"])
                               / auto["calibrated_measured"])
                steady = _steady_peaks(auto)
                median = statistics.median(steady)
                med_err.append(abs(auto["calibrated_predicted"] - median) / median)
                spread.append(max(steady) / median - 1.0)
            if auto.get("calibrated_first"):
                first_err.append(abs(auto["calibrated_predicted"] - auto["calibrated_first"])
                                 / auto["calibrated_first"])
            if auto.get("calibrated_in_use"):
                use_err.append(abs(auto["in_use_predicted"] - auto["calibrated_in_use"]) / auto["calibrated_in_use"])
            if auto["outcome"] in ("oom", "error") or auto["over_budget_steps"]:
                violations.append(f"{r['model']} f={run['fraction']}: {_outcome(auto)}")
            if auto["outcome"] == "refused" and none["outcome"] == "trained":
                violations.append(f"{r['model']} f={run['fraction']}: auto refused what none trained")
    found = ": " + "; ".join(violations) if violations else "."
    lines += ["", f"- Budget violations (an out-of-memory error after the first step, any other error, a step over B, "
              f"or a refusal where `None` trained): {len(violations)}{found}"]
    no_budget = [f"{r['model']} {_mib(r['p_dymem'])} MiB ({r['p_dymem'] / r['p0']:.2f}x)" for r in results
                 if "error" not in r and r.get("p_dymem")]
    if no_budget:
        lines.append("- Without a budget (`memory_budget=None`, the device uncapped), the device peak with Dymem, as a "
                     "share of P0: " + ", ".join(no_budget) + ".")
    if raw_err:
        lines.append(f"- Simulator error on the probe step (uncalibrated, device peak): median "
                     f"{statistics.median(raw_err):.1%}, max {max(raw_err):.1%} over {len(raw_err)} runs.")
    if cal_err:
        how = (f" ({placed} of {len(cal_err)} predicted by the plan's placement: its buffers replayed through GTBM's "
               "placer, kept variables in the persistent group as the probe found it)" if placed else "")
        lines.append(f"- Calibrated prediction of the budgeted plan vs its measured steady peak{how}: median "
                     f"{statistics.median(cal_err):.1%}, max {max(cal_err):.1%} over {len(cal_err)} runs"
                     + (f"; against its first step: median {statistics.median(first_err):.1%}, max "
                        f"{max(first_err):.1%} (the rest is the growth of later steps)." if first_err else "."))
    if med_err:
        lines.append(f"- The same predictions against the median step of each run (the plan's typical step): median "
                     f"{statistics.median(med_err):.1%}, max {max(med_err):.1%}. The plan's own steps spread "
                     f"(worst step / median step - 1) by median {statistics.median(spread):.1%}, max "
                     f"{max(spread):.1%}: the same plan, the same shapes, a different peak from step to step (the CPU "
                     "executor dispatches kernels to its inter-op threads, so the order of allocation varies). "
                     f"In {sum(x > 0.06 for x in spread)} of {len(spread)} runs the spread alone exceeds 6%.")
    lines += utilization_lines(results, getattr(args, "baseline_results", None))
    if use_err:
        lines.append(f"- The simulator's bytes in use of the budgeted plan (with the probe's measured temporaries, "
                     f"before the fragmentation term) vs measured in its first step: median "
                     f"{statistics.median(use_err):.1%}, max {max(use_err):.1%} over {len(use_err)} runs.")
    lines += [PEAK_END if of_peak else END, ""]
    return "\n".join(lines)


def utilization(results: list[dict], least_budget: int = 64 * MiB) -> dict[str, list[float]]:
    """Steady peak (the highest of steps 3 on, of the plan that trained: :func:`_trained_peaks`) over the budget of
    every run that trained, by ``"all"`` runs,
    ``"large"`` ones (budgets of ``least_budget`` and more) and ``"unbound"`` ones among those: the plan that trained
    swapped nothing (``swapped_bytes`` 0; the step fitted as planned, chained and with its updates deferred, so the
    budget did not bind it and it had nothing to use the rest for)."""
    out = {"all": [], "large": [], "unbound": []}
    for r in results:
        for run in r.get("runs", []):
            auto = run["auto"]
            if auto["outcome"] != "trained" or len(auto["peaks"]) < 3:
                continue
            share = max(_trained_peaks(auto)) / run["budget"]
            out["all"].append(share)
            if run["budget"] >= least_budget:
                out["unbound" if auto.get("swapped_bytes") == 0 else "large"].append(share)
    return out


def utilization_lines(results: list[dict], baseline: list[dict] | None = None) -> list[str]:
    """The report's lines on how much of each budget the steady steps used (and, with a ``baseline`` run's results,
    the same figures of that run beside them, and the bytes swapped per step of the runs both trained)."""
    def figures(res):
        u = utilization(res)
        unbound = f" ({len(u['unbound'])} more swapped nothing: {_shares(u['unbound'])})" if u["unbound"] else ""
        return (f"median {statistics.median(u['large']):.3f}, lowest {min(u['large']):.3f} over "
                f"{len(u['large'])} runs{unbound}" if u["large"] else "no runs")

    lines = [f"- Steady peak (steps 3 on) / B, budgets of 64 MiB and more, runs that swapped: {figures(results)}"
             + (f"; the baseline run, every run counted as it recorded no bytes swapped: {figures(baseline)}."
                if baseline else ".")]
    bands = by_budget(results)
    if bands:
        lines.append("- The same runs by budget, beside the most a plan placed at its limit uses (1 - the placement's "
                     "allowance of 3 pageblocks + 1.5% of B; the median over the band's runs): "
                     + "; ".join(f"{label}: median {statistics.median(v):.3f}, lowest {min(v):.3f} over {len(v)} "
                                 f"(ceiling {ceiling:.3f})" for label, ceiling, v in bands) + ".")
    if baseline:
        base = {(r["model"], run["fraction"]): run["auto"] for r in baseline for run in r.get("runs", [])}
        for r in results:
            for run in r.get("runs", []):
                auto, old = run["auto"], base.get((r["model"], run["fraction"]))
                if old is None or auto["outcome"] != "trained" or old["outcome"] != "trained":
                    continue
                now_u, old_u = max(_trained_peaks(auto)), max(_trained_peaks(old))
                swapped = (f", swapped {_mib(old.get('swapped_bytes'))} -> {_mib(auto.get('swapped_bytes'))} MiB per "
                           "step" if old.get("swapped_bytes") else
                           f", swaps {old.get('calibrated_swaps', '–')} -> {auto.get('calibrated_swaps', '–')} "
                           f"({_mib(auto.get('swapped_bytes'))} MiB swapped per step)")
                lines.append(f"  - {r['model']} f={run['fraction']} (B {_mib(run['budget'])} MiB): steady peak / B "
                             f"{old_u / run['budget']:.3f} -> {now_u / run['budget']:.3f}{swapped}")
    return lines


#: The budget bands :func:`by_budget` splits the swapping runs into (lower edges, MiB).
BUDGET_BANDS = (64, 128, 256, 512)


def by_budget(results: list[dict], block_size: int = 2 * MiB) -> list[tuple[str, float, list[float]]]:
    """Steady peak / B of the runs that swapped, budgets of 64 MiB and more (:func:`utilization`'s ``"large"``), by
    :data:`BUDGET_BANDS`: ``(label, ceiling, shares)`` per band with runs, where ``ceiling`` is the median over its
    runs of the most a plan placed at its limit uses of the budget (1 -
    :func:`dymem_tf.planning.first_step.placed_allowance` / B, with the pageblock each run recorded, else
    ``block_size``): under small budgets the allowance's three pageblocks are a large share."""
    from dymem_tf.planning import first_step

    edges = [e * MiB for e in BUDGET_BANDS]
    out = []
    for k, low in enumerate(edges):
        high = edges[k + 1] if k + 1 < len(edges) else None
        runs = [run for r in results for run in r.get("runs", []) if run["auto"]["outcome"] == "trained"
                and len(run["auto"]["peaks"]) >= 3 and run["auto"].get("swapped_bytes") != 0
                and low <= run["budget"] and (high is None or run["budget"] < high)]
        if runs:
            label = f"{low // MiB}-{high // MiB} MiB" if high else f"{low // MiB} MiB and more"
            ceiling = statistics.median(
                1 - first_step.placed_allowance(run["budget"], run["auto"].get("block_size") or block_size)
                / run["budget"] for run in runs)
            out.append((label, ceiling, [max(_trained_peaks(run["auto"])) / run["budget"] for run in runs]))
    return out


def _trained_peaks(auto: dict) -> list[int]:
    """The peaks of the steps of the plan that trained, from step 3 on: after the probe, the calibrated plan, the
    refined ones (up to two) and a fall-back to the probe's plan, each of which ran one first step."""
    first = max(2, 1 + ("calibrated_first" in auto) + _refinements(auto) + bool(auto.get("fallback")))
    return auto["peaks"][first:] or auto["peaks"][-1:]


def _refinements(auto: dict) -> int:
    """How many refined plans a budgeted run made (runs saved before the count was recorded: one at most)."""
    return auto.get("refinements", int(bool(auto.get("refined"))))


def _shares(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in sorted(values))


def _steady_peaks(auto: dict) -> list[int]:
    """The measured peaks of the steps the last calibrated plan ran (the probe ran the first step, the calibrated
    plan the second where it was refined, a first refinement the third where it was refined again)."""
    return auto["peaks"][1 + _refinements(auto):] or auto["peaks"]


def _outcome(run: dict) -> str:
    if run["outcome"] == "trained":
        over = f", **{run['over_budget_steps']} steps over B**" if run["over_budget_steps"] else ""
        fallback = ", fell back to the probe's plan" if run.get("fallback") else ""
        times = {2: "twice", 3: "three times"}.get(1 + _refinements(run))
        refined = f", calibrated {times}" if times else ""
        return f"trained {run['steps_run']} steps{over}{fallback}{refined}"
    if run["outcome"] == "refused":
        return f"refused (variables changed: {run.get('changed_variables', '?')})"
    if run["outcome"] == "not run":
        return "–"
    if run["outcome"] == "error":
        kinds = re.findall(r"\b(\w+(?:Error|Exception))\b", run["error"])
        return f"**error** ({kinds[-1] if kinds else repr(run['error'][-80:])})"
    return f"**out of memory** in step {run['steps_run'] + 1}"


def write_section(path: str, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the section between the markers in ``path`` (or append it)."""
    text = open(path).read() if os.path.exists(path) else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + section.rstrip("\n") + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as fh:
        fh.write(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(BATCH), help="comma-separated names from bench/model_zoo.py")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--fractions", default="0.35,0.6,0.85")
    parser.add_argument("--of-peak", action="store_true",
                        help="budgets B = f x P0 (shares of the plain peak), written to their own section and "
                             "docs/budget_reliability_of_peak.json")
    parser.add_argument("--identity-steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 steps on 256 samples, two models")
    parser.add_argument("--write", action="store_true", help="with --quick: write docs/benchmarks.md anyway")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--identity-only", action="store_true",
                        help="only the bit-identity runs (oneDNN off and on), written to their own section and "
                             "docs/identity.json")
    parser.add_argument("--budgets-only", action="store_true",
                        help="skip the bit-identity runs (with --json: merge them from an --identity-only run)")
    parser.add_argument("--json", help="save the run to this file instead of docs/ and leave docs/benchmarks.md as "
                                       "it is (a run of a few models beside the saved full one)")
    parser.add_argument("--baseline", help="a saved JSON run whose steady peak / B and bytes swapped per step the "
                        "report prints beside this run's (e.g. docs/budget_reliability.json)")
    parser.add_argument("--report-from", help="re-render docs/benchmarks.md's section from a saved JSON run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("identity", "digest", "p0", "p_dymem", "budget"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("auto", "none"), help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.fractions = [float(f) for f in str(args.fractions).split(",")]
    args.baseline_results = None
    if args.baseline:
        with open(args.baseline) as fh:
            args.baseline_results = json.load(fh)["results"]
    if args.quick:
        args.steps, args.samples = min(args.steps, 4), min(args.samples, 256)
        if args.models == ",".join(BATCH):
            args.models = "resnet50_sgd,transformer_encoder"
    if args.child:
        print("RESULT" + json.dumps(_child(args.child, args)), flush=True)
        return 0
    if args.report_from:  # re-render the section from a saved run (its command line and duration are kept)
        with open(args.report_from) as fh:
            saved = json.load(fh)
        if isinstance(saved, list):  # the first format: the results alone, default settings
            saved = {"argv": [], "steps": args.steps, "samples": args.samples, "seconds": None, "results": saved}
        args.argv, args.steps, args.samples = saved["argv"], saved["steps"], saved["samples"]
        args.of_peak = saved.get("of_peak", False)
        args.identity_only = saved.get("identity_only", False)
        args.identity_steps = saved.get("identity_steps", args.identity_steps)
        section = _render(saved["results"], args, saved["seconds"])
        print(section)
        write_section(os.path.join(REPO, "docs", "benchmarks.md"), section, *_markers(args))
        return 0
    if args.budgets_only and not args.json:
        parser.error("--budgets-only writes no report: give --json FILE (the identity columns would read as missing)")
    unknown = [m for m in args.models.split(",") if m not in BATCH]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(BATCH)}")
    t0 = time.perf_counter()
    results = []
    saving = not args.quick or args.write
    for name in args.models.split(","):
        print(f"{name} ...", flush=True)
        results.append(run_model(name, args))
        print(json.dumps(results[-1])[:400], flush=True)
        if saving or args.json:  # after every model, so that an interrupted run keeps what it measured
            _save(results, args, time.perf_counter() - t0, complete=False)
    section = _render(results, args, time.perf_counter() - t0)
    print(section)
    if saving and not args.json:
        write_section(os.path.join(REPO, "docs", "benchmarks.md"), section, *_markers(args))
    if saving or args.json:
        _save(results, args, time.perf_counter() - t0, complete=True)
    return 0


def _render(results, args, seconds) -> str:
    """The section ``args`` asks for (with ``--budgets-only``, which has no identity columns, its utilization lines)."""
    if getattr(args, "budgets_only", False):
        return "\n".join(utilization_lines(results, getattr(args, "baseline_results", None)))
    return identity_report(results, args, seconds) if getattr(args, "identity_only", False) \
        else report(results, args, seconds)


def _markers(args) -> tuple[str, str]:
    """The markers of the section ``args`` writes."""
    if getattr(args, "identity_only", False):
        return IDENTITY_BEGIN, IDENTITY_END
    return (PEAK_BEGIN, PEAK_END) if getattr(args, "of_peak", False) else (BEGIN, END)


def _save(results, args, seconds, complete):
    """Writes the run so far to ``--json``'s file, else docs/budget_reliability.json,
    docs/budget_reliability_of_peak.json with ``--of-peak``, or docs/identity.json with ``--identity-only``
    (``complete`` false until the last model ran)."""
    name = ("identity.json" if getattr(args, "identity_only", False) else
            "budget_reliability_of_peak.json" if args.of_peak else "budget_reliability.json")
    with open(getattr(args, "json", None) or os.path.join(REPO, "docs", name), "w") as fh:
        json.dump({"argv": args.argv, "steps": args.steps, "samples": args.samples, "seconds": seconds,
                   "of_peak": args.of_peak, "identity_only": getattr(args, "identity_only", False),
                   "identity_steps": args.identity_steps, "complete": complete, "results": results}, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
