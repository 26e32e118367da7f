"""Lowered conditionals in the memory model: which branch each op runs in, and which branch of each conditional
the simulator counts.

A lowered ``cond`` is a ``Switch`` per value it takes in (output 0 feeds the false branch, output 1 the true one,
both switched on one predicate) and a ``Merge`` per value it returns (a lowered loop's Switch and Merge carry its
variables and open no branch: :func:`in_loop_plumbing`). Only one branch runs: the ops of the other
are dead and allocate nothing. The simulator runs every op of the graph, so without this it would hold both
branches' tensors at once; instead it counts, for each conditional, the branch whose tensors take more bytes (the
worst case of the two) and leaves the other's tensors out (:func:`uncounted_ops`).
"""
from __future__ import annotations

from collections import defaultdict

from dymem_tf.planning.analysis import StepGraph

#: One level of a branch path: (the predicate tensor of the branch's ``Switch``, the output taken: 0 false, 1 true).
Level = tuple[str, int]


def branch_paths(step_graph: StepGraph) -> dict[str, tuple[Level, ...]]:
    """Each op's lowered conditional branches, outermost first (``()`` outside every conditional): an op is in the
    branch of the deepest of its inputs; a ``Switch``'s output enters its branch, a ``Merge`` leaves it."""
    ops = step_graph.ops
    paths: dict[str, tuple[Level, ...]] = {}
    for name in step_graph.execution_order():
        op = ops[name]
        found = [path for t in op.inputs if (path := tensor_path(step_graph, paths, t)) is not None]
        found += [paths[c] for c in op.control_inputs if c in paths]
        joins = op.type == "Merge" and not in_loop_plumbing(step_graph, op)
        paths[name] = _common_prefix(found) if joins else max(found, key=len, default=())
    return paths


def tensor_path(step_graph: StepGraph, paths: dict[str, tuple[Level, ...]], tensor: str) -> tuple[Level, ...] | None:
    """The branch path ``tensor`` is made in (its producer's; a conditional ``Switch``'s output is in the branch it
    enters), or None for a tensor whose producer has no path in ``paths``."""
    info = step_graph.tensors.get(tensor)
    if info is None or info.producer not in paths:
        return None
    path, producer = paths[info.producer], step_graph.ops[info.producer]
    if producer.type == "Switch" and len(producer.inputs) > 1 and not in_loop_plumbing(step_graph, producer):
        path = path + ((producer.inputs[1], _port(tensor)),)
    return path


def in_loop_plumbing(step_graph: StepGraph, op) -> bool:
    """Whether ``op`` (a ``Switch`` or ``Merge``) carries a lowered loop's variable rather than a conditional's: a
    Switch on a ``LoopCond``'s predicate (its outputs lead to the body and to the ``Exit``, both of which run), or a
    Merge of a value entering the loop. Neither opens or closes a branch."""
    producers = [step_graph.ops[step_graph.tensors[t].producer] for t in op.inputs if t in step_graph.tensors]
    if op.type == "Switch":
        return len(producers) > 1 and producers[1].type == "LoopCond"
    return op.type == "Merge" and any(p.type == "Enter" for p in producers)


def uncounted_ops(step_graph: StepGraph) -> set[str]:
    """The ops of the lighter branch of every lowered conditional (fewer bytes of tensors made; the false branch on
    a tie), nested branches inside it included: the simulator leaves their tensors and temporaries out, since they
    never run in the same step as the other branch. Empty for a step without conditionals."""
    return counted_branches(step_graph)[0]


def counted_merge_inputs(step_graph: StepGraph) -> dict[str, str]:
    """Each conditional ``Merge`` -> its input from the branch the simulator counts (the heavier): TF's kernel
    outputs the buffer of the branch that ran, and the model runs that one. Empty without conditionals."""
    return counted_branches(step_graph)[1]


def counted_branches(step_graph: StepGraph) -> tuple[set[str], dict[str, str]]:
    """:func:`uncounted_ops` and :func:`counted_merge_inputs` of ``step_graph``, from one walk of its branches."""
    if not any(op.type == "Switch" for op in step_graph.ops.values()):
        return set(), {}
    paths = branch_paths(step_graph)
    light = _light_branches(step_graph, paths)
    merges = {}
    for op in step_graph.ops.values():
        if op.type != "Merge" or in_loop_plumbing(step_graph, op) or _in_light(paths.get(op.name, ()), light):
            continue
        found = [t for t in op.inputs if (path := tensor_path(step_graph, paths, t)) is not None
                 and len(path) > len(paths[op.name]) and not _in_light(path, light)]
        if found:
            merges[op.name] = found[0]
    return {name for name, path in paths.items() if _in_light(path, light)}, merges


def _light_branches(step_graph: StepGraph, paths: dict[str, tuple[Level, ...]]) -> set[tuple[Level, ...]]:
    """The branch paths that make fewer bytes than the other branch of their conditional (:func:`_lighter`)."""
    weight: dict[tuple[Level, ...], int] = defaultdict(int)
    for name, path in paths.items():
        made = sum(step_graph.tensors[t].bytes for t in step_graph.ops[name].outputs
                   if not step_graph.tensors[t].persistent and step_graph.tensors[t].alias_of is None)
        for depth in range(1, len(path) + 1):
            weight[path[:depth]] += made
    for name, path in paths.items():  # a branch that makes nothing (it returns its input) still is one
        for t in step_graph.ops[name].inputs:
            entered = tensor_path(step_graph, paths, t)
            if entered is not None and len(entered) > len(path):
                for depth in range(1, len(entered) + 1):
                    weight.setdefault(entered[:depth], 0)
    return {path for path in weight if _lighter(path, weight)}


def _in_light(path: tuple[Level, ...], light: set[tuple[Level, ...]]) -> bool:
    """Whether ``path`` lies in one of the ``light`` branches (or a branch nested in one)."""
    return any(path[:d] in light for d in range(1, len(path) + 1))


def _lighter(path: tuple[Level, ...], weight: dict) -> bool:
    """Whether the branch at ``path`` makes fewer bytes than the other branch of its conditional (the false one
    counts as lighter on a tie)."""
    (pred, side), parent = path[-1], path[:-1]
    other = weight.get(parent + ((pred, 1 - side),), 0)
    return weight[path] < other or (weight[path] == other and side == 0)


def _common_prefix(paths: list[tuple[Level, ...]]) -> tuple[Level, ...]:
    """The longest path every one of ``paths`` starts with (``()`` for none)."""
    if not paths:
        return ()
    prefix = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def _port(tensor: str) -> int:
    """The output index in a tensor name ``op:k`` (0 without one)."""
    head, _, port = tensor.rpartition(":")
    return int(port) if head and port.isdigit() else 0
