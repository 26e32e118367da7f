"""Writes what TensorBoard shows of a Dymem run: ``dymem/...`` scalars and the "Dymem" dashboard's data files.

:class:`DymemSummaryWriter` is what :class:`dymem_tf.DymemCallback` uses when it has a log dir; it can also be used
by hand. For a log dir ``D`` it writes the run ``D/dymem``: a ``tf.summary`` event file with the scalars (they show
in the Scalars dashboard too) and ``D/dymem/plugins/dymem/`` with the plan, the modelled timeline and swap schedule,
per-step statistics and, when recorded, the allocator trace (layout: :mod:`tensorboard_plugin_dymem.logdata`).
Given a Keras ``TensorBoard`` callback's log dir, ``dymem`` sits next to its ``train`` and ``validation`` runs.

A new writer on a directory starts the run's dashboard data afresh (one training session per run); the scalars
append to the event files like any ``tf.summary`` writer's.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import numbers
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tensorboard_plugin_dymem import logdata

#: Scalars written per step (when the stats have them), by the key in the stats dict. Host-pool keys carry the
#: ``host_`` prefix the callback gives them; ``*_per_step`` keys are differences of the cumulative counters.
DEVICE_SCALARS = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved", "reserved_overhead",
                  "extent", "peak_extent", "largest_free_block", "bytes_limit", "num_failed_allocs")
HOST_SCALARS = ("host_bytes_in_use", "host_peak_bytes_in_use", "host_bytes_swapped_out_per_step",
                "host_bytes_swapped_in_per_step")
PLAN_SCALARS = ("planned_swap_bytes", "modelled_stall_s")
_PER_STEP = {"host_bytes_swapped_out": "host_bytes_swapped_out_per_step",
             "host_bytes_swapped_in": "host_bytes_swapped_in_per_step"}
MAX_PEAK_TENSORS = logdata.MAX_PEAK_TENSORS
#: Allocations a run's trace keeps by default: enough for a few steps of a large model, and what the dashboard
#: parses in about ten seconds (once; it caches the result).
DEFAULT_TRACE_RECORDS = 500_000


def scalar_tag(key: str) -> str:
    """``dymem/device/<key>``, ``dymem/host/<key without host_>`` or ``dymem/plan/<key>``."""
    if key.startswith("host_"):
        return f"dymem/host/{key[len('host_'):]}"
    if key in PLAN_SCALARS:
        return f"dymem/plan/{key}"
    return f"dymem/device/{key}"


def _is_group_key(key: str) -> bool:
    return any(g in key for g in logdata.GROUPS)


def flatten_stats(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numbers of ``stats`` (nested dicts joined with ``/``); anything else is left out."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_stats(value, prefix=f"{name}/"))
        elif isinstance(value, bool) or value is None:
            continue
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if math.isfinite(number):
                out[name] = int(value) if isinstance(value, numbers.Integral) else number
    return out


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old or the new file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


class DymemSummaryWriter:
    """Writes one Dymem run under ``<log_dir>/<run_name>``.

    Args:
        log_dir: the log directory (TensorBoard's ``--logdir`` or a directory under it).
        run_name: the run's subdirectory; ``"dymem"`` by default.
        profile: the cost-model profile (name or :class:`~dymem_tf.planning.device_profiles.DeviceProfile`) that planned the
            step; defaults to the one the plan records (``params.profile``, else its ``device``). Used to
            simulate the plan for the timeline and schedule.
    """

    def __init__(self, log_dir: str, run_name: str = logdata.RUN_SUBDIR, profile=None):
        if not log_dir:
            raise ValueError("DymemSummaryWriter needs a log directory")
        self.log_dir = os.fspath(log_dir)
        self.run_dir = os.path.join(self.log_dir, run_name)
        self.plugin_dir = logdata.plugin_dir(self.run_dir)
        self.profile = profile
        os.makedirs(self.plugin_dir, exist_ok=True)
        for name in logdata.DATA_FILES:  # data of an earlier session in this directory would mix with ours
            path = os.path.join(self.plugin_dir, name)
            if os.path.exists(path):
                os.remove(path)
        self._meta: dict[str, Any] = {"version": logdata.FORMAT_VERSION, "writer": _writer_version(),
                                      "created": time.time(), "notes": []}
        self._tf_writer = None
        self._steps_fh = None
        self._counters: dict[str, float] = {}
        self._warned: set[str] = set()
        self._closed = False
        self._tracing = False
        self._trace_device = None  # the pool being traced (None: the CPU device)
        self._plans = 0  # plans written: each gets a line of plans.jsonl, each step the index of the newest
        self._save_meta()

    # ------------------------------------------------------------------------------------------------ public API
    def write_plan(self, record) -> None:
        """Write the plan of one traced step (a :class:`dymem_tf.passes.step_pass.TraceRecord`: ``function_name``,
        ``plan``, ``step_graph``, ``report``), its simulated timeline and its swap schedule, and add it to the run's
        plans (``plans.jsonl``: predicted against measured peak, calibration); the steps written after it run it."""
        self._check_open()
        plan, step_graph = record.plan, record.step_graph
        atomic_write_text(os.path.join(self.plugin_dir, logdata.PLAN_FILE), plan.to_json() + "\n")
        self._append_line(logdata.PLANS_FILE, plan_entry(record, self._plans))
        self._plans += 1
        report = getattr(record, "report", None)
        self._meta.update({
            "graph_name": getattr(record, "function_name", None), "batch_size": plan.batch_size,
            "policy": plan.policy, "device": plan.device, "budget_bytes": plan.budget_bytes,
            "persistent_bytes": plan.persistent_bytes, "num_layers": plan.num_layers,
            "num_ops": len(step_graph.ops), "num_tensors": len(step_graph.tensors),
            "rewrite": report.summary() if report is not None and hasattr(report, "summary") else None,
            "plan_written": time.time(),
        })
        views = None
        try:
            views = plan_views(plan, step_graph, self.profile)
        except Exception as err:  # pylint: disable=broad-except  (the dashboard must never stop training)
            self._warn("simulate", f"dymem_tf: the Dymem dashboard shows the plan without simulated timings: "
                                   f"simulating it failed ({type(err).__name__}: {err})")
            self._meta["notes"].append(f"simulation failed: {type(err).__name__}: {err}")
        if views is None:
            schedule = logdata.schedule_from_plan(plan.to_dict(),
                                                  first_backward_layer=first_backward_layer(step_graph))
        else:
            timeline, schedule = views
            atomic_write_json(os.path.join(self.plugin_dir, logdata.TIMELINE_FILE), timeline)
        atomic_write_json(os.path.join(self.plugin_dir, logdata.SCHEDULE_FILE), schedule)
        self._save_meta()

    def write_step(self, step: int, stats: Mapping[str, Any]) -> None:
        """Record one training step's statistics: a line of ``steps.jsonl`` and the ``dymem/...`` scalars.

        ``stats`` holds the allocator's ``memory_stats()`` keys, the host pool's with a ``host_`` prefix,
        ``planned_swap_bytes`` and ``modelled_stall_s``; missing keys are simply not written.
        """
        self._check_open()
        flat = flatten_stats(stats or {})
        for key, derived in _PER_STEP.items():  # cumulative counters -> what moved during this step
            if key in flat:
                previous, value = self._counters.get(key, 0), flat[key]
                flat[derived] = value - previous if value >= previous else value  # a counter that went back was reset
                self._counters[key] = value
        if "block_size" in flat and "block_size" not in self._meta:
            self._meta["block_size"] = int(flat["block_size"])
            self._save_meta()
        row = {"step": int(step), "wall_time": round(time.time(), 3), **flat}
        if self._plans:
            row["plan"] = self._plans - 1  # the index in plans.jsonl of the plan this step ran
        if self._steps_fh is None:
            self._steps_fh = open(os.path.join(self.plugin_dir, logdata.STEPS_FILE), "a", encoding="utf-8")
        self._steps_fh.write(json.dumps(row, allow_nan=False) + "\n")  # one write per line: readers never see half
        self._steps_fh.flush()
        keys = [k for k in flat if k in DEVICE_SCALARS or k in HOST_SCALARS or k in PLAN_SCALARS
                or (not k.startswith("host_") and _is_group_key(k))]
        self._scalars(int(step), {scalar_tag(k): flat[k] for k in keys})

    def write_trace(self, csv_path: str) -> bool:
        """Copy an allocator trace CSV into the run (atomically). Returns False, with a warning, when the file is
        missing or is not an allocator trace."""
        self._check_open()
        try:
            with open(csv_path, encoding="utf-8", errors="replace") as fh:
                header = [h.strip() for h in fh.readline().split(",")]
        except OSError as err:
            self._warn(f"trace:{csv_path}", f"dymem_tf: no allocator trace for TensorBoard: cannot read "
                                            f"{csv_path!r} ({err.strerror or err})")
            return False
        missing = [c for c in logdata.TRACE_COLUMNS if c not in header]
        if missing:
            self._warn(f"trace:{csv_path}", f"dymem_tf: {csv_path!r} is not an allocator trace (no column "
                                            f"{', '.join(missing)}); not copied")
            return False
        target = os.path.join(self.plugin_dir, logdata.TRACE_FILE)
        tmp = f"{target}.tmp-{os.getpid()}"
        shutil.copyfile(csv_path, tmp)
        os.replace(tmp, target)
        return True

    def start_allocator_trace(self, max_records: int = DEFAULT_TRACE_RECORDS, device: str | None = None) -> bool:
        """Start recording the GTBM allocator's allocations (the first ``max_records``) of ``device`` (None: the
        CPU device; ``"GPU:<k>"``: a GPU that GTBM serves); :meth:`close` stops the recording and saves the trace in
        the run. Returns False, with a warning, when GTBM does not serve the device in this process."""
        self._check_open()
        from dymem_tf.memory import allocator

        served = allocator.is_active() if device is None else allocator.serves_gpu(device)
        if not served:
            self._warn("trace", "dymem_tf: no allocator trace for TensorBoard: the GTBM allocator does not serve "
                                "the device in this process (import dymem_tf right after tensorflow; on GPUs, set "
                                "DYMEM_GTBM_GPU=1)")
            return False
        allocator.start_trace(max_records, device)
        self._tracing = True
        self._trace_device = device
        return True

    def _finish_allocator_trace(self) -> None:
        from dymem_tf.memory import allocator

        self._tracing = False
        device = getattr(self, "_trace_device", None)
        allocator.stop_trace(device)
        target = os.path.join(self.plugin_dir, logdata.TRACE_FILE)
        tmp = f"{target}.tmp-{os.getpid()}"
        info = allocator.dump_trace(tmp, device)
        os.replace(tmp, target)
        if info.get("dropped"):
            self._meta["notes"].append(f"allocator trace truncated: {info['dropped']} allocations beyond "
                                       f"{info.get('max_records')} records were not recorded")

    def flush(self) -> None:
        if self._steps_fh is not None:
            self._steps_fh.flush()
        if self._tf_writer is not None:
            self._tf_writer.flush()

    def close(self) -> None:
        """Flush and close the files; the writer cannot be used afterwards. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._tracing:
            try:
                self._finish_allocator_trace()
            except Exception as err:  # pylint: disable=broad-except  (closing must not fail the training run)
                self._warn("trace", f"dymem_tf: the allocator trace could not be saved: {err}")
        if self._steps_fh is not None:
            self._steps_fh.close()
            self._steps_fh = None
        if self._tf_writer is not None:
            self._tf_writer.close()
            self._tf_writer = None
        self._meta["closed"] = time.time()
        self._save_meta()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DymemSummaryWriter is closed")

    def _save_meta(self) -> None:
        atomic_write_json(os.path.join(self.plugin_dir, logdata.META_FILE), self._meta)

    def _warn(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(text, RuntimeWarning, stacklevel=3)

    def _append_line(self, name: str, obj: Any) -> None:
        """Append one JSON line to a data file in one write (readers never see half a line)."""
        with open(os.path.join(self.plugin_dir, name), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, allow_nan=False) + "\n")

    def _scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not values:
            return
        if self._tf_writer is None:
            self._tf_writer = tf.summary.create_file_writer(self.run_dir)
        with self._tf_writer.as_default(step=step), tf.device("/CPU:0"):
            for tag, value in values.items():
                _write_scalar(tag, float(value), step)
        self._tf_writer.flush()


