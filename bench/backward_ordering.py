"""What ordering the backward pass buys: the GPT decoder's step with and without the holds of
``dymem_tf.planning.backward_ordering`` (gradient ops ready early wait for their consumers).

    python bench/backward_ordering.py --write     # writes docs/benchmarks.md's section and the JSON

Measured: in a fresh interpreter per arm (GTBM capped at ``--budget``, oneDNN off), ``bench/model_zoo.gpt_decoder``
with ``--layers`` blocks trains ``--steps`` steps under ``DymemCallback(memory_budget="auto",
offload_optimizer_state=False)`` (feature maps only); the arm without holds replaces the pipeline's
:func:`~dymem_tf.planning.pipeline.holds_for` by one that holds nothing. The table gives the first step's (the
least-memory probe's) measured peak, the outcome and every later step's peak. Modelled: the same step captured
without training (``dymem_tf.keras.dry_run``-style) and planned for the least memory with each arm, on this CPU's
profile and the H200's: the simulated peak and step time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import largest_batch  # noqa: E402  (the section writer and the measured fit are shared)

BEGIN, END = "<!-- backward-ordering:begin -->", "<!-- backward-ordering:end -->"
ARMS = ("holds", "none")
MiB = 1 << 20


def _model(args, samples: int):
    import keras

    from model_zoo import gpt_decoder

    keras.utils.set_random_seed(0)
    return gpt_decoder(args.batch, samples, 0, seq=args.seq, dim=args.dim, layers=args.layers)


def _without_holds() -> None:
    from dymem_tf.planning import pipeline

    pipeline.holds_for = lambda *a, **k: []


def run_child(args) -> dict:
    """One arm in this fresh interpreter: the measured fit and the modelled least-memory step."""
    import dymem_tf

    if args.arm == "none":
        _without_holds()
    model, x, y = _model(args, max(args.batch * args.steps, 64))
    cb = dymem_tf.DymemCallback(memory_budget="auto", verbose=0, offload_optimizer_state=False)
    result = largest_batch.measured_fit(model, x, y, args.batch, args.steps, cb)
    result["hold_notes"] = [sum("held until" in n for n in r.plan.notes) for r in cb.records]
    result["modelled"] = modelled(args)
    return result


def modelled(args) -> dict:
    """Least-memory plan of the captured step on the cpu and h200 profiles: simulated peak and step time."""
    import tensorflow as tf

    from dymem_tf.passes import graph_def_view, graph_pass, step_pass
    from dymem_tf.planning import pipeline, simulator

    model, x, y = _model(args, args.batch)
    captured = {}

    def capture(call):
        ops = step_pass.replica_ops(call.graph())[0][1]
        captured["sg"], _ = step_pass.capture(ops, args.batch)
        call.fail("captured for the model")

    try:
        with graph_pass.armed(capture):
            model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    except tf.errors.CancelledError:
        pass
    out = {}
    for profile in ("cpu", "h200"):
        planned = pipeline.plan_step(captured["sg"], pipeline.PlanSettings(profile=profile, least_memory=True),
                                     copy=True)
        sim = simulator.simulate(planned.step_graph, planned.plan, profile, timeline=False)
        out[profile] = {"peak_bytes": int(sim.peak_bytes), "step_time_s": sim.step_time_s}
    return out


def run(arm: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--arm", arm, "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(args.steps), "--dim", str(args.dim), "--seq", str(args.seq)]
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", DYMEM_DEVICE_MEMORY_LIMIT=args.budget)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"outcome": "failed", "error": " | ".join((proc.stderr or "").strip().splitlines()[-3:])}
    return json.loads(lines[-1])


def report(results: dict, args, seconds: float) -> str:
    lines = [BEGIN, "## Ordering the backward pass: gradient ops held until their consumers near", "",
             f"`python bench/backward_ordering.py --write` on this 2-core CPU machine ({seconds / 60:.0f} min; GTBM is "
             f"the emulated device capped at {args.budget}, oneDNN off). `bench/model_zoo.gpt_decoder` with "
             f"{args.layers} blocks, batch {args.batch}, AdamW, feature maps only (`DymemCallback(memory_budget="
             f"\"auto\", offload_optimizer_state=False)`), {args.steps} steps; *none* plans the same step without "
             "the holds of `planning/backward_ordering.py`. Modelled: the least-memory plan of the captured step, "
             "simulated (step memory and time; not a measurement).", "",
             "| arm | probe (first step) measured peak MiB | outcome | later steps' peak MiB | modelled peak, cpu / "
             "h200 MiB | modelled step, cpu / h200 ms |", "| --- | ---: | --- | ---: | --- | --- |"]
    for arm in ARMS:
        r = results.get(arm, {})
        peaks = r.get("peaks") or []
        m = r.get("modelled") or {}
        probe = f"{peaks[0] / MiB:.0f}" if peaks else "-"
        later = f"{max(peaks[1:]) / MiB:.0f}" if len(peaks) > 1 else "-"
        outcome = r.get("outcome", "-") + (f" ({r.get('error', '')[:90]})" if r.get("outcome") != "trained" else "")
        mp = " / ".join(f"{m[p]['peak_bytes'] / MiB:.1f}" for p in ("cpu", "h200")) if m else "-"
        mt = " / ".join(f"{m[p]['step_time_s'] * 1e3:.1f}" for p in ("cpu", "h200")) if m else "-"
        lines.append(f"| {arm} | {probe} | {outcome} | {later} | {mp} | {mt} |")
    return "\n".join(lines + ["", END])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget", default="192MiB")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section and the JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    t0 = time.perf_counter()
    results = {arm: run(arm, args) for arm in ARMS}
    section = report(results, args, time.perf_counter() - t0)
    print(section)
    if args.write:
        largest_batch.write_section(section, BEGIN, END, results, "backward_ordering.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
