"""Recompute instead of keep or swap: forward tensors the backward pass can compute again from what it holds anyway.

Many feature maps kept for the backward pass are cheap element-wise functions of tensors that stay on the device
for the backward pass anyway: a ResNet's ReLU output is ``Relu(x * inv + c)`` of the convolution output ``x``
(which the batch-norm gradient keeps) and two per-channel vectors; GELU's output in a Transformer's MLP is
``Erfc(-x/sqrt 2) * 0.5x`` of two tensors its gradient keeps. Such a tensor need not stay on the device between
its forward and backward uses (nor travel to host memory and back): copies of the ops that made it, run again
just before its first backward consumer on the same inputs, give the same bytes (the same kernels on the same
values; element-wise kernels compute each element on its own, whatever the threads). This is the recomputation of
SuperNeurons and Capuchin, restricted to what costs the least: short chains of element-wise ops.

:func:`find_recomputable` finds, for each forward tensor with backward consumers, such a chain (at most
:data:`MAX_CHAIN_OPS` ops) whose *leaves* are constants, tensors small next to it, or tensors alive anyway when its
first backward consumer runs (they have a consumer at or after it). The planner (:mod:`dymem_tf.planning.planner`)
weighs each against keeping and swapping the tensor (a ``SwapDecision`` with ``kind="recompute"``); the rewrite
copies the chain's ops, triggered one dependency layer before the consumers, and reroutes the consumers to the copy
(:func:`dymem_tf.passes.graph_pass.encode_plan`). A recomputation and a swap of one of its leaves exclude each other.
"""
from __future__ import annotations

import dataclasses

from dymem_tf.planning.analysis import COPYABLE_ALIAS_OP_TYPES, StepGraph
from dymem_tf.planning.plan import RecomputeRoute

#: Deterministic element-wise ops (and BiasAdd): recomputed, they give the same bytes.
RECOMPUTABLE_OP_TYPES = frozenset({
    "Abs", "Add", "AddV2", "BiasAdd", "Cast", "Elu", "Erf", "Erfc", "Exp", "LeakyRelu", "Log", "Log1p", "Maximum",
    "Minimum", "Mul", "Neg", "RealDiv", "Reciprocal", "Relu", "Relu6", "Rsqrt", "Selu", "Sigmoid", "Softplus",
    "Softsign", "Sqrt", "Square", "SquaredDifference", "Sub", "Tanh",
})
#: Most ops one recomputation copies.
MAX_CHAIN_OPS = 4
#: A leaf this many times smaller than the tensor may live longer for it.
SMALL_LEAF_RATIO = 16
#: Producers of persistent tensors a recomputation may read (their value never changes).
CONSTANT_OP_TYPES = frozenset({"Const", "HostConst"})


@dataclasses.dataclass(frozen=True)
class Recomputable:
    """A forward tensor the backward pass can compute again: the chain's ops in execution order (the tensor's
    producer last), the tensors it reads (``leaves``), and the tensor's backward consumers, in execution order.

    ``reroutes``: ``(consumer, source op)`` pairs: the consumer's inputs that read the source (the tensor's
    producer, or a forward alias op of the tensor, a ``Reshape``) are to read its recomputed copy; ``aliases``: those
    alias ops, copied for the backward consumers to read the recomputed tensor."""

    tensor: str
    bytes: int
    ops: tuple[str, ...]
    leaves: tuple[str, ...]
    backward_consumers: tuple[str, ...]
    reroutes: tuple[tuple[str, str], ...] = ()
    aliases: tuple[str, ...] = ()


def find_recomputable(sg: StepGraph, min_bytes: int = 1) -> list[Recomputable]:
    """Every forward tensor of ``sg`` of at least ``min_bytes`` whose backward consumers (each reading it directly)
    can get it from a chain of at most :data:`MAX_CHAIN_OPS` recomputable ops over leaves that are on the device
    anyway (see the module's docstring)."""
    out = []
    for t in sg.tensors.values():
        found = _recomputable(sg, t.name, min_bytes)
        if found is not None:
            out.append(found)
    return out


