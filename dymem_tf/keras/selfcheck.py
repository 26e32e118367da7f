"""``python -m dymem_tf selfcheck``: check on this machine what can be checked of dymem_tf, and say what was not.

Checks, in order (each one a row of the report; one that raises is a failure, the others still run):

* ``gtbm``: which devices the GTBM allocator serves. On the CPU device its statistics must agree with
  ``tf.config.experimental.get_memory_info("CPU:0")``. Each GPU gets a row "GTBM serves GPU:<k>: yes/no (opt-in
  DYMEM_GTBM_GPU=1)" with the reason when not (on a machine without GPUs one row says what the opt-in did).
* ``kernels``: the swap ops have a kernel for every visible device type.
* ``round trip``: ``DymemSwapOut`` then ``DymemSwapIn`` (and the partial pair) gives back every bit, on every
  visible device, for every dtype the ops accept. A dtype TensorFlow keeps in host memory on that device (int32 on
  a GPU) is never swapped (the pass excludes it, :func:`dymem_tf.passes.graph_capture.in_host_memory`): its row
  says so.
* ``bandwidth`` (GPUs only): device-to-host and host-to-device rates of the swap ops, and how much of the copies a
  matmul running at the same time hides. On a CPU the row says it was skipped.
* ``training``: a 3-step tiny training with op determinism, without and with swapping, gives identical losses and
  weights, and the swap ops ran.

The exit status is 1 when any check failed, else 0. ``DYMEM_SELFCHECK_INJECT`` (a comma-separated list of
``round trip``/``training``) is a test hook: it corrupts one byte (or one loss) that the named check then compares,
to show that a failure is caught and gives a non-zero exit.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

INJECT_ENV = "DYMEM_SELFCHECK_INJECT"

OK, FAIL, SKIP, INFO, WARN = "ok", "FAIL", "skipped", "info", "warning"


@dataclasses.dataclass
class Result:
    """One row of the report."""

    check: str
    device: str
    status: str
    detail: str


def _injected(check: str) -> bool:
    return check in {part.strip() for part in os.environ.get(INJECT_ENV, "").split(",")}


def _short(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:GPU:0`` -> ``GPU:0``."""
    return device.split("device:")[-1]


def visible_devices() -> list[str]:
    """The logical devices TensorFlow runs ops on: ``CPU:0`` first, then the GPUs."""
    import tensorflow as tf

    return [_short(d.name) for d in tf.config.list_logical_devices("CPU")[:1] + tf.config.list_logical_devices("GPU")]


# ------------------------------------------------------------------------------------------------------- checks

def check_gtbm(devices: list[str]) -> list[Result]:
    import tensorflow as tf

    from dymem_tf import units
    from dymem_tf.memory import allocator

    rows = []
    if os.environ.get("DYMEM_GTBM", "1").strip().lower() in ("0", "false", "off", "no"):
        rows.append(Result("gtbm", "CPU:0", SKIP, "GTBM is turned off (DYMEM_GTBM=0): TensorFlow's allocator serves "
                                                  "the CPU device"))
    elif not allocator.is_active():
        try:
            allocator.memory_stats()
            reason = "inactive"
        except allocator.GtbmNotActiveError as err:
            reason = str(err)
        rows.append(Result("gtbm", "CPU:0", FAIL, reason))
    else:
        stats = allocator.memory_stats()
        info = tf.config.experimental.get_memory_info("CPU:0")
        limit = stats["bytes_limit"]
        detail = (f"serves the CPU device: limit {units.format_bytes(limit) if limit else 'none'}, "
                  f"in use {units.format_bytes(stats['bytes_in_use'])}")
        if info["current"] != stats["bytes_in_use"] or info["peak"] != stats["peak_bytes_in_use"]:
            rows.append(Result("gtbm", "CPU:0", FAIL, f"{detail}; get_memory_info('CPU:0') disagrees: {info}"))
        else:
            rows.append(Result("gtbm", "CPU:0", OK, detail + "; get_memory_info('CPU:0') agrees"))
    return rows + check_gtbm_gpus(devices)


