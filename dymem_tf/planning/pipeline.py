"""The planning pipeline, one function for the callback's pass and the dry run: defer ▶ plan ▶ check triggers.

:func:`plan_step` takes a captured :class:`~dymem_tf.planning.analysis.StepGraph` and the settings of one plan
(:class:`PlanSettings`) and returns a :class:`PlannedStep`: the graph planned on (with the deferral edges added),
the :class:`~dymem_tf.planning.plan.Plan`, and the deferral edges for the rewrite to insert.
"""
from __future__ import annotations

import dataclasses

from dymem_tf.planning import planner, update_deferral
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.cost_model import CostModel
from dymem_tf.planning.device_profiles import DeviceProfile
from dymem_tf.planning.plan import Plan


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What a plan is made for; the defaults are the callback's (``DymemCallback`` validates user values)."""

    policy: str = "dymem"
    budget_bytes: int | None = None
    persistent_bytes: int = 0
    profile: DeviceProfile | CostModel | str = "cpu"  # a profile, its name, or a calibrated cost model
    batch_size: int | None = None
    min_swap_bytes: int = planner.DEFAULT_MIN_SWAP_BYTES
    swapin_ahead: int | None = 1  # TFLMS' level distance; for dymem a cap on how late a trigger may sit
    headroom: float = planner.DEFAULT_HEADROOM  # share of the budget kept free
    defer_updates: bool = True  # see dymem_tf.planning.update_deferral


@dataclasses.dataclass
class PlannedStep:
    """One step's plan, the graph it was made on, and the deferral edges ``(waiting op, gradient op)``."""

    step_graph: StepGraph
    plan: Plan
    deferrals: list[tuple[str, str]]


def deferrals_for(step_graph: StepGraph, settings: PlanSettings) -> list[tuple[str, str]]:
    """The deferral edges the rewrite will add: none for the "none" policy, none into or out of a conditional."""
    if not settings.defer_updates or settings.policy == "none":
        return []
    return [(a, b) for a, b in update_deferral.find_deferrals(step_graph)
            if not (step_graph.ops[a].conditional or step_graph.ops[b].conditional)]


def drop_conditional_triggers(plan: Plan, step_graph: StepGraph) -> int:
    """Clear triggers that sit in conditional branches (a dead trigger would starve its swap-in) or in another loop
    frame than the swapped tensor (TF forbids edges across frames); returns how many swap-ins now start as soon as
    their swap-out is done."""
    dropped = 0
    for decision in plan.swaps:
        frame = step_graph.ops[decision.producer].frame
        for swap_in in decision.swap_ins:
            op = step_graph.ops.get(swap_in.trigger_op)
            if op is not None and (op.conditional or op.frame != frame):
                swap_in.trigger_op, dropped = "", dropped + 1
    return dropped


def plan_step(step_graph: StepGraph, settings: PlanSettings, copy: bool = False) -> PlannedStep:
    """Defer gradient-independent optimizer ops, plan the swaps, and clear triggers the rewrite cannot place.

    ``copy=True`` leaves ``step_graph`` untouched (the dry run plans one graph under several policies); otherwise
    the deferral edges are added to it in place. Raises :class:`~dymem_tf.planning.planner.BudgetTooSmallError`
    (a ValueError) when no plan fits the budget.
    """
    deferrals = deferrals_for(step_graph, settings)
    graph = update_deferral.defer(step_graph, deferrals, copy=copy) if deferrals or copy else step_graph
    plan = planner.make_plan(
        graph, policy=settings.policy, budget_bytes=settings.budget_bytes,
        persistent_bytes=settings.persistent_bytes, profile=settings.profile, batch_size=settings.batch_size,
        min_swap_bytes=settings.min_swap_bytes, swapin_ahead=settings.swapin_ahead, headroom=settings.headroom)
    if deferrals:
        plan.notes.append(f"{len(deferrals)} gradient-independent optimizer ops deferred to their gradients")
    untriggered = drop_conditional_triggers(plan, graph)
    if untriggered:
        plan.notes.append(f"{untriggered} swap-ins start without a trigger: their layers run only inside "
                          "conditional branches")
    return PlannedStep(graph, plan, deferrals)
