"""Which outputs a device's kernel keeps in host memory, from TensorFlow's kernel registry.

On an accelerator TF places some outputs in host memory: the ones its kernel registers with ``.HostMemory("name")``
(``Shape``, ``Size``, ``Rank``, ``ShapeN``, ... whatever their dtype) and int32 tensors. TF decides this per node in
``MemoryTypesForNode`` (``core/framework/memory_types.cc``): it finds the one kernel whose type constraints match the
node's attributes (``FindKernelDef``: the highest priority among the device type's kernels, else a
``DEVICE_DEFAULT`` kernel) and maps that kernel's ``host_memory_arg`` names to output indices through the
op's ``OpDef`` (``NameRangesForNode``). :func:`host_memory_outputs` does the same from Python, so a swap plan never
picks a tensor a GPU kernel would find in host memory, and never counts it as device memory.

The registry is read once per (op type, device type) and cached. The registry of this process is the one consulted:
TF's Linux wheel registers its GPU kernels even on a machine without a GPU.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from dymem_tf import compat

#: The device type of kernels registered with ``Device(DEVICE_DEFAULT)``: TF falls back to them when no kernel of
#: the device's own type matches the node (``FindKernelRegistration`` in ``core/framework/op_kernel.cc``).
DEFAULT_DEVICE_TYPE = "DEFAULT"


class KernelHostArgs(NamedTuple):
    """What one registered kernel says about host memory: the attr constraints that select it, its label and
    priority, and the names of its outputs registered as ``HostMemory``."""

    constraints: tuple[tuple[str, frozenset[int]], ...]  # (attr name, allowed DataType enums)
    label: str
    priority: int
    host_outputs: frozenset[str]


@functools.lru_cache(maxsize=None)
def kernel_host_args(op_type: str, device_type: str) -> tuple[KernelHostArgs, ...]:
    """The kernels registered for ``op_type`` on ``device_type`` (``"GPU"``), each with its ``HostMemory`` outputs
    (input names dropped); empty when none is registered in this process."""
    op_def = compat.registered_op_def(op_type)
    if op_def is None:
        return ()
    outputs = frozenset(arg.name for arg in op_def.output_arg)
    return tuple(
        KernelHostArgs(tuple((c.name, frozenset(c.allowed_values.list.type)) for c in k.constraint), k.label,
                       k.priority, frozenset(k.host_memory_arg) & outputs)
        for k in compat.registered_kernel_defs(op_type) if k.device_type == device_type)


def host_memory_outputs(op, device_type: str) -> frozenset[int]:
    """Indices of the outputs of ``op`` (a ``tf.Operation`` or a GraphDef view of one) that the kernel TF picks for it
    on ``device_type`` registers as ``HostMemory``; empty when no kernel is registered for the op there."""
    if not _registers_host_outputs(op.type, device_type):
        return frozenset()
    kernels = _candidates(op, device_type) or _candidates(op, DEFAULT_DEVICE_TYPE)
    if not kernels:
        return frozenset()
    names = frozenset.intersection(*(k.host_outputs for k in kernels))
    return _output_indices(op, names) if names else frozenset()


@functools.lru_cache(maxsize=None)
def _registers_host_outputs(op_type: str, device_type: str) -> bool:
    """Whether any kernel of ``op_type`` that TF may pick on ``device_type`` (its own or a ``DEVICE_DEFAULT`` one)
    keeps an output in host memory: when none does, no op of the type needs its attributes matched."""
    return any(k.host_outputs for kind in (device_type, DEFAULT_DEVICE_TYPE) for k in kernel_host_args(op_type, kind))


def _candidates(op, device_type: str) -> list[KernelHostArgs]:
    """The kernels registered for ``op`` on ``device_type`` that TF could pick for it: those whose label and
    constraints admit the op, of the highest priority among them (one, unless an attribute could not be read)."""
    kernels = [k for k in kernel_host_args(op.type, device_type) if _selects(k, op)]
    top = max((k.priority for k in kernels), default=0)
    return [k for k in kernels if k.priority == top]


def _selects(kernel: KernelHostArgs, op) -> bool:
    """Whether ``kernel`` may be the one TF picks for ``op``: its label matches the op's ``_kernel`` attr and every
    type constraint admits the op's attribute (an attribute that cannot be read does not rule the kernel out)."""
    if kernel.label != _text(_attr(op, "_kernel")):
        return False
    for name, allowed in kernel.constraints:
        value = _attr(op, name)
        types = value if isinstance(value, list) else [value]
        if allowed and value is not None and not all(_enum(t) in allowed for t in types):
            return False
    return True


def _output_indices(op, names: frozenset[str]) -> frozenset[int]:
    """The output indices the output arguments ``names`` of ``op`` span (a list argument spans its ``number_attr``
    or ``type_list_attr`` length); empty when a length cannot be read."""
    op_def = compat.registered_op_def(op.type)
    indices, start = set(), 0
    for arg in op_def.output_arg:
        count = _arg_length(op, arg)
        if count is None:
            return frozenset()
        if arg.name in names:
            indices.update(range(start, start + count))
        start += count
    return frozenset(indices)


def _arg_length(op, arg) -> int | None:
    """How many outputs the output argument ``arg`` of ``op`` produces, or None when its length attr is unreadable."""
    if arg.number_attr:
        value = _attr(op, arg.number_attr)
        return int(value) if value is not None else None
    if arg.type_list_attr:
        value = _attr(op, arg.type_list_attr)
        return len(value) if value is not None else None
    return 1


def _attr(op, name: str):
    """``op.get_attr(name)``, or None when the op has no such attribute."""
    try:
        return op.get_attr(name)
    except (ValueError, TypeError, AttributeError):
        return None


def _text(value) -> str:
    """A string attribute as text ("" when absent)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _enum(dtype) -> int | None:
    """The DataType enum of a ``tf.DType`` (or of an enum value already)."""
    return getattr(dtype, "as_datatype_enum", dtype)
