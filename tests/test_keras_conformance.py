"""Keras's own tests with DymemCallback injected into every ``fit``: the quick set of ``make keras-conformance``.

The TensorBoard, EMA, checkpoint and early-stopping callback tests and the functional-model tests (71 tests) run
once without and once with ``DymemCallback(min_swap_bytes=0, verbose=0)`` appended to every ``fit`` (two pytest
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
    assert set(summary["traces_unmodified_by_reason"]) <= {"no-gradients", "unknown-shape"}
