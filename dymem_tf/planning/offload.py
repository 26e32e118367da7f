"""Optimizer state off the device between its uses: find the variables a step uses only after its gradients exist,
and model each one as a tensor the planner may swap.

Adam's ``m`` and ``v``, SGD's momentum and the like are read and written only by the optimizer's update, at the end
of the backward pass; yet they occupy the device for the whole step, through the forward pass and the backward
peak. An *offloadable variable* is a resource variable whose every use in the step is a whole-variable read or
write (``ReadVariableOp``, ``Assign*VariableOp``) in the update phase. This stage

1. finds them (:func:`find_offloadable`);
2. names the reads of them that do not wait for a gradient yet (:func:`early_reads`): the update deferral
   (:mod:`dymem_tf.planning.update_deferral`) defers those too, so that every use comes after the gradients;
3. models each as a tensor of the variable's size produced by its resource op (:func:`mark`): the simulator keeps
   it on the device for the whole step unless the plan swaps it, and then only from its swap-in until its last use
   (between steps it lives in host memory). Its bytes leave the persistent bytes the planner is given.

The planner then chooses per variable, like per feature map, against the budget (a ``SwapDecision`` with
``kind="variable"``); the rewrite inserts ``DymemVariableSwapOut`` / ``DymemVariableSwapIn``
(``cc/ops/variable_swap_ops.cc``). The value is copied byte for byte: training is bit-identical.

**Weights** (issue #14, item 2) are read in the forward pass, again in the backward pass (a ``MatMul``'s gradient
with respect to its input needs the kernel) and written by the update. An *offloadable weight* is a resource
variable whose uses are whole-variable ops, with reads in the forward pass and writes only in the update
(:func:`find_offloadable_weights`). Offloaded, it lives in host memory but for two stays on the device: one from a
swap-in before its forward reads until their forward users are done (the device copy is then dropped: nothing wrote
it), one from a second swap-in before its backward users and its update until its update is done (then it is
copied back). The backward users no longer read the forward read: the rewrite gives them a read after the second
swap-in (``DymemVariableRead``), through copies of the alias ops (``Reshape`` ...) they read it through
(:class:`~dymem_tf.planning.plan.WeightRoute`). That costs three copies a step instead of none, so the planner
offloads a weight only where the budget needs it.
"""
from __future__ import annotations

import dataclasses

from dymem_tf import op_sets
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.plan import WeightRoute

#: Ops that read or write a whole variable through its resource handle.
WHOLE_VARIABLE_OP_TYPES = frozenset({"ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp",
                                     "AssignSubVariableOp"})
#: Ops that give a variable's resource handle to the step (a function argument, a placeholder before Grappler).
RESOURCE_SOURCE_OP_TYPES = frozenset({"_Arg", "Placeholder", "VarHandleOp"})


@dataclasses.dataclass(frozen=True)
class OffloadableVariable:
    """A variable the step uses only in its update: its resource tensor, value dtype and shape, and size."""

    tensor: str
    dtype: str
    shape: tuple
    bytes: int


def find_offloadable(sg: StepGraph) -> list[OffloadableVariable]:
    """The variables of ``sg`` used only by whole-variable ops of the update phase, in the same loop frame as
    their resource, with a known non-scalar value shape."""
    out = []
    for t in sg.tensors.values():
        if t.dtype != "resource" or not t.consumers or sg.ops[t.producer].type not in RESOURCE_SOURCE_OP_TYPES:
            continue
        frame = sg.ops[t.producer].frame
        users = [sg.ops[c] for c in t.consumers]
        if any(u.type not in WHOLE_VARIABLE_OP_TYPES or u.phase != "update" or u.frame != frame for u in users):
            continue
        value = _value_of(sg, t.name)
        if value is not None and value.bytes > 0 and len(value.shape) > 0:
            out.append(OffloadableVariable(t.name, value.dtype, tuple(value.shape), int(value.bytes)))
    return out