def check_gtbm_gpus(devices: list[str]) -> list[Result]:
    """One row per GPU: "GTBM serves GPU:<k>: yes/no (opt-in DYMEM_GTBM_GPU=1)", with the reason when not; on a
    machine without GPUs one row for GPU:0 that says what the opt-in did (nothing)."""
    from dymem_tf.memory import allocator

    opt_in = f"opt-in {allocator.GPU_ENV}=1"
    status = allocator.gpu_status() if os.environ.get("DYMEM_GTBM", "1").strip().lower() not in (
        "0", "false", "off", "no") else {"requested": allocator.gpu_requested(), "devices": {},
                                          "reason": "DYMEM_GTBM=0 turns GTBM off on every device"}
    gpus = [d for d in devices if d.startswith("GPU")]
    if not gpus:
        said = "set, but no GPU is visible: it does nothing" if status["requested"] else "not set; no GPU is visible"
        return [Result("gtbm", "GPU", INFO, f"GTBM serves GPU:0: no ({opt_in}: {said})")]
    rows = []
    for device in gpus:
        served = status["devices"].get(device, {}).get("served", False)
        why = status["devices"].get(device, {}).get("reason") or status.get("reason") or "not requested"
        detail = f"GTBM serves {device}: {'yes' if served else 'no'} ({opt_in}" + ("" if served else f"; {why}") + ")"
        rows.append(Result("gtbm", device, OK if served else (WARN if status["requested"] else INFO), detail))
    return rows


#: The swap ops a plan may insert on any device (whole and partial swaps of feature maps).
SWAP_OPS = ("DymemSwapOut", "DymemSwapIn", "DymemSwapOutPartial", "DymemSwapInPartial")


def check_kernels(devices: list[str]) -> list[Result]:
    from dymem_tf import compat
    from dymem_tf.memory.native import load_ops_library

    load_ops_library()
    visible = {d.split(":")[0] for d in devices}
    rows = []
    for kind in ("CPU", "GPU"):
        missing = [op for op in SWAP_OPS if kind not in compat.registered_kernel_devices(op)]
        if kind in visible:
            if missing:
                rows.append(Result("kernels", kind, FAIL, f"no {kind} kernel for {', '.join(missing)}"))
            else:
                rows.append(Result("kernels", kind, OK, f"{', '.join(SWAP_OPS)} have kernels"))
        else:
            rows.append(Result("kernels", kind, INFO, f"{'not compiled in' if missing else 'compiled in'}; not run "
                                                      f"(no {kind} visible)"))
    return rows


def _random_tensor(dtype, shape: tuple[int, ...], rng):
    """A tensor of ``dtype`` with random bits (NaN payloads, denormals and all)."""
    import tensorflow as tf

    n = int(np.prod(shape))
    if dtype == tf.bool:
        return tf.constant(rng.integers(0, 2, size=shape).astype(bool))
    raw = rng.integers(0, 256, size=(n, dtype.size) if dtype.size > 1 else (n,), dtype=np.uint8)
    return tf.reshape(tf.bitcast(tf.constant(raw), dtype), shape)


