"""The first step under a budget: measured, calibrated and unable to lose training state.

Under a ``memory_budget`` the callback runs the first step of every new input shape in two stages, three when
the second leaves too little room:

1. **Probe.** The step is planned with the least device memory the policy can reach (every candidate swapped,
   swap-ins triggered one layer ahead, optimizer state offloaded where allowed). The model's and the optimizer's
   variables are copied to host memory before it runs (:class:`~dymem_tf.keras.variables.VariableSnapshot`); if it
   runs out of memory they are restored and :class:`~dymem_tf.planning.planner.BudgetTooSmallError` says what was
   measured. The allocator's peak during the step is the *measured* peak of that plan.
2. **Budget.** The ratio of the measured to the predicted bytes in use of the step's own memory (kernel
   workspaces and whatever else the simulator does not model), the placement's fragmentation (reserved less in-use
   bytes) and a margin derived from the simulator's error on the probe set the planner's headroom
   (:func:`calibrated_headroom`), and the step is planned again for the fastest plan whose calibrated peak fits.
   With GTBM's groups that peak is the plan's own placement (:func:`placed_prediction`, from
   :mod:`dymem_tf.memory.placement`: the probe's fragmentation is mostly the persistent group's holes, which the
   variables a calibrated plan keeps fill), and the plan is made to the budget less the placement's allowance
   (:func:`placed_margin`): the step pass plans again with the headroom moved by what the placed peak missed that
   limit by, either way, and keeps the plan placed highest within it. Without a placement the step slack
   (:func:`step_slack`) and the simulator's error are kept free instead (:func:`calibration_margin`). Its first step
   is guarded the same way; if it still runs out of memory, or no plan fits the calibrated budget, training goes on
   with the probe's plan, which is known to fit.
3. **Refined.** A calibrated plan whose first step does not show that it holds the budget (placed:
   :func:`placed_plan_holds`; otherwise it leaves less than the step slack free) is
   calibrated again from that step (``Calibration.source == "calibrated"``): the placement's
   fragmentation of a plan that holds most of the budget differs from the probe's, which held a fraction of it
   (ResNet-50 32px + SGD: 10 MiB at 38 MiB in use in the probe, 24 MiB at 190 MiB in the calibrated plan). The
   plan made with it is guarded the same way; a placed one that does not hold either is calibrated twice more on
   its own step with its whole miss carried, the last time one allowance lower (:data:`PLACED_REFINEMENTS`), then
   training falls back to the probe's plan.

A refusal is therefore based on a measurement: a budget is refused only when the least-memory plan did not fit.

Every plan's first step is measured, budget or not (:func:`measurement`, kept in ``Plan.measured``): the plan
summary and the dashboard show its predicted against its measured device peak.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

#: Growth of a plan's device peak from its first step to later ones, relative to its calibrated prediction: the
#: allocator places in the executor's op order, which varies from step to step. Measured after updates stopped
#: copying weights (:mod:`dymem_tf.planning.read_ordering`), 20 steps of budgeted plans: ResNet-50 32px + SGD,
#: calibrated 260 MiB, reserved 232-256 MiB; DenseNet-121 32px + SGD, calibrated 117.5 MiB, reserved 116-124 MiB
#: (+5.5%). Before, copies raced with the backward pass and later steps measured up to 9-11.5% above the first
#: (ResNet-50 64px under 512 MiB, docs/largest_batch.json).
STEP_VARIATION = 0.06
#: The same growth in bytes, which it never falls below: the reserved peak moves in whole pageblocks (2 MiB in GTBM;
#: each mobility group may hold a partly used one), so under small budgets it is several % of the budget (the
#: budget-reliability runs of docs/benchmarks.md: later steps up to 6-8 MiB above the first under 70-95 MiB budgets).
STEP_VARIATION_BYTES = 8 << 20
#: A probe that fits with less than this share of the budget to spare is refused, and a budgeted plan whose first
#: step leaves less is replaced by the probe's: later steps may measure that much more than the first (the share of
#: a small budget is larger: see :func:`step_slack`).
PROBE_SLACK = STEP_VARIATION
#: Bounds on the share of the budget kept free for the simulator's error on the budgeted plan, taken as its error on
#: the probe step's bytes in use (the plan differs from the probe, so the error is not exactly the probe's).
MIN_MODEL_ERROR, MAX_MODEL_ERROR = 0.02, 0.10
#: The share of the budget kept free when the probe's bytes in use were not measured: the step variation and the
#: simulator's error of about 5% together.
CALIBRATION_MARGIN = 0.10
#: The most headroom a calibration may ask for; beyond it the probe's plan is used as it is.
MAX_HEADROOM = 0.6
#: How many times a calibrated plan is made again when its placed prediction (:func:`placed_prediction`) is over the
#: calibration's limit, or under it by more than a pageblock (:func:`next_headroom`).
PLACEMENT_REPLANS = 3
#: The search for the headroom of a placed plan stops when the headrooms that fit and do not fit are this close.
HEADROOM_RESOLUTION = 0.005
#: ... and when a plan is placed within this share of the budget (or a pageblock, where that is more) under the
#: limit: each plan costs a search, a simulation and a placement (ResNet-50 224px under 768 MiB: 4 plans, 0.37 s of
#: a 0.45 s pass, to land 2 MiB under the limit instead of 5).
PLACED_CLOSE_SHARE = 0.01
#: Pageblocks by which the placer's replay of a step may miss its measured reserved peak either way: the live step
#: allocates in the executor's order, not the simulated one, and each of its groups holds a partly used block.
#: EfficientNet-B0 32px + Adam under 73 MiB: the probe's step measured 28 MiB of blocks, placed 26; the calibrated
#: plan's measured 34, placed 36. A probe's residual up to this is that jitter and is not carried into the plans
#: made from it (carried, it put the calibrated plan two blocks over: 62.1 MiB predicted, 58 measured).
PLACEMENT_JITTER_BLOCKS = 1
#: The plans a calibration may be measured on (see :attr:`Calibration.source`).
SOURCES = ("probe", "calibrated", "refined")
#: How the step a calibration measured ended (see :attr:`Calibration.outcome`).
OUTCOMES = ("ran", "out_of_memory", "under_used")
#: The least ratio of measured to predicted bytes in use an under-used plan's calibration scales the next plan by
#: (:func:`_scale`; others never scale below 1). GatedCNN 32px under 147 MiB measured 0.70 while the simulator held
#: each conditional's output beside the branch value it passes on (it now shares its buffer). A plan made with a
#: ratio that does not repeat is caught by its own guarded first step, and the plan that held trains instead.
MIN_UNDER_USED_RATIO = 0.5
#: How many times a placed plan whose first step does not hold (:func:`placed_plan_holds`) is calibrated again on
#: its own step before the probe's plan takes over. From the second time on the refined plan's miss is carried whole
#: (no :data:`PLACEMENT_JITTER_BLOCKS` discounted): DenseNet-121 32px under 95 MiB placed its refined plan at 86.0
#: MiB against a limit of 87.6 and measured 86 in one run, 88 in another, where falling back to the probe's plan
#: left 0.53 of the budget used; a plan one block lower holds. The last time the plan is also made one allowance
#: lower (:attr:`Calibration.last`): partial swaps place plans on their limit, and under 71 MiB DenseNet-121's
#: calibrated and two refined plans, placed at 66.0-66.7 MiB against a limit of 66.9, measured 67.0-67.5 (in use
#: 63.8 down to 63.0 MiB, the reserved bytes did not follow), each 0.1-0.6 MiB short of the 4.1 MiB allowance; the
#: probe's plan then trained at 37 MiB, 132.9 MiB swapped per step.
PLACED_REFINEMENTS = 3
#: What a calibrated plan placed in GTBM's groups (:func:`placed_prediction`) may measure above the higher of its
#: prediction and its first step in any later step: :data:`PLACED_ALLOWANCE_BLOCKS` pageblocks and
#: :data:`PLACED_ALLOWANCE_SHARE` of the budget (:func:`placed_allowance`). The most seen: over the 38 calibrated runs
#: of docs/budget_reliability_5fe8752.json (16 models, budgets 47 MiB to 2.1 GiB), 7 MiB of 842 (ResNet-152 + SGD, its
#: momentum moving) and 2 MiB under 95; in the runs of docs/budget_utilization.json, planned this close to the budget,
#: 8.0 MiB under 298 (ResNet-50 + Adam: its steps vary by 4 pageblocks as the swap-ins arrive) and 1.5 MiB under 73.
#: Later steps repeat the plan's chained order, and the placement replays the variables that move every step (SGD's
#: momentum), so the step slack a plan without a placement keeps (:func:`step_slack`: 6% or 8 MiB) is not needed.
PLACED_ALLOWANCE_BLOCKS = 3
PLACED_ALLOWANCE_SHARE = 0.015
#: The least pageblock the allowance counts: a device under 256 MiB has smaller blocks (at least 256 of them), whose
#: reserved bytes follow the bytes in use, and DenseNet-121's later steps rose by 3.0-3.25 MiB of them above the
#: first and the prediction (256 KiB blocks, under 95 and 125 MiB; its two threads run a band's ops in a different
#: order each step); 2 MiB blocks absorbed that rise. 3 blocks of 1 MiB and 1.5% of 95 MiB leave it 1.2 MiB.
PLACED_ALLOWANCE_LEAST_BLOCK = 1 << 20
#: GTBM's pageblock (the live allocator's default; a calibration reads its own from the persistent group)
DEFAULT_BLOCK_SIZE = 2 << 20


@dataclasses.dataclass
class Calibration:
    """Predicted and measured device peak of the probe step, and the headroom they imply for the budget.

    ``measured_peak_bytes`` is the peak of reserved bytes (what the budget holds) and ``measured_in_use_bytes`` the
    peak of bytes in use (what the simulator models; 0 when not measured); their difference is the placement's
    fragmentation, which the calibration adds as it was measured."""

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    persistent_bytes: int
    headroom: float
    measured_in_use_bytes: int = 0
    margin: float = CALIBRATION_MARGIN
    #: the plan whose first step was measured: ``"probe"``, ``"calibrated"`` (a calibrated plan whose first
    #: step left less than its slack, calibrated again: its fragmentation is nearer the next plan's than the
    #: probe's, which held a fraction of the bytes), or ``"refined"`` (a placed refined plan that did not hold
    #: either: see :data:`PLACED_REFINEMENTS`)
    source: str = "probe"
    #: GTBM's persistent group before the probe step (:class:`~dymem_tf.memory.placement.PersistentGroup`; None
    #: without GTBM's groups): with it, each plan's reserved bytes are predicted by its placement
    #: (:func:`placed_prediction`) instead of adding the measured step's fragmentation
    persistent_group: dict | None = None
    #: reserved bytes of the measured step that its placement did not explain beyond the placer's jitter
    #: (:data:`PLACEMENT_JITTER_BLOCKS`; never below 0)
    placement_residual_bytes: int = 0
    #: how the measured step ended (:data:`OUTCOMES`): ``"ran"``; ``"out_of_memory"``: it needed more than the
    #: budget, so it is taken to have measured the budget (a bound from below) and its whole miss is carried, as on
    #: a refined plan's step; ``"under_used"``: a placed plan that held measured under its prediction by more than
    #: the allowance (:func:`placed_plan_under_uses`): the next plan is scaled by the measured ratio of bytes in use
    #: below 1 (:func:`_scale`), with what that still leaves beyond the allowance carried as a residual below 0
    #: (:func:`_residual`), so that it keeps more
    outcome: str = "ran"
    #: the last refinement a placed plan gets (:data:`PLACED_REFINEMENTS`): one :func:`placed_allowance` more of the
    #: budget is kept free, so that a plan whose placement keeps missing by less than that holds rather than the
    #: probe's plan taking over
    last: bool = False

    @classmethod
    def from_probe(cls, budget_bytes: int, predicted_peak: int, measured_peak: int, persistent_bytes: int,
                   measured_in_use: int = 0, source: str = "probe", placed: Any = None,
                   group: Any = None, outcome: str = "ran", last: bool = False) -> "Calibration":
        """The calibration of a measured first step (of the ``source`` plan), its margin derived from the
        simulator's error on that step; with that step's ``placed`` placement and the persistent ``group`` it
        found (:class:`~dymem_tf.memory.placement.Placement`, ``PersistentGroup``), the placement's error too.
        ``outcome``: how that step ended (:attr:`outcome`; a probe's step ran, or the budget was refused);
        ``last``: the plan made with it is a placed plan's last refinement (:attr:`last`)."""
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if outcome != "ran" and source == "probe":
            raise ValueError(f"a probe's step that {outcome.replace('_', ' ')} calibrates nothing: a probe that ran "
                             "out of memory refuses the budget, and one is never placed")
        if outcome == "out_of_memory":
            measured_peak = max(int(measured_peak), int(budget_bytes))
        placeable = placed is not None and group is not None and measured_in_use > 0
        if placeable and outcome == "under_used":  # the measured ratio takes the simulator's error in (_scale)
            margin = placed_allowance(budget_bytes, int(group.block_size)) / max(int(budget_bytes), 1)
        elif placeable:
            margin = placed_margin(budget_bytes, predicted_peak, measured_in_use, int(group.block_size))
            if last:  # one allowance lower than the plans that missed it
                margin = min(margin + placed_allowance(budget_bytes, int(group.block_size)) / max(int(budget_bytes), 1),
                             MAX_HEADROOM)
        else:
            margin = calibration_margin(predicted_peak, measured_in_use, budget_bytes)
        headroom = calibrated_headroom(budget_bytes, predicted_peak, measured_peak, persistent_bytes, margin,
                                       measured_in_use, outcome, _carries_in_bytes(source, outcome, placeable))
        cal = cls(int(budget_bytes), int(predicted_peak), int(measured_peak), int(persistent_bytes), headroom,
                  int(measured_in_use), margin, source, outcome=outcome,
                  last=bool(last and placeable and outcome != "under_used"))
        if placeable:
            cal.persistent_group = dataclasses.asdict(group)
            cal.placement_residual_bytes = _residual(cal, placed, int(group.block_size))
        return cal

    @property
    def stage(self) -> str:
        """The stage a plan made with this calibration has (``Plan.params.stage``)."""
        return "calibrated" if self.source == "probe" else "refined"

    @property
    def error(self) -> float:
        """(measured - predicted) / measured of the reserved peak."""
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / max(self.measured_peak_bytes, 1)

    def summary(self) -> str:
        mib = 1 << 20
        in_use = (f", {self.measured_in_use_bytes / mib:.1f} MiB in use"
                  f" ({_in_use_error(self.predicted_peak_bytes, self.measured_in_use_bytes):+.1%})"
                  if self.measured_in_use_bytes else "")
        peak = "ran out of memory at" if self.outcome == "out_of_memory" else "measured peak"
        room = (", under its placement by more than the allowance: keeping more"
                if self.outcome == "under_used" else ", the last refinement: one allowance more kept free"
                if self.last else "")
        return (f"calibrated on the first step of the {self.source} plan: {peak} "
                f"{self.measured_peak_bytes / mib:.1f} MiB{in_use}, predicted "
                f"{self.predicted_peak_bytes / mib:.1f} MiB ({self.error:+.1%}){room}; planning with "
                f"{self.headroom:.1%} of the {self.budget_bytes / mib:.1f} MiB budget kept free "
                f"({self.margin:.1%} of it for later steps and the simulator's error)")


def _residual(cal: Calibration, placed: Any, block_size: int) -> int:
    """The measured step's reserved bytes its placement did not explain: beyond the placer's jitter and never below
    0, except that a refined plan's miss (it repeated a calibration that discounted the jitter) and an
    out-of-memory step's (it missed by more than it measured) are carried whole, and an under-used plan's, where
    its scaled placement (:func:`_scale`) is still above it, is what it left beyond the allowance (below 0)."""
    miss = cal.measured_peak_bytes - _placed(cal, placed)
    if cal.outcome == "under_used" and miss < 0:
        return min(miss + placed_allowance(cal.budget_bytes, block_size), 0)
    whole = cal.source == "refined" or cal.outcome == "out_of_memory"
    return max(miss - (0 if whole else PLACEMENT_JITTER_BLOCKS * block_size), 0)


def _in_use_error(predicted_peak: int, measured_in_use: int) -> float:
    """(measured - predicted) / measured of the bytes in use."""
    return (int(measured_in_use) - int(predicted_peak)) / max(int(measured_in_use), 1)


def step_slack(budget_bytes: int | None = None) -> float:
    """Share of ``budget_bytes`` that later steps of a plan may measure above its first: :data:`STEP_VARIATION`, or
    :data:`STEP_VARIATION_BYTES` where that is more (without a budget, the share alone)."""
    if not budget_bytes or budget_bytes <= 0:
        return PROBE_SLACK
    return min(max(PROBE_SLACK, STEP_VARIATION_BYTES / int(budget_bytes)), MAX_HEADROOM / 2)


def slack_bytes(budget_bytes: int) -> int:
    """:func:`step_slack` of ``budget_bytes`` in whole bytes: what a first step must leave free of the budget. In
    integers, so a step that leaves exactly the slack passes: ``(1 - 8 MiB / B) * B`` can fall a fraction of a byte
    short of ``B - 8 MiB`` in floating point, which refused a probe that measured exactly its limit."""
    budget_bytes = int(budget_bytes)
    share = max(math.ceil(PROBE_SLACK * budget_bytes), STEP_VARIATION_BYTES)
    return min(share, int(MAX_HEADROOM / 2 * budget_bytes))


def leaves_slack(measured: int, budget_bytes: int) -> bool:
    """Whether a first step that reserved ``measured`` bytes leaves its :func:`slack_bytes` of ``budget_bytes``."""
    return int(measured) + slack_bytes(budget_bytes) <= int(budget_bytes)


def least_budget(measured: int) -> int:
    """The least budget that a first step which reserved ``measured`` bytes leaves the slack of
    (:func:`leaves_slack`); the budget minus its slack grows with the budget."""
    measured = int(measured)
    small = STEP_VARIATION_BYTES / (MAX_HEADROOM / 2)  # below it the slack is capped at MAX_HEADROOM / 2
    large = STEP_VARIATION_BYTES / PROBE_SLACK  # above it the slack is the share PROBE_SLACK
    if measured <= (1 - MAX_HEADROOM / 2) * small:
        budget = measured / (1 - MAX_HEADROOM / 2)
    elif measured <= large - STEP_VARIATION_BYTES:
        budget = measured + STEP_VARIATION_BYTES
    else:
        budget = measured / (1 - PROBE_SLACK)
    budget = max(math.floor(budget) - 2, 1)
    while not leaves_slack(measured, budget):  # the float estimate is within a byte or two
        budget += 1
    return budget


def plain_step_margin(budget_bytes: int, largest_alloc: int | None = None) -> int:
    """Bytes a plain (unplanned) step's first step must leave free of ``budget_bytes`` to run as compiled: its
    :func:`step_slack`, or its largest buffer (``largest_alloc``) where that is more. Nothing orders an unplanned
    step's independent ops, so a later step may run its largest buffer (a convolution's workspace) beside tensors
    the first step had already freed: the GAN's plain step measured 64 MiB in its first two steps and ran out of a
    74 MiB device in its third, allocating a 22 MiB Conv2DBackpropFilter workspace with 57 MiB in use."""
    return max(slack_bytes(budget_bytes), int(largest_alloc or 0))


def calibration_margin(predicted_peak: int, measured_in_use: int = 0, budget_bytes: int | None = None) -> float:
    """Share of the budget a calibrated plan keeps free: :func:`step_slack` of ``budget_bytes`` plus the
    simulator's error on the probe's bytes in use (within :data:`MIN_MODEL_ERROR` .. :data:`MAX_MODEL_ERROR`);
    without that measurement, :data:`CALIBRATION_MARGIN` (or more, as the slack asks under a small budget)."""
    slack = step_slack(budget_bytes)
    if measured_in_use <= 0:
        return max(CALIBRATION_MARGIN, slack + MIN_MODEL_ERROR)
    error = abs(_in_use_error(predicted_peak, measured_in_use))
    return slack + min(max(error, MIN_MODEL_ERROR), MAX_MODEL_ERROR)


def placed_allowance(budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of ``budget_bytes`` a placed calibrated plan keeps free for what its placement may miss
    (:data:`PLACED_ALLOWANCE_BLOCKS` pageblocks of ``block_size``, at least :data:`PLACED_ALLOWANCE_LEAST_BLOCK`
    each, and :data:`PLACED_ALLOWANCE_SHARE` of the budget), at most :data:`MAX_HEADROOM` / 2 of it."""
    block = max(int(block_size), PLACED_ALLOWANCE_LEAST_BLOCK)
    allowance = PLACED_ALLOWANCE_BLOCKS * block + math.ceil(PLACED_ALLOWANCE_SHARE * int(budget_bytes))
    return min(allowance, int(MAX_HEADROOM / 2 * int(budget_bytes)))


def placed_margin(budget_bytes: int, predicted_peak: int, measured_in_use: int,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """Share of the budget a calibration with a placement keeps free: :func:`placed_allowance`, plus the bytes in
    use the simulator predicted too few of on the probe beyond :data:`MIN_MODEL_ERROR` of them (the allowance was
    measured on probes within it), as a share of the budget, at most :data:`MAX_MODEL_ERROR`. A probe predicted
    over what it used keeps nothing more: a calibration never predicts a plan below its simulation (:func:`_scale`).

    The miss is kept in bytes, not as the probe's share: the calibration already adds the probe's miss to a plan's
    step (:func:`_in_bytes`), and what is left uncertain is that miss itself, not the miss grown to the budget.
    Over the 39 placed calibrated runs of docs/budget_reliability_16_session4.json the steady peak came within the
    allowance of the placed prediction, the four whose probes missed by more than 10% (GPT decoder, transformer
    encoder; 47-66 MiB budgets, 10% of the budget kept for it) included, 0-2 MiB over."""
    missed = _missed(predicted_peak, measured_in_use) - MIN_MODEL_ERROR * max(int(measured_in_use), 0)
    extra = min(max(missed, 0.0) / max(int(budget_bytes), 1), MAX_MODEL_ERROR)
    return min(placed_allowance(budget_bytes, block_size) / max(int(budget_bytes), 1) + extra, MAX_HEADROOM)


def placed_plan_holds(measured: int, predicted: int, budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE
                      ) -> bool:
    """Whether a placed calibrated plan whose first step reserved ``measured`` bytes, predicted at ``predicted``
    (its steady peak, :func:`placed_prediction`), holds ``budget_bytes`` in later steps: the higher of the two
    leaves the :func:`placed_allowance` (see :data:`PLACED_ALLOWANCE_BLOCKS` for what later steps added)."""
    steady = max(int(measured), int(predicted))
    return steady + placed_allowance(budget_bytes, block_size) <= int(budget_bytes)


#: How many allowances (:func:`placed_allowance`) a placed plan's first step must measure under its prediction for
#: the plan to be made again to keep more (:func:`placed_plan_under_uses`). GatedCNN 32px under 147 MiB left 34 MiB
#: (4.1 allowances) and its plan made to keep more held at 112 MiB over 20 steps; InceptionV3 under 225 MiB left 21
#: MiB (2.2 allowances), and its plan made to keep more measured 208 MiB in its first step, rose to 222 MiB and ran
#: out of memory in step 16: its later steps rise well above its first, which a plan scaled on that step trusts.
UNDER_USE_ALLOWANCES = 3


def placed_plan_under_uses(measured: int, predicted: int, budget_bytes: int,
                           block_size: int = DEFAULT_BLOCK_SIZE) -> bool:
    """Whether a placed plan whose first step reserved ``measured`` bytes left far more of ``budget_bytes`` unused
    than its placement foresaw: it measured under its prediction ``predicted`` by more than
    :data:`UNDER_USE_ALLOWANCES` times the :func:`placed_allowance`. GatedCNN 32px under 147 MiB, while the simulator
    held a conditional's output beside the branch value it passes on: placed at 132 MiB, measured 98 in its first
    step and 100 in later ones."""
    return int(predicted) - int(measured) > UNDER_USE_ALLOWANCES * placed_allowance(budget_bytes, block_size)


def placed_close(budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes under the limit within which a placed plan is close enough (:data:`PLACED_CLOSE_SHARE`)."""
    return max(int(block_size), int(PLACED_CLOSE_SHARE * int(budget_bytes)))


def next_headroom(tried: list[tuple[float, int]], limit: float, budget_bytes: int, close: int,
                  floor: float = 0.0) -> float | None:
    """The headroom to plan a placed plan with next, from the ``(headroom, placed peak)`` pairs tried so far, or None
    to stop: a plan came within ``close`` bytes under ``limit``, or the least headroom that fits and the most that
    does not are within :data:`HEADROOM_RESOLUTION` (or out of order: the peak did not fall as the headroom grew).
    The placed peak falls as the headroom grows, in steps (the plans are sets of tensors); the next headroom is the
    secant between the nearest points either side of the limit, at least a quarter of their bracket from either end
    (DenseNet-121 under 95 MiB: a plan 0.3 MiB over the limit at 10.7% headroom, and the secant crept towards it by
    0.3% a plan), or, with points on one side only, the last one moved by what it missed the limit by (over it, by
    at least ``close``). Headrooms stay within ``floor`` (:func:`least_headroom`) and :data:`MAX_HEADROOM`."""
    fits = [(h, p) for h, p in tried if p <= limit]
    over = [(h, p) for h, p in tried if p > limit]
    if any(p >= limit - close for _, p in fits):
        return None
    lo = max(over)[0] if over else float(floor)
    hi = min(fits)[0] if fits else MAX_HEADROOM
    if hi - lo < HEADROOM_RESOLUTION:
        return None
    if fits and over:  # the secant, at least a quarter of the bracket from either end (the peak moves in steps)
        (h1, p1), (h2, p2) = min(fits), max(over)
        quarter = (hi - lo) / 4
        return min(max(h1 + (limit - p1) * (h2 - h1) / (p2 - p1), lo + quarter), hi - quarter)
    else:  # one side only: its end of the range may be tried (no headroom; the most there is)
        h, p = tried[-1]
        moved = (p - limit) / max(int(budget_bytes), 1)
        # over: at least ``close`` more (placed peaks move in pageblocks: DenseNet-121 under 95 MiB stayed 0.4 MiB
        # over its limit for 4 plans, each 0.5% more headroom, and a plan a block lower was there to be had)
        least = max(HEADROOM_RESOLUTION, int(close) / max(int(budget_bytes), 1))
        estimate = min(max(h + (max(moved, least) if over else moved), floor), MAX_HEADROOM)
        lo, hi = (lo - 1e-9, hi) if not over else (lo, hi + 1e-9)
    return estimate if lo < estimate < hi else (lo + hi) / 2


def _scale(predicted_peak: int, measured_peak: int, persistent_bytes: int, measured_in_use: int,
           outcome: str = "ran", in_bytes: bool = False) -> tuple[int, float, int]:
    """``(persistent, ratio, fragmentation)``: the calibrated peak of a plan predicted at P is
    ``persistent + ratio * (P - persistent) + fragmentation``. ``ratio`` is measured over predicted bytes in use of
    the step's own memory (above the persistent bytes; never below 1, an overestimate not relied on, except on an
    under-used plan's step, down to :data:`MIN_UNDER_USED_RATIO`: a plan that held overestimated by that much);
    ``fragmentation`` is reserved less in-use bytes at the probe's peaks. Without the in-use measurement the reserved
    peak stands for it (no fragmentation term). ``in_bytes`` (:func:`_in_bytes`): the ratio is 1 and the bytes the
    simulator missed the step's bytes in use by are added to ``fragmentation`` instead."""
    persistent = max(int(persistent_bytes), 0)
    in_use = int(measured_in_use) if measured_in_use > 0 else int(measured_peak)
    fragmentation = max(int(measured_peak) - in_use, 0)
    if in_bytes:
        return persistent, 1.0, fragmentation + _missed(predicted_peak, in_use)
    least = MIN_UNDER_USED_RATIO if outcome == "under_used" else 1.0
    ratio = max((in_use - persistent) / max(int(predicted_peak) - persistent, 1), least)
    return persistent, ratio, fragmentation


def _missed(predicted_peak: int, measured_in_use: int) -> int:
    """Bytes in use the simulator predicted too few of (0 where it predicted enough)."""
    return max(int(measured_in_use) - int(predicted_peak), 0)


def _in_bytes(calibration: Mapping[str, Any]) -> bool:
    """Whether a calibration carries its step's miss in bytes, not as a ratio (:func:`_scale`): a probe's step that
    ran, placed in GTBM's groups. The probe swaps every candidate; a calibrated plan swaps a few, and the
    simulator's miss on the probe comes with its swaps, not with the bytes it keeps. Over the 39 placed calibrated
    runs of docs/budget_reliability_16_session4.json the calibrated plans' own bytes in use were predicted within
    +1.2 MiB (and over by up to 9.6), while the probes of the GPT decoder and the transformer encoder missed by 7-14%:
    scaled by that ratio, the transformer's plan under 66 MiB was placed at 61.3 MiB and measured 58.5."""
    return _carries_in_bytes(calibration.get("source", "probe"), calibration.get("outcome", "ran"),
                             bool(calibration.get("persistent_group")))


def _carries_in_bytes(source: str, outcome: str, placed: bool) -> bool:
    """:func:`_in_bytes` of a calibration measured on a ``source`` plan's step that ended with ``outcome``,
    ``placed`` (with a persistent group) or not."""
    return source == "probe" and outcome == "ran" and placed


def _fields(calibration: "Calibration | Mapping[str, Any]") -> Mapping[str, Any]:
    """A calibration's fields by name (a :class:`Calibration`, or one read back from JSON)."""
    return calibration if isinstance(calibration, Mapping) else dataclasses.asdict(calibration)


def _scale_of(calibration: Mapping[str, Any]) -> tuple[int, float, int]:
    """:func:`_scale` of a calibration's fields."""
    return _scale(calibration["predicted_peak_bytes"], calibration["measured_peak_bytes"],
                  calibration.get("persistent_bytes", 0), calibration.get("measured_in_use_bytes", 0),
                  calibration.get("outcome", "ran"), _in_bytes(calibration))


def calibrated_prediction(calibration: "Calibration | Mapping[str, Any]", predicted_peak: int) -> int:
    """``predicted_peak`` as the calibration corrects it (see :func:`_scale`; :func:`calibrated_headroom` assumes
    the same)."""
    persistent, ratio, fragmentation = _scale_of(_fields(calibration))
    return int(round(persistent + ratio * max(int(predicted_peak) - persistent, 0) + fragmentation))


def _placed(calibration: "Calibration | Mapping[str, Any]", placed: Any) -> int:
    """The reserved bytes of ``placed`` with its step's own bytes scaled as the calibration measured them (or the
    step's miss added, :func:`_in_bytes`)."""
    cal = _fields(calibration)
    _, ratio, _ = _scale_of(cal)
    missed = _missed(cal["predicted_peak_bytes"], cal.get("measured_in_use_bytes", 0)) if _in_bytes(cal) else 0
    return int(round(placed.persistent_reserved_bytes + ratio * placed.step_reserved_bytes + missed))


def placed_prediction(calibration: "Calibration | Mapping[str, Any]", placed: Any) -> int:
    """The calibrated device peak of a plan whose step is placed as ``placed`` (a calibration with a
    ``persistent_group``): the persistent group's blocks with the variables the plan keeps, the blocks of the step's
    own buffers scaled by the measured ratio of bytes in use, and what the measured step's placement left
    unexplained."""
    cal = _fields(calibration)
    return _placed(cal, placed) + int(cal.get("placement_residual_bytes", 0))


@dataclasses.dataclass
class Measurement:
    """What the allocator measured in a plan's first step (:func:`measurement`; a plan keeps it as
    ``Plan.measured``)."""

    outcome: str = "ran"  # or "out_of_memory"
    peak_bytes: int = 0  # the device peak compared with the predicted one: GTBM's peak reserved bytes
    peak_bytes_reserved: int = 0
    peak_bytes_in_use: int = 0
    #: False: an earlier step since the allocator's last peak reset reached more, so the peaks bound this step's
    exact: bool = True
    predicted_peak_bytes: int | None = None
    error: float | None = None  # (measured - predicted) / measured of the peak
    calibrated_predicted_peak_bytes: int | None = None
    steps: int = 1  # the train function's call ran this many steps (steps_per_execution)


def measurement(before: Mapping[str, Any], after: Mapping[str, Any], predicted_peak: int | None = None,
                calibration: "Calibration | Mapping[str, Any] | None" = None, outcome: str = "ran", steps: int = 1,
                calibrated_peak: int | None = None) -> Measurement:
    """What the allocator measured in a plan's first step, from its statistics (GTBM's ``memory_stats()``) just
    before and just after the step: what a plan keeps as ``Plan.measured``.

    The allocator's peaks are maxima since its last peak reset. When they grew during the step they are the
    step's own peaks (``exact``); otherwise an earlier step reached more, and they bound this step's from above.
    ``peak_bytes`` is the peak of reserved bytes (pageblocks: what the device budget holds, as the probe and the
    calibration measure it); ``error`` is ``(measured - predicted) / measured`` of it."""
    in_use, reserved = int(after["peak_bytes_in_use"]), int(after["peak_bytes_reserved"])
    exact = (reserved > int(before.get("peak_bytes_reserved", -1))
             and in_use > int(before.get("peak_bytes_in_use", -1)))
    out = Measurement(outcome=outcome, peak_bytes=reserved, peak_bytes_reserved=reserved, peak_bytes_in_use=in_use,
                      exact=exact, steps=max(int(steps), 1))
    if predicted_peak is not None:
        out.predicted_peak_bytes = int(predicted_peak)
        if outcome == "ran" and reserved > 0:
            out.error = (reserved - int(predicted_peak)) / reserved
        if calibration:
            out.calibrated_predicted_peak_bytes = calibrated_prediction(calibration, int(predicted_peak))
    if calibrated_peak is not None:  # the plan's own placement, calibrated (placed_prediction)
        out.calibrated_predicted_peak_bytes = int(calibrated_peak)
    return out


def calibrated_headroom(budget_bytes: int, predicted_peak: int, measured_peak: int, persistent_bytes: int = 0,
                        margin: float = CALIBRATION_MARGIN, measured_in_use: int = 0, outcome: str = "ran",
                        in_bytes: bool = False) -> float:
    """Share of ``budget_bytes`` to keep free so that a plan predicted at ``(1 - h) * budget`` measures at most
    ``(1 - margin) * budget`` once calibrated (:func:`calibrated_prediction`; ``outcome``, ``in_bytes``: see
    :func:`_scale`)."""
    persistent, ratio, fragmentation = _scale(predicted_peak, measured_peak, persistent_bytes, measured_in_use,
                                              outcome, in_bytes)
    allowed = persistent + ((1.0 - margin) * budget_bytes - fragmentation - persistent) / ratio
    least = least_headroom(outcome) if ratio < 1.0 else margin
    return min(MAX_HEADROOM, max(least, 1.0 - allowed / max(int(budget_bytes), 1)))


def least_headroom(outcome: str = "ran") -> float:
    """The least headroom a calibration of a step that ended with ``outcome`` plans with: 0, except after an
    under-used plan, whose ratio below 1 (:func:`_scale`) maps the budget to simulated peaks above it: down to
    ``1 - 1 / MIN_UNDER_USED_RATIO`` (planned for up to twice the budget as the simulator counts; the placed
    prediction, scaled, is what must fit)."""
    return 1.0 - 1.0 / MIN_UNDER_USED_RATIO if outcome == "under_used" else 0.0