#: Alias ops the rewrite can copy for a weight's backward users: one data input aliased, the others (a shape) kept.
CLONABLE_ALIAS_OP_TYPES = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims", "EnsureShape", "StopGradient"})
#: Whole-variable ops that write the variable.
WRITE_OP_TYPES = WHOLE_VARIABLE_OP_TYPES - {"ReadVariableOp"}


@dataclasses.dataclass(frozen=True)
class OffloadableWeight:
    """A weight the step may keep in host memory between its uses (see the module's docstring).

    ``forward_users``: ops of the forward pass reading a forward read (through aliases), served by the first stay;
    ``backward_users``: the other ops reading it, rerouted to the second stay's read; ``update_users``: the
    resource's users other than the forward reads (the update's reads and writes), served by the second stay."""

    tensor: str
    dtype: str
    shape: tuple
    bytes: int
    forward_users: tuple[str, ...]
    backward_users: tuple[str, ...]
    update_users: tuple[str, ...]
    route: WeightRoute


#: Prefixes of the op types that use a resource as a variable (``DymemVariableSwapIn`` applies to it): those that
#: write it in place (:data:`dymem_tf.op_sets.VARIABLE_UPDATE_PREFIXES`, which GTBM's mobility rules share) and those
#: that read it.
VARIABLE_USER_PREFIXES = ("ReadVariableOp", *op_sets.VARIABLE_UPDATE_PREFIXES, "ResourceGather", "VarIsInitializedOp",
                          "VariableShape")
#: Ops that pass a resource on (into a loop frame, a conditional branch, an alias).
RESOURCE_PASSING_OP_TYPES = frozenset({"Enter", "Switch", "Identity", "Merge", "Exit"})


def variable_resources(sg: StepGraph) -> list[tuple[str, list[str]]]:
    """``(resource tensor, its direct consumers)`` for every variable the step uses: a resource given to the step
    (``_Arg`` ...) that ends, through the ops passing it on into loops and conditionals, only at ops using it as a
    variable (at least one)."""
    out = []
    for t in sg.tensors.values():
        if t.dtype != "resource" or not t.consumers or sg.ops[t.producer].type not in RESOURCE_SOURCE_OP_TYPES:
            continue
        if _used_as_variable(sg, t.name, set()):
            out.append((t.name, sorted(t.consumers)))
    return out


def _used_as_variable(sg: StepGraph, tensor: str, seen: set) -> bool:
    """Whether every use of resource ``tensor`` (followed through the ops passing it on) is a variable op, and
    there is one."""
    found = False
    for c in sg.tensors[tensor].consumers:
        op = sg.ops[c]
        if op.type.startswith(VARIABLE_USER_PREFIXES):
            found = True
        elif op.type in RESOURCE_PASSING_OP_TYPES:
            for out in op.outputs:
                if sg.tensors[out].dtype != "resource" or out in seen or not sg.tensors[out].consumers:
                    continue
                seen.add(out)
                if not _used_as_variable(sg, out, seen):
                    return False
                found = True
        else:
            return False
    return found


def find_offloadable_weights(sg: StepGraph, min_bytes: int = 1) -> list[OffloadableWeight]:
    """The weights of ``sg`` of at least ``min_bytes`` that the rewrite can keep in host memory between their uses:
    whole-variable ops only, in the resource's loop frame and outside conditionals, reads in the forward pass
    (at least one) or later, writes only in the update; the backward users of the reads read them directly or
    through alias ops the rewrite can copy. (The planner checks that its forward users run well before the rest.)"""
    out = []
    for t in sg.tensors.values():
        if t.dtype != "resource" or not t.consumers or sg.ops[t.producer].type not in RESOURCE_SOURCE_OP_TYPES:
            continue
        weight = _weight_of(sg, t.name, min_bytes)
        if weight is not None:
            out.append(weight)
    return out


