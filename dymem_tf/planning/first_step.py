"""The first step under a budget: measured, calibrated and unable to lose training state.

Under a ``memory_budget`` the callback runs the first step of every new input shape in two stages:

1. **Probe.** The step is planned with the least device memory the policy can reach (every candidate swapped,
   swap-ins triggered one layer ahead, optimizer state offloaded where allowed). The model's and the optimizer's
   variables are copied to host memory before it runs; if it runs out of memory they are restored and
   :class:`~dymem_tf.planning.planner.BudgetTooSmallError` says what was measured. The allocator's peak during the
   step is the *measured* peak of that plan.
2. **Budget.** The ratio of the measured to the predicted peak of the step's own memory (kernel workspaces,
   fragmentation and whatever else the simulator does not model) sets the planner's headroom
   (:func:`calibrated_headroom`), and
   the step is planned again, once, for the fastest plan whose calibrated peak fits. Its first step is guarded the
   same way; if it still runs out of memory, or no plan fits the calibrated budget, training goes on with the
   probe's plan, which is known to fit.

A refusal is therefore based on a measurement: a budget is refused only when the least-memory plan did not fit.

Every plan's first step is measured, budget or not (:func:`measurement`, kept in ``Plan.measured``): the plan
summary and the dashboard show its predicted against its measured device peak.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

#: Share of the budget kept free on top of the measured error of the simulator: the step-to-step variation of the
#: allocator's peak (placement order, the executor's op order: up to several % on the models measured) and the
#: simulator's error growing as fewer tensors are swapped than in the probe.
CALIBRATION_MARGIN = 0.10
#: The most headroom a calibration may ask for; beyond it the probe's plan is used as it is.
MAX_HEADROOM = 0.6
#: A probe that fits with less than this share of the budget to spare is refused, and a budgeted plan whose first
#: step leaves less is replaced by the probe's: later steps of one plan measure more than its first near the limit
#: (the pool fragments differently with the executor's op order). ResNet-50 64px under 512 MiB
#: (docs/largest_batch.json): 466 MiB in the probe step, 508 MiB and out of memory in step 5 (+9%); 452 -> 504 MiB
#: (+11.5%) for a budgeted plan that still fitted. 5% let those trials run out of memory after their first step.
PROBE_SLACK = 0.10


@dataclasses.dataclass
class Calibration:
    """Predicted and measured device peak of one step, and the headroom they imply for the budget."""

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    persistent_bytes: int
    headroom: float

    @property
    def error(self) -> float:
        """(measured - predicted) / measured."""
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / max(self.measured_peak_bytes, 1)

    def summary(self) -> str:
        mib = 1 << 20
        return (f"calibrated on the first step: measured peak {self.measured_peak_bytes / mib:.1f} MiB, predicted "
                f"{self.predicted_peak_bytes / mib:.1f} MiB ({self.error:+.1%}); planning with {self.headroom:.1%} "
                f"of the {self.budget_bytes / mib:.1f} MiB budget kept free")


def calibrated_prediction(calibration: Mapping[str, Any], predicted_peak: int) -> int:
    """``predicted_peak`` scaled as the calibration scales it: the step's own memory (above the persistent bytes)
    times the measured / predicted ratio of the probe step (never below 1), as :func:`calibrated_headroom` assumes."""
    persistent = max(int(calibration.get("persistent_bytes", 0)), 0)
    ratio = max((int(calibration["measured_peak_bytes"]) - persistent)
                / max(int(calibration["predicted_peak_bytes"]) - persistent, 1), 1.0)
    return int(round(persistent + ratio * max(int(predicted_peak) - persistent, 0)))


def measurement(before: Mapping[str, Any], after: Mapping[str, Any], predicted_peak: int | None = None,
                calibration: Mapping[str, Any] | None = None, outcome: str = "ran", steps: int = 1) -> dict:
    """What the allocator measured in a plan's first step, from its statistics (GTBM's ``memory_stats()``) just
    before and just after the step: the dict a plan keeps as ``Plan.measured``.

    The allocator's peaks are maxima since its last peak reset. When they grew during the step they are the
    step's own peaks (``exact``); otherwise an earlier step reached more, and they bound this step's from above.
    ``peak_bytes`` is the peak of reserved bytes (pageblocks: what the device budget holds, as the probe and the
    calibration measure it); ``error`` is ``(measured - predicted) / measured`` of it."""
    in_use, reserved = int(after["peak_bytes_in_use"]), int(after["peak_bytes_reserved"])
    exact = (reserved > int(before.get("peak_bytes_reserved", -1))
             and in_use > int(before.get("peak_bytes_in_use", -1)))
    out: dict[str, Any] = {"outcome": outcome, "peak_bytes": reserved, "peak_bytes_reserved": reserved,
                           "peak_bytes_in_use": in_use, "exact": exact}
    if predicted_peak is not None:
        out["predicted_peak_bytes"] = int(predicted_peak)
        if outcome == "ran" and reserved > 0:
            out["error"] = (reserved - int(predicted_peak)) / reserved
        if calibration:
            out["calibrated_predicted_peak_bytes"] = calibrated_prediction(calibration, int(predicted_peak))
    if steps > 1:
        out["steps"] = int(steps)  # the train function's call ran steps_per_execution steps
    return out


def calibrated_headroom(budget_bytes: int, predicted_peak: int, measured_peak: int, persistent_bytes: int = 0,
                        margin: float = CALIBRATION_MARGIN) -> float:
    """Share of ``budget_bytes`` to keep free so that a plan predicted at ``(1 - h) * budget`` measures at most
    ``(1 - margin) * budget``.

    The simulator's error is taken as a ratio of the step's own memory (the peak above the persistent bytes:
    workspaces, temporaries and fragmentation grow with the feature maps that stay on the device), never below 1
    (an overestimate is not relied on)."""
    persistent = max(int(persistent_bytes), 0)
    ratio = max((int(measured_peak) - persistent) / max(int(predicted_peak) - persistent, 1), 1.0)
    allowed = persistent + ((1.0 - margin) * budget_bytes - persistent) / ratio
    return min(MAX_HEADROOM, max(margin, 1.0 - allowed / max(int(budget_bytes), 1)))


class VariableSnapshot:
    """Host copies of a model's and its optimizer's variables, to put back after a failed step."""

    def __init__(self, model):
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += list(getattr(optimizer, "variables", []))
        seen, self._saved = set(), []
        for var in variables:
            if id(var) not in seen:
                seen.add(id(var))
                self._saved.append((var, np.array(var.numpy(), copy=True)))

    def restore(self) -> int:
        """Assign every saved value back; returns how many variables changed (a failed step may have updated some
        before it ran out of memory)."""
        changed = 0
        for var, value in self._saved:
            if not np.array_equal(var.numpy(), value):
                changed += 1
            var.assign(value)
        return changed

    def __len__(self) -> int:
        return len(self._saved)
