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
"""
from __future__ import annotations

import dataclasses

from dymem_tf.planning.analysis import StepGraph

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


def early_reads(sg: StepGraph, variables: list[OffloadableVariable]) -> set[str]:
    """The ``ReadVariableOp`` ops of ``variables`` (the update deferral defers those that need no gradient)."""
    return {c for v in variables for c in sg.tensors[v.tensor].consumers if sg.ops[c].type == "ReadVariableOp"}


def mark(sg: StepGraph, variables: list[OffloadableVariable]) -> int:
    """Model each variable as a tensor of its size (in place; see :attr:`TensorInfo.variable`); returns the bytes
    marked, which leave the persistent bytes."""
    total = 0
    for v in variables:
        t = sg.tensors[v.tensor]
        t.shape, t.bytes, t.shape_known = v.shape, v.bytes, True
        t.persistent, t.variable = False, True
        total += v.bytes
    return total
