"""The planning pipeline, one function for the callback's pass and the dry run: find offloadable state and
weights ▶ defer ▶ order updates after reads ▶ hold early gradient ops ▶ model the state ▶ find recomputable
tensors ▶ plan ▶ check triggers.

:func:`plan_step` takes a captured :class:`~dymem_tf.planning.analysis.StepGraph` and the settings of one plan
(:class:`PlanSettings`) and returns a :class:`PlannedStep`: the graph planned on (with the deferral edges added),
the :class:`~dymem_tf.planning.plan.Plan`, and the deferral edges for the rewrite to insert.
"""
from __future__ import annotations

import dataclasses

from dymem_tf.planning import (backward_ordering, first_step, loop_lists, offload, planner, read_ordering, recompute,
                               sequencing, update_deferral)
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.cost_model import CostModel
from dymem_tf.planning.device_profiles import DeviceProfile
from dymem_tf.planning.memory_model import MeasuredMemory
from dymem_tf.planning.plan import Plan
from dymem_tf.planning.simulator import simulate
from dymem_tf.planning.stages import stage


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
    #: "planned": the rewrite chains the ops in the simulated order, in bands; "strict": op by op (dymem policy only,
    #: see dymem_tf.planning.sequencing); "free": the executor orders them
    execution_order: str = "planned"
    #: let the dymem policy offload optimizer state between its uses (dymem_tf.planning.offload); the pass enables
    #: it under a budget only
    offload_variables: bool = False
    #: let the dymem policy keep weights in host memory between their uses (dymem_tf.planning.offload); the pass
    #: enables it under a budget only
    offload_weights: bool = False
    #: let the dymem policy recompute cheap feature maps instead of keeping or swapping them, where hidden round
    #: trips do not fit the budget (dymem_tf.planning.recompute)
    recompute: bool = True
    least_memory: bool = False  # without a budget: the least-memory plan (the first step's probe)
    #: without a budget (not least_memory): swap nothing where every candidate together lowers the predicted peak by
    #: less than this (one of GTBM's pageblocks); not applied with ``min_swap_bytes`` 0, which swaps every candidate
    min_peak_saving: int = planner.MIN_PEAK_SAVING
    #: kernel temporaries measured in a traced step of this graph (the first step's probe), or None
    memory: MeasuredMemory | None = None
    #: oneDNN's layout pass rewrites the graph after the plan is applied (the pass acted before it: several replicas,
    #: or XLA's auto-clustering); then a CPU step keeps TF's order (dymem_tf.planning.sequencing)
    onednn_later: bool = False


@dataclasses.dataclass
class PlannedStep:
    """One step's plan, the graph it was made on, and the control edges the rewrite adds, ``(before, after)``: the
    deferrals (gradient op, deferred update op), the read orderings (user of a read, in-place update) and the holds
    (anchor, gradient op ready early)."""

    step_graph: StepGraph
    plan: Plan
    deferrals: list[tuple[str, str]]
    #: ``(resource, consumers)`` of the variables the plan keeps on the device while others may be offloaded: the
    #: rewrite brings each back before its consumers if an earlier plan (or the callback, at the start of ``fit``)
    #: left it in host memory (a no-op otherwise)
    resident: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    #: the order the rewrite chains the ops in (:mod:`dymem_tf.planning.sequencing`); no ops: none
    sequence: sequencing.Sequence = sequencing.Sequence()


def deferrals_for(step_graph: StepGraph, settings: PlanSettings, always: set[str] | frozenset[str] = frozenset()
                  ) -> list[tuple[str, str]]:
    """The deferral edges the rewrite will add: none for the "none" policy, none into or out of a conditional;
    ``always``: ops deferred whatever they own (reads of offloadable optimizer state)."""
    if not _adds_edges(settings):
        return []
    return _outside_conditionals(step_graph, update_deferral.find_deferrals(step_graph, always=always))


def read_orderings_for(step_graph: StepGraph, settings: PlanSettings) -> list[tuple[str, str]]:
    """The edges ordering in-place variable updates after the uses of their reads (same conditions as the
    deferral: not for the "none" policy, none into or out of a conditional)."""
    if not _adds_edges(settings):
        return []
    return _outside_conditionals(step_graph, read_ordering.find_read_orderings(step_graph))


