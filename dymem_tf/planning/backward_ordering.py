"""Hold gradient ops that are ready early until the backward pass reaches them.

Some gradient ops read only forward tensors: GELU's gradient squares and exponentiates its input
(``gradient_tape/.../Gelu/Square``), a normalisation's gradient re-derives its statistics' terms. TF's executor runs
an op as soon as its inputs exist, so such an op runs during the forward pass and its output then waits, alive, for
the backward pass to reach its consumer: at the peak of a 12-block GPT step (AdamW, 2 MiB per tensor) three such
GELU temporaries per block were alive at once. The simulator, which runs ops layer by layer as soon as they are
ready, saw the same.

This stage adds a control edge to each such op from an op that runs just before the op's first consumer (as late as
possible), when that moves it later, cannot close a cycle, and makes no input live longer except forward feature
maps no larger than what the op owns (which the planner may then swap, unlike the gradient op's outputs). The values
are unchanged, so results stay bit-identical; only lifetimes change.
It is the memory-aware ordering of the backward pass (issue #14, item 3) for the ops that gain from it without cost.
"""
from __future__ import annotations

from dymem_tf.planning.analysis import Reachability, StepGraph, is_acyclic_with, no_autograph

#: Ops owning fewer output bytes than this are not worth an edge.
MIN_HOLD_BYTES = 64 * 1024
#: An op is held only when its first consumer runs at least this many dependency layers after it.
MIN_SLACK_LAYERS = 2


def _owned_bytes(sg: StepGraph, name: str) -> int:
    """Bytes of the buffers ``name``'s outputs own (not persistent, not aliases)."""
    tensors = (sg.tensors[t] for t in sg.ops[name].outputs)
    return sum(t.bytes for t in tensors if not t.persistent and t.alias_of is None)


def _consumers(sg: StepGraph, name: str) -> list[str]:
    """Ops reading an output of ``name`` (through aliases), once each, in the order the graph lists them: a set's
    order would change with Python's string hashing and so, between equal candidates, the plan from one process
    to the next."""
    return list(dict.fromkeys(c for t in sg.ops[name].outputs for c in sg.buffer_consumers(t) if c != name))


def _inputs_stay(sg: StepGraph, name: str, effective: dict[str, int], held: dict[str, str]) -> bool:
    """Whether holding ``name`` until its effective layer costs no memory the plan cannot take back. Each input is
    persistent, produced by an op held too (the chain moves together), read at or after that layer by another op,
    or a forward feature map: those, no larger in all than what ``name`` owns, then live into the backward pass in
    place of ``name``'s outputs, and unlike them the planner may swap them (GELU's input ``x`` instead of the
    ``exp(-x^2/2)`` its gradient derives from it early)."""
    extended = 0
    for tensor in sg.ops[name].inputs:
        info = sg.tensors.get(tensor)
        if info is None or info.persistent:
            continue
        buffer = sg.buffer_of(tensor)
        producer = sg.tensors[buffer].producer
        if producer in held or any(effective[c] >= effective[name] for c in sg.buffer_consumers(buffer) if c != name):
            continue
        if sg.ops[producer].phase != "forward":
            return False
        extended += sg.tensors[buffer].bytes
    return extended <= _owned_bytes(sg, name)


def _eligible(sg: StepGraph, order: list[str], min_bytes: int) -> list[str]:
    """The gradient ops outside conditional branches that own at least ``min_bytes``, consumers first."""
    return [name for name in reversed(order) if sg.ops[name].phase == "backward" and not sg.ops[name].conditional
            and _owned_bytes(sg, name) >= min_bytes]


def _propose(sg: StepGraph, eligible: list[str], layers: dict[str, int], excluded: set[str], paths: Reachability
             ) -> tuple[dict, dict]:
    """Anchors for the ``eligible`` ops (:func:`_eligible`) ready long before their first consumer (consumers
    first, so a chain of such ops follows its last link), and the dependency layers the ops would then have
    (``layers``: each op's own)."""
    g = sg.graph
    effective = dict(layers)
    anchor_of: dict[str, str] = {}
    for name in eligible:
        op = sg.ops[name]
        if name in excluded:
            continue
        consumers = _consumers(sg, name)
        if not consumers:
            continue
        first = min(consumers, key=effective.__getitem__)
        if effective[first] - op.layer < MIN_SLACK_LAYERS:
            continue
        candidates = [p for p in g.predecessors(first) if p != name and sg.ops[p].phase == "backward"
                      and effective[p] < effective[first] and sg.ops[p].frame == op.frame]
        if first in anchor_of:
            candidates.append(anchor_of[first])
        candidates = [p for p in candidates if effective[p] > op.layer and not paths.has_path(name, p)]
        if candidates:
            anchor_of[name] = max(candidates, key=effective.__getitem__)
            effective[name] = effective[anchor_of[name]] + 1
    return anchor_of, effective


@no_autograph
def find_holds(sg: StepGraph, min_bytes: int = MIN_HOLD_BYTES) -> list[tuple[str, str]]:
    """``(anchor, op)`` pairs: gradient op ``op``, ready long before its first consumer, should run after ``anchor``
    (an op its first consumer waits for). A hold that would keep an input alive longer is dropped, and the
    proposal made again without it, until every hold is free."""
    order = sg.topological_order()
    paths = sg.reachability()
    eligible = _eligible(sg, order, min_bytes)
    layers = {name: sg.ops[name].layer for name in order}
    excluded: set[str] = set()
    while True:
        anchor_of, effective = _propose(sg, eligible, layers, excluded, paths)
        costly = {n for n in anchor_of if not _inputs_stay(sg, n, effective, anchor_of)}
        if not costly:
            break
        excluded |= costly
    pairs = sorted(((a, n) for n, a in anchor_of.items()), key=lambda p: effective[p[1]])
    return pairs if is_acyclic_with(sg.graph, pairs) else []
