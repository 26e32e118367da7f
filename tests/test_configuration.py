"""docs/configuration.md names every argument of DymemCallback and dry_run, and every DYMEM_* variable the code reads."""
import glob
import inspect
import os
import re

import dymem_tf
from dymem_tf.keras import dry_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "configuration.md")


def _section(title: str) -> str:
    text = open(DOC, encoding="utf-8").read()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _rows(section: str) -> list[list[str]]:
    return [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]


def _table_names(section: str) -> set[str]:
    """The first column's names of a Markdown table (``a``, or ``a``, ``b`` for a shared row)."""
    return {name for row in _rows(section) for name in re.findall(r"`([A-Za-z_]+)`", row[0])}


def test_every_callback_parameter_is_documented_with_its_default():
    section = _section("## `DymemCallback(")
    params = inspect.signature(dymem_tf.DymemCallback).parameters
    assert _table_names(section) == set(params)
    documented = {re.findall(r"`([A-Za-z_]+)`", row[0])[0]: row[1].strip() for row in _rows(section)}
    for name, param in params.items():
        if name == "profile":
            continue  # None means "this machine's", which the table says in words
        assert documented[name] == "`" + repr(param.default).replace("'", '"') + "`", (name, documented[name])


def test_every_dry_run_parameter_is_documented():
    section = _section("## `dymem_tf.dry_run(")
    assert _table_names(section) == set(inspect.signature(dry_run.dry_run).parameters)


def test_every_environment_variable_the_code_reads_is_documented():
    sources = [p for pattern in ("dymem_tf/**/*.py", "dymem_tf/cc/**/*.cc", "dymem_tf/cc/**/*.h", "setup.py")
               for p in glob.glob(os.path.join(REPO, pattern), recursive=True)]
    read = set()
    for path in sources:
        read.update(re.findall(r"\"(DYMEM_[A-Z_]+)\"", open(path, encoding="utf-8").read()))
    assert {"DYMEM_DEVICE_MEMORY_LIMIT", "DYMEM_GTBM"} <= read  # the scan finds them
    assert _table_names(_section("## Environment variables")) >= read