def holds_for(step_graph: StepGraph, settings: PlanSettings) -> list[tuple[str, str]]:
    """The edges holding gradient ops that are ready early until their consumers near (same conditions as the
    deferral)."""
    if not _adds_edges(settings):
        return []
    return _outside_conditionals(step_graph, backward_ordering.find_holds(step_graph))


def sequence_for(step_graph: StepGraph, settings: PlanSettings, plan: Plan | None = None) -> sequencing.Sequence:
    """The order the rewrite makes the executor follow: with ``execution_order`` "planned" or "strict", for the dymem
    policy (the baselines keep TF's order, as the systems they stand for do); "planned" in bands where ``plan`` is
    given (its simulation bounds them), each contraction alone where the plan keeps a budget. The least-memory plan
    (the probe) is chained one op at a time: its simulation, which would bound the bands, is the least reliable of
    a step's plans, and in bands ResNet-50 64px, batch 258, SGD measured 506 MiB in its probe against 474 chained,
    which left no slack under 512 MiB. So is a budgeted plan whose step holds a buffer larger than the allowance
    its placement keeps free (:func:`first_step.placed_allowance`): the executor's order inside a band places such
    a buffer differently from step to step, and one misplaced is more than the allowance (ResNet-50 + Adam, batch
    258 under 512 MiB, 64.5 MiB feature maps: a refined plan measured 494 MiB in its first step and ran out of
    memory in its sixth)."""
    if settings.execution_order == "free" or settings.policy != "dymem":
        return sequencing.Sequence()
    sequence = sequencing.find_sequence(step_graph, onednn_later=settings.onednn_later)
    if not (sequence.ops and settings.execution_order == "planned" and plan is not None) or settings.least_memory:
        return sequence
    temporaries = settings.memory.held_during(step_graph) if settings.memory is not None else None
    if settings.budget_bytes and _largest_buffer(step_graph, temporaries) > first_step.placed_allowance(
            settings.budget_bytes):
        return sequence  # chained one op at a time (see the docstring)
    sim = simulate(step_graph, plan, settings.profile, timeline=False, temporaries=temporaries)
    budgeted = settings.budget_bytes is not None or settings.least_memory or settings.memory is not None
    bands = sequencing.find_bands(step_graph, sequence.ops, sim, contractions_alone=budgeted)
    return dataclasses.replace(sequence, bands=bands)


def _largest_buffer(step_graph: StepGraph, temporaries: dict[str, int] | None) -> int:
    """The bytes of the step's largest device buffer: a tensor that owns one, or an op's measured temporaries."""
    tensors = (t.bytes for t in step_graph.tensors.values() if not t.persistent and t.alias_of is None)
    return max(max(tensors, default=0), max((temporaries or {}).values(), default=0))


def _adds_edges(settings: PlanSettings) -> bool:
    """Whether the plan adds ordering edges (deferrals, read orderings): with ``defer_updates``, not for "none"."""
    return settings.defer_updates and settings.policy != "none"


