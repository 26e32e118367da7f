"""pytest plugin: ``--outcomes=PATH`` writes ``{test id: outcome}`` as JSON when the session ends.

The test id is the module's dotted name and the rest of pytest's node id
(``keras.src.callbacks.tensorboard_test::TestTensorBoardV2::test_TensorBoard_basic``); the outcome is ``"passed"``,
``"failed"`` (the test or its set-up or tear-down failed) or ``"skipped"``.
"""
from __future__ import annotations

import json

_OUTCOMES: dict[str, str] = {}
_IDS: dict[str, str] = {}  # pytest node id -> test id
_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, help="write {test id: outcome} as JSON to this file")


def test_id(item) -> str:
    """``module.dotted.name::Class::test`` (pytest's node id of a test outside the root dir has no usable path)."""
    module = getattr(getattr(item, "module", None), "__name__", None) or str(item.path)
    return module + "::" + item.nodeid.partition("::")[2]


def pytest_itemcollected(item):
    _IDS[item.nodeid] = test_id(item)


def pytest_runtest_logreport(report):
    outcome = report.outcome
    if report.when != "call" and outcome == "passed":
        outcome = None  # set-up and tear-down that pass say nothing about the test
    if outcome is None:
        return
    key = _IDS.get(report.nodeid, report.nodeid)
    old = _OUTCOMES.get(key)
    if old is None or _RANK[outcome] > _RANK[old]:
        _OUTCOMES[key] = outcome


def pytest_sessionfinish(session):
    path = session.config.getoption("--outcomes")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_OUTCOMES, f, indent=0, sort_keys=True)
