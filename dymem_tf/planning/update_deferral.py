"""Defer optimizer arithmetic that does not need the gradients until the gradients are there.

An optimizer's update mixes terms that depend on the gradient with terms that only read optimizer state, e.g.
Keras' SGD computes ``m * momentum`` and ``g * lr``. The first term is ready when the step starts, so TF's
executor computes it at once and keeps one weight-sized temporary per variable alive through the whole forward
and backward pass (90 MiB for ResNet-50 with momentum, twice that for Adam). This stage adds a control edge from
the op producing the gradient-side operand to each such op, so it runs next to its gradient-side partner. The
arithmetic is unchanged, so results stay bit-identical; only the temporaries' lifetimes shrink.
"""
from __future__ import annotations

from dymem_tf.planning.analysis import (StepGraph, adjacency_with, analyse, descendants, loop_back_edges,
                                       no_autograph, predecessors_of, reachable, successors_of)

#: Ops producing fewer bytes than this are not worth an edge.
MIN_DEFER_BYTES = 4096


@no_autograph
def find_deferrals(sg: StepGraph, min_bytes: int = MIN_DEFER_BYTES, always: frozenset[str] | set[str] = frozenset()
                   ) -> list[tuple[str, str]]:
    """``(anchor, op)`` pairs: ``op`` (update arithmetic that depends on no gradient) should run after ``anchor``
    (the op producing the gradient-derived operand it is combined with). Ops in ``always`` (reads of offloaded
    optimizer state, :mod:`dymem_tf.planning.offload`) are deferred whatever they own."""
    succ, pred = successors_of(sg.graph), predecessors_of(sg.graph)
    order = sg.topological_order()
    derived: dict[str, bool] = {}
    for name in order:
        derived[name] = sg.ops[name].phase == "backward" or any(map(derived.__getitem__, pred[name]))
    program = {name: i for i, name in enumerate(sg.ops)}
    anchor: dict[str, str] = {}
    for name in reversed(order):  # consumers first: a chain of state-only ops follows its last link's anchor
        op = sg.ops[name]
        if op.phase != "update" or derived[name]:
            continue
        candidates = []
        for c in succ[name]:
            if derived[c]:
                candidates += [p for p in pred[c] if p != name and derived[p]]
            elif c in anchor:
                candidates.append(anchor[c])
        if candidates:
            anchor[name] = min(candidates, key=program.__getitem__)
    pairs = []
    leads_to = _path_check(sg)
    for name, anc in anchor.items():
        owned = sum(sg.tensors[t].bytes for t in sg.ops[name].outputs
                    if not sg.tensors[t].persistent and sg.tensors[t].alias_of is None)
        if (owned >= min_bytes or name in always) and not leads_to(name, anc):
            pairs.append((anc, name))
    pairs.sort(key=lambda p: program[p[1]])
    return pairs


def _path_check(sg: StepGraph):
    """``leads_to(src, dst)``: whether ``src`` reaches ``dst`` in the graph TF runs, the loops' back edges included
    (an edge from ``dst`` back to ``src`` would close a cycle there: the executor then returned garbage, the LSTM's
    Optional arriving as a float). The DAG's reachability answers, except from an op that reaches a loop's back
    edge: one walk with the back edges."""
    paths, back = sg.reachability(), loop_back_edges(sg)
    if not back:
        return paths.has_path
    looping = descendants(sg.graph, [src for src, _ in back], reverse=True)  # ops that reach a back edge
    adjacency = adjacency_with(sg.graph, back)  # built once: a step has many anchors
    reached: dict[str, set[str]] = {}

    def leads_to(src: str, dst: str) -> bool:
        if paths.has_path(src, dst):
            return True
        if src not in looping:
            return False
        if src not in reached:
            reached[src] = reachable(adjacency, [src])
        return dst in reached[src]

    return leads_to


@no_autograph
def defer(sg: StepGraph, deferrals: list[tuple[str, str]], copy: bool = False) -> StepGraph:
    """Add the deferral edges to ``sg`` as control inputs and recompute its dependency layers (in place, or on a
    copy with ``copy=True``)."""
    if copy:
        sg = sg.copy()
    for anc, name in deferrals:
        op = sg.ops[name]
        if anc not in op.control_inputs:
            op.control_inputs.append(anc)
            sg.graph.add_edge(anc, name, kind="control")
    return analyse(sg)