def check_round_trip(device: str, shapes=((1031, 3), (0, 5))) -> Result:
    import tensorflow as tf

    from dymem_tf.ops import swap_ops
    from dymem_tf.passes.graph_capture import in_host_memory

    rng = np.random.default_rng(12)
    exact, host_kept, wrong = [], [], []
    corrupt = _injected("round trip")
    for dtype in swap_ops.SUPPORTED_DTYPES:
        if in_host_memory(device, dtype.name):
            host_kept.append(dtype.name)
            continue
        for shape in shapes:
            source = _random_tensor(dtype, shape, rng)
            with tf.device(device):
                x = tf.identity(source)
                host = swap_ops.swap_out(x)
                back = swap_ops.swap_in(host)
                # a partial swap's two parts, joined again (its first rows kept on the device)
                whole = swap_ops.swap_in_partial(*swap_ops.swap_out_partial(x, 7)) if shape[0] > 7 else back
            if whole.numpy().tobytes() != source.numpy().tobytes():
                wrong.append(f"{dtype.name}{list(shape)} (partial swap)")
            expected = source.numpy().tobytes()
            got = bytearray(back.numpy().tobytes())
            if corrupt and got:
                got[0] ^= 0x01
                corrupt = False
            where = _short(back.device) if back.device else "?"
            if host.numpy().tobytes() != expected or bytes(got) != expected or back.shape != source.shape:
                wrong.append(f"{dtype.name}{list(shape)}")
            elif where != device:
                wrong.append(f"{dtype.name}{list(shape)} (came back on {where})")
        if not any(w.startswith(dtype.name + "[") for w in wrong):
            exact.append(dtype.name)
    detail = f"bit-exact for {len(exact)} dtypes ({', '.join(exact)})"
    if host_kept:
        detail += (f"; {', '.join(host_kept)} not swapped: TensorFlow keeps it in host memory on this device, and "
                   "the pass never swaps it")
    if wrong:
        return Result("round trip", device, FAIL, f"different after the round trip: {', '.join(wrong)}; {detail}")
    return Result("round trip", device, OK, detail)


def check_bandwidth(device: str, megabytes: int = 128) -> Result:
    """Copy rates of the swap ops each way, and the share of the copies a concurrent matmul hides (GPUs only).

    Measured inside ``tf.function`` graphs, as the train step runs them: TF's executor issues independent ops
    concurrently, the copies go to TF's host-to-device and device-to-host streams, the matmuls to the compute
    stream. The functions return only device tensors, so no extra copy is timed."""
    if not device.startswith("GPU"):
        return Result("bandwidth", device, SKIP, "host link and overlap are measured on GPUs only (on the CPU the "
                                                 "swap ops are a memcpy within the same memory)")
    import tensorflow as tf

    from dymem_tf.ops import swap_ops

    n = megabytes * (1 << 20) // 4
    reps = 4

    @tf.function
    def copies_out(v):
        hosts = [swap_ops.swap_out(v) for _ in range(reps)]
        with tf.control_dependencies(hosts):
            return tf.identity(v[:1])

    @tf.function
    def copies_in(h):
        return tf.add_n([swap_ops.swap_in(h)[:1] for _ in range(reps)])

    @tf.function
    def matmuls(m):
        return tf.add_n([tf.reduce_sum(tf.matmul(m, m + float(i))) for i in range(8)])

    @tf.function
    def both(m, v):
        y = tf.add_n([tf.reduce_sum(tf.matmul(m, m + float(i))) for i in range(8)])
        z = v
        for _ in range(reps // 2):
            z = swap_ops.swap_in(swap_ops.swap_out(z))
        return y, z[:1]

    def timed(fn, *args) -> float:
        fn(*args)  # trace and warm up
        tf.test.experimental.sync_devices()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn(*args)
            tf.test.experimental.sync_devices()
            best = min(best, time.perf_counter() - start)
        return best

    with tf.device(device):
        x = tf.random.uniform((n,))
        a = tf.random.uniform((4096, 4096))
        host = swap_ops.swap_out(x)
        t_out = timed(copies_out, x)
        t_in = timed(copies_in, host)
        t_mm = timed(matmuls, a)
        t_both = timed(both, a, x)
    nbytes = n * 4
    d2h, h2d = reps * nbytes / t_out, reps * nbytes / t_in
    t_copies = (reps // 2) * nbytes * (1 / d2h + 1 / h2d)
    hidden = max(0.0, min(1.0, (t_mm + t_copies - t_both) / max(min(t_mm, t_copies), 1e-9)))
    detail = (f"device-to-host {d2h / 1e9:.1f} GB/s, host-to-device {h2d / 1e9:.1f} GB/s ({megabytes} MiB copies); "
              f"matmuls running at the same time hid {hidden:.0%} of the shorter of the two")
    if hidden < 0.5:
        return Result("bandwidth", device, WARN, detail + ": copies barely overlap compute, so swaps will stall")
    return Result("bandwidth", device, OK, detail)


def _tiny_training(callbacks, steps: int = 3, batch: int = 8):
    import keras

    keras.backend.clear_session()  # the same op names in both runs
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
    b = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(a)
    c = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(keras.layers.Add()([a, b]))
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(c))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True), jit_compile=False)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(steps * batch, 16, 16, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[np.arange(steps * batch) % 10]
    hist = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    return hist.history["loss"], [w.numpy() for w in model.weights]


def check_training(device: str) -> Result:
    import tensorflow as tf

    from dymem_tf.keras.callback import DymemCallback
    from dymem_tf.memory import host_pool

    tf.config.experimental.enable_op_determinism()
    base_loss, base_weights = _tiny_training([])
    swaps_before = host_pool.host_pool_stats()["num_swap_outs"]
    cb = DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)
    loss, weights = _tiny_training([cb])
    ran = host_pool.host_pool_stats()["num_swap_outs"] - swaps_before
    if _injected("training"):
        loss = [np.nextafter(np.float32(loss[0]), np.float32(np.inf)).item()] + list(loss[1:])
    planned = len(cb.plan.swaps) if cb.plan is not None else 0
    if not planned or not ran:
        return Result("training", device, FAIL, f"the step was not rewritten (planned swaps: {planned}, swap-outs "
                                                f"run: {ran}; skipped: {[s.kind.value for s in cb.skipped]})")
    same_weights = len(weights) == len(base_weights) and all(
        np.array_equal(w, b) for w, b in zip(weights, base_weights))
    detail = f"3 steps, {planned} tensors swapped per step ({ran} swap-outs ran)"
    if loss != base_loss or not same_weights:
        return Result("training", device, FAIL, f"{detail}; losses {loss} with swapping, {base_loss} without; "
                                                f"weights {'equal' if same_weights else 'differ'}")
    return Result("training", device, OK, f"{detail}: losses and weights identical to training without swapping "
                                          "(op determinism on)")