def _weight_of(sg: StepGraph, resource: str, min_bytes: int) -> OffloadableWeight | None:
    """The :class:`OffloadableWeight` of ``resource``, or None when it is not one."""
    frame = sg.ops[sg.tensors[resource].producer].frame
    users = [sg.ops[c] for c in sg.tensors[resource].consumers]
    if any(u.type not in WHOLE_VARIABLE_OP_TYPES or u.frame != frame or u.conditional for u in users):
        return None
    reads = [u.name for u in users if u.type == "ReadVariableOp" and u.phase == "forward"]
    if not reads or any(u.type in WRITE_OP_TYPES and u.phase != "update" for u in users):
        return None
    value = _value_of(sg, resource)
    if value is None or value.bytes < min_bytes or len(value.shape) == 0:
        return None
    route = WeightRoute(reads=sorted(reads), writes=sorted(u.name for u in users if u.type in WRITE_OP_TYPES))
    forward: set[str] = set()
    backward: set[str] = set()
    for read in reads:
        if _walk_read(sg, sg.ops[read].outputs[0], read, route, forward, backward) is None:
            return None
    update = sorted(u.name for u in users if u.name not in reads)
    return OffloadableWeight(resource, value.dtype, tuple(value.shape), int(value.bytes), tuple(sorted(forward)),
                             tuple(sorted(backward)), tuple(update), route)


def _walk_read(sg: StepGraph, tensor: str, source: str, route: WeightRoute, forward: set, backward: set
               ) -> bool | None:
    """Sort the users of ``tensor`` (output 0 of ``source``: a forward read, or an alias op of one) into
    ``forward`` and ``backward``, noting in ``route`` the alias ops to copy and the inputs to reroute. Returns
    whether a backward user reads ``tensor`` (through aliases), or None when one reads it through an alias op the
    rewrite cannot copy."""
    needed = False
    for name in sg.tensors[tensor].consumers:
        op = sg.ops[name]
        outs = [o for o in op.outputs if sg.tensors[o].alias_of == tensor]
        if op.phase == "forward" and outs:  # an alias of the weight (a Reshape): its users decide
            if op.type in CLONABLE_ALIAS_OP_TYPES and op.inputs[:1] == [tensor] and outs == op.outputs[:1]:
                mark = len(route.clones)
                below = _walk_read(sg, outs[0], name, route, forward, backward)
                if below is None:
                    return None
                if below:  # copied for the backward users, after the copy of its source
                    route.clones.insert(mark, [name, source])
                    needed = True
                continue
            if any(sg.ops[c].phase != "forward" for o in outs for c in sg.buffer_consumers(o)):
                return None
            forward.add(name)
        elif op.phase == "forward":
            forward.add(name)
        else:
            backward.add(name)
            route.reroutes.append([name, source])
            needed = True
    return needed


def _value_of(sg: StepGraph, resource: str):
    """A tensor holding the variable's value with a known shape: a read's output or an assignment's input."""
    for c in sg.tensors[resource].consumers:
        op = sg.ops[c]
        values = op.outputs[:1] if op.type == "ReadVariableOp" else op.inputs[1:2]
        for name in values:
            v = sg.tensors[name]
            if v.shape_known and v.bytes > 0:
                return v
    return None


def early_reads(sg: StepGraph, variables: list[OffloadableVariable],
                weights: list[OffloadableWeight] = ()) -> set[str]:
    """The ``ReadVariableOp`` ops of ``variables`` and the update's reads of ``weights`` (the update deferral
    defers those that need no gradient)."""
    reads = {c for v in variables for c in sg.tensors[v.tensor].consumers if sg.ops[c].type == "ReadVariableOp"}
    return reads | {c for w in weights for c in w.update_users if sg.ops[c].type == "ReadVariableOp"}


def mark(sg: StepGraph, variables: list[OffloadableVariable] | list[OffloadableWeight]) -> int:
    """Model each variable as a tensor of its size (in place; see :attr:`TensorInfo.variable`); returns the bytes
    marked, which leave the persistent bytes."""
    total = 0
    for v in variables:
        t = sg.tensors[v.tensor]
        t.shape, t.bytes, t.shape_known = v.shape, v.bytes, True
        t.persistent, t.variable = False, True
        total += v.bytes
    return total
