"""A loop of ``fit`` calls in one process: host memory, device peaks and plans made per fit, with and without
Dymem (issue 46: "One fit, one session").

Each configuration runs in its own Python process: ``--fits`` calls of ``model.fit(..., epochs=1)`` on the same
model, with one ``DymemCallback`` for all of them (``shared``) or a new one per fit (``fresh``), for each
``memory_budget`` of ``--budgets`` (``auto``, ``none``, a size such as ``36MiB``, or ``0.6x`` of the plain step's
peak: one that forces swapping), and a control without the callback (``plain``, run first). After each fit it
records the process's resident set (``/proc``), the device's peak bytes in use and reserved in that fit (GTBM's,
peaks reset before it), the plans the pass made so far (the process's plan cache), the graphs TensorFlow offered to
the pass, the live ``FuncGraph``s, the gradient functions in TensorFlow's registry (each trace of a train step pins
its graph there: ``compat.new_gradients``) and the callback's records.

    python bench/fit_loop.py                       # MobileNetV2 64px, batch 16, Adam, 30 fits of 64 samples
    python bench/fit_loop.py --model small --fits 12 --json out.json

A configuration holds when the resident set after the last fit is within ``--rss-tolerance`` MiB of the one after
fit 3, the device's peaks in use of fits 2 on are equal to 64 KiB (where a plan trains: a step left as compiled
peaks as TensorFlow's executor orders it, as without Dymem), plans were made in the first fit only, and the live
graphs, gradient functions and records after the last fit are those after fit 3.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
    import gc, json, os, sys
    import numpy as np, tensorflow as tf
    import dymem_tf
    import keras
    from dymem_tf.memory import devices
    from dymem_tf.passes import caches, graph_pass
    from tensorflow.python.framework import ops as tf_ops
    from tensorflow.python.framework.func_graph import FuncGraph

    spec = json.loads(sys.argv[1])
    keras.utils.set_random_seed(0)

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def build(name, size):
        if name == "mobilenetv2":
            net = keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10)
        else:  # a small CNN: three convolutions and a classifier
            inp = keras.Input((size, size, 3))
            h = inp
            for width in (16, 32, 32):
                h = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(h)
            net = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
        net.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return net

    model = build(spec["model"], spec["size"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(spec["samples"], spec["size"], spec["size"], 3)).astype("float32")
    y = np.arange(spec["samples"]) % 10
    budget = {"auto": "auto", "none": None}.get(spec["budget"], spec["budget"])  # a size, or bytes (an int)
    shared = dymem_tf.DymemCallback(budget, verbose=0) if spec["callback"] == "shared" else None
    rows = []
    for fit in range(spec["fits"]):
        devices.reset_device_peaks()
        if spec["callback"] == "plain":
            callbacks = []
        else:
            callbacks = [shared if shared is not None else dymem_tf.DymemCallback(budget, verbose=0)]
        history = model.fit(x, y, batch_size=spec["batch"], epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        records = len(callbacks[0].records) if callbacks else 0
        swaps = len(callbacks[0].plan.swaps) if callbacks and callbacks[0].plan is not None else 0
        del callbacks
        gc.collect()
        stats = devices.device_memory_stats() or {}
        rows.append({"fit": fit + 1, "rss_mib": round(rss_mib(), 1),
                     "peak_reserved": int(stats.get("peak_bytes_reserved", 0)),
                     "peak_in_use": int(stats.get("peak_bytes_in_use", 0)),
                     "plans_made": caches.SHARED_PLANS.stored, "graphs_offered": graph_pass.graphs_offered(),
                     "func_graphs": sum(isinstance(o, FuncGraph) for o in gc.get_objects()),
                     "gradient_functions": len(tf_ops._gradient_registry._registry), "records": records,
                     "swaps": swaps,
                     "loss": float(history.history["loss"][-1])})
    print("RESULT" + json.dumps(rows), flush=True)
""")


#: How far the device's peaks in use of two fits of one planned step may differ: what the fit allocates besides the
#: step (Keras' first-fit bookkeeping, the iterator's buffers) moves them by a few KiB.
PEAK_TOLERANCE = 64 << 10


