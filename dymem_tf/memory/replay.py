"""Replay allocation traces through GTBM and the baseline policies, offline.

Usage::

    python -m dymem_tf.memory.replay TRACE.csv [MORE.csv ...] [--policy gtbm|gtbm_nogroups|best_fit|first_fit|all]
                              [--block-size N] [--alignment N] [--groups auto|trace|lifetime|none] [--json]

Input: a dynamic storage allocation instance as CSV with the columns ``id,lower,upper,size`` (MiniMalloc's format;
extra columns are allowed), each buffer alive over the half-open interval ``[lower, upper)``: the MiniMalloc and
idealloc benchmarks, or a trace recorded by :func:`dymem_tf.memory.allocator.record_trace` (which adds ``group``,
``offset``, ``op``, ``step`` and timestamps). Buffers are allocated at ``lower`` and freed at ``upper``, online and in
time order; at equal times frees come first, then allocations in file order.

Policies (the C++ core in ``dymem_tf/cc/gtbm/``): ``gtbm`` (pageblocks owned by mobility groups),
``gtbm_nogroups`` (the same with one group, to isolate the grouping), ``best_fit`` (a mirror of TensorFlow's BFC
allocator: 256-byte rounding, 21 bins, regions doubling from 2 MiB) and ``first_fit`` (address-ordered).

Reported per file and policy:

* ``footprint``: peak of the memory the allocator holds -- GTBM: pageblocks owned by groups (the live allocator
  returns free blocks to the OS with madvise, a GPU pool would unmap them with CUDA's virtual memory API);
  best_fit: its regions (BFC never returns them); first_fit: its heap top;
* ``lower_bound``: peak of the live requested bytes, which no placement can beat; ``ratio`` = footprint / bound;
* ``peak_extent``: the highest byte reserved, i.e. the arena needed without page-level release;
* ``time``: wall time of the replay loop.

Mobility groups (``--groups``): ``trace`` uses the file's ``group`` column (what the live allocator decided);
``lifetime`` assigns them from the lifetimes, the way the planner does from the step's dataflow graph, where every
tensor's lifetime is known before the step runs: alive over at least 90% of the horizon -> persistent, at least
10% -> mobile (a feature map kept for the backward pass, the planner's swap candidates), else transient; ``none``
puts everything in one group; ``auto`` (default) uses the column when present, else the lifetime rule.

Block size: ``--block-size`` (bytes or units, e.g. ``2MiB``); by default the lower bound / 256 rounded down to a
power of two. Alignment: by default 64 bytes for recorded traces, and for abstract instances the largest power of
two up to 64 that divides every size.

The replay engine is the TF-free library ``_dymem_replay`` (ctypes), safe to load in any process.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import sys
import threading
from typing import Iterable, Sequence

from tabulate import tabulate

from dymem_tf.units import parse_bytes

POLICIES = ("gtbm", "gtbm_nogroups", "best_fit", "first_fit")
GROUP_MODES = ("auto", "trace", "lifetime", "none")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def replay_library() -> ctypes.CDLL:
    """The ctypes handle of ``_dymem_replay`` (loaded once)."""
    global _lib
    with _lock:
        if _lib is None:
            from dymem_tf.memory.native import library_path

            lib = ctypes.CDLL(library_path("replay"))
            lib.dymem_replay_stat_names.restype = ctypes.c_char_p
            lib.dymem_replay_stat_names.argtypes = []
            lib.dymem_replay_num_stats.restype = ctypes.c_int
            lib.dymem_replay_num_stats.argtypes = []
            lib.dymem_replay_last_error.restype = ctypes.c_char_p
            lib.dymem_replay_last_error.argtypes = []
            lib.dymem_replay_run.restype = ctypes.c_int
            lib.dymem_replay_run.argtypes = [
                ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p,
                ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
            ]
            i64p = ctypes.POINTER(ctypes.c_int64)
            lib.dymem_replay_buffers.restype = ctypes.c_int
            lib.dymem_replay_buffers.argtypes = [
                i64p, i64p, i64p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_char_p, i64p, ctypes.c_int,
            ]
            _lib = lib
        return _lib


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """Outcome of replaying one file with one policy (bytes, or the instance's units)."""

    path: str
    policy: str
    footprint: int
    peak_extent: int
    used_extent: int
    lower_bound: int
    peak_in_use: int
    reserved_at_peak_in_use: int
    num_buffers: int
    num_failed: int
    time_ns: int
    block_size: int
    alignment: int
    buffers_persistent: int
    buffers_transient: int
    buffers_mobile: int
    groups_from_trace: bool

    @property
    def ratio(self) -> float:
        """footprint / lower bound (1.0 is optimal)."""
        return self.footprint / self.lower_bound if self.lower_bound else 1.0

    @property
    def extent_ratio(self) -> float:
        return self.peak_extent / self.lower_bound if self.lower_bound else 1.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        d["extent_ratio"] = self.extent_ratio
        return d


def _checked(policy: str, block_size: int | str, alignment: int | str, groups: str) -> tuple[int, int]:
    """``(block, alignment)`` in bytes after checking the arguments both entry points share (ValueError)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if groups not in GROUP_MODES:
        raise ValueError(f"unknown groups mode {groups!r}: use one of {', '.join(GROUP_MODES)}")
    block = parse_bytes(block_size)
    align = parse_bytes(alignment)
    if align & (align - 1):
        raise ValueError(f"alignment must be a power of two, got {align}")
    return block, align


def _result(call, path: str, policy: str) -> ReplayResult:
    """Run ``call(out, len)`` of the library and read its statistics (ValueError with the library's message)."""
    lib = replay_library()
    names = lib.dymem_replay_stat_names().decode().split(",")
    out = (ctypes.c_int64 * len(names))()
    if call(out, len(names)) != 0:
        raise ValueError(lib.dymem_replay_last_error().decode(errors="replace"))
    values = dict(zip(names, out))
    fields = {f.name for f in dataclasses.fields(ReplayResult)} - {"path", "policy"}
    kwargs = {k: values[k] for k in fields}
    kwargs["groups_from_trace"] = bool(kwargs["groups_from_trace"])
    return ReplayResult(path=path, policy=policy, **kwargs)


def replay(path: str | os.PathLike, policy: str = "gtbm", block_size: int | str = 0, alignment: int | str = 0,
           groups: str = "auto") -> ReplayResult:
    """Replay one CSV file with one policy. ``block_size`` / ``alignment`` 0 mean automatic (see module doc).

    Raises ValueError for a bad argument or an unreadable / malformed file.
    """
    block, align = _checked(policy, block_size, alignment, groups)
    lib = replay_library()
    return _result(lambda out, n: lib.dymem_replay_run(os.fsencode(os.fspath(path)), policy.encode(), block, align,
                                                       groups.encode(), out, n), os.fspath(path), policy)


def replay_buffers(buffers, policy: str = "gtbm", block_size: int | str = 0, alignment: int | str = 0,
                   groups: str = "auto") -> ReplayResult:
    """Replay an instance held in memory: ``buffers`` is an array-like of rows ``(lower, upper, size)`` or
    ``(lower, upper, size, group)`` (group 0 persistent, 1 transient, 2 mobile), sizes in TensorFlow bytes (automatic
    alignment 64). Otherwise as :func:`replay` (its ``path`` is ``"<memory>"``)."""
    import numpy as np

    block, align = _checked(policy, block_size, alignment, groups)
    rows = np.asarray(buffers, dtype=np.int64)
    if rows.size == 0:
        rows = rows.reshape(0, 3)
    if rows.ndim != 2 or rows.shape[1] not in (3, 4):
        raise ValueError(f"buffers must be rows of 3 or 4 columns (lower, upper, size[, group]), got shape "
                         f"{rows.shape}")
    lower, upper, size = (np.ascontiguousarray(rows[:, k]) for k in range(3))
    group = np.ascontiguousarray(rows[:, 3], dtype=np.int32) if rows.shape[1] == 4 else None
    i64p, i32p = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
    lib = replay_library()
    return _result(lambda out, n: lib.dymem_replay_buffers(
        lower.ctypes.data_as(i64p), upper.ctypes.data_as(i64p), size.ctypes.data_as(i64p),
        group.ctypes.data_as(i32p) if group is not None else None, len(rows), policy.encode(), block, align,
        groups.encode(), out, n), "<memory>", policy)


def replay_all(paths: Iterable[str | os.PathLike], policies: Sequence[str] = POLICIES, block_size: int | str = 0,
               alignment: int | str = 0, groups: str = "auto") -> list[ReplayResult]:
    """Replay every file with every policy."""
    return [replay(p, pol, block_size, alignment, groups) for p in paths for pol in policies]


def format_table(results: Sequence[ReplayResult]) -> str:
    """A plain-text table per file."""
    lines: list[str] = []
    by_file: dict[str, list[ReplayResult]] = {}
    for r in results:
        by_file.setdefault(r.path, []).append(r)
    for path, rows in by_file.items():
        first = rows[0]
        source = "trace column" if first.groups_from_trace else "lifetimes"
        lines.append(
            f"{path}: {first.num_buffers} buffers, lower bound {first.lower_bound:,}, alignment {first.alignment}, "
            f"groups from {source} (persistent {first.buffers_persistent}, transient {first.buffers_transient}, "
            f"mobile {first.buffers_mobile})"
        )
        table = tabulate(
            [(r.policy, f"{r.footprint:,}", f"{r.ratio:.3f}", f"{r.peak_extent:,}", f"{r.extent_ratio:.3f}",
              f"{r.block_size:,}" if r.block_size else "-", f"{r.time_ns / 1e6:.2f}", r.num_failed) for r in rows],
            headers=("policy", "footprint", "ratio", "peak_extent", "ratio", "block", "time_ms", "failed"),
            tablefmt="plain", colalign=("left",) + ("right",) * 7, disable_numparse=True)
        lines += ["  " + row for row in table.splitlines()]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "dymem-replay") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Replay allocation traces (CSV id,lower,upper,size[,group,...]) through GTBM and baselines.",
    )
    parser.add_argument("paths", nargs="+", help="CSV files (MiniMalloc format or recorded GTBM traces)")
    parser.add_argument("--policy", default="all", choices=POLICIES + ("all",), help="placement policy (default all)")
    parser.add_argument("--block-size", default="0", help="GTBM block size, e.g. 2MiB (default: lower bound / 256)")
    parser.add_argument("--alignment", default="0", help="chunk alignment, a power of two (default: automatic)")
    parser.add_argument("--groups", default="auto", choices=GROUP_MODES, help="source of the mobility groups")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    args = parser.parse_args(argv)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    try:
        block = parse_bytes(args.block_size)
        align = parse_bytes(args.alignment)
        results = replay_all(args.paths, policies, block, align, args.groups)
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(format_table(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
