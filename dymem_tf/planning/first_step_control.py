"""The first step under a budget as a state machine: which plan the train step runs next, decided from what each
guarded first step measured (the stages are described in :mod:`dymem_tf.planning.first_step`).

::

    PROBE ─────leaves slack────▶ CALIBRATED ──leaves slack──▶ SETTLED
      │                            │  │
      │ out of memory,             │  └─within slack (once)──▶ REFINED ──leaves slack──▶ SETTLED
      │ within slack               │                             │
      ▼                            └─out of memory, refused ─┬───┘ out of memory, refused, within slack
    refused (an error)                                       ▼
                                                          FALLBACK (the probe's plan trains)

The controller knows no Keras and no TensorFlow: the callback reports what each first step measured (or that it
ran out of memory, or that no plan fitted) and carries out the :class:`Decision` it gets back: restore the
variables, install a train function planned for a new request, or go back to the probe's plan.
"""
from __future__ import annotations

import dataclasses
import enum

from dymem_tf.planning import first_step


class State(str, enum.Enum):
    """Which plan's first step comes next, or which plan trains."""

    PROBE = "probe"  # the least-memory plan, measured to calibrate the next
    CALIBRATED = "calibrated"  # the plan made with the probe's calibration
    REFINED = "refined"  # the plan made with a calibration from the calibrated plan's own first step
    SETTLED = "settled"  # a budgeted plan left its slack: it trains
    FALLBACK = "fallback"  # the probe's plan trains (a budgeted plan ran out, was refused or left no slack)

    def __str__(self) -> str:
        return self.value


class Action(str, enum.Enum):
    """What the callback does after a first step."""

    KEEP = "keep"  # the plan that ran trains on
    CALIBRATE = "calibrate"  # plan again, calibrated on the step that ran (``Decision.source``), guarded
    FALL_BACK = "fall_back"  # train with the probe's plan, known to fit
    REFUSE = "refuse"  # the least-memory plan did not fit the budget: the variables are restored, fit stops


@dataclasses.dataclass(frozen=True)
class Decision:
    """The controller's answer to one first step: ``action``, the state it leads to, and for a calibration the
    stage the calibration comes from (``"probe"`` or ``"calibrated"``, :data:`first_step.SOURCES`)."""

    action: Action
    state: State
    source: str | None = None


class FirstStepControl:
    """The first steps of one ``fit`` under ``budget_bytes``: starts at :attr:`State.PROBE`; :meth:`stepped`,
    :meth:`ran_out_of_memory` and :meth:`refused` report a first step and return what to do next."""

    def __init__(self, budget_bytes: int):
        if budget_bytes is None or int(budget_bytes) <= 0:
            raise ValueError(f"a first step is controlled under a positive budget, got {budget_bytes!r}")
        self.budget_bytes = int(budget_bytes)
        self.state = State.PROBE

    @property
    def guarded(self) -> bool:
        """Whether the next first step runs guarded (a plan whose outcome is still open)."""
        return self.state in (State.PROBE, State.CALIBRATED, State.REFINED)

    def leaves_slack(self, measured: int | None) -> bool:
        """Whether a step that reserved ``measured`` bytes (None: not measured) leaves the room later steps need
        (:func:`first_step.slack_bytes` of the budget)."""
        return measured is None or first_step.leaves_slack(measured, self.budget_bytes)

    def stepped(self, measured: int | None, in_use: int | None = None) -> Decision:
        """A guarded first step ran and reserved ``measured`` bytes at its peak (``in_use`` of them in use)."""
        if self.state is State.PROBE:
            if not self.leaves_slack(measured):
                return self._to(Action.REFUSE, State.PROBE)
            return self._to(Action.CALIBRATE, State.CALIBRATED, "probe")
        if self.state is State.CALIBRATED:
            if self.leaves_slack(measured):
                return self._to(Action.KEEP, State.SETTLED)
            if in_use:  # calibrated again once, from this step's own fragmentation
                return self._to(Action.CALIBRATE, State.REFINED, "calibrated")
            return self._to(Action.FALL_BACK, State.FALLBACK)
        if self.state is State.REFINED:
            if self.leaves_slack(measured):
                return self._to(Action.KEEP, State.SETTLED)
            return self._to(Action.FALL_BACK, State.FALLBACK)
        return self._to(Action.KEEP, self.state)

    def ran_out_of_memory(self) -> Decision:
        """A guarded first step ran out of memory (its variables are restored): the probe's refuses the budget, a
        budgeted plan's falls back to the probe's plan."""
        if self.state is State.PROBE:
            return self._to(Action.REFUSE, State.PROBE)
        return self._to(Action.FALL_BACK, State.FALLBACK)

    def refused(self) -> Decision:
        """No plan fitted the calibrated budget (the step never ran): the probe's plan, measured to fit, trains;
        with no probe run yet there is nothing to fall back to."""
        if self.state is State.PROBE:
            return self._to(Action.REFUSE, State.PROBE)
        return self._to(Action.FALL_BACK, State.FALLBACK)

    def _to(self, action: Action, state: State, source: str | None = None) -> Decision:
        """Move to ``state`` and say so with ``action``."""
        self.state = state
        return Decision(action, state, source)
