"""On-disk layout of the Dymem dashboard's data, and its reader (pure Python: no TensorFlow, no TensorBoard).

A *run* is a directory that holds ``plugins/dymem/`` (TensorBoard's plugin-assets convention). The writer,
:class:`dymem_tf.observe.summaries.DymemSummaryWriter`, puts it at ``<log_dir>/dymem`` next to the run's
``events.out.tfevents.*`` file that holds the ``dymem/...`` scalars::

    <log_dir>/dymem/
        events.out.tfevents.*          tf.summary scalars (dymem/device/..., dymem/host/..., dymem/plan/...)
        plugins/dymem/
            meta.json                  format version, run facts (policy, budget, batch size, graph)
            plan.json                  the plan, exactly ``Plan.to_json()`` (``dymem_tf.planning.plan.Plan.load`` reads it)
            plans.jsonl                one JSON object per plan of the run: predicted and measured device peak,
                                       calibration
            timeline.json              modelled device bytes per dependency layer, by mobility group
            schedule.json              swap-out, host residency, swap-in trigger and consumer of every swap
            steps.jsonl                one JSON object per training step: allocator and host-pool statistics, and
                                       ``plan``, the index in plans.jsonl of the plan the step ran
            trace.csv                  the allocator trace (id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns)

Every JSON file is replaced atomically; ``steps.jsonl`` and ``plans.jsonl`` grow by whole lines. Each file is optional: the page
shows what is there and says what is missing. Readers raise :class:`DataError` with a message that names the
file and what is wrong with it.
"""
from __future__ import annotations

import csv
import json
import math
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

PLUGIN_NAME = "dymem"
FORMAT_VERSION = 1
RUN_SUBDIR = "dymem"  # the writer's run directory under a log dir

META_FILE = "meta.json"
PLAN_FILE = "plan.json"
TIMELINE_FILE = "timeline.json"
SCHEDULE_FILE = "schedule.json"
STEPS_FILE = "steps.jsonl"
PLANS_FILE = "plans.jsonl"
TRACE_FILE = "trace.csv"
DATA_FILES = (META_FILE, PLAN_FILE, PLANS_FILE, TIMELINE_FILE, SCHEDULE_FILE, STEPS_FILE, TRACE_FILE)

GROUPS = ("persistent", "transient", "mobile")
TRACE_COLUMNS = ("id", "lower", "upper", "size", "group", "offset", "op", "step", "alloc_ns", "free_ns")

MAX_TIMELINE_POINTS = 1500  # measured timelines are thinned to this many points (peaks kept)
MAX_PEAK_TENSORS = 200  # rows of the "largest tensors at the peak" table
MAX_STEPS = 5000  # per-step rows sent to the page (the last ones)


class DataError(ValueError):
    """A data file of a run cannot be used; the message says which file and why."""


# ------------------------------------------------------------------------------------------------------ locations
def plugin_dir(run_dir: str) -> str:
    """``<run_dir>/plugins/dymem``."""
    return os.path.join(run_dir, "plugins", PLUGIN_NAME)


def is_run_dir(path: str) -> bool:
    """Whether ``path`` holds Dymem data (any of :data:`DATA_FILES`)."""
    pdir = plugin_dir(path)
    return any(os.path.isfile(os.path.join(pdir, name)) for name in DATA_FILES)


def list_runs(logdir: str, max_depth: int = 8) -> list[str]:
    """Runs under ``logdir`` with Dymem data, named like TensorBoard names runs (relative path, ``.`` for the root).

    Hidden directories and the ``plugins`` folders themselves are not descended into.
    """
    if not logdir or not os.path.isdir(logdir):
        return []
    root = os.path.abspath(logdir)
    runs = []
    for dirpath, dirnames, _ in os.walk(root, followlinks=False):
        depth = 0 if dirpath == root else os.path.relpath(dirpath, root).count(os.sep) + 1
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "plugins")
        if depth >= max_depth:
            dirnames[:] = []
        if is_run_dir(dirpath):
            runs.append(os.path.relpath(dirpath, root).replace(os.sep, "/"))
    return sorted(runs)