def _write_scalar(tag: str, value: float, step: int) -> None:
    """``tf.summary.scalar`` (provided by the tensorboard package), else the same record through
    ``tf.summary.write`` with the Scalars dashboard's metadata."""
    scalar = getattr(tf.summary, "scalar", None)
    if scalar is not None:
        scalar(tag, value, step=step)
        return
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=metadata)


def _writer_version() -> str:
    from dymem_tf import __version__

    return f"dymem_tf {__version__}"


# ---------------------------------------------------------------------------------------- plan -> dashboard views
def plan_entry(record, index: int) -> dict:
    """One line of ``plans.jsonl``: what a plan predicted of the device peak, what its first step measured
    (``Plan.measured``; empty when the plan was written before its step ran) and, for a plan made after the probe
    step under a budget, the calibration it was made with."""
    plan = record.plan
    calibration = plan.predicted.calibration
    entry = {
        "index": int(index), "function_name": getattr(record, "function_name", None),
        "replica": getattr(record, "replica", None), "stage": plan.params.stage, "policy": plan.policy,
        "batch_size": plan.batch_size, "budget_bytes": plan.budget_bytes, "persistent_bytes": plan.persistent_bytes,
        "num_swaps": len(plan.swaps), "swapped_bytes": plan.swapped_bytes,
        "predicted_peak_bytes": plan.predicted.peak_bytes,
        "no_swap_peak_bytes": plan.predicted.no_swap_peak_bytes,
        "measured": dataclasses.asdict(plan.measured) if plan.measured is not None else {},
        "calibration": dataclasses.asdict(calibration) if calibration is not None else None,
    }
    return json.loads(json.dumps(entry, default=_plain))  # NumPy numbers and the like as plain JSON


