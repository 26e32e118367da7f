"""Shared driver of the example scripts: synthetic data, one training run, and the with/without comparison.

Every example trains a ``keras.applications`` network on synthetic images (seeded; no download) and ends with a
summary: device peak, reserved pool, host (swap) peak, step time and final loss. ``--compare`` runs the same
training once without Dymem and once with it, each in a fresh process (the allocator's peak statistics are
per process), and prints the memory table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(description: str, default_batch: int, default_image_size: int, argv=None) -> argparse.Namespace:
    """The flags every example accepts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=int, default=default_batch, help="batch size (default %(default)s)")
    parser.add_argument("--image-size", type=int, default=default_image_size, help="square input side in pixels")
    parser.add_argument("--steps", type=int, default=6, help="training steps (the first one includes tracing)")
    parser.add_argument("--budget", default=None,
                        help="device memory budget: none (default: swap every tensor worth swapping, to show the "
                             "least memory), auto (the device: swap only what does not fit), or e.g. 512MiB (on "
                             "the CPU it caps the GTBM pool)")
    parser.add_argument("--policy", default="dymem", choices=["dymem", "vdnn", "tflms", "none"],
                        help="swap policy; 'none' trains without the Dymem callback")
    parser.add_argument("--profile", "--device", dest="profile", default=None,
                        help="planner cost-model profile (default: this machine's)")
    parser.add_argument("--logdir", default=None, help="TensorBoard log dir for the Dymem dashboard")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true", help="enable TF op determinism")
    parser.add_argument("--compare", action="store_true",
                        help="train without Dymem and with --policy, each in a fresh process, and print the table")
    parser.add_argument("--json-out", default=None, help="write the run's summary as JSON to this path")
    parser.add_argument("--quiet", action="store_true", help="no Keras progress bar")
    args = parser.parse_args(argv)
    for flag in ("batch", "image_size", "steps", "classes"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    return args


def _budget(value):
    """``--budget`` as ``DymemCallback``'s ``memory_budget``: None for none (swap every tensor worth swapping)."""
    return None if value is None or str(value).strip().lower() == "none" else value


def main(model_name: str, description: str, default_batch: int, default_image_size: int, argv=None) -> int:
    """Entry point of an example script."""
    args = parse_args(description, default_batch, default_image_size, argv)
    if args.compare:
        return compare(model_name, args)
    if _budget(args.budget) not in (None, "auto"):  # a size: the CPU device gets that much memory
        os.environ["DYMEM_DEVICE_MEMORY_LIMIT"] = str(args.budget)
    summary = train(model_name, args)
    print_summary([summary])
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0 if summary["status"] == "ok" else 1


def train(model_name: str, args: argparse.Namespace) -> dict:
    """Train ``model_name`` for ``args.steps`` steps and return the measured summary."""
    import tensorflow as tf

    import dymem_tf  # right after TF: registers the GTBM allocator before the first allocation
    from dymem_tf.keras import dry_run
    from dymem_tf.memory import allocator

    import keras
    import numpy as np

    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(args.seed)
    model = dry_run.build_model(model_name, args.image_size, args.classes)
    rng = np.random.default_rng(args.seed)
    n = args.batch * args.steps
    x = rng.uniform(0, 1, size=(n, args.image_size, args.image_size, 3)).astype("float32")
    y = rng.integers(0, args.classes, size=(n,)).astype("int64")
    callbacks = []
    dymem_cb = None
    if args.policy != "none":
        dymem_cb = dymem_tf.DymemCallback(memory_budget=_budget(args.budget), policy=args.policy,
                                          profile=args.profile, log_dir=args.logdir, verbose=0 if args.quiet else 1)
        callbacks.append(dymem_cb)
    timer = StepTimer()
    callbacks.append(timer)
    gtbm = allocator.is_active()
    if gtbm:
        allocator.reset_peak_stats()
    else:  # e.g. TF_CPU_ALLOCATOR_USE_BFC=true DYMEM_GTBM=0: TF's own allocator, peak via its memory info
        _tf_memory_info(tf, reset=True)
    status, error = "ok", ""
    history = None
    try:
        history = model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, callbacks=callbacks,
                            verbose=0 if args.quiet else 1)
    except tf.errors.ResourceExhaustedError as err:
        status, error = "oom", err.message.splitlines()[0][:200]
    except dymem_tf.BudgetTooSmallError as err:  # the planner found no swap set that fits: nothing was trained
        status, error = "too-small", str(err)[:300]
    stats = allocator.memory_stats() if gtbm else _tf_memory_info(tf)
    from dymem_tf.memory import host_pool

    host = host_pool.host_pool_stats()
    plan = dymem_cb.plan if dymem_cb is not None else None
    return {
        "model": model_name,
        "policy": args.policy,
        "batch": args.batch,
        "image_size": args.image_size,
        "steps": args.steps,
        "budget": args.budget,
        "status": status,
        "error": error,
        "gtbm": gtbm,
        "allocator": "gtbm" if gtbm else stats.get("allocator", "tensorflow"),
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "peak_bytes_reserved": stats.get("peak_bytes_reserved"),
        "persistent_bytes": stats.get("groups", {}).get("persistent", {}).get("in_use"),
        "host_peak_bytes": host.get("peak_bytes_in_use"),
        "swapped_tensors": len(plan.swaps) if plan is not None else 0,
        "swapped_bytes": sum(s.bytes for s in plan.swaps) if plan is not None else 0,
        # the simulator's device peak for this plan (same batch, the planner's cost profile): compare with the
        # measured peak_bytes_in_use
        "predicted_peak_bytes": plan.predicted.peak_bytes if plan is not None else None,
        "step_time_s": timer.median_step_s(),
        "final_loss": float(history.history["loss"][-1]) if history is not None else None,
    }


