"""The first step of a ``fit`` as a state machine: which train function runs next, decided from what each guarded
first step measured (the stages under a budget are described in :mod:`dymem_tf.planning.first_step`).

::

    AUTO ──fits, with slack──▶ PLAIN                       (memory_budget="auto": the step as compiled)
      │
      └─out of memory / within slack─▶ plan for the device: PROBE if guarded, else UNGUARDED

    PROBE ─────leaves slack────▶ CALIBRATED ──holds──▶ SETTLED    (holds with room to spare, once: USE_MORE)
      │                            │  │
      │ out of memory,             │  └─does not hold (once)──▶ REFINED ──holds──▶ SETTLED
      │ within slack, refused      │   or out of memory, placed  │  ▲ placed, does not hold or
      ▼                            └─refused ────────────────┬───┘ └┘ out of memory (once more)
    REFUSED (an error)                                       ▼ out of memory, refused, does not hold
                                                          FALLBACK (the probe's plan trains)

A budgeted plan *holds* when its first step leaves the room its later steps need: the allowance of its placement
where it was placed in GTBM's groups (:func:`first_step.placed_plan_holds`), the step slack otherwise. A placed
plan is refined up to :data:`first_step.PLACED_REFINEMENTS` times (the refined plan's own miss calibrates the
next), an unplaced one once (without a placement to predict the next plan from, a second refinement was not shown
to help). A placed plan whose first step ran out of memory is refined the same way, once, its
step measured at the budget (ResNet-50 + Adam under 179 MiB: a calibrated plan placed 0.1 MiB under its limit ran
out in one run and measured 175.9 MiB in another; falling back left 0.44 of the budget used); the pass plans that
refinement only where a plan is placed within its limit (else no plan fits: the fall-back), since each try skips a
batch.

A placed plan that holds but measured under its prediction by more than three allowances
(:func:`first_step.placed_plan_under_uses`) is made again once, calibrated on its step to keep more
(``Action.USE_MORE``, a refinement); if that plan does not hold or runs out of memory, the plan that held trains
(FALLBACK), not the probe's.

PLAIN, UNGUARDED, SETTLED, FALLBACK and REFUSED are terminal: nothing is guarded any more. The controller knows no
Keras and no TensorFlow: the first-step session (:mod:`dymem_tf.keras.session`) reports what each first step
measured (or that it ran out of memory, or that no plan fitted) and carries out the :class:`Decision` it gets back.
"""
from __future__ import annotations

import dataclasses
import enum

from dymem_tf.planning import first_step


class State(str, enum.Enum):
    """Which train function's first step comes next, or which one trains."""

    AUTO = "auto"  # the step as compiled, its first step guarded (memory_budget="auto")
    PLAIN = "plain"  # the step as compiled trains: it fits the device
    PROBE = "probe"  # the least-memory plan, measured to calibrate the next
    CALIBRATED = "calibrated"  # the plan made with the probe's calibration
    REFINED = "refined"  # a plan calibrated on the first step of the calibrated (or a refined) plan
    SETTLED = "settled"  # a budgeted plan left its slack: it trains
    FALLBACK = "fallback"  # a plan known to fit trains: the probe's, or one that held before a plan keeping more
    UNGUARDED = "unguarded"  # a plan trains without a guarded first step (no budget, or nothing to calibrate)
    REFUSED = "refused"  # the budget cannot be met: fit stops with an error, the variables as they were

    def __str__(self) -> str:
        return self.value


#: States after which nothing is guarded and no decision is left to take.
TERMINAL = frozenset({State.PLAIN, State.SETTLED, State.FALLBACK, State.UNGUARDED, State.REFUSED})


class Action(str, enum.Enum):
    """What the session does after a first step."""

    KEEP = "keep"  # the train function that ran trains on
    PLAN = "plan"  # the step as compiled does not fit: plan it for the device
    CALIBRATE = "calibrate"  # plan again, calibrated on the step that ran (``Decision.source``), guarded
    #: the plan held and left room it was not predicted to leave: plan again to keep more, calibrated on its step,
    #: guarded, with this plan (known to fit) as the one to fall back to
    USE_MORE = "use_more"
    FALL_BACK = "fall_back"  # train with the plan known to fit: the probe's, or the plan that held before USE_MORE
    REFUSE = "refuse"  # the least-memory plan did not fit the budget: the variables are restored, fit stops


