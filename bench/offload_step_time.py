"""Step time at equal batch: no Dymem against Dymem with feature maps only and with optimizer state and weights off.

    python bench/offload_step_time.py --write      # writes docs/benchmarks.md's section and the JSON
    python bench/offload_step_time.py --rounds 1   # quicker, writes nothing

Issue #14 asks that swapping cost at most 1.15x the step time of no swapping where the budget does not force
optimizer state or weights off the device, and that the modelled H200 cost of that traffic be reported where it
does. The model is ``bench/model_zoo.gpt_decoder`` (AdamW) with ``--layers`` blocks at batch ``--batch``. A
calibration run measures its device peak ``P0`` without Dymem; then every round runs each configuration once, in a
fresh interpreter (GTBM is the emulated device, uncapped but for the budget the callback sets; oneDNN off), in an
order rotated by the round:

* ``plain``: no callback;
* ``dymem``: ``DymemCallback(memory_budget=None)``: no budget, feature maps swapped, nothing offloaded;
* ``loose``: ``DymemCallback(memory_budget=--loose x P0)``: a budget feature maps meet;
* ``tight``: ``DymemCallback(memory_budget=--tight x P0)``: a budget that needs state and weights off the device.

A run's step time is the median of its steps after the first two (tracing, the budget's probe, the calibrated
plan's first step); its ratio is against ``plain`` of the same round, and the table gives the median over rounds
with each round's ratio. For the budgeted runs the plan's counts and its state and weight traffic per step are
given, with what that traffic costs on an H200 (the ``h200`` profile's link rates and latencies) and the modelled
H200 step with that plan against the step without swapping (``dymem_tf.planning.simulator`` on the captured step).
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
sys.path.insert(0, HERE)
import largest_batch  # noqa: E402  (the section writer is shared)

BEGIN, END = "<!-- offload-step-time:begin -->", "<!-- offload-step-time:end -->"
CONFIGS = ("plain", "dymem", "loose", "tight")
MiB = 1 << 20


def run_child(args) -> dict:
    """One configuration in this fresh interpreter: step times, peaks and, under a budget, the plan's traffic."""
    import keras

    import dymem_tf
    from model_zoo import StepPeaks, gpt_decoder

    keras.utils.set_random_seed(0)
    model, x, y = gpt_decoder(args.batch, args.batch * args.steps, 0, seq=args.seq, dim=args.dim,
                              layers=args.layers)
    budget = None if args.budget_bytes is None else int(args.budget_bytes)
    callback = None if args.config == "plain" else dymem_tf.DymemCallback(memory_budget=budget, verbose=0)
    times, peaks = _StepTimes(), StepPeaks()
    model.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=args.steps, shuffle=False, verbose=0,
              callbacks=[c for c in (callback, peaks, times) if c is not None])
    out = {"times": times.seconds, "peaks": peaks.peaks}
    if callback is not None and callback.records:
        out.update(plan_traffic(callback.records[-1]))
    return out