def _tf_memory_info(tf, reset: bool = False) -> dict:
    """Peak of TF's own CPU allocator (``get_memory_info``), for runs without GTBM; {} where TF has no stats."""
    try:
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
            return {}
        info = tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, RuntimeError, tf.errors.OpError):
        return {}
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("1", "true")
    return {"peak_bytes_in_use": info.get("peak"), "allocator": "tf_bfc" if bfc else "tensorflow"}


class StepTimer:
    """Keras callback measuring the wall time of each training step (the first, with tracing, is excluded)."""

    def __new__(cls):
        import keras

        class _Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times = []
                self._t0 = 0.0

            def on_train_batch_begin(self, batch, logs=None):
                self._t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._t0)

            def median_step_s(self):
                steady = self.times[1:] or self.times
                return float(sorted(steady)[len(steady) // 2]) if steady else None

        return _Timer()


def compare(model_name: str, args: argparse.Namespace) -> int:
    """Run without Dymem and with ``args.policy`` in fresh processes and print the memory table."""
    policies = ["none"] + ([args.policy] if args.policy != "none" else ["dymem"])
    summaries = []
    for policy in policies:
        summaries.append(run_in_subprocess(model_name, args, policy))
    print_summary(summaries)
    return 0 if all(s["status"] == "ok" for s in summaries) else 1


def run_in_subprocess(model_name: str, args: argparse.Namespace, policy: str, extra_env=None,
                      stderr_path=None) -> dict:
    """Run one example configuration in a fresh interpreter and return its JSON summary (the child's stderr is
    also written to ``stderr_path`` when given)."""
    import tempfile

    script = os.path.join(HERE, f"train_{model_name}.py")
    if not os.path.exists(script):
        raise ValueError(f"no example script for {model_name!r} ({script})")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        cmd = [sys.executable, script, "--batch", str(args.batch), "--image-size", str(args.image_size),
               "--steps", str(args.steps), "--policy", policy, "--classes", str(args.classes), "--seed", str(args.seed),
               "--json-out", out, "--quiet"]
        if args.budget:
            cmd += ["--budget", str(args.budget)]
        if args.profile:
            cmd += ["--profile", args.profile]
        if args.deterministic:
            cmd.append("--deterministic")
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        env = dict(os.environ, **(extra_env or {}))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if stderr_path:
            with open(stderr_path, "w") as fh:
                fh.write(proc.stderr or "")
        if os.path.exists(out):
            with open(out) as fh:
                return json.load(fh)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"model": model_name, "policy": policy, "batch": args.batch, "status": "failed",
                "error": " | ".join(tail)}


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def print_summary(summaries: list[dict]) -> None:
    """The end-of-run memory table (MiB; step time is the median of the steps after the first)."""
    header = ["model", "policy", "batch", "status", "device peak MiB", "reserved MiB", "host peak MiB",
              "swapped", "step s", "loss"]
    rows = []
    for s in summaries:
        rows.append([s.get("model", ""), s.get("policy", ""), str(s.get("batch", "")), s.get("status", ""),
                     _mib(s.get("peak_bytes_in_use")), _mib(s.get("peak_bytes_reserved")),
                     _mib(s.get("host_peak_bytes")), str(s.get("swapped_tensors", "-")),
                     "-" if s.get("step_time_s") is None else f"{s['step_time_s']:.3f}",
                     "-" if s.get("final_loss") is None else f"{s['final_loss']:.6f}"])
    print()
    print(tabulate(rows, headers=header, tablefmt="simple", disable_numparse=True))
    if len(summaries) == 2 and all(s.get("peak_bytes_in_use") for s in summaries):
        base, ours = summaries
        print(f"\ndevice peak with {ours['policy']}: {ours['peak_bytes_in_use'] / base['peak_bytes_in_use']:.2f}x "
              f"of without; step time: {ours['step_time_s'] / base['step_time_s']:.2f}x")
    for s in summaries:
        if s.get("error"):
            print(f"{s.get('policy')}: {s['error']}")
