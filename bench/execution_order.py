"""Step time of the planned execution order against TF's own, interleaved: what the chain costs on the CPU.

    python bench/execution_order.py                          # ResNet-50 and DenseNet-121, 64px, 3 rounds
    python bench/execution_order.py --models resnet50 --rounds 1 --onednn on
    python bench/execution_order.py --orders planned,free --rounds 5     # more rounds of the two that matter
    python bench/execution_order.py --models densenet121 --budget 80MiB  # the order under a budget

``DymemCallback(memory_budget=None, execution_order="planned")`` chains the step's ops with control edges in the
simulator's order, in bands whose ops may run side by side (``dymem_tf/planning/sequencing.py``); ``"strict"``
chains every op; ``"free"`` leaves the order to TF's executor. Each run is a fresh interpreter, with oneDNN's CPU
kernels off and on (``--onednn``), that trains ``--steps`` steps (default 24) of batch 16 with SGD and momentum
(``--optimizer sgd``: without), no budget unless ``--budget`` gives one (then each contraction is a band of its own,
and the first steps are the probe's and the calibrated plan's). Its step time is the median after the first step,
its peak the largest step peak after the first (the first three under a budget), and its peak spread that peak over
the median step peak, less one, of the bytes in use (what the order decides) and of GTBM's reserved bytes (which
also move by a pageblock or two from step to step, docs/reliability.md, "Reserved bytes from step to step"; each
run's JSON line lists them per step). The three orders alternate within each round, and the report gives planned /
free and strict / free per round and their medians. The environment passes on to the runs
(``TF_NUM_INTEROP_THREADS=1`` for one inter-op thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODELS = ("resnet50", "densenet121")
ORDERS = ("planned", "strict", "free")


#: ``--optimizer``: Keras's SGD with momentum 0.9 (whose momentum moves to a new buffer every step, see
#: docs/reliability.md) or plain SGD (no variable but batch normalisation's statistics moves)
OPTIMIZERS = ("momentum", "sgd")


def child(name: str, order: str, image_size: int, steps: int = 24, budget: str | None = None,
          optimizer: str = "momentum") -> dict:
    """One run in this interpreter: the median step time after the first, the peaks, the reserved peak of every
    step (``reserved_mib_steps``), and the plan's swap count."""
    import keras
    import numpy as np

    import dymem_tf

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import StepTimer
    from model_zoo import StepPeaks

    keras.utils.set_random_seed(0)
    app = {"resnet50": keras.applications.ResNet50, "densenet121": keras.applications.DenseNet121}[name]
    model = app(weights=None, input_shape=(image_size, image_size, 3), classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9 if optimizer == "momentum" else 0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy())
    x = np.random.default_rng(0).normal(size=(16 * steps, image_size, image_size, 3)).astype("float32")
    y = np.zeros(16 * steps, dtype="int64")
    cb = dymem_tf.DymemCallback(memory_budget=budget, verbose=0, execution_order=order)
    timer, peaks = StepTimer(), StepPeaks()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb, timer, peaks])
    skip = 3 if budget else 1  # under a budget the probe's step and the calibrated plan's first come first
    steady, in_use = peaks.peaks[skip:] or peaks.peaks, peaks.in_use[skip:] or peaks.in_use
    return {"model": name, "order": order, "onednn": bool(dymem_tf.compat.onednn_enabled()), "budget": budget,
            "optimizer": optimizer, "step_s": timer.median_step_s(),
            "peak_spread": max(steady) / statistics.median(steady) - 1.0, "peak_mib": max(steady) / 2**20,
            "reserved_mib_steps": [p / 2**20 for p in peaks.peaks],
            "in_use_spread": max(in_use) / statistics.median(in_use) - 1.0, "in_use_mib": max(in_use) / 2**20,
            "chained": next((int(n.split()[0]) for n in (cb.plan.notes if cb.plan is not None else ())
                             if " ops chained in the planned order" in n), 0),
            "bands": next((int(n.split(", in ")[1].split()[0]) for n in (cb.plan.notes if cb.plan is not None else ())
                           if " ops chained in the planned order, in " in n), None),
            "swaps": len(cb.plan.swaps) if cb.plan is not None else 0}


