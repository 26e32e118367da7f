"""Byte sizes: the one parser of sizes written by people (budgets, environment variables, command lines, the
bench's configuration and TensorFlow's logs) and the formatting shared by summaries, the CLI and error messages.

Imports nothing but the standard library: ``bench/run_all.py`` loads this file by path, without TensorFlow. The C++
parser (``ParseBytes`` in ``dymem_tf/cc/gtbm/parse.cc``), which reads the allocator's environment variables before
any Python runs, follows the same rules; ``tests/test_gtbm_allocator.py`` checks that the two agree.
"""
from __future__ import annotations

import math
import os
import re
from typing import Union

ByteSize = Union[int, str]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
#: multiplier per lower-cased unit: IEC (KiB ...) and bare K/M/G/T are powers of 1024, SI (kB/KB ...) of 1000
_MULTIPLIERS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_BYTES_RE = re.compile(r"^\s*\+?(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")
MAX_BYTES = 2**63 - 1


def parse_bytes(value: ByteSize) -> int:
    """Byte count from an int or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5GiB"`` or ``"1073741824"``.

    Units (case-insensitive): B; KiB/MiB/GiB/TiB and K/M/G/T are powers of 1024; kB/KB/MB/GB/TB powers of 1000; a
    bare number is bytes. Fractions are rounded down to whole bytes. Raises ValueError naming the text for
    negatives, unknown units, garbage or values beyond 2**63-1, and TypeError for other types (bool, float, None).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"a byte count must be an int or a string like '512MiB', got {type(value).__name__}")
    total = value if isinstance(value, int) else _parse_text(value)
    if total < 0:
        raise ValueError(f"invalid byte count {value!r}: negative")
    if total > MAX_BYTES:
        raise ValueError(f"invalid byte count {value!r}: too large")
    return total


def env_bytes(name: str, what: str = "size") -> int | None:
    """The byte count in environment variable ``name`` (None when unset or blank); a malformed value raises
    ValueError naming the variable, its text and ``what`` it should be, never a silent default."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return parse_bytes(raw)
    except ValueError as err:
        raise ValueError(f"{name}={raw!r} is not a valid {what}: {err}") from None


def _parse_text(text: str) -> int:
    """Bytes that ``text`` (a number and an optional unit) denotes, unbounded; ValueError when it is not one."""
    match = _BYTES_RE.match(text)
    if match is None:
        raise ValueError(f"invalid byte count {text!r}: expected a non-negative number with an optional unit, "
                         "e.g. '512MiB', '2GB', '1.5GiB' or '1073741824'")
    unit = match.group("unit")
    if unit.lower() not in _MULTIPLIERS:
        raise ValueError(f"invalid byte count {text!r}: unknown unit {unit!r} "
                         "(use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    mult = _MULTIPLIERS[unit.lower()]
    whole, _, frac = match.group("num").partition(".")
    return int(whole or "0") * mult + (int(frac) * mult // 10 ** len(frac) if frac else 0)


def format_bytes(n: float, up: bool = False) -> str:
    """``1536`` → ``"1.5 KiB"``: binary units, one decimal, for messages and tables. ``up``: rounded up, never
    below ``n`` (for "at least" figures: a least budget shown rounded to the nearest could name one that is short)."""
    k = 0
    while k < len(_UNITS) - 1 and abs(n) >= 1024 ** (k + 1):
        k += 1
    if k == 0:
        return f"{math.ceil(n) if up else int(n)} B"
    return _one_decimal(n, 1024 ** k, _UNITS[k], up)


def mib(n: float, up: bool = False) -> str:
    """``3145728`` → ``"3.0 MiB"``: the fixed unit of plan summaries and planner messages (easy to compare);
    ``up`` as in :func:`format_bytes`."""
    return _one_decimal(n, 2**20, "MiB", up)


def at_least(needed: int, refused: int, formatter=format_bytes) -> str:
    """``needed`` bytes for an "at least" hint, rounded up by ``formatter`` (:func:`format_bytes` or :func:`mib`),
    and with its exact bytes where it reads as the ``refused`` figure rounded to the nearest (3.36 and 3.38 MiB
    both read "3.4 MiB")."""
    shown = formatter(needed, up=True)
    return f"{shown} ({int(needed)} bytes)" if shown == formatter(refused) else shown


def _one_decimal(n: float, scale: int, unit: str, up: bool) -> str:
    """``n / scale`` with one decimal (rounded up with ``up``, exactly for whole bytes) and ``unit``."""
    if not up:
        return f"{n / scale:.1f} {unit}"
    if isinstance(n, int) or float(n).is_integer():
        tenths = -(-int(n) * 10 // scale)  # ceil in integers: a float quotient can round a byte's excess away
    else:
        tenths = math.ceil(n * 10 / scale)
    return f"{tenths / 10:.1f} {unit}"
