"""The plan message the pass hands the native graph pass: a version line and records, as one schema defines them.

The schema is one file for both sides, ``dymem_tf/cc/pass/plan_schema.h``: the C++ parser (``step_plan.cc``)
includes it as X-macros and this module reads its ``DYMEM_PLAN_`` lines, so a record written here has the fields the
parser expects, and a message of another version is refused there with a message instead of being misread.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Iterable

#: The schema both sides read (installed with the package: ``cc/**/*.h`` is package data).
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "cc" / "pass" / "plan_schema.h"
#: The first field of a message's version line.
HEADER = "dymem-plan"

_VERSION = re.compile(r"^DYMEM_PLAN_VERSION\((\d+)\)\s*$")
_RECORD = re.compile(r"^DYMEM_PLAN_RECORD\((\w+),(.*)\)\s*$")


@dataclasses.dataclass(frozen=True)
class Schema:
    """The message's version and each record kind's field names, in order."""

    version: int
    records: dict[str, tuple[str, ...]]


@functools.cache
def schema() -> Schema:
    """The schema read from :data:`SCHEMA_PATH`."""
    version, records = None, {}
    for line in SCHEMA_PATH.read_text().splitlines():
        if m := _VERSION.match(line):
            version = int(m.group(1))
        elif m := _RECORD.match(line):
            records[m.group(1)] = tuple(re.findall(r'"([^"]*)"', m.group(2)))
    if version is None or not records:
        raise RuntimeError(f"{SCHEMA_PATH} defines no plan message version or no records")
    return Schema(version, records)


def record(kind: str, *fields) -> str:
    """One record line: ``kind`` and its fields, tab-separated. Raises ValueError for a kind the schema does not
    define or another number of fields than it lists, and for a field holding a tab or a newline."""
    names = schema().records.get(kind)
    if names is None:
        raise ValueError(f"the plan message has no record kind {kind!r} (known: {', '.join(schema().records)})")
    if len(fields) != len(names):
        raise ValueError(f"a {kind!r} record has {len(names)} fields ({', '.join(names)}), not {len(fields)}")
    text = [str(f) for f in fields]
    if any("\t" in f or "\n" in f for f in text):
        raise ValueError(f"a field of a {kind!r} record holds a tab or a newline: {text}")
    return "\t".join([kind, *text])


def message(records: Iterable[str]) -> str:
    """The message: the version line, then ``records`` (lines made by :func:`record`), one per line."""
    return "\n".join([f"{HEADER}\t{schema().version}", *records]) + "\n"


def records_of(text: str) -> list[list[str]]:
    """The records of a message, each as ``[kind, field, ...]`` (the version line left out)."""
    lines = [line.split("\t") for line in text.splitlines() if line]
    return lines[1:] if lines and lines[0][0] == HEADER else lines
