"""Deepest GPT-style decoder under a fixed device budget: feature-map swapping alone against optimizer state and weights
offloaded.

    python bench/transformer_depth.py --write          # all three modes; writes docs/benchmarks.md's section
    python bench/transformer_depth.py --steps 5        # quicker, writes nothing

The model is ``bench/model_zoo.gpt_decoder`` (pre-norm blocks, causal self-attention, GELU MLP, AdamW) at
``--dim`` wide, ``--seq`` tokens, batch ``--batch``, with a varying number of blocks. Each trial is a fresh
interpreter with the GTBM device capped at ``--budget`` (oneDNN off) that trains ``--steps`` steps on
``max(--samples, batch x steps)`` samples; it *fits* when every step trained with its measured device peak under the
budget. Modes:

* ``plain``: no Dymem callback;
* ``features``: ``DymemCallback(memory_budget="auto", offload_optimizer_state=False)``: feature maps only;
* ``state``: ``DymemCallback(memory_budget="auto", offload_weights=False)``: feature maps and optimizer state
  (AdamW's m and v);
* ``weights``: ``DymemCallback(memory_budget="auto")``: feature maps, optimizer state and weights.

The search doubles the number of blocks from ``--start`` until a trial fails, then bisects.
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
sys.path.insert(0, HERE)
import largest_batch  # noqa: E402  (the search, the fit test and the section writer are shared)
BEGIN, END = "<!-- transformer-depth:begin -->", "<!-- transformer-depth:end -->"
MODES = ("plain", "features", "state", "weights")
MiB = 1 << 20


def trial(layers: int, mode: str, args) -> dict:
    """One trial in a fresh interpreter; its JSON result (``outcome`` trained / refused / oom / failed)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--layers", str(layers), "--mode", mode,
           "--steps", str(args.steps), "--samples", str(args.samples), "--batch", str(args.batch), "--dim",
           str(args.dim), "--seq", str(args.seq), "--budget", args.budget]
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", DYMEM_DEVICE_MEMORY_LIMIT=args.budget)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {
        "outcome": "failed", "error": " | ".join((proc.stderr or "").strip().splitlines()[-3:])}
    result.update(layers=layers, seconds=round(time.perf_counter() - t0, 1))
    return result


def deepest(mode: str, args, budget_bytes: int, log) -> tuple[int, list[dict]]:
    """The most blocks that fit (0 when even ``--start`` does not), and every trial run to find it."""
    trials = []

    def ok(layers: int) -> bool:
        result = trial(layers, mode, args)
        trials.append(result)
        good = largest_batch.fits(result, budget_bytes, args.steps)
        log(f"  {mode:8s} {layers:3d} blocks: {'fits' if good else result.get('outcome')} "
            f"(max step peak {max(result.get('peaks') or [0]) / MiB:.0f} MiB, {result['seconds']:.0f} s)")
        return good

    return largest_batch.search(args.start, args.limit, ok, lambda lo: 1), trials


def report(results: dict, args, seconds: float) -> str:
    """The Markdown section for docs/benchmarks.md."""
    got = {m: results[m]["deepest"] for m in results}
    # a mode none of whose trials failed stopped at the search's limit: its depth is a lower bound
    from dymem_tf.units import parse_bytes

    capped = {m for m in results if results[m]["trials"]
              and all(largest_batch.fits(t, parse_bytes(args.budget), args.steps) for t in results[m]["trials"])}

    def depth(mode: str) -> str:
        return "-" if mode not in got else f"≥ {got[mode]}" if mode in capped else str(got[mode])

    def ratio(mode: str) -> str:
        if not (got.get("features") and got.get(mode)):
            return "-"
        return f"{'≥ ' if mode in capped else ''}{got[mode] / got['features']:.2f}x"

    late = [(m, t) for m in results for t in results[m]["trials"] if largest_batch.late_oom(t)]
    failed = ", ".join(f"{m} {t['layers']} blocks (step {t['steps_run'] + 1})" for m, t in late) or "none"
    lines = [BEGIN, "## Deepest decoder-only LM under a fixed budget: optimizer state and weights offloaded", "",
             f"`python bench/transformer_depth.py --write{f' --limit {args.limit}' if args.limit != 256 else ''}` "
             f"on this 2-core CPU machine ({seconds / 60:.0f} min; GTBM "
             f"is the emulated device, oneDNN off). `bench/model_zoo.gpt_decoder`: GPT-2-style blocks "
             f"{args.dim} wide, {args.seq} tokens, batch {args.batch}, AdamW; device capped at {args.budget}. "
             f"Every trial is a fresh process that trains {args.steps} steps on max({args.samples}, batch x "
             f"{args.steps}) samples and fits when every step trained with its measured peak under the budget. "
             "*plain*: no callback; *features*: `DymemCallback(memory_budget=\"auto\", "
             "offload_optimizer_state=False)` (feature maps only); *state*: `DymemCallback(memory_budget=\"auto\", "
             "offload_weights=False)` (feature maps and optimizer state); *weights*: "
             "`DymemCallback(memory_budget=\"auto\")` (feature maps, optimizer state and weights).", "",
             "| plain | features | state | weights | state / features | weights / features | trials | "
             "out of memory after step 1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| {depth('plain')} | {depth('features')} | {depth('state')} | "
             f"{depth('weights')} | {ratio('state')} | {ratio('weights')} | "
             f"{sum(len(r['trials']) for r in results.values())} | {failed} |",
             "", f"Deepest model (blocks) per mode (\"≥\": every trial fitted up to the search's limit of "
             f"{args.limit} blocks); every trial (blocks, outcome, each step's peak) is in "
             "[docs/transformer_depth.json](transformer_depth.json).", END]
    return "\n".join(lines)


def write_docs(section: str, results: dict) -> None:
    largest_batch.write_section(section, BEGIN, END, results, "transformer_depth.json")


def run_child(args) -> dict:
    """One trial in this fresh interpreter (see the module docstring)."""
    import dymem_tf
    import keras

    from model_zoo import gpt_decoder

    keras.utils.set_random_seed(0)
    samples = max(args.samples, args.batch * args.steps)
    model, x, y = gpt_decoder(args.batch, samples, 0, seq=args.seq, dim=args.dim, layers=args.layers)
    callback = None if args.mode == "plain" else dymem_tf.DymemCallback(
        memory_budget="auto", verbose=0, offload_optimizer_state=args.mode in ("state", "weights"),
        offload_weights=args.mode == "weights")
    result = largest_batch.measured_fit(model, x, y, args.batch, args.steps, callback)
    result["samples"] = samples
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget", default="192MiB")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--start", type=int, default=4, help="first number of blocks tried")
    parser.add_argument("--limit", type=int, default=256, help="most blocks tried")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md's section and the JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return 0
    from dymem_tf.units import parse_bytes

    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    budget_bytes = parse_bytes(args.budget)
    t0 = time.perf_counter()
    results = {}
    for mode in modes:
        print(f"GPT decoder {args.dim} wide, batch {args.batch}, mode {mode}, device {args.budget}:", flush=True)
        best, trials = deepest(mode, args, budget_bytes, lambda s: print(s, flush=True))
        results[mode] = {"deepest": best, "trials": trials}
    section = report(results, args, time.perf_counter() - t0)
    print(section)
    if args.write:
        write_docs(section, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
