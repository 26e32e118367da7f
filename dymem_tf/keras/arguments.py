"""``DymemCallback``'s size arguments, parsed and validated (a clear error for each bad value)."""
from __future__ import annotations

from dymem_tf.memory import allocator, devices


def resolve_budget(memory_budget):
    if memory_budget is None:
        return None
    if isinstance(memory_budget, str) and memory_budget.strip().lower() == "auto":
        return devices.device_memory_capacity()
    if isinstance(memory_budget, float) and memory_budget.is_integer():
        memory_budget = int(memory_budget)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, str)):
        raise TypeError(f"memory_budget must be None, \"auto\", a number of bytes or a string such as \"6GiB\", "
                        f"got {memory_budget!r}")
    if isinstance(memory_budget, int) and memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
    try:
        budget = allocator.parse_bytes(memory_budget)
    except ValueError as err:
        raise ValueError(f"memory_budget={memory_budget!r} is not a valid budget: {err}") from None
    if budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
    return budget


def resolve_min_swap_bytes(value) -> int:
    if isinstance(value, str):
        try:
            return allocator.parse_bytes(value)
        except ValueError as err:
            raise ValueError(f"min_swap_bytes={value!r} is not a valid size: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"min_swap_bytes must be a non-negative integer (bytes) or a string such as \"64KiB\", "
                         f"got {value!r}")
    return value