@dataclasses.dataclass(frozen=True)
class Decision:
    """The controller's answer to one first step: ``action``, the state it leads to, and for a calibration the
    state whose first step it is calibrated on (``State.PROBE``, ``State.CALIBRATED`` or ``State.REFINED``)."""

    action: Action
    state: State
    source: State | None = None


class FirstStepControl:
    """The first steps of one ``fit``: starts at ``state`` (:attr:`State.AUTO`, :attr:`State.PROBE` under a
    positive ``budget_bytes``, or :attr:`State.UNGUARDED`); the report methods return what to do next."""

    def __init__(self, budget_bytes: int | None = None, state: State = State.PROBE):
        self.state = State(state)
        self.budget_bytes = None
        self.refinements = 0  # refined plans made so far
        self.used_more = False  # a refinement keeps more than a plan that held (USE_MORE): it falls back to that plan
        self.ran_out = False  # a budgeted plan ran out of memory and was refined (once only: each try skips a batch)
        if self.state is State.PROBE:
            self._set_budget(budget_bytes)

    @property
    def guarded(self) -> bool:
        """Whether the next first step runs guarded (a train function whose outcome is still open)."""
        return self.state in (State.AUTO, State.PROBE, State.CALIBRATED, State.REFINED)

    @property
    def settled(self) -> bool:
        """Whether a terminal state is reached (:data:`TERMINAL`)."""
        return self.state in TERMINAL

    def leaves_slack(self, measured: int | None) -> bool:
        """Whether a step that reserved ``measured`` bytes (None: not measured) leaves the room later steps need
        (:func:`first_step.slack_bytes` of the budget)."""
        return measured is None or first_step.leaves_slack(measured, self.budget_bytes)

    def plain_fits(self) -> Decision:
        """The step as compiled fitted the device with its slack: it trains."""
        self._expect(State.AUTO)
        return self._to(Action.KEEP, State.PLAIN)

    def plan_for(self, budget_bytes: int | None, guarded: bool) -> Decision:
        """The step is planned for ``budget_bytes`` (the step as compiled did not fit, or a budget was asked for):
        its first step is the probe when ``guarded``."""
        if self.state not in (State.AUTO, State.PROBE, State.UNGUARDED):
            raise RuntimeError(f"the step cannot be planned anew in state {self.state}")
        if not guarded:
            self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
            return self._to(Action.PLAN, State.UNGUARDED)
        self._set_budget(budget_bytes)
        return self._to(Action.PLAN, State.PROBE)

    def resume(self, state: State) -> Decision:
        """Train with the train function an earlier ``fit`` settled in ``state`` (a terminal state but REFUSED),
        after :meth:`plan_for`: nothing is guarded again."""
        state = State(state)
        if state not in TERMINAL or state is State.REFUSED or self.state not in (State.PROBE, State.UNGUARDED):
            raise RuntimeError(f"cannot resume {state} from {self.state}")
        return self._to(Action.KEEP, state)

    def holds(self, measured: int | None, placed: tuple[int, int] | None = None) -> bool:
        """Whether a budgeted plan whose first step reserved ``measured`` bytes holds the budget in later steps:
        with ``placed`` (``(predicted steady peak, pageblock size)`` of a plan placed in GTBM's groups), its
        placement's allowance (:func:`first_step.placed_plan_holds`); otherwise the step slack
        (:meth:`leaves_slack`)."""
        if measured is None or placed is None:
            return self.leaves_slack(measured)
        predicted, block_size = placed
        return first_step.placed_plan_holds(measured, predicted, self.budget_bytes, block_size)

    def stepped(self, measured: int | None, in_use: int | None = None,
                placed: tuple[int, int] | None = None, swaps: bool = False) -> Decision:
        """A guarded planned first step ran and reserved ``measured`` bytes at its peak (``in_use`` of them in
        use); ``placed``: the plan's placed prediction and pageblock size (:meth:`holds`; a probe's is not used);
        ``swaps``: the plan moves tensors it could keep (a plan that held may then be made again to keep more)."""
        if self.state is State.PROBE:
            if not self.leaves_slack(measured):
                return self._to(Action.REFUSE, State.REFUSED)
            return self._to(Action.CALIBRATE, State.CALIBRATED, State.PROBE)
        if self.state in (State.CALIBRATED, State.REFINED):
            if self.holds(measured, placed):
                if swaps and in_use and self._under_uses(measured, placed):
                    self.refinements, self.used_more = self.refinements + 1, True
                    return self._to(Action.USE_MORE, State.REFINED, self.state)
                return self._to(Action.KEEP, State.SETTLED)
            if self.used_more:  # the plan that held before it trains
                return self._to(Action.FALL_BACK, State.FALLBACK)
            if in_use and self._refinement_left(measured, placed):
                self.refinements += 1  # calibrated again from this step's own fragmentation (and miss)
                return self._to(Action.CALIBRATE, State.REFINED, self.state)
            return self._to(Action.FALL_BACK, State.FALLBACK)
        return self._to(Action.KEEP, self.state)

    def _under_uses(self, measured: int | None, placed: tuple[int, int] | None) -> bool:
        """Whether a placed plan that held left room beyond its allowance (:func:`first_step.placed_plan_under_uses`)
        with a refinement left and none used for that yet."""
        if measured is None or placed is None or self.used_more or not self._refinement_left(measured, placed):
            return False
        return first_step.placed_plan_under_uses(measured, placed[0], self.budget_bytes, placed[1])

    def _refinement_left(self, measured: int | None, placed: tuple[int, int] | None) -> bool:
        """Whether a plan may be refined once more: up to :data:`first_step.PLACED_REFINEMENTS` times where it was
        placed and measured, else once."""
        allowed = first_step.PLACED_REFINEMENTS if placed is not None and measured is not None else 1
        return self.refinements < allowed

    def ran_out_of_memory(self, in_use: int | None = None, placed: tuple[int, int] | None = None) -> Decision:
        """A guarded first step ran out of memory (its variables are restored): the probe's refuses the budget; a
        budgeted plan placed in GTBM's groups (``placed``, see :meth:`holds`) with ``in_use`` bytes measured at its
        peak is refined like one that does not hold, once and while refinements are left (it ran out at the
        budget: the step measured the whole budget and more; each try skips a batch); else the plan known to fit
        trains (the probe's, or the plan that held before a plan made to keep more)."""
        if self.state is State.PROBE:
            return self._to(Action.REFUSE, State.REFUSED)
        if self.state in (State.CALIBRATED, State.REFINED) and in_use and placed is not None \
                and self._refinement_left(self.budget_bytes, placed) and not (self.used_more or self.ran_out):
            self.refinements, self.ran_out = self.refinements + 1, True
            return self._to(Action.CALIBRATE, State.REFINED, self.state)
        return self._to(Action.FALL_BACK, State.FALLBACK)

    def refused(self) -> Decision:
        """No plan fitted the budget (the step never ran): after a probe, the probe's plan, measured to fit,
        trains; with no probe run yet there is nothing to fall back to."""
        if self.state in (State.PROBE, State.UNGUARDED):
            return self._to(Action.REFUSE, State.REFUSED)
        return self._to(Action.FALL_BACK, State.FALLBACK)

    def _set_budget(self, budget_bytes: int | None) -> None:
        if budget_bytes is None or int(budget_bytes) <= 0:
            raise ValueError(f"a first step is guarded under a positive budget, got {budget_bytes!r}")
        self.budget_bytes = int(budget_bytes)

    def _expect(self, state: State) -> None:
        if self.state is not state:
            raise RuntimeError(f"this report belongs to state {state}, not {self.state}")

    def _to(self, action: Action, state: State, source: State | None = None) -> Decision:
        """Move to ``state`` and say so with ``action``."""
        self.state = state
        return Decision(action, state, source)