def _plain(value):
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


def first_backward_layer(step_graph) -> int | None:
    """Where the backward pass begins: the layer after the last forward op whose output a gradient op reads (the
    loss). Gradient constants and shape ops that depend on no forward result sit in early layers and do not count.
    None when the step has no backward ops."""
    ops = step_graph.ops
    fed = [ops[t.producer].layer for t in step_graph.tensors.values()
           if not ops[t.producer].is_backward and any(ops[c].is_backward for c in t.consumers)]
    if fed:
        return max(fed) + 1
    layers = [op.layer for op in ops.values() if op.is_backward and op.layer >= 0]
    return min(layers) if layers else None


class _LayerClock:
    """Maps simulated times to positions on the dependency-layer axis: layer ``k`` spans ``[k, k + 1)``, and a time
    inside layer ``k``'s compute interval lands proportionally inside it."""

    def __init__(self, step_graph, result):
        n = step_graph.num_layers
        self.starts = [math.inf] * n
        self.ends = [0.0] * n
        for pos, name in enumerate(result.order):
            k = step_graph.ops[name].layer
            self.starts[k] = min(self.starts[k], float(result.op_start_s[pos]))
            self.ends[k] = max(self.ends[k], float(result.op_end_s[pos]))
        for k in range(n):  # layers without ops (none in practice) sit at the previous layer's end
            if self.starts[k] == math.inf:
                self.starts[k] = self.ends[k] = self.ends[k - 1] if k else 0.0
        self.n = n

    def __call__(self, t: float) -> float:
        k = bisect.bisect_right(self.starts, t) - 1
        if k < 0:
            return 0.0
        if t >= self.ends[k]:
            return float(k + 1)  # after layer k's compute (a stall before k + 1, or the end of the step)
        width = self.ends[k] - self.starts[k]
        return k + ((t - self.starts[k]) / width if width > 0 else 0.0)