def resolve_run(logdir: str, run: str) -> str:
    """The directory of ``run`` under ``logdir``; DataError for names outside it or without Dymem data."""
    if not run:
        raise DataError("no run given: pass ?run=<name> (see /runs for the names)")
    root = os.path.abspath(logdir)
    path = os.path.abspath(os.path.join(root, *run.split("/")))
    if os.path.commonpath([root, path]) != root:
        raise DataError(f"run {run!r} is outside the log directory")
    if not is_run_dir(path):
        raise DataError(f"run {run!r} has no Dymem data (no plugins/{PLUGIN_NAME}/ files in it)")
    return path


# ------------------------------------------------------------------------------------------------- file readers
def read_json(path: str) -> dict:
    """A JSON object from ``path``; DataError naming the file when it is empty, truncated or not an object."""
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise DataError(f"{name} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise DataError(f"{name} is not UTF-8 text (the file is corrupt)") from None
    if not text.strip():
        raise DataError(f"{name} is empty (the writer may have been interrupted)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{name} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    if not isinstance(value, dict):
        raise DataError(f"{name} should hold a JSON object, found {type(value).__name__}")
    return value


def _require(obj: dict, name: str, key: str, kinds: tuple, where: str = "") -> Any:
    if key not in obj:
        raise DataError(f"{name} lacks the field {where}{key!r}")
    value = obj[key]
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        want = " or ".join(k.__name__ for k in kinds)
        raise DataError(f"{name}: field {where}{key!r} should be {want}, found {type(value).__name__}")
    return value


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_version(obj: dict, name: str) -> None:
    version = obj.get("version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DataError(f"{name} has format version {version!r}; this plugin reads version {FORMAT_VERSION}: "
                        f"upgrade dymem_tf in the environment that runs TensorBoard")


def read_meta(path: str) -> dict:
    meta = read_json(path)
    _check_version(meta, META_FILE)
    return meta


def _require_swaps(doc: dict, name: str) -> list:
    """``doc``'s ``num_layers`` and ``swaps`` list, every swap an object with a ``tensor`` name and its ``bytes``."""
    swaps = _require(doc, name, "swaps", (list,))
    _require(doc, name, "num_layers", (int,))
    for i, s in enumerate(swaps):
        if not isinstance(s, dict):
            raise DataError(f"{name}: swaps[{i}] should be an object")
        _require(s, name, "tensor", (str,), f"swaps[{i}].")
        _require(s, name, "bytes", (int,), f"swaps[{i}].")
    return swaps


def read_plan(path: str) -> dict:
    """The plan as a dict (the fields of :class:`dymem_tf.planning.plan.Plan`), checked for what the page uses."""
    plan = read_json(path)
    _require_swaps(plan, PLAN_FILE)
    if not isinstance(plan.get("predicted", {}), dict):
        raise DataError(f"{PLAN_FILE}: field 'predicted' should be an object")
    return plan


def read_timeline(path: str) -> dict:
    """The modelled timeline; every point has a ``layer`` and a non-negative byte count per group."""
    tl = read_json(path)
    _check_version(tl, TIMELINE_FILE)
    points = _require(tl, TIMELINE_FILE, "points", (list,))
    for i, p in enumerate(points):
        if not isinstance(p, dict) or not _num(p.get("layer")):
            raise DataError(f"{TIMELINE_FILE}: points[{i}] needs a numeric 'layer'")
        for g in GROUPS:
            if g in p and not (_num(p[g]) and p[g] >= 0):
                raise DataError(f"{TIMELINE_FILE}: points[{i}].{g} should be a non-negative number")
    budget = tl.get("budget_bytes")
    if budget is not None and not _num(budget):
        raise DataError(f"{TIMELINE_FILE}: field 'budget_bytes' should be a number or null")
    return tl


def read_schedule(path: str) -> dict:
    """The swap schedule; every swap has a tensor, its bytes, its producer layer and its swap-ins."""
    sc = read_json(path)
    _check_version(sc, SCHEDULE_FILE)
    for i, s in enumerate(_require_swaps(sc, SCHEDULE_FILE)):
        where = f"swaps[{i}]."
        _require(s, SCHEDULE_FILE, "producer_layer", (int, float), where)
        for k, si in enumerate(_require(s, SCHEDULE_FILE, "swap_ins", (list,), where)):
            if not isinstance(si, dict):
                raise DataError(f"{SCHEDULE_FILE}: {where}swap_ins[{k}] should be an object")
            _require(si, SCHEDULE_FILE, "trigger_layer", (int, float), f"{where}swap_ins[{k}].")
            _require(si, SCHEDULE_FILE, "consumer_layer", (int, float), f"{where}swap_ins[{k}].")
    return sc


def _read_lines(path: str, name: str, key: str) -> tuple[list[dict], list[int], bool]:
    """The JSON objects of a ``.jsonl`` file that have an integer ``key``, the numbers of the lines that could
    not be read, and whether the file holds nothing (the text after the last newline is a line being written)."""
    rows, bad = [], []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
    except OSError as err:
        raise DataError(f"{name} cannot be read: {err.strerror or err}") from None
    for lineno, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(lineno)
            continue
        if not isinstance(row, dict) or not isinstance(row.get(key), int) or isinstance(row.get(key), bool):
            bad.append(lineno)
            continue
        rows.append(row)
    return rows, bad, not rows and not bad and not lines[-1].strip()


def _skipped_note(name: str, bad: list[int]) -> str:
    shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
    return f"{name}: skipped {len(bad)} unreadable line(s) (line {shown})"


def read_steps(path: str) -> tuple[list[dict], list[str]]:
    """Rows of ``steps.jsonl`` and notes about lines that were skipped (a torn last line is normal while writing)."""
    rows, bad, empty = _read_lines(path, STEPS_FILE, "step")
    for row in rows:
        if "fragmentation" in row and "reserved_overhead" not in row:
            # written before 1 - in use / reserved got its own name: "fragmentation" is the pool map's figure
            row["reserved_overhead"] = row.pop("fragmentation")
    notes = [_skipped_note(STEPS_FILE, bad)] if bad else []
    if empty:
        notes.append(f"{STEPS_FILE} is empty: no training step has finished yet")
    return rows[-MAX_STEPS:], notes


def _bytes_or_none(value: Any) -> int | float | None:
    return value if _num(value) and value >= 0 else None


def plan_accuracy(entry: dict) -> dict:
    """One plan of ``plans.jsonl`` as the page shows it: predicted and measured device peak and the error, and
    the calibration it was planned with. Numbers that are missing or malformed become None."""
    measured = entry.get("measured") if isinstance(entry.get("measured"), dict) else {}
    predicted = _bytes_or_none(entry.get("predicted_peak_bytes"))
    peak = _bytes_or_none(measured.get("peak_bytes"))
    outcome = measured.get("outcome") if isinstance(measured.get("outcome"), str) else ("ran" if measured else None)
    exact = measured.get("exact") is not False
    error = None
    if outcome == "ran" and exact and peak and predicted is not None:
        error = (peak - predicted) / peak
    out = {
        "index": entry["index"],
        "stage": entry.get("stage") if isinstance(entry.get("stage"), str) else None,
        "function_name": entry.get("function_name") if isinstance(entry.get("function_name"), str) else None,
        "replica": entry.get("replica") if isinstance(entry.get("replica"), int) else None,
        "batch_size": entry.get("batch_size") if _num(entry.get("batch_size")) else None,
        "budget_bytes": _bytes_or_none(entry.get("budget_bytes")),
        "persistent_bytes": _bytes_or_none(entry.get("persistent_bytes")),
        "num_swaps": entry.get("num_swaps") if _num(entry.get("num_swaps")) else None,
        "predicted_peak_bytes": predicted,
        "calibrated_predicted_peak_bytes": _bytes_or_none(measured.get("calibrated_predicted_peak_bytes")),
        "measured_peak_bytes": peak,
        "measured_peak_bytes_in_use": _bytes_or_none(measured.get("peak_bytes_in_use")),
        "measured_exact": exact if measured else None,
        "outcome": outcome,
        "error": error,
        "calibration": None,
    }
    cal = entry.get("calibration")
    if isinstance(cal, dict):
        raw, got = _bytes_or_none(cal.get("predicted_peak_bytes")), _bytes_or_none(cal.get("measured_peak_bytes"))
        out["calibration"] = {
            "predicted_peak_bytes": raw, "measured_peak_bytes": got,
            "error": (got - raw) / got if raw is not None and got else None,
            "headroom": cal.get("headroom") if _num(cal.get("headroom")) else None,
            "budget_bytes": _bytes_or_none(cal.get("budget_bytes")),
            "persistent_bytes": _bytes_or_none(cal.get("persistent_bytes")),
        }
    return out


def read_plans(path: str) -> tuple[list[dict], list[str]]:
    """The plans of ``plans.jsonl`` (see :func:`plan_accuracy`) and notes about lines that were skipped."""
    rows, bad, _ = _read_lines(path, PLANS_FILE, "index")
    return [plan_accuracy(row) for row in rows], [_skipped_note(PLANS_FILE, bad)] if bad else []


class TraceRow(NamedTuple):
    """One buffer of the allocator trace, live during the half-open event interval ``[lower, upper)``.

    ``lower`` and ``upper`` count allocation and free events on one clock; a buffer still live when the trace was
    written has ``upper`` = the trace's last event and ``free_ns`` None. ``size`` is the requested size.
    """

    id: int
    lower: int
    upper: int
    size: int
    group: str
    offset: int
    op: str
    step: int
    alloc_ns: int | None
    free_ns: int | None

    @property
    def freed(self) -> bool:
        """False for a buffer still live when the trace was written (timestamped traces leave its free_ns empty)."""
        return self.free_ns is not None or self.alloc_ns is None


def _int(text: str, column: str, lineno: int, allow_empty: bool = False) -> int | None:
    text = text.strip()
    if not text:
        if allow_empty:
            return None
        raise DataError(f"{TRACE_FILE} line {lineno}: column {column!r} is empty")
    try:
        return int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value == int(value):
            return int(value)
        raise DataError(f"{TRACE_FILE} line {lineno}: column {column!r} should be an integer, found {text!r}") from None


def _group_name(text: str, lineno: int) -> str:
    """The allocator writes group numbers (0 persistent, 1 transient, 2 mobile); names are accepted too."""
    text = text.strip().lower()
    if text.isdigit() and int(text) < len(GROUPS):
        return GROUPS[int(text)]
    if text in GROUPS:
        return text
    raise DataError(f"{TRACE_FILE} line {lineno}: unknown group {text!r} (expected 0-2 or "
                    f"{', '.join(GROUPS)})")


def _checked_row(rec: list[str], idx: dict[str, int], lineno: int) -> TraceRow:
    """One trace row, parsed with checks that name the column and the problem (the slow path)."""
    alloc_ns = _int(rec[idx["alloc_ns"]], "alloc_ns", lineno, allow_empty=True)
    free_ns = _int(rec[idx["free_ns"]], "free_ns", lineno, allow_empty=True)
    row = TraceRow(
        id=_int(rec[idx["id"]], "id", lineno),
        lower=_int(rec[idx["lower"]], "lower", lineno),
        upper=_int(rec[idx["upper"]], "upper", lineno),
        size=_int(rec[idx["size"]], "size", lineno),
        group=_group_name(rec[idx["group"]], lineno),
        offset=_int(rec[idx["offset"]], "offset", lineno),
        op=rec[idx["op"]].strip(),
        step=_int(rec[idx["step"]], "step", lineno, allow_empty=True) or 0,
        alloc_ns=alloc_ns if alloc_ns is not None and alloc_ns >= 0 else None,
        free_ns=free_ns if free_ns is not None and free_ns >= 0 else None,
    )
    if row.size < 0 or row.offset < 0 or row.lower < 0:
        raise DataError(f"{TRACE_FILE} line {lineno}: negative size, offset or lower")
    if row.upper <= row.lower:
        raise DataError(f"{TRACE_FILE} line {lineno}: upper ({row.upper}) must exceed lower "
                        f"({row.lower}): lifetimes are half-open event intervals [lower, upper)")
    return row


_GROUP_TEXT = {**{str(i): g for i, g in enumerate(GROUPS)}, **{g: g for g in GROUPS}}


def read_trace(path: str) -> list[TraceRow]:
    """The rows of an allocator trace CSV; DataError on a missing column or a malformed row (with its line)."""
    rows = []
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{TRACE_FILE} is empty (no header line)")
            header = [h.strip() for h in header]
            missing = [c for c in TRACE_COLUMNS if c not in header]
            if missing:
                raise DataError(f"{TRACE_FILE} lacks the column(s) {', '.join(missing)} "
                                f"(expected {','.join(TRACE_COLUMNS)}; found {','.join(header)[:200]})")
            idx = {c: header.index(c) for c in TRACE_COLUMNS}
            i_id, i_lo, i_up, i_sz, i_gr, i_off, i_op, i_st, i_an, i_fn = (idx[c] for c in TRACE_COLUMNS)
            width = max(idx.values()) + 1
            for lineno, rec in enumerate(reader, 2):
                if len(rec) < width:
                    if not rec or (len(rec) == 1 and not rec[0].strip()):
                        continue
                    raise DataError(f"{TRACE_FILE} line {lineno}: {len(rec)} fields, expected {len(header)} "
                                    f"(the file is truncated or corrupt)")
                try:  # fast path for what the allocator writes; anything else gets the checked parse
                    lower, upper, size, offset = int(rec[i_lo]), int(rec[i_up]), int(rec[i_sz]), int(rec[i_off])
                    alloc_ns = int(rec[i_an]) if rec[i_an] else -1
                    free_ns = int(rec[i_fn]) if rec[i_fn] else -1
                    row = TraceRow(int(rec[i_id]), lower, upper, size, _GROUP_TEXT[rec[i_gr]], offset,
                                   rec[i_op].strip(), int(rec[i_st]) if rec[i_st] else 0,
                                   alloc_ns if alloc_ns >= 0 else None, free_ns if free_ns >= 0 else None)
                    valid = 0 <= lower < upper and size >= 0 and offset >= 0
                except (ValueError, KeyError):
                    valid = False
                rows.append(row if valid else _checked_row(rec, idx, lineno))
    except OSError as err:
        raise DataError(f"{TRACE_FILE} cannot be read: {err.strerror or err}") from None
    except csv.Error as err:
        raise DataError(f"{TRACE_FILE} is not valid CSV: {err}") from None
    return rows


# ------------------------------------------------------------------------------------------------ trace analysis
def analyse_trace(rows: list[TraceRow], block_size: int | None = None) -> dict:
    """The peak of traced bytes in use, the pool map and the largest live buffers there, and that step's timeline.

    The peak is the event after which the most bytes are live (``lower <= t < upper``). The pool map lists the
    buffers live then by offset, and the gaps between them up to the highest end offset reached by then (free, or
    held by buffers allocated before the trace started); ``fragmentation`` is ``1 - largest gap / gap bytes``.
    """
    if not rows:
        return {"pool": None, "tensors": None, "measured_timeline": None}
    deltas: dict[int, int] = {}
    for r in rows:
        deltas[r.lower] = deltas.get(r.lower, 0) + r.size
        deltas[r.upper] = deltas.get(r.upper, 0) - r.size
    in_use, peak_t, peak_bytes = 0, rows[0].lower, -1
    for t in sorted(deltas):
        in_use += deltas[t]
        if in_use > peak_bytes:
            peak_t, peak_bytes = t, in_use
    live = [r for r in rows if r.lower <= peak_t < r.upper]
    extent = max((r.offset + r.size for r in rows if r.lower <= peak_t), default=0)
    blocks = sorted(live, key=lambda r: (r.offset, r.id))
    gaps, cursor = [], 0
    for r in blocks:
        if r.offset > cursor:
            gaps.append({"offset": cursor, "size": r.offset - cursor})
        cursor = max(cursor, r.offset + r.size)
    if extent > cursor:
        gaps.append({"offset": cursor, "size": extent - cursor})
    free = sum(g["size"] for g in gaps)
    largest = max((g["size"] for g in gaps), default=0)
    by_group: dict[str, int] = {}
    for r in live:
        by_group[r.group] = by_group.get(r.group, 0) + r.size
    peak_step = max((r for r in rows if r.lower <= peak_t), key=lambda r: r.lower).step
    pool = {
        "event": peak_t,
        "step": peak_step,
        "in_use_bytes": peak_bytes,
        "extent_bytes": extent,
        "free_bytes": free,
        "largest_free_bytes": largest,
        "fragmentation": (1.0 - largest / free) if free else 0.0,
        "by_group": by_group,
        "blocks": [{"id": r.id, "offset": r.offset, "size": r.size, "group": r.group, "op": r.op} for r in blocks],
        "gaps": gaps,
    }
    largest_live = sorted(live, key=lambda r: (-r.size, r.id))[:MAX_PEAK_TENSORS]
    tensors = {
        "source": "trace",
        "count": len(live),
        "total_bytes": peak_bytes,
        "rows": [{
            "id": r.id, "size": r.size, "group": r.group, "op": r.op, "offset": r.offset,
            "lifetime": r.upper - r.lower if r.freed else None,
        } for r in largest_live],
    }
    return {"pool": pool, "tensors": tensors, "measured_timeline": _step_timeline(rows, peak_step, block_size)}


def _step_timeline(rows: list[TraceRow], step: int, block_size: int | None) -> dict:
    """Traced bytes in use by group at every event of ``step`` (thinned to the peaks), with the pool's extent and,
    given GTBM's pageblock size, its reserved bytes (GTBM gives a block back as soon as nothing in it is live).

    The step's window runs from its first allocation to just before the first later allocation of another step
    (or the end of the trace), so the frees that end the step are included.
    """
    own = [r.lower for r in rows if r.step == step]
    start, last_own = min(own), max(own)
    later = [r.lower for r in rows if r.step != step and r.lower > last_own]
    end = min(later) - 1 if later else max(r.upper for r in rows)
    events = [(r.lower, 1, r) for r in rows if r.lower <= end]
    events += [(r.upper, -1, r) for r in rows if r.upper <= end and r.freed]
    events.sort(key=lambda e: (e[0], e[1]))
    running = {g: 0 for g in GROUPS}
    blocks: dict[int, int] = {}
    reserved = extent = 0
    points = []
    for t, sign, r in events:
        running[r.group] += sign * r.size
        if sign > 0:
            extent = max(extent, r.offset + r.size)
        if block_size:
            for b in range(r.offset // block_size, (r.offset + max(r.size, 1) - 1) // block_size + 1):
                count = blocks.get(b, 0) + sign
                if count == 0:
                    blocks.pop(b, None)
                    reserved -= block_size
                else:
                    if count == 1 and sign > 0:
                        reserved += block_size
                    blocks[b] = count
        if t >= start:
            stamp = r.alloc_ns if sign > 0 else r.free_ns
            point = {"t": t, **running, "extent": extent, "ns": stamp}
            if block_size:
                point["reserved"] = reserved
            points.append(point)
    use_time = all(p["ns"] is not None for p in points)
    t0, ns0 = points[0]["t"], points[0]["ns"]
    for p in points:
        ns = p.pop("ns")
        p["x"] = (ns - ns0) / 1e6 if use_time else p["t"] - t0
    return {
        "step": step,
        "x_label": "ms since the step's first allocation" if use_time else "allocator events since the step began",
        "points": _thin(points, MAX_TIMELINE_POINTS),
    }


def _total(p: dict) -> float:
    return sum(p.get(g, 0) for g in GROUPS)


def _thin(points: list[dict], limit: int) -> list[dict]:
    """At most ``limit`` points: per bucket the one with the largest total, plus the first and last."""
    if len(points) <= limit:
        return points
    inner = points[1:-1]
    buckets = limit - 2
    out = [points[0]]
    for b in range(buckets):
        chunk = inner[len(inner) * b // buckets:len(inner) * (b + 1) // buckets]
        if chunk:
            out.append(max(chunk, key=_total))
    out.append(points[-1])
    return out



# ------------------------------------------------------------------------------------------------ swap schedule
def schedule_from_plan(plan: dict, first_backward_layer: int | None = None, swap_out: dict | None = None,
                       swap_in: dict | None = None) -> dict:
    """``schedule.json`` from a plan dict (``Plan.to_dict()``), with simulated timings where given.

    ``swap_out`` maps a tensor to ``{start_layer, end_layer, start_s, end_s}`` and ``swap_in`` maps
    ``(tensor, k)`` to the same plus ``consumer_start_s`` and ``stall_s``; positions are on the dependency-layer
    axis (layer ``k`` spans ``[k, k + 1)``). Without timings a swap-out starts at its producer's layer and a
    swap-in runs from its trigger layer to its consumers' layer.
    """
    swap_out, swap_in = swap_out or {}, swap_in or {}
    swaps = []
    for s in plan.get("swaps", []):
        ins = []
        for k, si in enumerate(s.get("swap_ins", [])):
            entry = {"trigger_op": si.get("trigger_op"), "trigger_layer": si.get("trigger_layer"),
                     "consumers": list(si.get("consumers", [])), "consumer_layer": si.get("start_layer_of_consumers"),
                     "stall_s": si.get("predicted_stall_s", 0.0)}
            entry.update(swap_in.get((s["tensor"], k), {}))
            ins.append(entry)
        swaps.append({
            "tensor": s["tensor"], "producer": s.get("producer"), "bytes": s["bytes"],
            # "variable": optimizer state in host memory between its uses; "weight": a weight there but for its
            # forward and backward stays
            "kind": s.get("kind", "tensor"),
            "producer_layer": s.get("producer_layer"),
            "swap_out": swap_out.get(s["tensor"], {"start_layer": s.get("producer_layer"), "end_layer": None}),
            "swap_ins": ins,
        })
    return {
        "version": FORMAT_VERSION,
        "num_layers": plan.get("num_layers", 0),
        "first_backward_layer": first_backward_layer,
        "timed": bool(swap_out or swap_in),
        "stall_s": sum(si["stall_s"] or 0.0 for s in swaps for si in s["swap_ins"]),
        "swaps": swaps,
    }


# ----------------------------------------------------------------------------------------------------- caching
class _FileCache:
    """Parsed files keyed by (path, mtime, size): a trace is parsed once, not on every page load."""

    def __init__(self, capacity: int = 32):
        self._items: dict[tuple, Any] = {}
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, path: str, parse: Callable[[str], Any], tag: str = "") -> Any:
        st = os.stat(path)
        key = (tag, path, st.st_mtime_ns, st.st_size)
        with self._lock:
            if key in self._items:
                return self._items[key]
        value = parse(path)
        with self._lock:
            if len(self._items) >= self._capacity:
                self._items.pop(next(iter(self._items)))
            self._items[key] = value
        return value


_CACHE = _FileCache()


# ------------------------------------------------------------------------------------------------- run payload
def load_run(logdir: str, run: str) -> dict:
    """Everything the page shows for one run. Missing or unreadable files become ``messages``, never exceptions.

    Raises DataError only when the run itself is unknown.
    """
    run_dir = resolve_run(logdir, run)
    pdir = plugin_dir(run_dir)
    out: dict[str, Any] = {"run": run, "meta": {}, "plan": None, "plans": [], "timeline": None, "schedule": None,
                           "steps": [], "pool": None, "tensors": None, "measured_timeline": None, "messages": []}

    def note(level: str, text: str, file: str) -> None:
        out["messages"].append({"level": level, "text": text, "file": file})

    def load(name: str, reader: Callable[[str], Any], missing: str | None, cache_tag: str = "") -> Any:
        path = os.path.join(pdir, name)
        if not os.path.isfile(path):
            if missing:
                note("info", missing, name)
            return None
        try:
            return _CACHE.get(path, reader, tag=cache_tag or name)
        except DataError as err:
            note("error", str(err), name)
        except OSError as err:
            note("error", f"{name} cannot be read: {err.strerror or err}", name)
        return None

    out["meta"] = load(META_FILE, read_meta, None) or {}
    plan = load(PLAN_FILE, read_plan, f"No plan yet ({PLAN_FILE} is missing): the plan is written after the "
                                      f"first training step.")
    if plan is not None:
        out["plan"] = _plan_summary(plan)
    out["timeline"] = load(TIMELINE_FILE, read_timeline,
                           None if plan is None else f"No modelled timeline ({TIMELINE_FILE} is missing).")
    out["schedule"] = load(SCHEDULE_FILE, read_schedule, None)
    if out["schedule"] is None and plan is not None:
        out["schedule"] = schedule_from_plan(plan)
        note("info", f"The swap schedule is taken from {PLAN_FILE} ({SCHEDULE_FILE} is missing or unreadable): "
                     f"layers only, no simulated copy times.", SCHEDULE_FILE)
    steps = load(STEPS_FILE, read_steps, "No per-step statistics yet (steps.jsonl is missing).")
    if steps is not None:
        out["steps"], notes = steps
        for text in notes:
            note("warning", text, STEPS_FILE)
    plans = load(PLANS_FILE, read_plans, None)
    if plans is not None:
        out["plans"], notes = plans
        for text in notes:
            note("warning", text, PLANS_FILE)
    elif plan is not None:
        # a run written before plans.jsonl existed: its one plan, with what plan.json says it measured
        predicted = plan.get("predicted") or {}
        out["plans"] = [plan_accuracy({"index": 0, "stage": (plan.get("params") or {}).get("stage"),
                                       "policy": plan.get("policy"), "batch_size": plan.get("batch_size"),
                                       "budget_bytes": plan.get("budget_bytes"),
                                       "persistent_bytes": plan.get("persistent_bytes"),
                                       "num_swaps": len(plan["swaps"]),
                                       "predicted_peak_bytes": predicted.get("peak_bytes"),
                                       "measured": plan.get("measured"), "calibration": predicted.get("calibration")})]
    block_size = _block_size(out["meta"], out["steps"])
    # Only the analysis is cached: a trace's rows take far more memory than what the page draws from them.
    traced = load(TRACE_FILE, lambda path: analyse_trace(read_trace(path), block_size),
                  "No allocator trace in this run (trace.csv): the pool map and the tensors at the peak need one; "
                  "train with DymemCallback(trace_allocations=True) (see docs/tensorboard.md).",
                  cache_tag=f"analysis:{block_size}")
    if traced is not None:
        if traced["pool"] is None:
            note("warning", f"{TRACE_FILE} has a header but no buffers.", TRACE_FILE)
        else:
            out.update(traced)
            swapped = {s.get("producer") for s in (plan or {}).get("swaps", [])}
            out["tensors"] = {**out["tensors"],
                              "rows": [{**r, "swapped": r["op"] in swapped} for r in out["tensors"]["rows"]]}
    if out["tensors"] is None and out["timeline"] is not None and out["timeline"].get("peak_tensors"):
        tl = out["timeline"]
        # the listed buffers hold the peak's transient and mobile bytes (weights and optimizer slots are not listed)
        total = tl.get("peak_tensor_bytes")
        if not _num(total):
            peak, persistent = (tl.get("peak") or {}).get("bytes"), tl.get("persistent_bytes") or 0
            total = peak - persistent if _num(peak) and _num(persistent) else peak
        out["tensors"] = {"source": "model", "count": tl.get("peak_tensor_count", len(tl["peak_tensors"])),
                          "total_bytes": total, "rows": tl["peak_tensors"]}
    if out["schedule"] is not None and plan is not None:
        n_plan, n_sched = len(plan["swaps"]), len(out["schedule"]["swaps"])
        if n_plan != n_sched:
            note("warning", f"{PLAN_FILE} has {n_plan} swaps but {SCHEDULE_FILE} has {n_sched}: the files come "
                            f"from different traces of the step (the writer was interrupted?).", SCHEDULE_FILE)
    return out


def _block_size(meta: dict, steps: list[dict]) -> int | None:
    """GTBM's pageblock size, from the run's metadata or statistics (None when unknown or not positive)."""
    for value in [meta.get("block_size")] + [row.get("block_size") for row in reversed(steps[-1:])]:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value)
    return None


def _plan_summary(plan: dict) -> dict:
    """The plan fields the page shows (not the per-op mobility map, which can be large)."""
    predicted = plan.get("predicted") or {}
    scalars = {k: v for k, v in predicted.items() if _num(v)}
    return {
        "policy": plan.get("policy"),
        "device": plan.get("device"),
        "budget_bytes": plan.get("budget_bytes"),
        "persistent_bytes": plan.get("persistent_bytes"),
        "batch_size": plan.get("batch_size"),
        "num_layers": plan.get("num_layers"),
        "num_swaps": len(plan["swaps"]),
        "swapped_bytes": sum(s["bytes"] for s in plan["swaps"]),
        "num_swap_ins": sum(len(s.get("swap_ins") or []) for s in plan["swaps"]),
        "predicted": scalars,
        "peak_by_group": predicted.get("peak_by_group") if isinstance(predicted.get("peak_by_group"), dict) else {},
        "notes": [n for n in plan.get("notes", []) if isinstance(n, str)],
        "stage": (plan.get("params") or {}).get("stage") if isinstance(plan.get("params"), dict) else None,
        "measured": plan.get("measured") if isinstance(plan.get("measured"), dict) else {},
        "calibration": predicted.get("calibration") if isinstance(predicted.get("calibration"), dict) else None,
    }