# ------------------------------------------------------------------------------------------------------- driver

def run_checks(training: bool = True) -> tuple[list[Result], list[str]]:
    """Every check's rows, and the devices they ran on."""
    devices = visible_devices()
    results: list[Result] = []

    def attempt(name, device, fn, *args):
        try:
            out = fn(*args)
        except Exception as err:  # pylint: disable=broad-except  (a check that raises is a failed check)
            first = (str(err).strip().splitlines() or [""])[0]
            out = Result(name, device, FAIL, f"{type(err).__name__}: {first}"[:300])
        results.extend(out if isinstance(out, list) else [out])

    attempt("gtbm", "-", check_gtbm, devices)
    attempt("kernels", "-", check_kernels, devices)
    for device in devices:
        attempt("round trip", device, check_round_trip, device)
    for device in devices:
        attempt("bandwidth", device, check_bandwidth, device)
    if training:
        default = next((d for d in devices if d.startswith("GPU")), devices[0])
        attempt("training", default, check_training, default)
    return results, devices


def report(results: list[Result], devices: list[str]) -> str:
    import keras
    import tensorflow as tf
    from tabulate import tabulate

    from dymem_tf.memory import native

    built = native.build_info().get("tensorflow_version")
    built = f" (native libraries built for {built})" if built else ""
    counts = {status: sum(r.status == status for r in results) for status in (OK, FAIL, WARN, SKIP, INFO)}
    lines = [f"dymem_tf selfcheck: TensorFlow {tf.__version__}{built}, Keras {keras.__version__}; devices: "
             f"{', '.join(devices)}",
             tabulate([(r.check, r.device, r.status, r.detail) for r in results],
                      headers=("check", "device", "result", "detail"), tablefmt="simple", disable_numparse=True,
                      maxcolwidths=[None, None, None, 90]),
             f"selfcheck: {counts[OK]} ok, {counts[FAIL]} failed, {counts[WARN]} warnings, {counts[SKIP]} skipped"]
    if not any(d.startswith("GPU") for d in devices):
        lines.append("No GPU is visible: the GPU kernels, the host link and the overlap were not exercised.")
    return "\n".join(lines)


def main(training: bool = True) -> int:
    results, devices = run_checks(training=training)
    print(report(results, devices))
    return 1 if any(r.status == FAIL for r in results) else 0