def _per_layer_max(rows, clock: _LayerClock) -> list[tuple[int, int, int]]:
    """Per dependency layer, the (persistent, transient, mobile) state with the largest total during it."""
    best: list[tuple[int, int, int] | None] = [None] * clock.n
    state = tuple(rows[0][1:]) if rows else (0, 0, 0)
    j = 0
    for k in range(clock.n):
        end = clock.starts[k + 1] if k + 1 < clock.n else math.inf
        cand = state
        while j < len(rows) and rows[j][0] < end:
            state = tuple(rows[j][1:])
            if sum(state) > sum(cand):
                cand = state
            j += 1
        best[k] = cand
    return best  # type: ignore[return-value]


def plan_views(plan, step_graph, profile=None) -> tuple[dict, dict]:
    """The dashboard's ``timeline.json`` and ``schedule.json`` for ``plan``, by simulating it on ``step_graph``
    (and simulating the step without swapping, for comparison)."""
    from dymem_tf.planning.cost_model import CostModel
    from dymem_tf.planning.device_profiles import DeviceProfile, get_profile
    from dymem_tf.planning.simulator import Simulator

    if not step_graph.layers and step_graph.ops:
        from dymem_tf.planning.analysis import analyse

        analyse(step_graph)
    if profile is None:
        profile = plan.params.profile  # the planner records the profile it planned with
    cost = CostModel(get_profile(profile if profile is not None else plan.device),
                     float(plan.params.compute_scale or 1.0))
    sim = Simulator(step_graph, cost)
    res = sim.run(plan.swaps, plan.persistent_bytes)
    base = res if not plan.swaps else sim.run([], plan.persistent_bytes)
    clock = _LayerClock(step_graph, res)
    base_clock = clock if base is res else _LayerClock(step_graph, base)
    with_swaps = _per_layer_max(res.timeline, clock)
    without = _per_layer_max(base.timeline, base_clock)
    points = [{"layer": k, "persistent": p, "transient": t, "mobile": m, "no_swap": sum(without[k])}
              for k, (p, t, m) in enumerate(with_swaps)]
    backward = first_backward_layer(step_graph)
    timeline = {
        "version": logdata.FORMAT_VERSION,
        "x_axis": "dependency layer",
        "budget_bytes": plan.budget_bytes,
        "persistent_bytes": plan.persistent_bytes,
        "first_backward_layer": backward,
        "points": points,
        "peak": {"layer": round(clock(res.peak_time_s), 3), "bytes": int(res.peak_bytes), "op": res.peak_op,
                 "time_s": res.peak_time_s, "by_group": dict(res.peak_by_group)},
        "no_swap_peak_bytes": int(base.peak_bytes),
        "step_time_s": res.step_time_s,
        "stall_s": res.stall_s,
    }
    timeline["peak_tensors"], timeline["peak_tensor_count"] = _tensors_at(res, sim)
    timeline["peak_tensor_bytes"] = sum(int(buf.bytes) for buf in res.peak_buffers)  # the peak less persistent
    swap_out, swap_in = {}, {}
    for ev in res.swap_events:
        swap_out[ev.tensor] = {"start_layer": round(clock(ev.out_start), 4), "end_layer": round(clock(ev.out_end), 4),
                               "start_s": ev.out_start, "end_s": ev.out_end}
        swap_in[(ev.tensor, ev.swap_in)] = {
            "start_layer": round(clock(ev.in_start), 4), "end_layer": round(clock(ev.in_end), 4),
            "start_s": ev.in_start, "end_s": ev.in_end, "consumer_start_layer": round(clock(ev.consumer_start), 4),
            "consumer_start_s": ev.consumer_start, "stall_s": ev.stall}
    schedule = logdata.schedule_from_plan(plan.to_dict(), first_backward_layer=backward, swap_out=swap_out,
                                          swap_in=swap_in)
    schedule["step_time_s"] = res.step_time_s
    return timeline, schedule


def _tensors_at(res, sim) -> tuple[list[dict], int]:
    """The largest buffers on the device at the simulated peak, and how many are live then: the simulator's own
    live set (``res.peak_buffers``), so an alias (Identity, Reshape ... output) or a tensor written in place into a
    dying input's buffer is not counted again; ``shares`` names the other tensors in the buffer."""
    step_graph = sim.sg
    live = []
    for buf in res.peak_buffers:
        producer = step_graph.ops[step_graph.tensors[buf.tensor].producer]
        label = buf.tensor if buf.swap_in is None else f"{buf.tensor} (swap-in {buf.swap_in})"
        live.append({"tensor": label, "size": int(buf.bytes), "op": producer.name, "op_type": producer.type,
                     "keras_layer": producer.keras_layer, "layer": producer.layer,
                     "swapped": buf.group == "mobile", "group": buf.group,
                     "shares": [n for n in sim.buffer_tensors(buf.tensor) if n != buf.tensor]})
    live.sort(key=lambda r: (-r["size"], r["tensor"]))
    return live[:MAX_PEAK_TENSORS], len(live)
