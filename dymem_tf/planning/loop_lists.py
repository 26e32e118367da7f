"""The TensorLists of lowered loops: their sizes, and the lists streamed through host memory.

A forward loop pushes, each iteration, the tensors its gradient needs into a TensorList (``TensorListPushBack``);
the loop hands the list out of its frame (an ``Exit``'s variant), and the gradient loop pops the elements in reverse
(``TensorListPopBack``). TF's shape inference gives such a list no size, yet lists like these hold most of an LSTM
step's memory: :func:`size_loop_lists` sizes them for the memory model.

:func:`streamable_lists` finds the accumulators that can be *streamed*: each element is copied to host memory as it
is pushed (a swap-out that the push reads instead of the device tensor) and back to the device as it is popped (a
swap-in of the popped element that its readers read). The list then lives in host memory, and the device holds only
the iterations in flight: the swap ops run inside the loops, so no edge crosses a frame. The swap ops copy a list's
elements on the CPU device only, so lists on a GPU are not streamed.
"""
from __future__ import annotations

from dymem_tf.planning.analysis import OpInfo, StepGraph, TensorInfo, frame_depth, step_frame_depth
from dymem_tf.planning.plan import StreamedList

#: Ops that store one element in a TensorList: the input index of the element (the list is input 0).
_LIST_WRITERS = {"TensorListPushBack": 1, "TensorListSetItem": 2}
#: Ops that make an empty TensorList: the input index of its length bound (-1: unbounded).
_LIST_MAKERS = {"EmptyTensorList": 1, "TensorListReserve": 1}


def size_loop_lists(sg: StepGraph, constants: dict[str, int]) -> int:
    """Size the TensorLists that lowered loops hand out of their frame (an ``Exit``'s variant: the accumulators a
    forward loop fills for its gradient, a loop's outputs before they are stacked) and the lists a loop's input is
    unstacked into (``TensorListFromTensor``), which TF's shape inference leaves without a size: a list holds its
    length times the element a write in the loop stores. ``constants``: scalar integer constants by tensor name
    (the lists' length bounds). Returns how many lists were sized; the others keep 0 bytes."""
    sized = 0
    for op in sg.ops.values():
        if op.type == "TensorListFromTensor":
            source = sg.tensors.get(op.inputs[0]) if op.inputs else None
            if source is not None and source.shape_known and source.shape:
                sized += _size_list(sg.tensors[op.outputs[0]], source.shape, source.bytes)
        elif op.type == "Exit" and sg.tensors[op.outputs[0]].dtype == "variant":
            merge = _loop_merge(sg, op)
            element = _list_element(sg, merge) if merge is not None else None
            length = _list_length(sg, merge, constants) if element is not None else None
            if length:
                shape, nbytes = element
                sized += _size_list(sg.tensors[op.outputs[0]], (length, *shape), length * nbytes)
    return sized


def _size_list(t: TensorInfo, shape: tuple, nbytes: int) -> int:
    """Give the list ``t`` the shape and bytes of its stacked elements (no longer a handle); 1 if it took them."""
    if nbytes <= 0:
        return 0
    t.shape, t.bytes, t.shape_known, t.persistent = tuple(shape), int(nbytes), True, False
    return 1


def _loop_merge(sg: StepGraph, exit_op: OpInfo) -> OpInfo | None:
    """The ``Merge`` that carries ``exit_op``'s loop variable (Exit <- Switch <- Merge), or None."""
    switch = _producer(sg, exit_op, 0, "Switch")
    return _producer(sg, switch, 0, "Merge") if switch is not None else None


def _producer(sg: StepGraph, op: OpInfo, index: int, kind: str) -> OpInfo | None:
    """The producer of ``op``'s input ``index`` if it is an op of type ``kind``, else None."""
    if len(op.inputs) <= index:
        return None
    producer = sg.ops[sg.tensors[op.inputs[index]].producer]
    return producer if producer.type == kind else None


def _list_element(sg: StepGraph, merge: OpInfo) -> tuple[tuple, int] | None:
    """(shape, bytes) of the element the loop of ``merge`` writes into the list it carries (the largest, if its
    writes differ), or None when no write of a known size is found (the list's users: :func:`_list_users`)."""
    best = None
    for op in _list_users(sg, merge.outputs[0], merge.frame):
        slot = _LIST_WRITERS.get(op.type)
        if slot is None or len(op.inputs) <= slot:
            continue
        element = sg.tensors[op.inputs[slot]]
        if _holds_new_bytes(sg, element) and (best is None or element.bytes > best[1]):
            best = (element.shape, element.bytes)
    return best


def _holds_new_bytes(sg: StepGraph, element: TensorInfo) -> bool:
    """Whether storing ``element`` in a list each iteration keeps a new buffer: not a variable's (a weight read in
    the loop), not a tensor that entered the loop unchanged (the same buffer every iteration), and of known size."""
    source = sg.tensors[sg.buffer_of(element.name)]
    return (element.shape_known and element.bytes > 0 and not source.persistent
            and sg.ops[source.producer].type != "Enter")