def run_one(spec: dict, env: dict) -> list[dict]:
    """The rows of one configuration, run in a fresh Python process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT"):])


def verdict(rows: list[dict], tolerance_mib: float) -> dict:
    """What the loop shows: RSS growth from fit 3 to the last, whether the device peaks of fits 2 on are equal,
    and whether plans were made after the first fit."""
    third = rows[min(2, len(rows) - 1)]
    growth = rows[-1]["rss_mib"] - third["rss_mib"]
    # the bytes in use, which the plan decides, within PEAK_TOLERANCE (reserved bytes move by whole pageblocks)
    in_use = [r["peak_in_use"] for r in rows[1:]] or [0]
    peaks_equal = max(in_use) - min(in_use) <= PEAK_TOLERANCE
    replanned = rows[-1]["plans_made"] - rows[0]["plans_made"]
    kept = {key: rows[-1][key] - third[key] for key in ("func_graphs", "gradient_functions", "records")}
    # a step nothing planned (the step as compiled fits) peaks as TensorFlow's executor orders it, as without Dymem
    planned = any(r["records"] for r in rows)
    peaks_hold = peaks_equal or not planned
    reserved = [r["peak_reserved"] for r in rows[1:]]
    return {"rss_growth_mib": round(growth, 1), "peaks_equal_from_fit_2": peaks_equal, "planned": planned,
            "reserved_spread_mib": round((max(reserved) - min(reserved)) / 2**20, 1) if reserved else 0.0,
            "plans_after_fit_1": replanned, "growth_from_fit_3": kept,
            "holds": growth <= tolerance_mib and peaks_hold and not replanned and not any(kept.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenetv2", choices=("mobilenetv2", "small"))
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--fits", type=int, default=30)
    parser.add_argument("--budgets", default="auto,none,0.6x",
                        help="comma-separated memory_budget values: auto, none, a size, or a share of the plain "
                             "step's peak reserved bytes (0.6x); a size or share must force swapping")
    parser.add_argument("--callbacks", default="shared,fresh")
    parser.add_argument("--rss-tolerance", type=float, default=50.0, help="MiB from fit 3 to the last fit")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results, ok = {}, True
    configs = [("plain", "-")] + [(c, b) for b in args.budgets.split(",") for c in args.callbacks.split(",")]
    print(f"command: python bench/fit_loop.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"{'callback':<8} {'budget':<8} {'RSS fit 1':>10} {'fit 3':>8} {'last':>8} {'growth':>7} "
          f"{'in use fit 2 / last':>20} {'reserved spread':>16} {'plans made':>11} {'holds':>6}")
    plain_peak = None
    for callback, budget in configs:
        spec = {"model": args.model, "size": args.size, "batch": args.batch, "samples": args.samples,
                "fits": args.fits, "budget": budget, "callback": callback}
        if budget.endswith("x"):  # a share of the plain step's peak, as the control measured it
            spec["budget"] = int(float(budget[:-1]) * plain_peak)
        rows = run_one(spec, env)
        if callback == "plain":
            plain_peak = max(r["peak_reserved"] for r in rows)
        v = verdict(rows, args.rss_tolerance)
        results[f"{callback}/{budget}"] = {"rows": rows, "verdict": v}
        ok &= v["holds"] or callback == "plain"
        peak = f"{rows[min(1, len(rows) - 1)]['peak_in_use'] / 2**20:.1f} / {rows[-1]['peak_in_use'] / 2**20:.1f}"
        print(f"{callback:<8} {budget:<8} {rows[0]['rss_mib']:>10.0f} {rows[min(2, len(rows) - 1)]['rss_mib']:>8.0f} "
              f"{rows[-1]['rss_mib']:>8.0f} {v['rss_growth_mib']:>7.1f} {peak:>20} {v['reserved_spread_mib']:>16.1f} "
              f"{rows[-1]['plans_made']:>5} ({v['plans_after_fit_1']:+d}) {str(v['holds']):>6}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
