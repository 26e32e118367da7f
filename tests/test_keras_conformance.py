"""Keras's own tests with DymemCallback injected into every ``fit``: the quick set of ``make keras-conformance``.

The TensorBoard, EMA, checkpoint and early-stopping callback tests and the functional-model tests (71 tests) run
once without and once with ``DymemCallback(memory_budget=None, min_swap_bytes=0, verbose=0)`` appended to every
``fit`` (two pytest
processes, one after the other; see tools/keras_conformance). No test may pass without the callback and fail with it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_keras_quick_set_passes_with_dymem_injected(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "tools.keras_conformance", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["dymem_tf"] == os.path.join(REPO, "dymem_tf")
    assert summary["fail_only_with_callback"] == []
    assert summary["plain"]["run"] == summary["injected"]["run"] >= 70
    assert summary["plain"]["passed"] == summary["injected"]["passed"]
    # the callback really was in those fits, and most of them swapped
    assert summary["fits"]["injected"] >= 40
    # 40 of 51 swap; the others are planned with nothing worth swapping (the TensorBoard tests' one-layer models,
    # whose backward-pass tensors Grappler fuses away), left unmodified without gradients, or raise before a step
    assert summary["fits"]["swapped"] >= 0.7 * summary["fits"]["injected"]
    assert set(summary["traces_unmodified_by_reason"]) <= {"unknown-shape"}
    assert set(summary["traces_nothing_to_plan"]) <= {"no-gradients"}
    assert all(row["test"] for row in summary["traces_unmodified_by_test"])


def test_summary_lists_unmodified_traces_per_test_and_counts_steps_without_gradients_apart():
    from tools.keras_conformance import run

    def row(test, skipped, swapped=False):
        return {"test": test, "swapped": swapped, "traces": int(swapped), "skipped": skipped, "eager": False,
                "raised": None}

    fits = [row("m::sparse", ["unknown-shape", "unknown-shape"]), row("m::frozen", ["no-gradients"]),
            row("m::dense", [], swapped=True)]
    summary = run.summarize({"m::t": "passed"}, {"m::t": "passed"}, fits)
    assert summary["traces_unmodified_by_reason"] == {"unknown-shape": 2}
    assert summary["traces_nothing_to_plan"] == {"no-gradients": 1}
    assert summary["traces_unmodified_by_test"] == [
        {"reason": "unknown-shape", "test": "m::sparse", "traces": 2},
        {"reason": "no-gradients", "test": "m::frozen", "traces": 1}]
    assert summary["fits_not_swapped_by_cause"] == {"left unmodified: unknown-shape": 1,
                                                    "nothing to plan: no-gradients (no backward pass)": 1}
    text = run.report(dict(summary, modules=["m"], dymem_tf="."), {"plain": 1.0, "injected": 1.0})
    assert "unknown-shape   2  m::sparse" in text and "with nothing to plan: no-gradients 1" in text