def _list_length(sg: StepGraph, merge: OpInfo, constants: dict[str, int]) -> int | None:
    """The length the list carried by ``merge`` reaches: the bound its maker was given (before the loop), else the
    length of a list the loop's input was unstacked into; None when neither is known."""
    enter = next((sg.ops[sg.tensors[i].producer] for i in merge.inputs
                  if sg.ops[sg.tensors[i].producer].type == "Enter"), None)
    if enter is None or not enter.inputs:
        return None
    maker = sg.ops[sg.tensors[enter.inputs[0]].producer]
    slot = _LIST_MAKERS.get(maker.type)
    bound = constants.get(maker.inputs[slot], -1) if slot is not None and len(maker.inputs) > slot else -1
    if bound > 0:
        return bound
    unstacked = [sg.tensors[sg.ops[sg.tensors[e.inputs[0]].producer].inputs[0]]
                 for e in sg.ops.values() if e.type == "Enter" and e.frame == enter.frame and e.inputs
                 and sg.ops[sg.tensors[e.inputs[0]].producer].type == "TensorListFromTensor"]
    lengths = {t.shape[0] for t in unstacked if t.shape_known and t.shape}
    return lengths.pop() if len(lengths) == 1 else None


#: Ops a streamed list may pass through inside the gradient loop besides its pops: the loop's plumbing and ops
#: that read the list's metadata only.
_LIST_PLUMBING = frozenset({"Enter", "Merge", "Switch", "Identity", "NextIteration", "Exit", "TensorListLength",
                            "TensorListElementShape"})


def streamable_lists(sg: StepGraph, min_bytes: int = 1) -> list[StreamedList]:
    """The sized lists of at least ``min_bytes`` that a forward loop of the step's frame fills with
    ``TensorListPushBack`` only and a gradient loop reads with ``TensorListPopBack`` only, on a device other than a
    GPU, in the step's order: what :func:`streamed` may keep in host memory."""
    base = step_frame_depth(sg.ops.values())
    found = []
    for op in sg.ops.values():
        if op.type != "Exit" or op.is_backward or frame_depth(op.frame) != base or "GPU" in op.device.upper():
            continue
        t = sg.tensors[op.outputs[0]]
        merge = _loop_merge(sg, op) if t.dtype == "variant" and t.bytes >= min_bytes else None
        pushes = _pushes(sg, merge) if merge is not None else None
        pops = _pops(sg, t) if pushes else None
        if pops:
            found.append(StreamedList(t.name, t.bytes, pushes, pops))
    return found


def mark_streamed(sg: StepGraph, lists: list[StreamedList]) -> None:
    """Model ``lists`` as held in host memory: their bytes leave the device (the elements of one iteration stay)."""
    for streamed in lists:
        sg.tensors[streamed.tensor].bytes = 0


def _pushes(sg: StepGraph, merge: OpInfo) -> list[list[str]] | None:
    """``[element tensor, push op]`` of each write into the list ``merge`` carries, or None when a write is not a
    ``TensorListPushBack`` of a tensor made in the loop."""
    pushes = []
    for op in _list_users(sg, merge.outputs[0], merge.frame):
        if op.type in _LIST_PLUMBING:
            continue
        if op.type != "TensorListPushBack" or len(op.inputs) < 2 or not _holds_new_bytes(sg, sg.tensors[op.inputs[1]]):
            return None
        pushes.append([op.inputs[1], op.name])
    return pushes or None


def _pops(sg: StepGraph, t: TensorInfo) -> list[list[str]] | None:
    """``[pop op, reader, ...]`` of each ``TensorListPopBack`` the gradient loops reading ``t`` pop it with (the
    readers of the popped element), or None when ``t`` is read otherwise."""
    pops = []
    for consumer in t.consumers:
        enter = sg.ops[consumer]
        if enter.type != "Enter" or not enter.is_backward:
            return None
        for op in _list_users(sg, enter.outputs[0], enter.frame):
            if op.type in _LIST_PLUMBING:
                continue
            if op.type != "TensorListPopBack" or len(op.outputs) < 2:
                return None
            pops.append([op.name, *sg.tensors[op.outputs[1]].consumers])
    return pops or None


def _list_users(sg: StepGraph, start: str, frame: str) -> list[OpInfo]:
    """The ops of ``frame`` that read the list ``start`` or a handle of it the loop passes on (variant outputs of
    the ops that read it), each once, in the order found."""
    seen, todo, users = {start}, [start], {}
    while todo:
        for consumer in sg.tensors[todo.pop()].consumers:
            op = sg.ops[consumer]
            if op.frame != frame and op.type != "Exit":
                continue
            users.setdefault(op.name, op)
            if op.type == "Exit":
                continue
            for out in op.outputs:
                if sg.tensors[out].dtype == "variant" and out not in seen:
                    seen.add(out)
                    todo.append(out)
    return list(users.values())
