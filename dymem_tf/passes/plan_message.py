"""The plan message the pass hands the native graph pass: a header and records, as one schema defines them.

The schema is one file for both sides, ``dymem_tf/cc/pass/plan_schema.h``: the C++ parser (``step_plan.cc``)
includes it as X-macros and reads each field by name, and this module reads its ``DYMEM_PLAN_`` lines and writes
each record's fields by keyword (:func:`record`). The message's header line states the version and, per record
kind, its field names in the order its records hold them (:func:`header`); the parser maps columns by those names
and refuses a message of another version, or one naming a kind or field its schema lacks or leaving one out, with
a message instead of misreading it.
"""
from __future__ import annotations

import dataclasses
import functools
import keyword
import re
from pathlib import Path
from typing import Iterable

#: The schema both sides read (installed with the package: ``cc/**/*.h`` is package data).
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "cc" / "pass" / "plan_schema.h"
#: The first field of a message's header line.
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
    for kind, names in records.items():  # record() takes the fields as keyword arguments
        for name in names:
            if not name.isidentifier() or keyword.iskeyword(name) or names.count(name) > 1:
                raise RuntimeError(f"{SCHEMA_PATH}: the field {name!r} of {kind!r} is repeated, or no name a "
                                   "keyword argument can have")
    return Schema(version, records)


def record(kind: str, **fields) -> str:
    """One record line: ``kind`` and its fields, given by name, tab-separated in the schema's order. Raises
    ValueError naming the kind or field for a kind the schema does not define, a field it does not list for the
    kind, one it lists that is not given, and a field holding a tab or a newline."""
    names = schema().records.get(kind)
    if names is None:
        raise ValueError(f"the plan message has no record kind {kind!r} (known: {', '.join(schema().records)})")
    unknown = [name for name in fields if name not in names]
    if unknown:
        raise ValueError(f"a {kind!r} record has no field {unknown[0]!r} (its fields: {', '.join(names)})")
    missing = [name for name in names if name not in fields]
    if missing:
        raise ValueError(f"a {kind!r} record needs the field {missing[0]!r} (its fields: {', '.join(names)})")
    text = [str(fields[name]) for name in names]
    bad = [name for name, value in zip(names, text) if "\t" in value or "\n" in value]
    if bad:
        raise ValueError(f"the field {bad[0]!r} of a {kind!r} record holds a tab or a newline: {fields[bad[0]]!r}")
    return "\t".join([kind, *text])


def header() -> str:
    """The message's first line: :data:`HEADER`, the version, and each record kind's ``kind:field,...``."""
    columns = [f"{kind}:{','.join(names)}" for kind, names in schema().records.items()]
    return "\t".join([HEADER, str(schema().version), *columns])


def message(records: Iterable[str]) -> str:
    """The message: the header line (:func:`header`), then ``records`` (lines made by :func:`record`), one per
    line."""
    return "\n".join([header(), *records]) + "\n"


def records_of(text: str) -> list[list[str]]:
    """The records of a message, each as ``[kind, field, ...]`` in the message's columns (the header left out)."""
    lines = [line.split("\t") for line in text.splitlines() if line]
    return lines[1:] if lines and lines[0][0] == HEADER else lines
