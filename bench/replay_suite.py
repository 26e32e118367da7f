"""GTBM replay table: footprint / lower bound per policy on recorded traces and public DSA instances.

Uses :func:`dymem_tf.memory.replay.replay` (the C++ allocator core through ``_dymem_replay``, no TensorFlow needed at run
time). Each instance is replayed online, in time order, with each policy; the table reports the footprint (the
memory the allocator holds at its peak: GTBM's owned pageblocks, best fit's regions, first fit's heap top), the
peak extent (the highest byte used: the arena a flat allocator without page release would need) and both divided
by the instance's lower bound (peak of live requested bytes).
"""
from __future__ import annotations

import glob
import os
import time

POLICIES = ("gtbm", "gtbm_nogroups", "best_fit", "first_fit")
#: The sub-directories of the public DSA benchmark dir that are replayed, in order.
DSA_SUITES = ("minimalloc/examples", "minimalloc/challenging", "idealloc/somas_tensors", "idealloc/iopddl")


def replay_file(path: str, kind: str, suite: str, policies=POLICIES, alignment: int = 0) -> dict:
    """Replay one file with every policy; a row with per-policy results (or the error)."""
    from dymem_tf.memory import replay

    row = {"name": os.path.splitext(os.path.basename(path))[0], "path": path, "kind": kind, "suite": suite,
           "policies": {}}
    t0 = time.perf_counter()
    for policy in policies:
        try:
            r = replay.replay(path, policy=policy, alignment=alignment)
        except (ValueError, OSError) as err:
            row["policies"][policy] = {"error": str(err)[:300]}
            continue
        row.setdefault("num_buffers", r.num_buffers)
        row.setdefault("lower_bound", r.lower_bound)
        row.setdefault("alignment", r.alignment)
        row.setdefault("groups_from_trace", r.groups_from_trace)
        row.setdefault("groups", {"persistent": r.buffers_persistent, "transient": r.buffers_transient,
                                  "mobile": r.buffers_mobile})
        row["policies"][policy] = {"footprint": r.footprint, "peak_extent": r.peak_extent, "ratio": r.ratio,
                                   "extent_ratio": r.extent_ratio, "num_failed": r.num_failed,
                                   "block_size": r.block_size, "time_ms": r.time_ns / 1e6}
    row["wall_s"] = time.perf_counter() - t0
    return row


def dsa_files(dsa_dir: str) -> list[tuple[str, str]]:
    """(suite, path) of every public instance under ``dsa_dir``, in suite order."""
    out = []
    for suite in DSA_SUITES:
        for path in sorted(glob.glob(os.path.join(dsa_dir, suite, "*.csv"))):
            out.append((suite, path))
    return out


def replay_dsa(dsa_dir: str, time_box_s: float = 60.0, max_bytes: int = 4 << 20, progress=None) -> dict:
    """Replay the public instances; skips files above ``max_bytes`` and stops once ``time_box_s`` is spent.

    Returns ``{"dir", "rows", "skipped": [(name, reason)], "note"}``; a missing directory gives an empty result
    with a note instead of an error.
    """
    result = {"dir": dsa_dir, "rows": [], "skipped": [], "note": ""}
    if not os.path.isdir(dsa_dir):
        result["note"] = f"{dsa_dir} not found: the public DSA instances were not replayed"
        return result
    files = dsa_files(dsa_dir)
    if not files:
        result["note"] = f"no CSV instances under {dsa_dir}"
        return result
    t0 = time.perf_counter()
    for suite, path in files:
        name = os.path.basename(path)
        if os.path.getsize(path) > max_bytes:
            result["skipped"].append((name, f"larger than {max_bytes >> 20} MiB"))
            continue
        if time.perf_counter() - t0 > time_box_s:
            result["skipped"].append((name, f"time box of {time_box_s:.0f}s spent"))
            continue
        # Abstract units: alignment 1 (a 64-byte rounding would distort instances whose sizes are a few units).
        row = replay_file(path, "dsa", suite, alignment=1)
        result["rows"].append(row)
        if progress:
            progress(f"replay {suite}/{name}", row["wall_s"])
    return result


def replay_traces(trace_metas: list[dict]) -> list[dict]:
    """Replay recorded traces (64-byte alignment, the live allocator's; groups from the trace's column)."""
    rows = []
    for meta in trace_metas:
        if meta.get("status") == "failed" or not os.path.exists(meta.get("path", "")):
            continue
        row = replay_file(meta["path"], "trace", meta.get("model", ""), alignment=64)
        row["model"] = meta.get("model")
        row["trace_policy"] = meta.get("policy")
        row["batch"] = meta.get("batch")
        row["image_size"] = meta.get("image_size")
        rows.append(row)
    return rows