def _recomputable(sg: StepGraph, name: str, min_bytes: int) -> Recomputable | None:
    """The :class:`Recomputable` of tensor ``name``, or None."""
    t = sg.tensors[name]
    if t.persistent or t.variable or t.alias_of is not None or not t.shape_known or t.bytes < max(min_bytes, 1):
        return None
    producer = sg.ops[t.producer]
    if producer.phase != "forward" or len(producer.outputs) != 1:
        return None
    routed = _backward_routes(sg, name)
    if not routed:
        return None  # no backward consumer, or one reads it through an alias that cannot be copied
    reroutes, aliases = routed
    backward = sorted({c for c, _ in reroutes}, key=sg.position)
    first = sg.position(backward[0])
    chain: list[str] = []
    leaves: list[str] = []
    if not _collect(sg, t.producer, t, first, producer.frame, chain, leaves):
        return None
    order = sorted(chain, key=sg.position)
    return Recomputable(name, t.bytes, tuple(order), tuple(dict.fromkeys(leaves)), tuple(backward),
                        tuple(reroutes), tuple(aliases))


def route_of(sg: StepGraph, r: Recomputable) -> RecomputeRoute:
    """The rewrite's instructions for ``r``: each chain op with the inputs that read an earlier chain op."""
    chain = set(r.ops)
    ops = [[op, [[k, sg.tensors[t].producer] for k, t in enumerate(sg.ops[op].inputs)
                 if sg.tensors[t].producer in chain]] for op in r.ops]
    return RecomputeRoute(ops=ops, aliases=list(r.aliases), reroutes=[list(p) for p in r.reroutes],
                          leaves=list(r.leaves))




def _backward_routes(sg: StepGraph, name: str) -> tuple[list, list] | None:
    """``(reroutes, aliases)`` for the backward consumers of tensor ``name``: those reading it directly, and those
    reading a forward alias op of it (one level, of a copyable type); None when there is no backward consumer or one
    reads it in another way."""
    producer = sg.tensors[name].producer
    reroutes, aliases = [], []
    for c in sg.tensors[name].consumers:
        op = sg.ops[c]
        outs = [o for o in op.outputs if sg.tensors[o].alias_of == name]
        if op.phase != "forward":
            reroutes.append((c, producer))
        elif outs:
            later = [u for u in sg.tensors[outs[0]].consumers if sg.ops[u].phase != "forward"]
            if not later:
                continue
            if (op.type not in COPYABLE_ALIAS_OP_TYPES or outs != op.outputs[:1] or op.inputs[:1] != [name]
                    or any(sg.tensors[o].alias_of is not None and sg.tensors[o].consumers for o in op.outputs[1:])
                    or any(sg.ops[u].phase == "forward" and sg.tensors[u2].alias_of == outs[0]
                           for u in sg.tensors[outs[0]].consumers for u2 in sg.ops[u].outputs)):
                return None
            aliases.append(c)
            reroutes += [(u, c) for u in later]
    return (reroutes, aliases) if reroutes else None


def _collect(sg: StepGraph, op_name: str, target, first_use: int, frame: str, chain: list, leaves: list) -> bool:
    """Add ``op_name`` and, recursively, the producers of its inputs that are not leaves to ``chain`` (its inputs
    that are, to ``leaves``); False when an op cannot be recomputed or the chain grows beyond the limit."""
    op = sg.ops[op_name]
    if (op.type not in RECOMPUTABLE_OP_TYPES or op.phase != "forward" or op.conditional or op.frame != frame
            or len(op.outputs) != 1 or op_name in chain or len(chain) >= MAX_CHAIN_OPS):
        return False
    chain.append(op_name)
    for tensor in op.inputs:
        if _is_leaf(sg, tensor, target, first_use):
            leaves.append(tensor)
        elif not _collect(sg, sg.tensors[tensor].producer, target, first_use, frame, chain, leaves):
            return False
    return True


def _is_leaf(sg: StepGraph, tensor: str, target, first_use: int) -> bool:
    """Whether a recomputation of ``target`` may read ``tensor`` as it is: a constant, small next to the target, or
    a buffer some op still reads when the target's first backward consumer (at position ``first_use``) runs."""
    owner = sg.tensors[sg.buffer_of(tensor)]
    if owner.persistent:
        return sg.ops[owner.producer].type in CONSTANT_OP_TYPES
    if owner.variable or not owner.shape_known:
        return False
    if owner.bytes * SMALL_LEAF_RATIO <= target.bytes:
        return True
    return owner.name != target.name and any(sg.position(c) >= first_use for c in sg.buffer_consumers(owner.name))
