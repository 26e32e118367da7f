"""A loop of ``fit`` calls in one process holds the same host memory and plans nothing again (issue 46), for each
``memory_budget`` kind, with one callback for all fits and with a new one per fit. Each configuration runs in its
own process through the benchmark's child (``bench/fit_loop.py``); the model is small and the counts are exact."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import fit_loop  # noqa: E402  (bench/ is not a package)

FITS = 12
#: 36 MiB for this 64px CNN (its plain step peaks at 28-32 MiB in use, 34-36 MiB reserved): the step swaps
CONFIGS = [(callback, budget) for budget in ("auto", "none", "36MiB") for callback in ("shared", "fresh")]


@pytest.mark.slow
@pytest.mark.parametrize("callback,budget", CONFIGS)
def test_repeated_fits_keep_host_memory_flat_and_plan_once(callback, budget):
    spec = {"model": "small", "size": 64, "batch": 16, "samples": 64, "fits": FITS, "budget": budget,
            "callback": callback}
    rows = fit_loop.run_one(spec, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    verdict = fit_loop.verdict(rows, tolerance_mib=50.0)
    third, last = rows[2], rows[-1]
    # each trace of a train step pins its graph in TensorFlow's gradient registry: none is left behind
    assert last["func_graphs"] == third["func_graphs"], rows
    assert last["gradient_functions"] == third["gradient_functions"], rows
    assert last["records"] == third["records"], rows  # the callback keeps one fit's records, not every fit's
    assert verdict["plans_after_fit_1"] == 0, rows  # one plan per distinct graph and budget
    assert verdict["rss_growth_mib"] <= 50.0, rows
    if budget == "auto":  # the step fits the device as compiled: nothing planned, nothing swapped
        assert all(r["records"] == 0 and r["swaps"] == 0 for r in rows), rows
    else:
        assert all(r["swaps"] > 0 for r in rows), rows
        assert verdict["peaks_equal_from_fit_2"], rows  # the plan's bytes in use repeat, fit after fit
