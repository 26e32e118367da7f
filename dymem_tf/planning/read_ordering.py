"""Order each in-place variable update after the last use of the values read from that variable.

TF's resource variables are copy-on-write: ``ReadVariableOp`` returns the variable's own buffer, and an update
(``AssignAddVariableOp``, ``ResourceApply*`` ...) that finds the buffer still referenced copies the whole variable
first (``PrepareToUpdateVariable``). A weight read in the forward pass is used again by the backward pass
(``Conv2DBackpropInput`` reads the kernel), while the executor may run the weight's update as soon as its gradient
(``Conv2DBackpropFilter``) is there: the update then copies the weight, and the step holds two copies of it until
the backward op ends. The allocator trace of ResNet-50 + SGD showed this for nearly every weight (70-83 MiB of
copies per step, 27 MiB of them at once at the peak) and the holes the old buffers leave behind.

This stage adds a control edge from every op that uses a read of the variable (through aliases) to the update, so
the update finds the buffer unshared and writes it in place. The values are the same (the readers read the old
value either way), so results stay bit-identical; the step graph the planner simulates then matches what runs.
"""
from __future__ import annotations

from dymem_tf.planning.analysis import Reachability, StepGraph, no_autograph

#: Ops that update a resource variable's buffer in place (input 0 is the resource).
IN_PLACE_UPDATE_OP_TYPES = frozenset({"AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp"})
#: Ops below this size are not worth an edge (a copy of them costs nothing).
MIN_VARIABLE_BYTES = 4096


def is_in_place_update(op_type: str) -> bool:
    """Whether ``op_type`` writes its resource input's buffer in place (copying it first when it is shared)."""
    return op_type in IN_PLACE_UPDATE_OP_TYPES or op_type.startswith("ResourceApply")


def _resource(sg: StepGraph, op_name: str) -> str | None:
    """The buffer-owning tensor of ``op_name``'s resource input (input 0), or None without inputs."""
    op = sg.ops[op_name]
    return sg.buffer_of(op.inputs[0]) if op.inputs else None


def _value_bytes(sg: StepGraph, read: str) -> int:
    """Bytes of the value a ``ReadVariableOp`` returns (0 when unknown)."""
    outputs = sg.ops[read].outputs
    return sg.tensors[outputs[0]].bytes if outputs else 0


def _uses_before(sg: StepGraph, update: str, reads: list[str], position: dict[str, int], paths: Reachability
                 ) -> set[str]:
    """The ops that use a value of ``reads`` and do not depend on ``update`` (edges from them cannot close a cycle)."""
    g = sg.graph
    users: set[str] = set()
    for read in reads:
        if position[read] > position[update] and paths.has_path(update, read):
            continue  # a read of the updated value
        value = sg.ops[read].outputs[0]
        passing = {sg.tensors[a].producer for a in sg.aliases().get(value, ())}  # Identity ... of the value
        for user in sg.buffer_consumers(value):
            if user == update or user in passing or g.has_edge(user, update):
                continue
            if position[user] > position[update] and paths.has_path(update, user):
                continue
            users.add(user)
    return users


@no_autograph
def find_read_orderings(sg: StepGraph, min_bytes: int = MIN_VARIABLE_BYTES) -> list[tuple[str, str]]:
    """``(user, update)`` pairs: ``update`` (an in-place variable update) should run after ``user`` (an op using a
    value read from the same variable before the update), so that the update finds the buffer unshared."""
    reads: dict[str, list[str]] = {}
    for name, op in sg.ops.items():
        if op.type == "ReadVariableOp" and op.inputs and op.outputs and _value_bytes(sg, name) >= min_bytes:
            reads.setdefault(_resource(sg, name), []).append(name)
    position = {name: i for i, name in enumerate(sg.topological_order())}
    paths = sg.reachability()
    pairs = []
    for name, op in sg.ops.items():
        if not is_in_place_update(op.type) or not op.inputs:
            continue
        users = _uses_before(sg, name, reads.get(_resource(sg, name), []), position, paths)
        pairs += [(user, name) for user in sorted(users, key=position.__getitem__)]
    return pairs
