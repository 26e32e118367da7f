"""Byte-size formatting shared by summaries, the CLI and error messages."""
from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``: binary units, one decimal, for messages and tables."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def mib(n: float) -> str:
    """``3145728`` → ``"3.0 MiB"``: the fixed unit of plan summaries and planner messages (easy to compare)."""
    return f"{n / 2**20:.1f} MiB"