def run(name: str, order: str, image_size: int, onednn: str = "off", steps: int = 24,
        budget: str | None = None, optimizer: str = "momentum") -> dict:
    """:func:`child` in a fresh interpreter, oneDNN ``"on"`` or ``"off"``, under ``budget`` (None: no budget); a
    run that failed (TF's order may run out of a budget's memory) gives its error's last line as ``"error"``."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn == "on" else "0", TF_CPP_MIN_LOG_LEVEL="3",
               DYMEM_DEVICE_MEMORY_LIMIT=os.environ.get("DYMEM_DEVICE_MEMORY_LIMIT", "4GiB"))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, order, "--image-size", str(image_size),
           "--steps", str(steps), "--optimizer", optimizer] + (["--budget", budget] if budget else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = ((proc.stderr or "").strip().splitlines() or ["no output"])[-1]
        return {"model": name, "order": order, "onednn": onednn == "on", "budget": budget, "error": last}
    return json.loads(lines[-1])


def report(results: list[dict]) -> str:
    """Step time per model and oneDNN setting: each order's median, planned / free and strict / free per round and
    their medians; the largest step-to-step spread of the peak and the largest peak of each order; then the runs
    that failed."""
    failed: list[str] = []
    lines = ["| model | oneDNN | planned / strict / free s | planned / free [per round] | median | strict / free "
             "[per round] | median | in use: peak spread, peak MiB | reserved: peak spread, peak MiB |",
             "| --- | --- | --- | --- | ---: | --- | ---: | --- | --- |"]
    for name, onednn in dict.fromkeys((r["model"], r.get("onednn", False)) for r in results):
        rounds = [r for r in results if r["model"] == name and r.get("onednn", False) == onednn]
        per_round = {o: [r.get("step_s") for r in rounds if r["order"] == o] for o in ORDERS}  # None: failed
        step = {o: [x for x in per_round[o] if x is not None] for o in ORDERS}
        ratios = {o: [a / f for a, f in zip(per_round[o], per_round["free"]) if a is not None and f is not None]
                  for o in ("planned", "strict")}
        for o in ORDERS:
            errors = [r["error"] for r in rounds if r["order"] == o and "error" in r]
            if errors:
                failed.append(f"{name}, oneDNN {'on' if onednn else 'off'}, {o}: {len(errors)} of "
                              f"{len(per_round[o])} runs failed: {errors[0]}")

        def most(key: str) -> dict:
            return {o: max([r[key] or 0.0 for r in rounds if r["order"] == o and "error" not in r], default=None)
                    for o in ORDERS}

        cells = [" / ".join(f"{statistics.median(step[o]):.3f}" if step[o] else "-" for o in ORDERS)]
        for o in ("planned", "strict"):
            cells += [f"[{', '.join(f'{x:.2f}' for x in ratios[o])}]",
                      f"{statistics.median(ratios[o]):.2f}x" if ratios[o] else "-"]
        for spread, peak in (most("in_use_spread"), most("in_use_mib")), (most("peak_spread"), most("peak_mib")):
            cells.append(" / ".join("-" if spread[o] is None else f"{spread[o]:.1%}" for o in ORDERS) + ", "
                         + " / ".join("-" if peak[o] is None else f"{peak[o]:.0f}" for o in ORDERS))
        lines.append(f"| {name} | {'on' if onednn else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] * bool(failed) + failed)


def _is_budget(text: str) -> bool:
    """Whether ``text`` is a byte count ``memory_budget`` takes (:func:`dymem_tf.units.parse_bytes`) with a unit: a
    bare number would be bytes, surely a slip."""
    from dymem_tf.units import parse_bytes

    try:
        parse_bytes(text)
    except ValueError:
        return False
    return text.strip()[-1:].isalpha()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24, help="steps per run (the first is not timed)")
    parser.add_argument("--onednn", choices=("off", "on", "both"), default="both")
    parser.add_argument("--orders", default=",".join(ORDERS), help="orders to run, interleaved (free is the base)")
    parser.add_argument("--budget", help="memory_budget of every run, such as 80MiB (default: none)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="momentum",
                        help="SGD with momentum 0.9 (default) or plain SGD")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "ORDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.image_size, args.steps, args.budget,
                               args.optimizer)))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    if any(m not in MODELS for m in models) or args.rounds < 1 or args.steps < 3 or any(
            o not in ORDERS for o in orders):
        parser.error(f"--models: choose from {', '.join(MODELS)}; --orders from {', '.join(ORDERS)}; --rounds at "
                     "least 1; --steps at least 3")
    if args.budget and (not _is_budget(args.budget) or args.steps < 6):
        parser.error("--budget: bytes with a unit, such as 80MiB, and --steps at least 6")
    results = []
    settings = ("off", "on") if args.onednn == "both" else (args.onednn,)
    for _ in range(args.rounds):
        for name in models:
            for onednn in settings:
                for order in orders:
                    results.append(run(name, order, args.image_size, onednn, args.steps, args.budget,
                                       args.optimizer))
                    print(json.dumps(results[-1]), flush=True)
    print(f"python bench/execution_order.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