class _StepTimes:
    """A Keras callback recording each training step's wall time (made a Callback on first use)."""

    def __new__(cls):
        import keras

        class StepTimes(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds: list[float] = []
                self._start = 0.0

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return StepTimes()


def plan_traffic(record) -> dict:
    """What the plan of ``record`` (a :class:`dymem_tf.passes.step_pass.TraceRecord`) swaps, its state and weight
    copies per step, and their cost on an H200 as the planner models it."""
    from dymem_tf.planning import simulator
    from dymem_tf.planning.cost_model import as_cost_model

    plan, sg = record.plan, record.step_graph
    h200 = as_cost_model("h200")
    h2d = d2h = copy_s = 0.0
    for s in plan.offloaded_variables + plan.offloaded_weights:
        ins = len(s.swap_ins)
        h2d, d2h = h2d + ins * s.bytes, d2h + s.bytes
        copy_s += ins * h200.copy_time(s.bytes, "h2d") + h200.copy_time(s.bytes, "d2h")
    with_plan = simulator.simulate(sg, plan, h200, timeline=False)
    without = simulator.simulate(sg, [], h200, persistent_bytes=plan.persistent_bytes, timeline=False)
    return {"feature_maps": len(plan.feature_maps), "state": len(plan.offloaded_variables),
            "weights": len(plan.offloaded_weights), "h2d_bytes": int(h2d), "d2h_bytes": int(d2h),
            "h200_copy_s": copy_s, "h200_step_s": with_plan.step_time_s, "h200_no_swap_step_s": without.step_time_s,
            "h200_compute_s": without.compute_time_s, "stage": plan.params.stage}


def run(config: str, args, budget_bytes: int | None) -> dict:
    """One configuration in a fresh interpreter; its JSON result, or ``{"failed": ...}``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", config, "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(args.steps), "--dim", str(args.dim), "--seq", str(args.seq)]
    if budget_bytes is not None:
        cmd += ["--budget-bytes", str(budget_bytes)]
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"failed": " | ".join((proc.stderr or "").strip().splitlines()[-3:])}
    return json.loads(lines[-1])


def step_time(result: dict) -> float | None:
    """Median step time after the first two steps."""
    times = result.get("times") or []
    return statistics.median(times[2:]) if len(times) > 2 else None


def measure(args, log) -> dict:
    """The calibration run, then ``args.rounds`` interleaved rounds of every configuration."""
    calib = run("plain", args, None)
    if "failed" in calib:
        raise SystemExit(f"the calibration run failed: {calib['failed']}")
    p0 = max(calib["peaks"])
    budgets = {"plain": None, "dymem": None, "loose": int(args.loose * p0), "tight": int(args.tight * p0)}
    log(f"P0 = {p0 / MiB:.0f} MiB; loose budget {budgets['loose'] / MiB:.0f} MiB, tight {budgets['tight'] / MiB:.0f} MiB")
    rounds = []
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
        results = {}
        for config in order:
            results[config] = run(config, args, budgets[config])
            t = step_time(results[config])
            log(f"  round {r + 1} {config:6s}: " + (f"{t * 1e3:.0f} ms/step" if t else results[config].get("failed", "?")))
        rounds.append(results)
    return {"p0": p0, "budgets": budgets, "rounds": rounds}


def summarise(data: dict) -> dict:
    """Per configuration: the median ratio to plain, each round's ratio, and the last round's plan figures."""
    out = {}
    for config in CONFIGS:
        ratios = []
        for results in data["rounds"]:
            base, t = step_time(results.get("plain", {})), step_time(results.get(config, {}))
            if base and t:
                ratios.append(t / base)
        plan = next((res[config] for res in reversed(data["rounds"]) if "feature_maps" in res.get(config, {})), {})
        times = [t for res in data["rounds"] if (t := step_time(res.get(config, {})))]
        out[config] = {"ratio": statistics.median(ratios) if ratios else None, "ratios": ratios,
                       "step_s": statistics.median(times) if times else None, "plan": plan,
                       "peak": max((max(res[config].get("peaks") or [0]) for res in data["rounds"]
                                    if config in res), default=0)}
    return out


def report(data: dict, args, seconds: float) -> str:
    """The Markdown section for docs/benchmarks.md."""
    summary = summarise(data)
    b = data["budgets"]
    lines = [BEGIN, "## Step time with optimizer state and weights offloaded (measured on the CPU; H200 modelled)", "",
             f"`python bench/offload_step_time.py --write` on this 2-core CPU machine ({seconds / 60:.0f} min, "
             f"{args.rounds} interleaved rounds; GTBM is the emulated device, oneDNN off). `bench/model_zoo.gpt_decoder`"
             f" with {args.layers} blocks {args.dim} wide, {args.seq} tokens, batch {args.batch}, AdamW, "
             f"{args.steps} steps per run; step time = median of the steps after the first two. Its peak without "
             f"Dymem is P0 = {data['p0'] / MiB:.0f} MiB; *loose* = `memory_budget` {args.loose} x P0 = "
             f"{b['loose'] / MiB:.0f} MiB, *tight* = {args.tight} x P0 = {b['tight'] / MiB:.0f} MiB. The H200 columns "
             "are the planner's model of the captured step with the plan the run used (the `h200` profile), not a "
             "measurement.", "",
             "| configuration | step ms (CPU) | vs plain [per round] | max step peak MiB | feature maps | state | "
             "weights | state+weight copies per step | their H200 copy time | H200 step with plan / without |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    names = {"plain": "plain (no callback)", "dymem": "dymem, no budget", "loose": "dymem, loose budget",
             "tight": "dymem, tight budget"}
    for config in CONFIGS:
        s, p = summary[config], summary[config]["plan"]
        ratio = (f"{s['ratio']:.2f}x [{', '.join(f'{r:.2f}' for r in s['ratios'])}]" if s["ratio"] else "-")
        traffic = (f"{(p['h2d_bytes'] + p['d2h_bytes']) / MiB:.1f} MiB" if p else "-")
        h200 = (f"{p['h200_copy_s'] * 1e3:.2f} ms (compute {p['h200_compute_s'] * 1e3:.1f} ms)" if p else "-")
        modelled = (f"{p['h200_step_s'] / p['h200_no_swap_step_s']:.2f}x" if p and p["h200_no_swap_step_s"] else "-")
        lines.append(f"| {names[config]} | {s['step_s'] * 1e3:.0f} | {ratio} | {s['peak'] / MiB:.0f} | "
                     f"{p.get('feature_maps', '-')} | {p.get('state', '-')} | {p.get('weights', '-')} | {traffic} | "
                     f"{h200} | {modelled} |" if s["step_s"] else f"| {names[config]} | failed | | | | | | | | |")
    lines += ["", "Raw step times, peaks and plan figures of every run: "
              "[docs/offload_step_time.json](offload_step_time.json).", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loose", type=float, default=0.85, help="loose budget as a share of the plain peak")
    parser.add_argument("--tight", type=float, default=0.55, help="tight budget as a share of the plain peak")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section and the JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    t0 = time.perf_counter()
    data = measure(args, lambda s: print(s, flush=True))
    section = report(data, args, time.perf_counter() - t0)
    print(section)
    if args.write:
        largest_batch.write_section(section, BEGIN, END, data, "offload_step_time.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