def _outside_conditionals(step_graph: StepGraph, edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``edges`` less those into or out of a conditional branch (a dead op would never release its successor)."""
    return [(a, b) for a, b in edges if not (step_graph.ops[a].conditional or step_graph.ops[b].conditional)]


def offloadable_for(step_graph: StepGraph, settings: PlanSettings) -> list[offload.OffloadableVariable]:
    """The variables the plan may offload: only for the dymem policy with ``offload_variables`` and deferral on
    (without it their reads run at the step's start)."""
    if not (settings.offload_variables and settings.defer_updates and settings.policy == "dymem"):
        return []
    return offload.find_offloadable(step_graph)


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


def weights_for(step_graph: StepGraph, settings: PlanSettings) -> list[offload.OffloadableWeight]:
    """The weights the plan may offload: only for the dymem policy with ``offload_weights`` and deferral on."""
    if not (settings.offload_weights and settings.defer_updates and settings.policy == "dymem"):
        return []
    return offload.find_offloadable_weights(step_graph)


def recomputable_for(step_graph: StepGraph, settings: PlanSettings) -> list[recompute.Recomputable]:
    """The tensors the plan may recompute: only for the dymem policy with ``recompute`` (found on the graph with
    its ordering edges: where the backward consumers run decides what is still on the device)."""
    if not (settings.recompute and settings.policy == "dymem"):
        return []
    return recompute.find_recomputable(step_graph, settings.min_swap_bytes)


@dataclasses.dataclass
class PreparedStep:
    """A step graph made ready to plan: the ordering edges added (``deferrals``, read ``orderings``, ``holds``),
    offloadable optimizer state and weights found and marked (their ``modelled`` bytes), recomputable tensors
    found. None of it depends on the budget or the headroom, so re-plans of one graph share it."""

    graph: StepGraph
    variables: list
    weights: list
    deferrals: list[tuple[str, str]]
    orderings: list[tuple[str, str]]
    holds: list[tuple[str, str]]
    modelled: int
    modelled_weights: int
    recomputable: list
    streamed: list  # the loops' lists kept in host memory (planning.plan.StreamedList)


def preparation_key(settings: PlanSettings) -> tuple:
    """The settings :func:`prepare_step` reads: two plans of one graph whose keys are equal can share one
    preparation (the first step's probe and the calibrated plan under a budget)."""
    return (settings.policy, settings.defer_updates, settings.offload_variables, settings.offload_weights,
            settings.recompute, settings.min_swap_bytes, streams_lists(settings))


def streams_lists(settings: PlanSettings) -> bool:
    """Whether the plan keeps loops' lists in host memory (:mod:`dymem_tf.planning.loop_lists`): for the dymem
    policy under a budget or for the least-memory plan. Each element then crosses the link twice, so a step without
    a budget keeps them on the device."""
    return settings.policy == "dymem" and (settings.budget_bytes is not None or settings.least_memory)


def plan_step(step_graph: StepGraph, settings: PlanSettings, copy: bool = False) -> PlannedStep:
    """Defer gradient-independent optimizer ops, plan the swaps, and clear triggers the rewrite cannot place.

    With ``offload_variables`` the optimizer state used only in the update is modelled as tensors the planner may
    swap (:mod:`dymem_tf.planning.offload`); their bytes leave ``persistent_bytes``.

    ``copy=True`` leaves ``step_graph`` untouched (the dry run plans one graph under several policies); otherwise
    the deferral edges are added to it in place. Raises :class:`~dymem_tf.planning.planner.BudgetTooSmallError`
    (a ValueError) when no plan fits the budget. :func:`prepare_step` and :func:`finish_plan` are its two halves.
    """
    return finish_plan(prepare_step(step_graph, settings, copy), settings)


def prepare_step(step_graph: StepGraph, settings: PlanSettings, copy: bool = False) -> PreparedStep:
    """Everything :func:`plan_step` does before the planner's search (see :class:`PreparedStep`); ``settings``'
    budget, headroom, profile and measured memory are not read."""
    with stage("offload"):
        variables = offloadable_for(step_graph, settings)
        weights = weights_for(step_graph, settings)
        early = offload.early_reads(step_graph, variables, weights)
    with stage("defer"):
        deferrals = deferrals_for(step_graph, settings, always=early)
        graph = update_deferral.defer(step_graph, deferrals, copy=copy) if deferrals or copy else step_graph
    with stage("order"):
        orderings = read_orderings_for(graph, settings)
        if orderings:
            graph = update_deferral.defer(graph, orderings)
    with stage("hold"):
        holds = holds_for(graph, settings)
        if holds:
            graph = update_deferral.defer(graph, holds)
    with stage("offload"):
        modelled = offload.mark(graph, variables)
        modelled_weights = offload.mark(graph, weights)
    with stage("recompute"):
        recomputable = recomputable_for(graph, settings)
    with stage("stream"):
        streamed = loop_lists.streamable_lists(graph, settings.min_swap_bytes) if streams_lists(settings) else []
        if streamed:
            graph = graph.copy() if graph is step_graph else graph
            loop_lists.mark_streamed(graph, streamed)
    return PreparedStep(graph, variables, weights, deferrals, orderings, holds, modelled, modelled_weights,
                        recomputable, streamed)


def finish_plan(prepared: PreparedStep, settings: PlanSettings, memo: planner.PlannerMemo | None = None,
                sequenced: bool = True) -> PlannedStep:
    """The plan of a :func:`prepare_step`'d graph under ``settings`` (which must match the preparation's but for
    the budget, headroom, profile and measured memory); ``prepared`` is not changed. ``memo``: the planner an
    earlier plan of the same ``prepared`` step made under another budget or headroom, reused
    (:class:`planner.PlannerMemo`).
    ``sequenced=False`` leaves the planned order out (a search that keeps one of several plans orders that one
    with :func:`with_sequence`)."""
    graph, variables, weights = prepared.graph, prepared.variables, prepared.weights
    deferrals, orderings, holds = prepared.deferrals, prepared.orderings, prepared.holds
    modelled, modelled_weights, recomputable = prepared.modelled, prepared.modelled_weights, prepared.recomputable
    plan = planner.make_plan(
        graph, policy=settings.policy, budget_bytes=settings.budget_bytes,
        persistent_bytes=max(settings.persistent_bytes - modelled - modelled_weights, 0), profile=settings.profile,
        batch_size=settings.batch_size,
        min_swap_bytes=settings.min_swap_bytes, swapin_ahead=settings.swapin_ahead, headroom=settings.headroom,
        least_memory=settings.least_memory,
        temporaries=settings.memory.held_during(graph) if settings.memory is not None else None, weights=weights,
        recomputable=recomputable, memo=memo,
        min_peak_saving=settings.min_peak_saving if settings.min_swap_bytes > 0 else 0)
    if deferrals:
        plan.notes.append(f"{len(deferrals)} gradient-independent optimizer ops deferred to their gradients")
    if orderings:
        updates = len({update for _, update in orderings})
        plan.notes.append(f"{updates} variable updates ordered after the last use of their reads ({len(orderings)} "
                          "edges): they write in place instead of copying the variable")
    if holds:
        plan.notes.append(f"{len(holds)} gradient ops ready early held until their consumers near: their outputs "
                          "no longer wait through the forward pass")
    if settings.memory is not None:
        plan.notes.append(settings.memory.summary())
    if variables:
        plan.params.offloadable_variable_bytes = modelled
        plan.notes.append(f"{len(variables)} optimizer variables ({modelled / 2**20:.1f} MiB) may be offloaded "
                          f"between their uses; {len(plan.offloaded_variables)} are")
    if plan.recomputed:
        plan.notes.append(f"{len(recomputable)} feature maps could be recomputed from tensors on the device anyway; "
                          f"{len(plan.recomputed)} are")
    if weights:
        plan.params.offloadable_weight_bytes = modelled_weights
        plan.notes.append(f"{len(weights)} weights ({modelled_weights / 2**20:.1f} MiB) may be kept in host memory "
                          f"between their uses; {len(plan.offloaded_weights)} are")
    if prepared.streamed:
        plan.streamed_lists = list(prepared.streamed)
        plan.notes.append(f"{len(prepared.streamed)} loop lists ({sum(x.bytes for x in prepared.streamed) / 2**20:.1f} "
                          "MiB) kept in host memory element by element, copied as the loops push and pop them")
    untriggered = drop_conditional_triggers(plan, graph)
    if untriggered:
        plan.notes.append(f"{untriggered} swap-ins start without a trigger: their layers run only inside "
                          "conditional branches")
    resident = []
    if variables or weights:  # offloading is on: whatever this plan keeps comes back first
        offloaded = {s.tensor for s in plan.swaps if s.kind in ("variable", "weight")}
        resident = [(t, users) for t, users in offload.variable_resources(graph) if t not in offloaded]
    planned = PlannedStep(graph, plan, deferrals + orderings + holds, resident)
    return with_sequence(planned, settings) if sequenced else planned


def with_sequence(planned: PlannedStep, settings: PlanSettings) -> PlannedStep:
    """``planned`` with the order the rewrite chains its ops in (:func:`sequence_for`), said in its plan's notes."""
    graph, plan = planned.step_graph, planned.plan
    with stage("sequence"):
        sequence = sequence_for(graph, settings, plan)
    if sequence.ops:
        bands = sequence.band_count()
        plan.notes.append(f"{len(sequence.ops)} ops chained in the planned order" +
                          (f", in {bands} bands (ops of a band run side by side)" if bands < len(sequence.ops) else "")
                          + (", swap ops as soon as they are ready" if sequence.with_added else ""))
    elif sequence.skipped:
        plan.notes.append(sequence.skipped)
    accumulation = sequencing.accumulation_note(graph)
    if accumulation:
        plan.notes.append(accumulation)
    return dataclasses.replace(planned, sequence=sequence)
