"""Swap planning: which feature maps to swap and where each swap-in is triggered.

Policies
--------
``none``
    No swapping (the baseline the others are compared with).
``dymem`` (Yang & Cheng, HPDC'20)
    Candidates are forward tensors whose backward consumers run far enough after the producer that a round trip
    (D2H + H2D) fits into the modelled compute in between. Consumers close to each other share one swap-in, far
    apart groups get their own. Every swap-in is triggered in the *latest dependency layer* whose remaining
    compute before the consumers hides the copy, accounting for the serial H2D channel: swap-ins are scheduled
    "as late as possible" backwards from their deadlines, so a busy channel moves earlier triggers earlier still.
``vdnn`` (Rhu et al., MICRO'16)
    Swap every forward feature map (conv/matmul outputs and Keras-layer boundaries) and prefetch it one Keras
    layer ahead: the swap-in starts with the backward of the Keras layer that runs just before the consumer's.
``tflms`` (IBM Large Model Support)
    Swap every forward tensor above a size threshold that has backward consumers; each swap-in is triggered
    ``swapin_ahead`` topological levels (= dependency layers) before its consumers.

With a ``budget_bytes`` every policy chooses its swap set greedily: simulate, find the peak, add the largest
candidates that would be off the device at that instant, repeat until the simulated peak fits. Without a budget
every candidate is swapped. The greedy search runs in stages that give up speed for memory only when needed:
hidden round trips first, then any eligible tensor, and for dymem then later triggers (each copy hidden as if the
channel were idle, and finally one layer before the consumers). When the greedy plan is slower than the step
without swaps, the planner also starts from the first whole pool that fits and prunes it (latest-produced tensors
first, while the plan still fits and gets no slower), then lets another candidate take the place of the swap that
stalls most while that makes the plan faster (:meth:`_Planner.exchange`), and keeps the faster of the greedy and
pruned plans: adding tensors at the peak only queues them when the D2H channel is the bottleneck at the end of the
forward pass. :class:`BudgetTooSmallError` reports the peak of the last stage with every eligible tensor swapped.

Budgets are monotone (issue 48): a smaller budget gets a plan with no higher predicted peak and no fewer bytes
swapped. The greedy rounds do not read the budget (each adds a fixed share of the memory at the peak), so every
budget walks one chain of growing swap sets and stops at the first state that fits (:meth:`_Planner.fit_budget`);
the pruned plan keeps the chain's states that larger budgets get (:func:`_choose`). ``bench/budget_sweep.py``
checks it on real models; the search stays a heuristic, so this is measured, not proven.
Predictions come from :mod:`dymem_tf.planning.simulator`.

The planner works on the stall-free modelled schedule (dependency layers in order, :mod:`dymem_tf.planning.cost_model`
times). A ResNet-50 step graph (~8.5k ops at batch 64) plans without a budget in well under a second; a budget
that needs pruning takes about a second (ResNet-50 at 224x224 on this 2-core machine).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from dymem_tf import units
from dymem_tf.planning.analysis import ALIAS_OP_TYPES, FREE_OP_TYPES, StepGraph, analyse, input_frame, no_autograph
from dymem_tf.planning.cost_model import CostModel, as_cost_model
from dymem_tf.planning.device_profiles import DeviceProfile
from dymem_tf.planning.plan import Plan, PlanParams, RecomputeRoute, SwapDecision, SwapIn, WeightRoute
from dymem_tf.planning.simulator import SimResult, adopted_values, prepared, returned_values
from dymem_tf.planning.stages import stage, timed
from dymem_tf.units import mib

POLICIES = ("none", "dymem", "vdnn", "tflms")
#: How dymem places swap-in triggers: "queue" hides every copy given the serial host-to-device channel, "isolated"
#: hides each copy as if the channel were idle, "jit" starts each one layer ahead (the least memory).
TriggerMode = Literal["queue", "isolated", "jit"]

#: Forward ops whose outputs vDNN treats as layer feature maps.
CONV_LIKE_OP_TYPES = frozenset({
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
    "_FusedConv2D", "_FusedMatMul", "Einsum",
})

DEFAULT_MIN_SWAP_BYTES = 64 * 1024

#: A greedy plan whose modelled step is at most this share slower than the step without swaps ends the search
#: under a budget: pruning and exchanging (each trial a simulation of the whole step) would chase stalls smaller
#: than the cost model's own error.
SEARCH_STALL_TOLERANCE = 0.005

#: Share of the step's memory at the peak (above the persistent bytes) whose tensors one round of the greedy search
#: adds (:meth:`_Planner.fit_budget`): a budget-independent step, so that every budget walks one chain of swap sets.
GREEDY_STEP = 0.125

#: Simulations after which the downsizing of a budgeted plan takes up no further swap (:meth:`_Planner.downsize`;
#: the swap it is on may add up to :data:`DOWNSIZE_TRIES` more), and how many smaller candidates it tries in place
#: of each swap: each trial simulates the whole step, and a placed plan's headroom search makes up to four plans.
DOWNSIZE_TRIALS = 24
DOWNSIZE_TRIES = 3
#: Simulations the filling of a budgeted plan's room with kept rows may take (:meth:`_Planner.fill`): each tries
#: one partial swap, and each one accepted leaves less room for the next.
FILL_TRIALS = 6


#: Share of the budget the planner leaves free when nothing was measured: ``DymemCallback(calibrate=False)``, a
#: process without GTBM to measure the first step with, and the dry run. It is a default, not a bound on the
#: simulator's error: docs/benchmarks.md measures that error at about 5% (median) without a budget but beyond 10%
#: on some models, and far larger on the uncalibrated least-memory step under a budget ("Budget reliability").
#: Under a budget the callback therefore derives the headroom from its measured first step instead
#: (:func:`dymem_tf.first_step.calibrated_headroom`, never below the margin ``first_step.calibration_margin``
#: derives from the simulator's error on that step).
DEFAULT_HEADROOM = 0.1
#: The least predicted saving for which a plan without a budget swaps at all (:func:`make_plan`'s
#: ``min_peak_saving`` as the callback plans): GTBM's pageblock (2 MiB). GTBM reserves memory a pageblock at a time
#: and keeps swapped tensors in a mobility group of their own, whose partly used block a smaller saving does not pay
#: for: bench/model_zoo.py's LSTM swapped its loop's lists (predicted to save 0.1 MiB), and its step reserved 10 MiB
#: where it reserves 8 without them, the same 3.9 MiB in use.
MIN_PEAK_SAVING = 2 << 20


class BudgetTooSmallError(ValueError):
    """Even maximal swapping cannot bring the predicted peak under the budget."""

    def __init__(self, message: str, min_peak_bytes: int | None = None, budget_bytes: int | None = None,
                 suggested_batch: int | None = None):
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes
        self.budget_bytes = budget_bytes
        self.suggested_batch = suggested_batch
        self.eligible = 0  # eligible tensors the planner could swap (set where it is raised)


@dataclass
class _Candidate:
    tensor: str
    producer: str
    bytes: int
    prod_pos: int
    prod_layer: int
    orig: list[str]  # consumers served by the original device tensor
    keepers: list[str]  # ops that keep the original buffer alive without reading the tensor (alias consumers)
    groups: list[list[str]]  # consumer groups, each served by one swap-in (execution order)
    min_trigger_layer: int  # no swap-in may start before this layer (after producer and original consumers)
    kind: str = "tensor"  # or "variable" (optimizer state), "weight" (dymem_tf.planning.offload), "recompute"
    route: WeightRoute | None = None  # kind "weight"
    recompute: RecomputeRoute | None = None  # kind "recompute" (dymem_tf.planning.recompute)
    cost_s: float = 0.0  # modelled time its copies (or recomputation) take: the tie-break between equal sizes
    #: per swap-in group, the earliest trigger layer where it differs from min_trigger_layer (a weight's second
    #: stay starts after its forward users)
    group_min_layers: list[int] | None = None
    #: a branch's intermediate kept for the gradient in an optional: the ``OptionalFromValue`` that takes the host
    #: copy instead (:meth:`~dymem_tf.planning.analysis.StepGraph.optional_readers`)
    wrap: str = ""

    @property
    def from_host(self) -> bool:
        """Whether its swap-ins copy from host memory it lives in (no swap-out before them)."""
        return self.kind in ("variable", "weight")

    @property
    def copies(self) -> bool:
        """Whether it goes through the copy channels (a recomputation does not)."""
        return self.kind != "recompute"


@dataclass(frozen=True)
class _Choice:
    """A swap set that fits the budget, its simulation, its trigger mode and how it was found."""

    res: SimResult
    swaps: list[_Candidate]
    mode: TriggerMode
    how: str

    @property
    def step_time_s(self) -> float:
        return self.res.step_time_s


class PlannerMemo:
    """What :func:`make_plan` keeps between plans of one step graph that differ only in their budget and headroom
    (a placed plan's headroom search, :meth:`dymem_tf.passes.step_pass.StepPass._placed_plan`): the planner with its
    triggers, candidates and hideable sets, which do not read the budget. Owned by one search and dropped with it;
    a plan asked for with other inputs gets a planner of its own (the planner kept holds the objects its key names
    by identity, so no key can be recycled while it is kept)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._planner: "_Planner | None" = None

    def planner(self, key: tuple, build) -> "_Planner":
        """The planner made for ``key`` (the inputs it was made of, compared by identity where they are objects),
        made by ``build()`` the first time or when the key changed."""
        if self._planner is None or self._key != key:
            self._key, self._planner = key, build()
        return self._planner


def _planner_key(step_graph: StepGraph, profile, min_swap_bytes: int, swapin_ahead: int | None,
                 group_gap_layers: int, temporaries: Mapping[str, int] | None, weights: Sequence,
                 recomputable: Sequence) -> tuple:
    """What a :class:`_Planner` is made of, for :class:`PlannerMemo`: objects by identity, the temporaries (a new
    mapping for each plan) by value."""
    return (id(step_graph), profile if isinstance(profile, str) else id(profile), int(min_swap_bytes),
            swapin_ahead, group_gap_layers, dict(temporaries) if temporaries else None,
            tuple(map(id, weights)), tuple(map(id, recomputable)))


class _Planner:
    """State shared by the policies for one step graph and cost model."""

    def __init__(self, sg: StepGraph, cost: CostModel, min_swap_bytes: int, swapin_ahead: int | None,
                 group_gap_layers: int, temporaries: Mapping[str, int] | None = None, weights: Sequence = (),
                 recomputable: Sequence = ()):
        self.sg = sg
        self.weights = list(weights)  # offloadable weights (dymem_tf.planning.offload.OffloadableWeight)
        self.recomputable = list(recomputable)  # dymem_tf.planning.recompute.Recomputable
        self.cost = cost
        self.min_swap_bytes = max(int(min_swap_bytes), 1)
        self.swapin_ahead = swapin_ahead
        self.group_gap_layers = group_gap_layers
        self.sim = prepared(sg, cost, temporaries)
        self.order = self.sim.order
        self.pos = self.sim.pos
        self.start = self.sim.base_start  # stall-free schedule
        self.end = self.sim.base_end
        self.layer = [sg.ops[n].layer for n in self.order]
        nl = sg.num_layers
        last_pos = np.zeros(nl, dtype=np.int64)
        for i, lay in enumerate(self.layer):
            last_pos[lay] = i  # positions grow with layers: the last write is the layer's last op
        self.layer_end = self.end[last_pos].tolist() if nl else []
        self.trigger_of_layer = [self._pick_trigger(ops) for ops in sg.layers]
        self._quiet_triggers: list[str | None] | None = None  # per layer, a trigger that holds no variable
        self._bwd_start: list[tuple[int, str]] | None = None
        #: id(candidate) -> (candidate, its decision planned alone): the greedy search asks for every remaining
        #: candidate's triggers in every round, and they do not depend on the rest of the plan
        self._alone: dict[int, tuple[_Candidate, SwapDecision]] = {}
        self._alone_key: tuple[str, str] | None = None
        #: tensor -> (the optional that holds it, its readers) or None: looked up once, read in every trial's decisions
        self._optionals: dict[str, tuple[str, dict[str, str]] | None] = {}
        #: (policy, relaxed) -> candidates and tuple of tensor names -> hideable ones: budget-independent, asked for by
        #: every plan a :class:`PlannerMemo` reuses this planner for
        self._candidates: dict[tuple[str, bool], list[_Candidate]] = {}
        self._hideable: dict[tuple[str, ...], list[_Candidate]] = {}

    # ------------------------------------------------------------------------------------------------ helpers
    def _pick_trigger(self, ops: list[str]) -> str:
        """Deterministic trigger op of a layer: preferably a backward op that moves data, then any op that runs."""
        def rank(name: str) -> tuple[int, int]:
            op = self.sg.ops[name]
            runs = op.type not in FREE_OP_TYPES
            works = runs and (op.flops > 0 or op.bytes_accessed > 0)  # moves data, not only metadata
            tier = 0 if (op.is_backward and works) else 1 if op.is_backward and runs else 2 if runs else 3
            # a conditional op may never run; an op inside a loop cannot trigger a swap-in outside it
            return (tier + 4 * op.conditional + 8 * bool(op.frame), self.pos[name])
        return min(ops, key=rank)

    def h2d(self, nbytes: int) -> float:
        return self.cost.copy_time(nbytes, "h2d")

    def d2h(self, nbytes: int) -> float:
        return self.cost.copy_time(nbytes, "d2h")

    def _eligible(self, relaxed: bool):
        """(tensor, original consumers, backward data consumers, alias consumers) of swappable forward tensors."""
        sg = self.sg
        min_bytes = 1 if relaxed else self.min_swap_bytes
        for t in sg.tensors.values():
            if t.persistent or t.alias_of is not None or not t.shape_known or t.bytes < min_bytes or len(t.shape) == 0:
                continue
            if sg.ops[t.producer].is_backward and not t.variable:
                continue
            if t.dtype == "variant" and "GPU" in sg.ops[t.producer].device.upper():
                continue  # a loop's list: the swap ops copy TensorLists on the CPU device only
            wrap, chain = self.optional_wrap(t.name), set()
            if wrap:
                chain = sg.optional_chain(wrap)
            elif sg.ops[t.producer].conditional:
                continue  # made in a lowered branch and read in the gradient's: no swap-in can serve it there
            frame = sg.ops[t.producer].frame
            if any(input_frame(sg.ops[c]) != frame for c in t.consumers):
                continue  # read inside another loop frame: swap ops cannot sit there
            orig, bwd = [], []
            for c in t.consumers:
                if sg.ops[c].is_backward and sg.is_data_consumer(c):
                    bwd.append(c)
                elif c != wrap:  # the optional takes the swap-out's host copy
                    orig.append(c)
            # Backward ops reading the tensor through a forward alias op (a Reshape ...) read a copy of that op on
            # the swap-in (through an optional: the swap-in itself); other consumers of aliases read the original
            # buffer: they keep it alive.
            via = self.via_alias(t.name)
            bwd += via
            keepers = [c for c in sg.buffer_consumers(t.name) if c not in t.consumers and c not in via
                       and c not in chain]
            if bwd:
                bwd.sort(key=self.pos.__getitem__)
                yield t, orig, bwd, keepers

    def via_alias(self, tensor: str) -> dict[str, str]:
        """:meth:`StepGraph.alias_readers` of ``tensor`` (or, for a branch's intermediate kept in an optional, its
        :meth:`StepGraph.optional_readers`), empty where none can be served by a swap-in."""
        optional = self._optional(tensor)
        if optional is not None:
            return optional[1]
        return self.sg.alias_readers(tensor) or {}

    def optional_wrap(self, tensor: str) -> str:
        """The ``OptionalFromValue`` of a branch's intermediate that a swap can serve, or ""."""
        optional = self._optional(tensor)
        return optional[0] if optional is not None else ""

    def _optional(self, tensor: str) -> tuple[str, dict[str, str]] | None:
        """:meth:`StepGraph.optional_readers` of a tensor made in a branch, cached; None elsewhere, and on a GPU,
        where the optional ops take device memory: TensorFlow would copy the host copy back to the device to put it
        in the optional."""
        if tensor not in self._optionals:
            producer = self.sg.ops[self.sg.tensors[tensor].producer]
            found = None
            if producer.conditional and "GPU" not in producer.device.upper():
                found = self.sg.optional_readers(tensor)
            self._optionals[tensor] = found
        return self._optionals[tensor]

    def _split(self, t, orig: list[str], bwd: list[str], keepers: list[str], timed: bool
               ) -> tuple[list[str], list[str], list[str], int] | None:
        """Move backward consumers that run too early for a round trip to the original (those reading it through
        an alias op to ``keepers``); (original's consumers, keepers, swapped consumers, earliest trigger layer), or
        None if none remain.

        Structural rule (always): a swapped consumer's layer must exceed the trigger's earliest layer. Timed rule
        (dymem): the swap-out and the swap-in must both fit before the consumer in the stall-free schedule.
        """
        orig, keepers, via = list(orig), list(keepers), self.via_alias(t.name)
        p = self.pos[t.producer]
        min_trig = max([self.layer[p] + 1] + [self.layer[self.pos[c]] for c in orig + keepers])
        release = max([self.end[p] + self.d2h(t.bytes)] + [self.end[self.pos[c]] for c in orig + keepers])
        h = self.h2d(t.bytes)
        k = 0
        while k < len(bwd):
            c = self.pos[bwd[k]]
            if self.layer[c] > min_trig and (not timed or self.start[c] - release >= h):
                break
            (keepers if bwd[k] in via else orig).append(bwd[k])
            min_trig = max(min_trig, self.layer[c])
            release = max(release, self.end[c])
            k += 1
        if k == len(bwd):
            return None
        return orig, keepers, bwd[k:], min_trig

    def _group_by_gap(self, consumers: list[str], nbytes: int) -> list[list[str]]:
        """Consumers within ``group_gap_layers`` layers, or too close in time to refetch, share a swap-in."""
        h = self.h2d(nbytes)
        groups = [[consumers[0]]]
        for prev, cur in zip(consumers, consumers[1:]):
            pp, pc = self.pos[prev], self.pos[cur]
            far = (self.layer[pc] - self.layer[pp] > self.group_gap_layers and self.start[pc] - self.end[pp] >= h)
            if far:
                groups.append([cur])
            else:
                groups[-1].append(cur)
        return groups

    def _group_by_keras_layer(self, consumers: list[str]) -> list[list[str]]:
        """vDNN: one swap-in per consumer Keras layer (consecutive consumers of one Keras layer)."""
        groups: list[list[str]] = []
        last = object()
        for c in consumers:
            k = self.sg.ops[c].keras_layer
            if groups and k == last:
                groups[-1].append(c)
            else:
                groups.append([c])
            last = k
        return groups

    # ----------------------------------------------------------------------------------------------- candidates
    @timed("candidates")
    def candidates(self, policy: str, relaxed: bool = False) -> list[_Candidate]:
        """Swap candidates of ``policy``; ``relaxed`` drops the size threshold and the round-trip test (found once
        per planner)."""
        key = (policy, bool(relaxed))
        if key not in self._candidates:
            self._candidates[key] = self._find_candidates(policy, relaxed)
        return list(self._candidates[key])

    def _find_candidates(self, policy: str, relaxed: bool) -> list[_Candidate]:
        """:meth:`candidates`, found."""
        out = []
        for t, orig, bwd, keepers in self._eligible(relaxed):
            prod = self.sg.ops[t.producer]
            if policy == "vdnn" and not relaxed:
                boundary = prod.type in CONV_LIKE_OP_TYPES or any(
                    self.sg.ops[c].keras_layer != prod.keras_layer for c in t.consumers)
                if not boundary:
                    continue
            split = self._split(t, orig, bwd, keepers, timed=(policy == "dymem" and not relaxed))
            if split is None:
                continue
            orig2, keepers, swapped, min_trig = split
            if t.variable:
                if policy != "dymem" or orig2:
                    continue  # an offloaded variable needs one swap-in before all of its uses
                groups = [swapped]
            elif policy == "vdnn":
                groups = self._group_by_keras_layer(swapped)
            else:
                groups = self._group_by_gap(swapped, t.bytes)
            p = self.pos[t.producer]
            kind = "variable" if t.variable else "tensor"
            cost = (0.0 if t.variable else self.d2h(t.bytes)) + len(groups) * self.h2d(t.bytes)
            out.append(_Candidate(t.name, t.producer, t.bytes, p, self.layer[p], orig2, keepers, groups, min_trig,
                                  kind, cost_s=cost, wrap=self.optional_wrap(t.name)))
        if policy == "dymem":
            out += [c for w in self.weights if (c := self._weight_candidate(w, relaxed)) is not None]
        if policy == "dymem" and relaxed:  # no copy to hide: offered once the hidden round trips fall short
            out += [c for r in self.recomputable if (c := self._recompute_candidate(r)) is not None]
        return out

    def _recompute_candidate(self, r) -> _Candidate | None:
        """A recomputable tensor as a candidate: one group (its backward consumers), triggered after its forward
        consumers; None when no layer lies between them."""
        sg = self.sg
        t = sg.tensors[r.tensor]
        p = self.pos[t.producer]
        later = set(r.backward_consumers)
        keep = [c for c in sg.buffer_consumers(r.tensor) if c not in later]
        min_trig = max([self.layer[p] + 1] + [self.layer[self.pos[c]] for c in keep])
        if self.layer[self.pos[r.backward_consumers[0]]] <= min_trig:
            return None
        from dymem_tf.planning.recompute import route_of

        cost = float(sum(self.sim.dur[self.pos[op]] for op in r.ops))
        return _Candidate(r.tensor, t.producer, t.bytes, p, self.layer[p], keep, [], [list(r.backward_consumers)],
                          min_trig, "recompute", recompute=route_of(sg, r), cost_s=cost)

    def _consistent(self, cands: list[_Candidate]) -> list[_Candidate]:
        """``cands`` less the recomputations whose leaves would not be on the device: a leaf another candidate
        swaps, offloads or recomputes (earlier-produced recomputations are kept first)."""
        if not any(c.kind == "recompute" for c in cands):
            return cands
        gone = {self.sg.buffer_of(c.tensor) for c in cands if c.kind != "recompute"}
        kept = set()
        for c in sorted((c for c in cands if c.kind == "recompute"), key=lambda c: c.prod_pos):
            if not any(self.sg.buffer_of(leaf) in gone for leaf in c.recompute.leaves):
                kept.add(c.tensor)
                gone.add(c.tensor)
        return [c for c in cands if c.kind != "recompute" or c.tensor in kept]

    def _rivals(self, cand: _Candidate, picked: list[_Candidate]) -> list[_Candidate]:
        """The recomputations of ``picked`` that a swap ``cand`` of one of their leaves cancels (none for a
        recomputation ``cand``)."""
        if cand.kind == "recompute":
            return []
        buf = self.sg.buffer_of(cand.tensor)
        return [c for c in picked if c.kind == "recompute"
                and any(self.sg.buffer_of(leaf) == buf for leaf in c.recompute.leaves)]

    def moved_bytes(self, cands: list[_Candidate]) -> int:
        """The bytes a plan of ``cands`` takes off the device (:attr:`Plan.swapped_bytes` of its decisions)."""
        return sum(c.bytes for c in self._consistent(cands))

    def _weight_candidate(self, weight, relaxed: bool) -> _Candidate | None:
        """An offloadable weight as a candidate with two swap-in groups (its forward users; its backward users and
        update), or None when it is below the size threshold (unless ``relaxed``), has no forward users, or no
        dependency layer lies between its forward users and the rest."""
        if weight.bytes < (1 if relaxed else self.min_swap_bytes) or not weight.forward_users:
            return None
        t = self.sg.tensors[weight.tensor]
        p = self.pos[t.producer]
        first = sorted(weight.forward_users, key=self.pos.__getitem__)
        second = sorted(weight.backward_users + weight.update_users, key=self.pos.__getitem__)
        after_forward = max(self.layer[self.pos[c]] for c in first) + 1
        if not second or min(self.layer[self.pos[c]] for c in second) <= after_forward:
            return None  # no layer between the two stays for the second swap-in's trigger
        return _Candidate(t.name, t.producer, weight.bytes, p, self.layer[p], [], [], [first, second],
                          self.layer[p] + 1, "weight", weight.route,
                          group_min_layers=[self.layer[p] + 1, after_forward],
                          cost_s=2 * self.h2d(weight.bytes) + self.d2h(weight.bytes))

    # ------------------------------------------------------------------------------------------------ triggers
    def _layer_trigger(self, layer: int) -> tuple[str, int]:
        return self.trigger_of_layer[layer], layer

    def _trigger(self, cand: _Candidate, group: int, layer: int, c_layer: int) -> tuple[str, int]:
        """The trigger of ``cand``'s swap-in group ``group`` in ``layer``. A weight's swap-in is never triggered by
        an op that reads a variable or aliases a read (such an op may wait for a weight's swap-in itself, or be the
        weight's own read): the nearest layer in its range with another op is taken instead."""
        if cand.kind != "weight":
            return self._framed_trigger(cand, group, layer, c_layer)
        if self._quiet_triggers is None:
            self._quiet_triggers = [self._pick_trigger(q) if (q := [n for n in ops if not self._holds_variable(n)])
                                    else None for ops in self.sg.layers]
        lo = self._min_layer(cand, group)
        for g in itertools.chain(range(layer, lo - 1, -1), range(layer + 1, c_layer)):
            if self._quiet_triggers[g] is not None:
                return self._quiet_triggers[g], g
        return self._layer_trigger(layer)

    def _framed_trigger(self, cand: _Candidate, group: int, layer: int, c_layer: int) -> tuple[str, int]:
        """The trigger of ``layer``, or where its ops all run inside a loop the swapped tensor is not in (no edge
        may cross a frame), the nearest op of the tensor's frame in the group's range: the latest before ``layer``
        (a loop's ``Exit`` as it ends), else the earliest after it."""
        frame = self.sg.ops[cand.producer].frame
        trigger = self.trigger_of_layer[layer]
        if self.sg.ops[trigger].frame == frame:
            return trigger, layer
        lo = self._min_layer(cand, group)
        for g in itertools.chain(range(layer - 1, lo - 1, -1), range(layer + 1, c_layer)):
            ops = [n for n in self.sg.layers[g] if self.sg.ops[n].frame == frame]
            if ops:
                return self._pick_trigger(ops), g
        return trigger, layer

    def _holds_variable(self, name: str) -> bool:
        """Whether op ``name`` uses a variable's resource or reads only persistent tensors through an alias."""
        op = self.sg.ops[name]
        tensors = [self.sg.tensors[t] for t in op.inputs]
        return any(t.dtype == "resource" for t in tensors) or (
            op.type in ALIAS_OP_TYPES and bool(tensors) and tensors[0].persistent)

    def _clamp(self, g: int, c_layer: int, cand: _Candidate, group: int = 0) -> int:
        return min(max(g, self._min_layer(cand, group)), c_layer - 1)

    @staticmethod
    def _min_layer(cand: _Candidate, group: int) -> int:
        """The earliest trigger layer of the candidate's swap-in group ``group``."""
        return cand.group_min_layers[group] if cand.group_min_layers else cand.min_trigger_layer

    def _backward_keras_order(self) -> list[tuple[int, str]]:
        """(position of the first gradient-chain op, Keras layer) for every Keras layer, in backward order."""
        if self._bwd_start is None:
            first: dict[str, int] = {}
            sg = self.sg
            for name in self.order:
                op = sg.ops[name]
                if not op.is_backward or op.keras_layer is None or op.keras_layer in first:
                    continue
                if any(sg.ops[sg.tensors[i].producer].is_backward for i in op.inputs):
                    first[op.keras_layer] = self.pos[name]
            self._bwd_start = sorted((p, k) for k, p in first.items())
        return self._bwd_start

    @timed("triggers")
    def decisions(self, policy: str, cands: list[_Candidate], mode: TriggerMode = "queue") -> list[SwapDecision]:
        """Swap decisions (with triggers) for the chosen candidates under ``policy``.

        ``mode`` selects dymem's triggers: ``"queue"`` hides every copy given the serial H2D channel (latest
        layers, reserved backwards from the deadlines), ``"isolated"`` hides each copy as if the channel were idle
        (later triggers, less memory, queueing stalls possible), ``"jit"`` triggers one layer before the consumers
        (least memory, copies not hidden). The other policies have fixed trigger rules.
        """
        cands = self._consistent(cands)
        triggers: dict[tuple[int, int], tuple[str, int]] = {}
        if policy == "dymem" and mode == "queue":
            copying = [ci for ci, c in enumerate(cands) if c.copies]
            alap, _ = self._alap([cands[ci] for ci in copying])
            triggers = {(copying[k], gi): v for (k, gi), v in alap.items()}
        for ci, cand in enumerate(cands):
            for gi, group in enumerate(cand.groups):
                if (ci, gi) in triggers:
                    continue
                c0 = self.pos[group[0]]
                c_layer = self.layer[c0]
                if cand.kind == "recompute":  # on the compute stream: started one layer ahead
                    triggers[(ci, gi)] = self._layer_trigger(self._clamp(c_layer - 1, c_layer, cand))
                    continue
                if policy == "vdnn":
                    triggers[(ci, gi)] = self._vdnn_trigger(group[0], c_layer, cand)
                    continue
                if policy == "tflms":
                    g = c_layer - (1 if self.swapin_ahead is None else max(int(self.swapin_ahead), 1))
                elif mode == "isolated":
                    g = self._latest_hiding_layer(c0, cand.bytes)
                else:
                    g = c_layer - 1
                triggers[(ci, gi)] = self._trigger(cand, gi, self._clamp(g, c_layer, cand, gi), c_layer)
        out = []
        for ci, cand in enumerate(cands):
            sis = []
            for gi, group in enumerate(cand.groups):
                op, lay = triggers[(ci, gi)]
                sis.append(SwapIn(op, lay, list(group), self.layer[self.pos[group[0]]]))
            bwd = [c for g in cand.groups for c in g]
            via = self.via_alias(cand.tensor) if cand.kind == "tensor" else {}
            out.append(SwapDecision(cand.tensor, cand.producer, cand.bytes, cand.prod_layer, list(cand.orig), bwd, sis,
                                    cand.kind, cand.route, cand.recompute,
                                    alias_reads=[[c, via[c]] for c in bwd if c in via], optional_wrap=cand.wrap))
        return out

    def _latest_hiding_layer(self, consumer_pos: int, nbytes: int, slot_end: float = math.inf) -> int:
        """Latest layer that ends early enough for a copy of ``nbytes`` to finish by the consumer (or slot end)."""
        latest_start = min(self.start[consumer_pos], slot_end) - self.h2d(nbytes)
        g = bisect.bisect_right(self.layer_end, latest_start) - 1
        if self.swapin_ahead is not None:
            g = min(g, self.layer[consumer_pos] - max(int(self.swapin_ahead), 1))
        return g

    def _vdnn_trigger(self, consumer: str, c_layer: int, cand: _Candidate) -> tuple[str, int]:
        order = self._backward_keras_order()
        starts = [p for p, _ in order]
        k = self.sg.ops[consumer].keras_layer
        ref = next((p for p, kk in order if kk == k), self.pos[consumer]) if k is not None else self.pos[consumer]
        i = bisect.bisect_left(starts, ref) - 1
        if i >= 0:
            op = self.order[starts[i]]
            g = self.layer[starts[i]]
            if cand.min_trigger_layer <= g < c_layer:
                return op, g
        return self._layer_trigger(self._clamp(c_layer - 1, c_layer, cand))

    def _alap(self, cands: list[_Candidate], skip_unhideable: bool = False
              ) -> tuple[dict[tuple[int, int], tuple[str, int]], set[int]]:
        """Latest trigger layers that still hide each copy, reserving the serial H2D channel backwards in time.

        Swap-ins are visited from the latest deadline (first consumer start in the stall-free schedule) to the
        earliest; each gets the latest slot that ends by its deadline and before the next reserved slot, and the
        latest dependency layer ending before that slot's start becomes its trigger. Returns the triggers and the
        candidates with a swap-in that cannot be hidden (its slot starts before the tensor could be back on the
        host or before its earliest allowed trigger); with ``skip_unhideable`` those reserve no channel time.
        """
        out_end = self.swap_out_ends(cands)
        jobs = []
        for ci, cand in enumerate(cands):
            for gi, group in enumerate(cand.groups):
                c0 = self.pos[group[0]]
                jobs.append((self.start[c0], c0, ci, gi))
        jobs.sort(reverse=True)
        out = {}
        late: set[int] = set()
        next_start = math.inf
        for deadline, c0, ci, gi in jobs:
            cand = cands[ci]
            c_layer = self.layer[c0]
            latest_start = min(deadline, next_start) - self.h2d(cand.bytes)
            earliest = max(out_end[ci], self.layer_end[self._min_layer(cand, gi)])
            if latest_start < earliest:
                late.add(ci)
                if skip_unhideable:
                    continue
            g = self._latest_hiding_layer(c0, cand.bytes, next_start)
            next_start = latest_start
            out[(ci, gi)] = self._trigger(cand, gi, self._clamp(g, c_layer, cand, gi), c_layer)
        return out, late

    def swap_out_ends(self, cands: list[_Candidate]) -> list[float]:
        """Stall-free estimates of when each candidate's swap-out ends on the serial D2H channel (FIFO)."""
        out = [0.0] * len(cands)
        free = 0.0
        for ci in sorted(range(len(cands)), key=lambda i: cands[i].prod_pos):
            cand = cands[ci]
            if cand.copies and not cand.from_host:  # state and weights are in host memory already
                free = out[ci] = max(self.end[cand.prod_pos], free) + self.d2h(cand.bytes)
        return out

    def hideable(self, cands: list[_Candidate]) -> list[_Candidate]:
        """The candidates whose swap-ins can all be hidden together on the H2D channel (dymem; found once per set)."""
        key = tuple(c.tensor for c in cands)
        if key not in self._hideable:
            _, late = self._alap(cands, skip_unhideable=True)
            self._hideable[key] = [c for i, c in enumerate(cands) if i not in late]
        return list(self._hideable[key])

    def absent_windows(self, policy: str, mode: TriggerMode, cand: _Candidate, res: SimResult
                       ) -> list[tuple[float, float]]:
        """Times the tensor would be off the device if it alone were added to the plan simulated in ``res``.

        It leaves when its swap-out and its original consumers are done and returns when a swap-in starts, i.e.
        when the trigger ends (alone, the channel is idle: an optimistic estimate the next simulation corrects).
        """
        end = res.op_end_s
        assert end is not None
        out = self.d2h(cand.bytes) if cand.copies and not cand.from_host else 0.0
        decision = self._decision_alone(policy, mode, cand)
        home = end[self.pos[cand.groups[-1][-1]]] + self.d2h(cand.bytes) if cand.from_host else None
        return self._off_device(cand, end, self._released(cand, end, end[cand.prod_pos] + out),
                                [end[self.pos[si.trigger_op]] for si in decision.swap_ins], home)

    def _released(self, cand: _Candidate, end, out_end: float) -> float:
        """When the tensor's original buffer can go: its swap-out done at ``out_end`` and every op that reads the
        original (``end``: each op's end time, by position) done."""
        return max([out_end] + [end[self.pos[c]] for c in cand.orig + cand.keepers])

    def _off_device(self, cand: _Candidate, end, release: float, returns: list, home: float | None = None
                    ) -> list[tuple]:
        """The intervals the tensor is off the device: from ``release`` to its first swap-in group's return, then
        from each group's last consumer to the next group's return (``returns``: one time per group, in order),
        and for state and weights (``from_host``) from ``home``, when the last group's buffer is freed (its copy
        back done), to the step's end."""
        wins = []
        for group, back in zip(cand.groups, returns):
            wins.append((release, back))
            release = end[self.pos[group[-1]]]
        if home is not None:
            wins.append((max(home, release), math.inf))
        return wins

    def _decision_alone(self, policy: str, mode: TriggerMode, cand: _Candidate) -> SwapDecision:
        """``cand``'s decision as the only swap of a plan (cached for the planner's policy and mode)."""
        hit = self._alone.get(id(cand))
        if hit is None or hit[0] is not cand or self._alone_key != (policy, mode):
            if self._alone_key != (policy, mode):
                self._alone, self._alone_key = {}, (policy, mode)
            (decision,) = self.decisions(policy, [cand], mode)
            hit = self._alone[id(cand)] = (cand, decision)
        return hit[1]

    # --------------------------------------------------------------------------------------------- selection
    @timed("simulate")
    def run(self, swaps: list[SwapDecision], persistent: int, timeline: bool = False) -> SimResult:
        return self.sim.run(swaps, persistent, timeline=timeline, validate=False)

    def fit_budget(self, policy: str, mode: TriggerMode, pool: list[_Candidate], chosen: list[_Candidate], budget: int,
                   persistent: int, max_rounds: int = 200, trail: list | None = None
                   ) -> tuple[list[_Candidate], SimResult]:
        """Greedily add candidates of ``pool`` to ``chosen`` until the simulated peak fits ``budget``.

        Each round simulates the current set, finds the peak, and adds the largest candidates that would be off the
        device at that instant until their bytes cover :data:`GREEDY_STEP` of the step's memory at the peak (batched:
        a few simulations, not one per tensor). The rounds do not read the budget: every budget walks the same chain
        of growing swap sets and stops at the first round that fits, then keeps the shortest part of that round's
        batch that fits (a bisection: its fit/no-fit answers only grow with the budget). A smaller budget so never
        stops earlier on the chain, and swaps a superset of what a larger one does (issue 48: monotone budgets);
        sizing the batch by the excess over the budget made each budget walk its own chain. A batch that raises the
        peak (elsewhere: its swap-ins, or copies queued behind it) is halved until it does not; where even its largest
        candidate alone does, the stage has done what it can. A swap of a recomputation's leaf cancels it
        (:meth:`_consistent`): a batch takes no such swap smaller than the recomputation. ``trail``, if given,
        gets ``(swap set before, batch, mode, simulation of both)`` for each round of the chain walked (the first
        with an empty batch), in order: :meth:`fast_prefix` reads it.
        """
        chosen = list(chosen)
        taken = {c.tensor for c in chosen}
        remaining = sorted((c for c in pool if c.tensor not in taken), key=lambda c: (-c.bytes, c.cost_s, c.prod_pos))
        res = self.run(self.decisions(policy, chosen, mode), persistent)
        if trail is not None:
            trail.append((list(chosen), [], mode, res))
        for _ in range(max_rounds):
            if res.peak_bytes <= budget or not remaining:
                break
            step = max(int((res.peak_bytes - persistent) * GREEDY_STEP), 1)
            t_peak = res.peak_time_s
            picked, acc = [], 0
            for cand in remaining:
                if not any(a <= t_peak < b for a, b in self.absent_windows(policy, mode, cand, res)):
                    continue
                if any(r.bytes > cand.bytes for r in self._rivals(cand, chosen + picked)):
                    continue  # it would cancel a larger recomputation chosen (a swap of its leaf)
                picked.append(cand)
                acc += cand.bytes
                if acc >= step:
                    break
            if not picked:
                break
            r = self.run(self.decisions(policy, chosen + picked, mode), persistent)
            while r.peak_bytes > res.peak_bytes and len(picked) > 1:  # raises the peak elsewhere: a smaller batch
                picked = picked[:len(picked) // 2]
                r = self.run(self.decisions(policy, chosen + picked, mode), persistent)
            if r.peak_bytes > res.peak_bytes:  # even the largest alone raises it: the stage has done what it can
                break
            res = r
            if trail is not None:
                trail.append((list(chosen), list(picked), mode, res))
            if res.peak_bytes <= budget:  # the shortest prefix of the batch that fits (the whole batch does)
                lo, hi = 0, len(picked)  # chosen + picked[:lo] does not fit, chosen + picked[:hi] does
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    r = self.run(self.decisions(policy, chosen + picked[:mid], mode), persistent)
                    if r.peak_bytes <= budget:
                        hi, res = mid, r
                    else:
                        lo = mid
                picked = picked[:hi]
            chosen.extend(picked)
            ids = {c.tensor for c in picked}
            remaining = [c for c in remaining if c.tensor not in ids]
        return chosen, res

    def fast_prefix(self, policy: str, trail: list, limit: float, persistent: int) -> list[_Candidate]:
        """The longest start of the greedy chain walked in ``trail`` (:meth:`fit_budget`) whose states all run a step
        in at most ``limit`` seconds: the rounds up to the first slower one, then the longest part of that round's
        batch found fast by a bisection (the whole chain if no round is slower)."""
        last: list[_Candidate] = []
        for before, picked, mode, res in trail:
            if res.step_time_s <= limit:
                last = before + picked
                continue
            lo, hi = 0, len(picked)  # before + picked[:lo] is fast (it is the last state), + picked[:hi] is not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.run(self.decisions(policy, before + picked[:mid], mode), persistent).step_time_s <= limit:
                    lo = mid
                else:
                    hi = mid
            return before + picked[:lo] if picked else last
        return last

    def prune(self, policy: str, mode: TriggerMode, pool: list[_Candidate], budget: int, persistent: int,
              res: SimResult, protected: frozenset[str] = frozenset()) -> tuple[list[_Candidate], SimResult]:
        """Drop candidates from ``pool`` (whose plan ``res`` fits ``budget``) as long as the plan still fits and does
        not get slower: latest-produced first (they are the least likely to leave the device before the forward pass
        ends, and their swap-ins come first in the backward pass), in chunks that halve when a removal is rejected
        and double again after one is accepted. A heuristic: the result need not be the smallest such set. The
        ``protected`` tensors are never dropped."""
        kept = list(pool)
        order = sorted((c for c in pool if c.tensor not in protected), key=lambda c: (-c.prod_pos, c.tensor))
        i, chunk = 0, max(1, len(order) // 8)
        while i < len(order):
            if chunk == 1 and self._needed(order[i], res, budget):
                i += 1  # its removal would be rejected: spare the simulation
                continue
            drop = {c.tensor for c in order[i:i + chunk]}
            trial = [c for c in kept if c.tensor not in drop]
            r = self.run(self.decisions(policy, trial, mode), persistent) if trial else None
            if r is not None and r.peak_bytes <= budget and r.step_time_s <= res.step_time_s * (1 + 1e-9):
                kept, res = trial, r
                i += chunk
                chunk *= 2
            elif chunk > 1:
                chunk //= 2
            else:
                i += 1
        return kept, res

    def _needed(self, cand: _Candidate, res: SimResult, budget: int) -> bool:
        """Whether the plan simulated in ``res`` needs ``cand``'s swap to fit ``budget``: while the plan has the
        tensor off the device, its bytes on top of the plan's would exceed the budget. Ignores how dropping the
        copies moves the others (an estimate; a wrong one only keeps a swap the prune could have dropped). Weights
        and optimizer state are off the device from the step's start until their first swap-in, and again once their
        last use is done and copied back."""
        if cand.kind == "recompute" or res.memory_curve is None or res.op_end_s is None:
            return False
        events = {e.swap_in: e for e in res.swap_events if e.tensor == cand.tensor}
        if not events or 0 not in events:
            return False
        times, in_use = res.memory_curve
        end = res.op_end_s
        release = 0.0 if cand.from_host else self._released(cand, end, events[0].out_end)
        returns = [events[k].in_start if k in events else None for k in range(len(cand.groups))]
        home = events[0].out_end if cand.from_host else None  # the copy back after the last use
        for gone, back in self._off_device(cand, end, release, returns, home):
            first = max(int(np.searchsorted(times, gone, "right")) - 1, 0)
            last = int(np.searchsorted(times, gone if back is None else back, "left"))
            if last > first and int(in_use[first:last].max()) + cand.bytes > budget:
                return True
        return False

    def downsize(self, policy: str, mode: TriggerMode, pool: list[_Candidate], chosen: list[_Candidate], budget: int,
                 persistent: int, res: SimResult) -> tuple[list[_Candidate], SimResult]:
        """Replace swaps of ``chosen`` (whose plan ``res`` fits ``budget``) by fewer bytes while the plan still fits
        and is no slower: the largest swap first, dropped outright where the plan fits without it, else replaced by
        the smallest candidate of ``pool`` that is off the device at the peak its removal leaves and covers what
        that peak exceeds the budget by. The greedy search adds the largest tensors at the peak, so its last one
        may hold far more than the budget needs: MobileNetV2 32px under 67 MiB swapped a 3.4 MiB map where the
        plan without it was 0.1 MiB over (issue 48: plans between whole tensors). Recomputations are left as they
        are (their leaves tie them to the other swaps). No swap is taken up after :data:`DOWNSIZE_TRIALS`
        simulations; each takes at most 1 + :data:`DOWNSIZE_TRIES`."""
        chosen = list(chosen)
        trials = 0
        for cand in sorted((c for c in chosen if c.kind != "recompute"), key=lambda c: (-c.bytes, -c.prod_pos)):
            if trials >= DOWNSIZE_TRIALS:
                break
            base = [c for c in chosen if c is not cand]
            r = self.run(self.decisions(policy, base, mode), persistent)
            trials += 1
            if r.peak_bytes <= budget and r.step_time_s <= res.step_time_s * (1 + 1e-9):
                chosen, res = base, r
                continue
            for other in self._smaller(policy, mode, pool, chosen, cand, r, budget):
                trial = sorted(base + [other], key=lambda c: c.prod_pos)
                r2 = self.run(self.decisions(policy, trial, mode), persistent)
                trials += 1
                if r2.peak_bytes <= budget and r2.step_time_s <= res.step_time_s * (1 + 1e-9):
                    chosen, res = trial, r2
                    break
        return chosen, res

    def _smaller(self, policy: str, mode: TriggerMode, pool: list[_Candidate], chosen: list[_Candidate],
                 cand: _Candidate, res: SimResult, budget: int) -> list[_Candidate]:
        """The candidates of ``pool`` that could take ``cand``'s place in ``chosen`` (simulated without it in
        ``res``) for fewer bytes, the :data:`DOWNSIZE_TRIES` smallest: not chosen, no recomputation nor a leaf of
        one chosen, at least the bytes ``res``'s peak exceeds ``budget`` by, and off the device at that peak."""
        excess = res.peak_bytes - budget
        taken = {c.tensor for c in chosen}
        fits = sorted((c for c in pool if c.tensor not in taken and c.kind != "recompute"
                       and excess <= c.bytes < cand.bytes), key=lambda c: (c.bytes, c.cost_s, c.prod_pos))
        t_peak = res.peak_time_s
        return list(itertools.islice((c for c in fits if not self._rivals(c, chosen) and any(
            a <= t_peak < b for a, b in self.absent_windows(policy, mode, c, res))), DOWNSIZE_TRIES))

    def fill(self, swaps: list[SwapDecision], budget: int, persistent: int, res: SimResult
             ) -> tuple[list[SwapDecision], SimResult]:
        """Keep on the device the rows of swapped feature maps that the room ``res``'s plan leaves under
        ``budget`` holds, while the plan still fits and is no slower (partial swaps, :class:`SwapDecision`): each
        try takes the swap with the most whole rows of room over its time off the device, and keeps half as many
        where the simulation does not fit. A plan of whole tensors moves in steps of the smallest tensor at its
        peak: the gated CNN's feature maps are all 16 MiB, and under 104 MiB its plan measured 92 (issue 48)."""
        swaps, caps = list(swaps), {}
        for _ in range(FILL_TRIALS):
            away = _off_device_spans(res)
            (rows, row_bytes), k = max(((self._rows_of_room(s, budget, res, away, caps), k)
                                        for k, s in enumerate(swaps)), default=((0, 0), 0))
            if rows <= 0:
                break
            s = swaps[k]
            trial = list(swaps)
            trial[k] = dataclasses.replace(s, keep_rows=s.keep_rows + rows, kept_bytes=s.kept_bytes + rows * row_bytes)
            r = self.run(trial, persistent)
            if r.peak_bytes <= budget and r.step_time_s <= res.step_time_s * (1 + 1e-9):
                swaps, res = trial, r
            else:  # its copies moved the others: half as many rows, next time round
                caps[s.tensor] = rows // 2
        return swaps, res

    def _rows_of_room(self, s: SwapDecision, budget: int, res: SimResult, away: Mapping[str, tuple[float, float]],
                      caps: Mapping[str, int]) -> tuple[int, int]:
        """``(rows, bytes of one)`` of feature map ``s`` (swapped in ``res``'s plan) that fit the room ``budget``
        leaves over the times its rows would be kept (``away``, :func:`_off_device_spans`), and at most its cap in
        ``caps``; (0, 0) where it cannot be swapped in part (not a feature map with known rows, or
        one whose host copy a conditional's optional holds). A tensor sharing its buffer (a branch's value and the
        ``Merge`` passing it on) keeps rows of its own: the kept rows are a copy, not the shared buffer."""
        t = self.sg.tensors.get(s.tensor)
        if (s.kind != "tensor" or s.optional_wrap or t is None or not t.shape_known or not t.shape
                or t.dtype in ("variant", "resource", "string") or res.memory_curve is None):
            return 0, 0
        rows = int(t.shape[0] or 0)
        if rows < 2 or s.tensor not in away:
            return 0, 0
        row_bytes = s.bytes // rows
        times, in_use = res.memory_curve
        start, end = away[s.tensor]
        first = max(int(np.searchsorted(times, start, "right")) - 1, 0)
        last = int(np.searchsorted(times, end, "right"))
        room = budget - int(in_use[first:max(last, first + 1)].max())
        fits = min(room // max(row_bytes, 1), rows - 1 - s.keep_rows, caps.get(s.tensor, rows))
        return (int(fits), row_bytes) if fits > 0 else (0, 0)

    def exchange(self, policy: str, mode: TriggerMode, kept: list[_Candidate], pool: list[_Candidate], budget: int,
                 persistent: int, res: SimResult, rounds: int = 2, tries: int = 48,
                 protected: frozenset[str] = frozenset()) -> tuple[list[_Candidate], SimResult]:
        """Replace the swap whose swap-in stalls most by another candidate of ``pool`` while that makes the plan
        faster and it still fits. Pruning can keep a late tensor that had to leave while the D2H channel was full;
        once the channel has room another tensor may take its place at less cost. Tries the latest-produced
        candidates first (a peak at the end of the forward pass is where they matter), at most ``tries`` per round.
        The ``protected`` tensors are never replaced."""
        for _ in range(rounds):
            events = [e for e in res.swap_events if e.tensor not in protected]
            if not events or res.stall_s <= 0:
                break
            worst = max(events, key=lambda e: e.stall)
            base = [c for c in kept if c.tensor != worst.tensor]
            taken = {c.tensor for c in kept}
            others = sorted((c for c in pool if c.tensor not in taken), key=lambda c: (-c.prod_pos, c.tensor))
            better = None
            for cand in others[:tries]:
                trial = sorted(base + [cand], key=lambda c: c.prod_pos)
                r = self.run(self.decisions(policy, trial, mode), persistent)
                if r.peak_bytes <= budget and r.step_time_s < res.step_time_s * (1 - 1e-9):
                    better = (trial, r)
                    break
            if better is None:
                break
            kept, res = better
        return kept, res


@no_autograph
def make_plan(step_graph: StepGraph, policy: str = "dymem", budget_bytes: int | None = None,
              persistent_bytes: int = 0, profile: str | DeviceProfile | CostModel = "cpu",
              batch_size: int | None = None, min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES,
              swapin_ahead: int | None = None, group_gap_layers: int = 3,
              headroom: float = 0.0, least_memory: bool = False,
              temporaries: Mapping[str, int] | None = None, weights: Sequence = (),
              recomputable: Sequence = (), memo: PlannerMemo | None = None, min_peak_saving: int = 0) -> Plan:
    """Plan swaps for one training step.

    ``budget_bytes`` caps the predicted device peak (persistent bytes included); None swaps every candidate.
    ``persistent_bytes`` are the weights and optimizer slots (constant during the step). ``profile`` is a profile
    name, a :class:`DeviceProfile` or a (calibrated) :class:`CostModel`. ``min_swap_bytes`` skips small tensors;
    ``swapin_ahead`` is TFLMS' level distance (default 1) and, for dymem, a cap on how late a trigger may sit;
    ``group_gap_layers``: consumers further apart than this (and far enough in time) get separate swap-ins.
    ``headroom``: the swap set is chosen so the predicted peak stays under ``(1 - headroom) * budget_bytes``,
    leaving room for the allocator's fragmentation and the simulator's error (the callback uses the headroom it
    calibrates on the first step under a budget, else :data:`DEFAULT_HEADROOM`; 0 plans to the byte; below 0,
    down to -1, plans beyond the budget where a calibration measured the simulator over-predicting).
    ``least_memory`` (without a budget): every candidate, hideable or not, with dymem's latest triggers ("jit"):
    the plan the callback's first step under a budget measures (:mod:`dymem_tf.planning.first_step`).
    ``temporaries``: bytes each op holds while it runs besides its outputs, as measured
    (:mod:`dymem_tf.planning.memory_model`); the simulator adds them. ``weights``: the offloadable weights
    (:func:`dymem_tf.planning.offload.find_offloadable_weights`, marked as variables in ``step_graph``), which the
    dymem policy may keep in host memory between their uses like any other candidate. ``recomputable``: the
    tensors the backward pass can compute again (:func:`dymem_tf.planning.recompute.find_recomputable`), which the
    dymem policy may recompute instead of keeping or swapping them once hidden round trips fall short. ``memo``:
    reuse the planner of an earlier plan of the same inputs but budget and headroom (:class:`PlannerMemo`).
    ``min_peak_saving`` (without a budget, not ``least_memory``): swap nothing unless every candidate together lowers
    the predicted peak by at least this many bytes (the callback: one of GTBM's pageblocks, see
    :data:`MIN_PEAK_SAVING`).

    Raises ValueError for an unknown policy or a budget below the persistent bytes, and
    :class:`BudgetTooSmallError` when no swap set of the policy fits the budget.
    """
    policy = policy.lower()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known policies: {', '.join(POLICIES)}")
    if not step_graph.layers and step_graph.ops:
        analyse(step_graph)
    persistent_bytes = int(persistent_bytes)
    if budget_bytes is not None:
        budget_bytes = int(budget_bytes)
        if budget_bytes < persistent_bytes:
            raise ValueError(f"budget {mib(budget_bytes)} ({budget_bytes} bytes) is smaller than the model's "
                             f"persistent tensors {mib(persistent_bytes)} ({persistent_bytes} bytes: weights and "
                             "optimizer slots); no swapping of feature maps can help")
    if not -1.0 <= headroom < 1.0:  # below 0: a calibration measured the simulator over-predicting
        raise ValueError(f"headroom must be in [-1, 1), got {headroom!r}")
    cost = as_cost_model(profile)
    def build() -> _Planner:
        return _Planner(step_graph, cost, min_swap_bytes, swapin_ahead, group_gap_layers, temporaries, weights,
                        recomputable)

    with stage("simulate"):
        pl = build() if memo is None else memo.planner(_planner_key(
            step_graph, profile, min_swap_bytes, swapin_ahead, group_gap_layers, temporaries, weights,
            recomputable), build)
    notes: list[str] = []
    target = None
    if budget_bytes is not None:
        target = max(int(budget_bytes * (1.0 - headroom)), persistent_bytes)
        if headroom > 0:
            notes.append(f"planned for {mib(target)}: {headroom:.0%} of the budget kept for allocator "
                         "fragmentation and model error")
        elif headroom < 0:
            notes.append(f"planned for {mib(target)} as the simulator counts: {-headroom:.0%} over the budget, "
                         "which the simulator was measured to over-predict")
    unknown = step_graph.meta.get("unknown_shape_tensors", 0)
    if unknown:
        notes.append(f"{unknown} tensors have unknown static shapes and count as 0 bytes")
    base = pl.run([], persistent_bytes)
    chosen: list[_Candidate] = []
    mode: TriggerMode = "queue"
    if policy != "none":
        try:
            with stage("search"):
                chosen, mode = _choose(pl, policy, target, persistent_bytes, base, batch_size, notes, least_memory)
        except BudgetTooSmallError as err:
            if not headroom:
                raise
            raise _too_small(err.min_peak_bytes, budget_bytes, persistent_bytes, batch_size,
                             err.eligible, policy, headroom) from None
    elif budget_bytes is not None and base.peak_bytes > budget_bytes:
        notes.append(f"predicted peak {mib(base.peak_bytes)} exceeds the budget {mib(budget_bytes)} "
                     "(policy none does not swap)")
    swaps = pl.decisions(policy, chosen, mode) if chosen else []
    res = base
    if swaps:
        res = pl.run(swaps, persistent_bytes)
        if target is not None and policy == "dymem":
            swaps, res = _filled(pl, swaps, target, persistent_bytes, res, notes)
        if budget_bytes is None and not least_memory and base.peak_bytes - res.peak_bytes < min_peak_saving:
            notes.append(f"nothing swapped: the {len(swaps)} candidates together lower the predicted peak by "
                         f"{mib(base.peak_bytes - res.peak_bytes)}, less than {mib(min_peak_saving)}")
            swaps, res = [], base
    if swaps:
        for s, stall in zip((si for s in swaps for si in s.swap_ins), (e.stall for e in res.swap_events)):
            s.predicted_stall_s = float(stall)
    predicted = dataclasses.replace(res.as_predicted(), no_swap_peak_bytes=int(base.peak_bytes),
                                    no_swap_step_time_s=float(base.step_time_s))
    return Plan(
        policy=policy, device=cost.profile.name, budget_bytes=budget_bytes, persistent_bytes=persistent_bytes,
        batch_size=batch_size, num_layers=step_graph.num_layers, swaps=swaps,
        mobility=_mobility(step_graph, swaps), predicted=predicted, notes=notes,
        params=PlanParams(min_swap_bytes=int(min_swap_bytes), swapin_ahead=swapin_ahead,
                          group_gap_layers=group_gap_layers, headroom=headroom, compute_scale=cost.compute_scale,
                          trigger_mode=mode, profile=cost.profile))


def _choose(pl: _Planner, policy: str, budget: int | None, persistent: int, base: SimResult,
            batch_size: int | None, notes: list[str], least_memory: bool = False
            ) -> tuple[list[_Candidate], TriggerMode]:
    """The swap set and dymem trigger mode: every candidate without a budget, else a greedy fit in stages that
    trade speed for memory (hidden copies first; then any eligible tensor; for dymem then later triggers) and, unless
    that plan is as fast as no swapping, a pruned whole pool of the first stage that fits -- the faster plan wins."""
    every = cands = pl.candidates(policy)
    notes.append(f"{len(cands)} candidates for policy {policy}")
    if least_memory and budget is None:
        notes.append("least-memory plan: every candidate, swap-ins triggered one layer ahead")
        return cands, "jit" if policy == "dymem" else "queue"
    if policy == "dymem":
        hidden = pl.hideable(cands)
        if len(hidden) < len(cands):
            notes.append(f"{len(cands) - len(hidden)} round-trip candidates dropped: the H2D channel cannot hide "
                         "their swap-ins next to the others")
        cands = hidden
    if budget is None:
        return cands, "queue"
    if base.peak_bytes <= budget:
        notes.append("the step fits the budget without swapping")
        return [], "queue"
    relaxed = pl.candidates(policy, relaxed=True)
    stages = [(cands, "queue"), (relaxed, "queue")]
    if policy == "dymem":
        # last, the least-memory plan (the probe's): swapping more than it can cost more than it saves (each
        # swap-in is a second buffer), so whatever fits with it must not be refused
        stages += [(relaxed, "isolated"), (relaxed, "jit"), (every, "jit")]
    chosen: list[_Candidate] = []
    best: _Choice | None = None
    trail: list = []  # the greedy chain's rounds, budget-independent
    for pool, mode in stages:
        chosen, res = pl.fit_budget(policy, mode, pool, chosen, budget, persistent, trail=trail)
        if res.peak_bytes <= budget:
            best = _Choice(res, chosen, mode, "greedy")
            break
    no_swap_time = base.step_time_s * (1 + 1e-9)  # a plan this fast stalls nowhere
    fast = base.step_time_s * (1 + SEARCH_STALL_TOLERANCE)
    if best is not None and best.step_time_s <= fast:
        if best.step_time_s > no_swap_time:
            notes.append(f"the greedy swap set stalls {best.step_time_s / base.step_time_s - 1:.2%} of the step "
                         "(modelled); not searched further")
        return _downsized(pl, policy, best, relaxed, budget, persistent, notes), best.mode  # nothing worth searching
    # Adding tensors greedily can fall short or overshoot when the D2H channel is the bottleneck (a tensor added at
    # the peak only queues behind the others). Also start from the first whole pool that fits and drop what the
    # budget does not need; keep whichever plan is faster by more than the tolerance (the greedy one on a tie: a
    # gain below it is the cost model's noise, not a reason to leave the chain).
    # Monotone budgets (issue 48): a larger budget gets the first state of the greedy chain that fits it wherever
    # no pruned plan beats that state, i.e. wherever the state is as fast as no swapping (first pass) or as fast as
    # the pruned plans (second pass). So the pruned plan keeps every swap of the chain's start made of such states
    # (:meth:`_Planner.fast_prefix`, budget-independent), pruning it afresh when it swaps fewer bytes than they do.
    margin = SEARCH_STALL_TOLERANCE * base.step_time_s
    res = lowest = None
    for pool, mode in stages:
        res = pl.run(pl.decisions(policy, pool, mode), persistent)
        lowest = res if lowest is None or res.peak_bytes < lowest.peak_bytes else lowest
        if res.peak_bytes <= budget:
            names, kept, pruned, protected = {c.tensor for c in pool}, None, None, frozenset()
            for limit in (fast, None):
                if limit is None:  # the chain's states as fast as the pruned plan
                    limit = max(fast, pruned.step_time_s + margin)
                state = pl.fast_prefix(policy, trail, limit, persistent)
                keep = frozenset(names & {c.tensor for c in state})
                if kept is not None and (keep <= protected or pl.moved_bytes(kept) >= pl.moved_bytes(state)):
                    break  # nothing more to keep, or it swaps no less than they do: the first plan stands
                protected = keep
                kept, pruned = pl.prune(policy, mode, pool, budget, persistent, res, keep)
                kept, pruned = pl.exchange(policy, mode, kept, pool, budget, persistent, pruned, protected=keep)
                if best is not None and pruned.step_time_s >= best.step_time_s - margin:
                    break  # the greedy plan is as fast
            if best is None or pruned.step_time_s < best.step_time_s - margin:
                best = _Choice(pruned, kept, mode, f"pruned from {len(pool)} candidates, then exchanged")
            break
    if best is None:  # the least peak any stage reached
        raise _too_small(lowest.peak_bytes, budget, persistent, batch_size, len(relaxed), policy)
    if best.step_time_s > no_swap_time:
        notes.append(f"the budget needs swaps whose copies cannot all be hidden (stalls expected; swap set "
                     f"{best.how})")
    return _downsized(pl, policy, best, relaxed, budget, persistent, notes), best.mode


def _downsized(pl: _Planner, policy: str, best: _Choice, pool: list[_Candidate], budget: int, persistent: int,
               notes: list[str]) -> list[_Candidate]:
    """``best``'s swap set with its swaps replaced by fewer bytes where the plan still fits, for dymem
    (:meth:`_Planner.downsize`; a note says what it saved); the baselines keep their own rules."""
    if policy != "dymem" or not best.swaps:
        return best.swaps
    kept = pl.downsize(policy, best.mode, pool, best.swaps, budget, persistent, best.res)[0]
    before, after = pl.moved_bytes(best.swaps), pl.moved_bytes(kept)
    if after < before:
        notes.append(f"downsized: {len(best.swaps)} -> {len(kept)} swaps, {mib(before)} -> "
                     f"{mib(after)} off the device (smaller tensors at the peak in place of larger ones)")
    return kept


def _off_device_spans(res: SimResult) -> dict[str, tuple[float, float]]:
    """Per swapped tensor of ``res``'s plan, from its swap-out's start to its last swap-in's end: the time a partial
    swap keeps its rows on the device."""
    spans: dict[str, tuple[float, float]] = {}
    for e in res.swap_events:
        start, end = spans.get(e.tensor, (e.out_start, e.in_end))
        spans[e.tensor] = (min(start, e.out_start), max(end, e.in_end))
    return spans


def _filled(pl: _Planner, swaps: list[SwapDecision], budget: int, persistent: int, res: SimResult,
            notes: list[str]) -> tuple[list[SwapDecision], SimResult]:
    """``swaps`` with the room under ``budget`` filled by rows kept on the device (:meth:`_Planner.fill`); a note
    says how much."""
    swaps, res = pl.fill(swaps, budget, persistent, res)
    partial = [s for s in swaps if s.kept_bytes]
    if partial:
        notes.append(f"partial swaps: {len(partial)} tensors keep {mib(sum(s.kept_bytes for s in partial))} of "
                     "their rows on the device (the room the whole tensors left under the budget)")
    return swaps, res


def suggested_batch(batch: int | None, budget_bytes: int, peak_bytes: int, persistent_bytes: int,
                    margin: float = 0.0) -> int | None:
    """The batch whose step memory fits ``(1 - margin)`` of the budget, if ``batch`` peaks at ``peak_bytes``.

    The step's memory above the persistent bytes is taken as proportional to the batch. None when ``batch`` is
    unknown, the peak holds no step memory, or ``batch`` already fits.
    """
    room, step = budget_bytes * (1.0 - margin) - persistent_bytes, peak_bytes - persistent_bytes
    if not batch or step <= 0 or room >= step:
        return None
    return max(int(batch * room / step), 0)


def _too_small(min_peak: int, budget: int, persistent: int, batch: int | None, n: int, policy: str,
               headroom: float = 0.0) -> BudgetTooSmallError:
    act_min, act_budget = min_peak - persistent, int(budget * (1.0 - headroom)) - persistent
    suggested = suggested_batch(batch, budget, min_peak, persistent, headroom)
    if suggested is not None:
        hint = f"or reduce the batch size from {batch} to about {suggested}"
    else:
        hint = f"or reduce the batch size by about {100 * (1 - act_budget / max(act_min, 1)):.0f}%"
    needed = int(math.ceil(min_peak / (1.0 - headroom)))
    kept = f" (the planner keeps {headroom:.0%} of it free)" if headroom else ""
    msg = (f"budget {mib(budget)}{kept} is too small for policy {policy}: even swapping all {n} eligible tensors "
           f"the predicted peak is {mib(min_peak)} ({min_peak} bytes, of which {mib(persistent)} persistent); "
           f"use a budget of at least {units.at_least(needed, budget, mib)} {hint}")
    err = BudgetTooSmallError(msg, min_peak, budget, suggested)
    err.eligible = n
    return err


def _mobility(sg: StepGraph, swaps: list[SwapDecision]) -> dict[str, str]:
    """persistent (variable reads/handles, new variable values: :func:`~dymem_tf.planning.simulator.adopted_values`,
    the step's outputs: :func:`~dymem_tf.planning.simulator.returned_values`), mobile (producers of swapped tensors)
    or transient, per op with outputs."""
    mobile = {s.producer for s in swaps if s.kind == "tensor"}
    new_values = adopted_values(sg).keys() | returned_values(sg)
    out = {}
    for name, op in sg.ops.items():
        if not op.outputs:
            continue
        if name in mobile:
            out[name] = "mobile"
        elif name in new_values or all(sg.tensors[t].persistent for t in op.outputs):
            out[name] = "persistent"
        else:
            out[name] = "transient"
    return out


def validate_plan(step_graph: StepGraph, plan: Plan) -> list[str]:
    """Problems of ``plan`` against ``step_graph`` (empty list when valid)."""
    errs = []
    for s in plan.swaps:
        t = step_graph.tensors.get(s.tensor)
        if t is None:
            errs.append(f"unknown tensor {s.tensor}")
            continue
        if t.persistent:
            errs.append(f"{s.tensor} is persistent")
        served = set(s.forward_consumers)
        for si in s.swap_ins:
            if not si.trigger_op:  # untriggered (its layer was conditional): starts after the swap-out
                served.update(si.consumers)
                continue
            trig = step_graph.ops.get(si.trigger_op)
            if trig is None:
                errs.append(f"{s.tensor}: unknown trigger {si.trigger_op}")
                continue
            if trig.layer != si.trigger_layer:
                errs.append(f"{s.tensor}: trigger {si.trigger_op} is in layer {trig.layer}, not {si.trigger_layer}")
            if trig.layer <= s.producer_layer:
                errs.append(f"{s.tensor}: trigger layer {trig.layer} does not follow producer layer {s.producer_layer}")
            for c in si.consumers:
                if step_graph.ops[c].layer <= trig.layer:
                    errs.append(f"{s.tensor}: trigger {si.trigger_op} does not precede consumer {c}")
                if c in served:
                    errs.append(f"{s.tensor}: consumer {c} is served twice")
                served.add(c)
        if s.kind == "recompute":  # its copy serves the consumers it reroutes (checked by the simulator)
            continue
        if s.kind == "weight":  # its stays serve the users of its reads and its other users (the update)
            missing = set(t.consumers) - set(s.route.reads if s.route else []) - served
            if missing:
                errs.append(f"{s.tensor}: users {sorted(missing)} not served by a stay on the device")
        else:  # the original or a swap-in serves each consumer; readers through an alias get a copy of it
            readers = step_graph.alias_readers(s.tensor) or {}
            if s.optional_wrap:  # its optional serves the gradient's branch, which reads the swap-in
                wrap, readers = step_graph.optional_readers(s.tensor) or ("", {})
                if wrap != s.optional_wrap:
                    errs.append(f"{s.tensor}: {s.optional_wrap} is not the optional that holds it")
                served.add(s.optional_wrap)
            via = {c: a for c, a in s.alias_reads}
            wrong = set(t.consumers) - served
            wrong |= {c for c in served - set(t.consumers) if c not in readers}
            wrong |= {c for si in s.swap_ins for c in si.consumers
                      if c not in t.consumers and via.get(c) != readers.get(c)}
            if wrong:
                errs.append(f"{s.tensor}: consumers {sorted(wrong)} not served exactly once")
    return errs
