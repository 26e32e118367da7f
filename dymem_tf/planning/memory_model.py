"""The measured memory model: what a traced step allocated beyond the tensors of its graph.

A kernel allocates more than its outputs: TF's CPU convolution gradients (``Conv2DBackpropInput``/``Filter``)
take an im2col buffer of up to ~20-30 MiB whatever the model's size, cuDNN takes workspaces, some kernels stage
their results. No graph shows these *temporaries*; the GTBM allocator's trace of the first step does (every
allocation names the kernel that made it). :func:`from_trace` takes, per op of the step graph, the allocations that
are not its outputs (matched by size) and keeps the largest amount of them live at once; and how many ops held
temporaries at the same moment (the executor runs independent ops on several threads), and, per op, the most
temporaries of all ops that were live while its own were (``overlap``: what the executor's threads really held at
once in that step).

The simulator (:class:`~dymem_tf.planning.simulator.Simulator`) then holds that measured overlap during ``op``
(:meth:`MeasuredMemory.held_during`); without it (a hand-made model), ``temporaries[op]`` plus the largest
temporaries of the other ops of its dependency layer that may run beside it. Later steps order independent ops
differently, so their overlap varies: the step slack of :mod:`dymem_tf.planning.first_step` covers that. Pure
Python: the trace arrives as rows (dicts) of GTBM's CSV.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable, Mapping

from dymem_tf.planning.analysis import StepGraph, no_autograph

#: Temporaries smaller than this are ignored (scalars, shapes: noise next to the step's memory).
MIN_TEMPORARY_BYTES = 64 * 1024
#: The most ops whose temporaries are taken to coexist, whatever the trace showed.
MAX_CONCURRENCY = 4


@dataclasses.dataclass
class MeasuredMemory:
    """Per-op temporary bytes measured in a traced step, how many ops held them at once (1 = never two), and per
    op the most temporaries of all ops live while its own were (``overlap``; empty when not measured)."""

    temporaries: dict[str, int]
    concurrency: int = 1
    overlap: dict[str, int] = dataclasses.field(default_factory=dict)

    def held_during(self, sg: StepGraph) -> dict[str, int]:
        """Bytes held besides the outputs while each op of ``sg`` runs: the measured ``overlap`` where there is
        one, else its own temporaries plus the largest ones of up to ``concurrency - 1`` other ops of its
        dependency layer (independent ops the executor may run at the same time)."""
        if self.overlap:
            return {name: max(nbytes, self.temporaries.get(name, 0)) for name, nbytes in self.overlap.items()
                    if name in sg.ops and nbytes > 0}
        by_layer: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for name, nbytes in self.temporaries.items():
            op = sg.ops.get(name)
            if op is not None and nbytes > 0:
                by_layer[op.layer].append((nbytes, name))
        held = {}
        for members in by_layer.values():
            members.sort(reverse=True)
            for nbytes, name in members:
                others = [b for b, n in members if n != name][:max(self.concurrency - 1, 0)]
                held[name] = nbytes + sum(others)
        return held

    def summary(self) -> str:
        total = sum(self.temporaries.values())
        return (f"measured temporaries: {len(self.temporaries)} ops, largest "
                f"{max(self.temporaries.values(), default=0) / 2**20:.1f} MiB, {total / 2**20:.1f} MiB in all, "
                f"up to {self.concurrency} ops at once")


def _own_allocations(rows: Iterable[Mapping[str, str]], ops: Mapping, first_event: int
                     ) -> dict[str, list[tuple[int, int, int]]]:
    """``op -> [(size, lower, upper)]`` of the trace rows made by ops of the step graph from ``first_event`` on."""
    out: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for row in rows:
        name = row["op"]
        if name in ops and int(row["lower"]) >= first_event:
            out[name].append((int(row["size"]), int(row["lower"]), int(row["upper"])))
    return out


def _unmatched(allocs: list[tuple[int, int, int]], output_sizes: list[int]) -> list[tuple[int, int, int]]:
    """``allocs`` less one allocation of each output's size (the outputs; a forwarded output allocates none)."""
    left = list(allocs)
    for size in output_sizes:
        for i, alloc in enumerate(left):
            if alloc[0] == size:
                del left[i]
                break
    return left


def peak_live(allocs: list[tuple[int, int, int]]) -> int:
    """The most bytes of ``allocs`` live at once (half-open ``[lower, upper)`` event intervals)."""
    events = sorted([(lo, s) for s, lo, _ in allocs] + [(up, -s) for s, _, up in allocs])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _coexistence(temps: Mapping[str, list[tuple[int, int, int]]]) -> tuple[int, dict[str, int]]:
    """One sweep over the temporaries' events (frees before allocations at the same event): the most ops with a
    temporary live at once, and ``op -> the most bytes of all ops' temporaries live at one event while some of op's
    own were``."""
    events = sorted([(lo, 1, op, size) for op, allocs in temps.items() for size, lo, _ in allocs]
                    + [(up, 0, op, size) for op, allocs in temps.items() for size, _, up in allocs])
    count: dict[str, int] = defaultdict(int)  # live temporaries per op
    own: dict[str, int] = defaultdict(int)  # live bytes per op
    overlap: dict[str, int] = defaultdict(int)
    live = concurrency = 0
    for _, kind, op, size in events:
        delta = size if kind else -size
        live += delta
        count[op] += 1 if kind else -1
        own[op] += delta
        if not count[op]:
            del count[op]
        if not own[op]:
            del own[op]
        concurrency = max(concurrency, len(count))
        for name in own:
            overlap[name] = max(overlap[name], live)
    return concurrency, dict(overlap)


@no_autograph
def from_trace(rows: Iterable[Mapping[str, str]], sg: StepGraph, min_bytes: int = MIN_TEMPORARY_BYTES,
               first_event: int = 0) -> MeasuredMemory:
    """The temporaries of ``sg``'s ops in a GTBM trace (rows of :func:`dymem_tf.memory.allocator.dump_trace`'s
    CSV, of the step that ran ``sg``; rows before ``first_event`` are ignored)."""
    temps: dict[str, list[tuple[int, int, int]]] = {}
    for name, allocs in _own_allocations(rows, sg.ops, first_event).items():
        sizes = [sg.tensors[t].bytes for t in sg.ops[name].outputs if sg.tensors[t].alias_of is None]
        extra = _unmatched(allocs, sizes)
        if extra and peak_live(extra) >= min_bytes:
            temps[name] = extra
    concurrency, overlap = _coexistence(temps)
    return MeasuredMemory({name: peak_live(allocs) for name, allocs in temps.items()},
                          max(1, min(concurrency, MAX_CONCURRENCY)), overlap)
