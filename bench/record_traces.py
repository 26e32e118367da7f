"""Record GTBM allocation traces of real training steps, one fresh process per model.

    python bench/record_traces.py --models resnet50,densenet121,inception_v3 --out-dir build/traces

Each model trains ``--warmup`` step(s) (tracing, the Dymem pass, optimizer slots) and then ``--steps`` more steps
inside :func:`dymem_tf.memory.allocator.record_trace`, which writes every allocation and free of the CPU device's GTBM pool
as CSV (``id,lower,upper,size,group,offset,op,step,...``: MiniMalloc's columns plus the mobility group GTBM used).
``python -m dymem_tf.memory.replay`` (and ``bench/run_all.py``) replays them through GTBM, best fit and first fit.

Only allocations made while recording are in the trace: the weights and optimizer slots, allocated before, are not,
so a trace is the step's own working set (activations, gradients, temporaries, swap-ins).
Each model writes ``<model>_<policy>_b<batch>_<size>px.csv`` and a ``.json`` next to it with the settings and the
trace's record counts; ``--reuse`` skips models whose files exist with the same settings.
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
DEFAULT_IMAGE_SIZES = {"vgg16": 64, "resnet50": 64, "densenet121": 64, "inception_v3": 96}


def trace_name(model: str, policy: str, batch: int, image_size: int) -> str:
    """File stem of a recorded trace."""
    return f"{model}_{policy}_b{batch}_{image_size}px"


def _child(args) -> int:
    """Train one model and record the steps after the warm-up (runs in a fresh interpreter)."""
    import tensorflow as tf

    import dymem_tf  # right after TF: registers the GTBM allocator
    from dymem_tf.keras import dry_run
    from dymem_tf.memory import allocator

    import keras
    import numpy as np

    if not allocator.is_active():
        print("error: the GTBM allocator is not active in this process; cannot record a trace", file=sys.stderr)
        return 2
    keras.utils.set_random_seed(0)
    model = dry_run.build_model(args.model, args.image_size, 10)
    rng = np.random.default_rng(0)
    steps = args.warmup + args.steps
    n = args.batch * steps
    x = rng.uniform(0, 1, size=(n, args.image_size, args.image_size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int64")
    out = args.out

    class _Record(keras.callbacks.Callback):
        """Enters ``record_trace`` at the first step after the warm-up and leaves it when training ends."""

        def __init__(self):
            super().__init__()
            self._ctx = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup and self._ctx is None:
                self._ctx = allocator.record_trace(out)
                self._ctx.__enter__()

        def on_train_end(self, logs=None):
            if self._ctx is not None:
                self._ctx.__exit__(None, None, None)
                self._ctx = None

    callbacks = []
    if args.policy != "none":
        callbacks.append(dymem_tf.DymemCallback(memory_budget=None, policy=args.policy, verbose=0))
    recorder = _Record()
    callbacks.append(recorder)  # last: its batch-begin runs after the Dymem callback's
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, callbacks=callbacks, verbose=0)
    info = allocator.trace_info()
    meta = {"model": args.model, "policy": args.policy, "batch": args.batch, "image_size": args.image_size,
            "warmup": args.warmup, "steps": args.steps, "records": int(info["records"]),
            "dropped": int(info["dropped"]), "events": int(info["events"]), "path": out,
            "tensorflow": tf.__version__, "train_s": time.perf_counter() - t0}
    with open(os.path.splitext(out)[0] + ".json", "w") as fh:
        json.dump(meta, fh, indent=1)
    print(json.dumps(meta))
    return 0


def record(model: str, out_dir: str, policy: str = "dymem", batch: int = 16, image_size: int | None = None,
           warmup: int = 1, steps: int = 2, reuse: bool = False, timeout: float = 900) -> dict:
    """Record one model's trace in a fresh process; returns its metadata (``status`` ok / failed / reused)."""
    image_size = image_size or DEFAULT_IMAGE_SIZES.get(model, 64)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, trace_name(model, policy, batch, image_size))
    csv_path, meta_path = stem + ".csv", stem + ".json"
    if reuse and os.path.exists(csv_path) and os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        if (meta.get("warmup"), meta.get("steps")) == (warmup, steps):
            return dict(meta, status="reused", path=csv_path)
    for stale in (csv_path, meta_path):
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--policy", policy,
           "--batch", str(batch), "--image-size", str(image_size), "--warmup", str(warmup), "--steps", str(steps),
           "--out", csv_path]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        rc, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, [f"timed out after {timeout:.0f}s"]
    wall = time.perf_counter() - t0
    if rc == 0 and os.path.exists(csv_path) and os.path.exists(meta_path):
        with open(meta_path) as fh:
            meta = json.load(fh)
        return dict(meta, status="ok", path=csv_path, wall_s=wall)
    return {"model": model, "policy": policy, "batch": batch, "image_size": image_size, "status": "failed",
            "error": " | ".join(tail), "path": csv_path, "wall_s": wall}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,densenet121,inception_v3")
    parser.add_argument("--out-dir", default=os.path.join(REPO, "build", "traces"))
    parser.add_argument("--policy", default="dymem", choices=["dymem", "vdnn", "tflms", "none"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=0, help="0: 64 (inception_v3: 96)")
    parser.add_argument("--warmup", type=int, default=1, help="steps trained before recording starts")
    parser.add_argument("--steps", type=int, default=2, help="steps recorded")
    parser.add_argument("--reuse", action="store_true", help="keep traces already recorded with these settings")
    # internal: the per-model child process
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch <= 0 or args.steps <= 0 or args.warmup < 0:
        parser.error("--batch and --steps must be positive, --warmup non-negative")
    if args.child:
        return _child(args)
    failed = 0
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        meta = record(model, args.out_dir, args.policy, args.batch, args.image_size or None, args.warmup,
                      args.steps, args.reuse)
        if meta["status"] == "failed":
            failed += 1
            print(f"{model}: failed: {meta['error']}", flush=True)
        else:
            print(f"{model}: {meta['status']}, {meta['records']} allocations -> {meta['path']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
