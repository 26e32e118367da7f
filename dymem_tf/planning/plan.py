"""A swap plan as plain data: which tensors to swap, where each swap-in is triggered, and op mobility.

No TensorFlow here: a plan can be printed, saved, loaded, diffed and tested without running a step. The first
step's records it holds (:class:`~dymem_tf.planning.first_step.Calibration`, ``Measurement``) are defined with the
functions that make them in :mod:`dymem_tf.planning.first_step`, which imports nothing from here.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tabulate import tabulate

from dymem_tf.planning.device_profiles import DeviceProfile
from dymem_tf.planning.first_step import Calibration, Measurement
from dymem_tf.units import mib

MOBILITY_GROUPS = ("persistent", "transient", "mobile")


@dataclass
class SwapIn:
    """One swap-in of a swapped tensor: it starts when ``trigger_op`` has run and feeds ``consumers``."""

    trigger_op: str
    trigger_layer: int
    consumers: list[str]
    start_layer_of_consumers: int
    predicted_stall_s: float = 0.0  # simulated wait of the first consumer for this copy


@dataclass
class WeightRoute:
    """How the rewrite reroutes an offloaded weight's users (see :mod:`dymem_tf.planning.offload`).

    ``reads``: the forward pass's reads of the weight, which wait for its first swap-in; ``clones``: ``(alias op,
    its source)`` pairs, in order, of the forward ops (a ``Reshape`` of the read ...) that the backward users read
    the weight through: each is copied for them, reading the copy of its source; ``reroutes``: ``(consumer,
    source)`` pairs, a backward user's inputs that read ``source`` (a read or an alias op) read its backward copy
    instead; ``writes``: the ops that write the variable in place, after every backward user."""

    reads: list[str]
    clones: list[list[str]] = field(default_factory=list)
    reroutes: list[list[str]] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)


@dataclass
class RecomputeRoute:
    """How the rewrite recomputes a tensor (see :mod:`dymem_tf.planning.recompute`).

    ``ops``: ``[op, [[k, source op], ...]]`` in execution order: each op is copied, its input ``k`` reading the
    copy of ``source op`` (an earlier op of the chain), its other inputs as they are; the last op produces the
    tensor. ``aliases``: alias ops of the tensor copied to read its copy; ``reroutes``: ``(consumer, source)``
    pairs, the consumer's inputs that read ``source`` (the tensor's producer or one of ``aliases``) read the copy of
    ``source``; ``leaves``: the tensors the chain reads."""

    ops: list[list] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    reroutes: list[list[str]] = field(default_factory=list)
    leaves: list[str] = field(default_factory=list)


@dataclass
class SwapDecision:
    """A tensor swapped out after its producer runs and swapped back in for its backward consumers.

    ``forward_consumers`` keep reading the original device tensor (forward ops, metadata ops such as ``Shape``
    and early backward ops that run before the tensor is released); ``backward_consumers`` are rerouted to the
    outputs of ``swap_ins``.

    ``kind="variable"``: ``tensor`` is a resource variable (optimizer state) offloaded between its uses
    (:mod:`dymem_tf.planning.offload`): it lives in host memory between steps, its one swap-in brings it back
    before ``backward_consumers`` (every op using it) and it goes back to host memory after them.

    ``kind="weight"``: ``tensor`` is a weight's resource variable, in host memory between steps and between its
    two stays on the device: ``swap_ins[0]`` brings it back for the forward users of its reads (and goes back
    without a copy after them), ``swap_ins[1]`` for its backward users and its update (it is copied back after
    them); ``route`` says how the rewrite reroutes those users.

    ``kind="recompute"``: ``tensor`` is not kept for ``backward_consumers`` but computed again for them, by
    copies of the ops in ``recompute`` (its one swap-in's trigger starts them); nothing is copied to host memory.

    A *partial* swap (kind ``"tensor"``, ``keep_rows`` above 0) keeps the tensor's first ``keep_rows`` rows
    (``kept_bytes``, along its first dimension) on the device between its swap-out and its swap-ins and moves only
    the others (``DymemSwapOutPartial`` / ``DymemSwapInPartial``): the planner fills what a budget has room for
    with part of a tensor it must otherwise move whole.
    """

    tensor: str
    producer: str
    bytes: int
    producer_layer: int
    forward_consumers: list[str]
    backward_consumers: list[str]
    swap_ins: list[SwapIn]
    #: "tensor" (a feature map), "variable" (optimizer state offloaded between its uses), "weight" or "recompute"
    kind: str = "tensor"
    route: WeightRoute | None = None  # kind "weight" only
    recompute: RecomputeRoute | None = None  # kind "recompute" only
    #: kind "tensor": ``(consumer, alias op)`` pairs, the swap-in consumers that read the tensor through a forward
    #: alias op (a ``Reshape`` ...): the rewrite copies the alias op onto their swap-in and reroutes them to it
    alias_reads: list[list[str]] = field(default_factory=list)
    #: kind "tensor", a lowered ``cond``'s intermediate kept for its gradient in an optional: the
    #: ``OptionalFromValue`` op that holds the swap-out's host copy instead; ``alias_reads`` then name the
    #: ``OptionalGetValue`` each swap-in consumer read the value from, and the rewrite feeds them the swap-in itself
    optional_wrap: str = ""
    keep_rows: int = 0  # a partial swap: the first rows that stay on the device (0: the whole tensor moves)
    kept_bytes: int = 0  # their bytes

    @property
    def moved_bytes(self) -> int:
        """The bytes each copy moves: the tensor's, less the rows a partial swap keeps."""
        return self.bytes - self.kept_bytes


@dataclass
class StreamedList:
    """A TensorList a forward loop accumulates for its gradient loop, kept in host memory element by element
    (:mod:`dymem_tf.planning.loop_lists`): each pushed element is swapped out and the push reads the host copy;
    each popped element is swapped in for its readers."""

    tensor: str  # the list as the forward loop hands it out (an Exit's output)
    bytes: int
    pushes: list[list[str]] = field(default_factory=list)  # [element tensor, push op] per write
    pops: list[list[str]] = field(default_factory=list)  # [pop op, reader op, ...] per read


@dataclass
class Prediction:
    """What the simulator predicts of the plan's step, and of the same step without swaps."""

    peak_bytes: int | None = None  # the device peak, persistent bytes included
    peak_by_group: dict[str, int] = field(default_factory=dict)  # its bytes per mobility group
    step_time_s: float | None = None
    stall_s: float = 0.0  # time the compute waits for swap-ins
    compute_time_s: float = 0.0
    peak_op: str = ""  # the op running at the peak
    no_swap_peak_bytes: int | None = None
    no_swap_step_time_s: float | None = None
    #: the first step's calibration the plan was made with (a plan after the probe under a budget)
    calibration: Calibration | None = None
    #: the calibrated device peak its placement predicts (:func:`dymem_tf.planning.first_step.placed_prediction`)
    calibrated_peak_bytes: int | None = None


@dataclass
class PlanParams:
    """The settings the plan was made with."""

    min_swap_bytes: int = 0
    swapin_ahead: int | None = None
    group_gap_layers: int = 3
    headroom: float = 0.0  # share of the budget kept free
    compute_scale: float = 1.0  # the cost model's calibration of compute times
    trigger_mode: str = "queue"  # dymem's trigger placement (dymem_tf.planning.planner.TriggerMode)
    profile: DeviceProfile | None = None  # the cost profile planned with
    #: the first step's stage under a budget: "probe", "calibrated" or "refined" (None: not a first-step plan)
    stage: str | None = None
    offloadable_variable_bytes: int | None = None  # optimizer state the plan could offload
    offloadable_weight_bytes: int | None = None  # weights the plan could keep in host memory


@dataclass
class Plan:
    """The planner's output; ``predicted`` holds the simulator's numbers for this plan and for no swapping,
    ``params`` the settings it was made with, and ``measured`` (None until the plan's first step has run) what
    the allocator measured in that step."""

    policy: str
    device: str
    budget_bytes: int | None
    persistent_bytes: int
    batch_size: int | None
    num_layers: int
    swaps: list[SwapDecision] = field(default_factory=list)
    mobility: dict[str, str] = field(default_factory=dict)
    predicted: Prediction = field(default_factory=Prediction)
    notes: list[str] = field(default_factory=list)
    params: PlanParams = field(default_factory=PlanParams)
    measured: Measurement | None = None
    #: the loops' lists kept in host memory element by element (the swap ops run inside the loops)
    streamed_lists: list[StreamedList] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def swapped_bytes(self) -> int:
        """Total bytes of the swapped tensors, less the rows partial swaps keep on the device."""
        return sum(s.moved_bytes for s in self.swaps)

    @property
    def offloaded_variables(self) -> list[SwapDecision]:
        """The decisions that offload a variable (optimizer state) rather than swap a feature map."""
        return [s for s in self.swaps if s.kind == "variable"]

    @property
    def offloaded_weights(self) -> list[SwapDecision]:
        """The decisions that keep a weight in host memory between its uses."""
        return [s for s in self.swaps if s.kind == "weight"]

    @property
    def feature_maps(self) -> list[SwapDecision]:
        """The decisions that swap a feature map."""
        return [s for s in self.swaps if s.kind == "tensor"]

    @property
    def recomputed(self) -> list[SwapDecision]:
        """The decisions that recompute a feature map instead of keeping it."""
        return [s for s in self.swaps if s.kind == "recompute"]

    @property
    def num_swap_ins(self) -> int:
        return sum(len(s.swap_ins) for s in self.swaps)

    @property
    def measured_error(self) -> float | None:
        """(measured - predicted) / measured of the device peak of the plan's first step; None before it ran, when
        it ran out of memory, or without a prediction."""
        if self.measured is None or self.measured.outcome != "ran" or not self.measured.peak_bytes:
            return None
        m, p = self.measured.peak_bytes, self.predicted.peak_bytes
        return None if p is None else (m - p) / m

    def measured_summary(self) -> str | None:
        """``predicted X, measured Y (error Z%)`` for the plan's first step, or None before it ran."""
        m = self.measured
        if m is None:
            return None
        p = self.predicted.peak_bytes
        predicted = "predicted " + (mib(p) if p is not None else "–")
        calibrated = m.calibrated_predicted_peak_bytes
        if calibrated is not None:
            predicted += f" (calibrated {mib(calibrated)})"
        if m.outcome != "ran":
            return (f"{predicted}, ran out of memory in its first step (pool reserved "
                    f"{mib(m.peak_bytes_reserved)}, in use {mib(m.peak_bytes_in_use)})")
        bound = "" if m.exact else "at most "
        error = self.measured_error
        errors = [f"error {error:+.1%}"] if error is not None and bound == "" else []
        if calibrated is not None and bound == "" and m.peak_bytes:
            errors.append(f"calibrated {(m.peak_bytes - calibrated) / m.peak_bytes:+.1%}")
        text = f"{predicted}, measured {bound}{mib(m.peak_bytes)}"
        if errors:
            text += f" ({'; '.join(errors)})"
        return text + f"; in use {bound}{mib(m.peak_bytes_in_use)}"

    def swap_for(self, tensor: str) -> SwapDecision | None:
        """The decision for ``tensor`` or None."""
        for s in self.swaps:
            if s.tensor == tensor:
                return s
        return None

    # ---------------------------------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The plan of :meth:`to_dict`'s output, or of a file saved by another version: keys it does not know are
        left out at every level (the plan's, each swap's, its swap-ins' and routes', the results'), missing ones
        take their defaults."""
        d = _known(cls, d)
        predicted = _known(Prediction, d.pop("predicted", None) or {})
        if predicted.get("calibration"):
            predicted["calibration"] = Calibration(**_known(Calibration, predicted["calibration"]))
        params = _known(PlanParams, d.pop("params", None) or {})
        if params.get("profile"):
            params["profile"] = DeviceProfile(**_known(DeviceProfile, params["profile"]))
        measured = d.pop("measured", None)
        streamed = [StreamedList(**_known(StreamedList, x)) for x in d.pop("streamed_lists", None) or []]
        return cls(swaps=[_swap(s) for s in d.pop("swaps", None) or []], predicted=Prediction(**predicted),
                   streamed_lists=streamed,
                   params=PlanParams(**params),
                   measured=Measurement(**_known(Measurement, measured)) if measured else None, **d)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path, encoding="utf-8") as fh:
            return cls.from_json(fh.read())

    # ------------------------------------------------------------------------------------------- reporting
    def summary(self, top: int = 8) -> str:
        """A short human-readable table of the plan and its predicted effect."""
        p = self.predicted
        lines = [f"dymem_tf plan: policy={self.policy} device={self.device} batch={self.batch_size} "
                 f"dependency_layers={self.num_layers}"]
        offloaded, weights, maps = self.offloaded_variables, self.offloaded_weights, self.feature_maps
        partial = [s for s in maps if s.kept_bytes]
        kept = f", {len(partial)} in part ({mib(sum(s.kept_bytes for s in partial))} kept)" if partial else ""
        lines.append(f"  swapped tensors : {len(maps)} ({mib(sum(s.moved_bytes for s in maps))}), "
                     f"{sum(len(s.swap_ins) for s in maps)} swap-ins{kept}")
        if offloaded:
            lines.append(f"  offloaded state : {len(offloaded)} optimizer variables "
                         f"({mib(sum(s.bytes for s in offloaded))}) in host memory between their uses")
        if weights:
            lines.append(f"  offloaded weights: {len(weights)} weights ({mib(sum(s.bytes for s in weights))}) in "
                         "host memory but for their forward and their backward use")
        recomputed = self.recomputed
        if recomputed:
            lines.append(f"  recomputed      : {len(recomputed)} feature maps ({mib(sum(s.bytes for s in recomputed))})"
                         " computed again for the backward pass instead of kept")
        if p.peak_bytes is not None:
            budget = "none" if self.budget_bytes is None else mib(self.budget_bytes)
            fits = "" if self.budget_bytes is None else (
                "  [fits]" if p.peak_bytes <= self.budget_bytes else "  [OVER BUDGET]")
            lines.append(f"  predicted peak  : {mib(p.peak_bytes)}  budget {budget}{fits}  "
                         f"(no swap {mib(p.no_swap_peak_bytes or 0)}, persistent "
                         f"{mib(self.persistent_bytes)})")
            measured = self.measured_summary()
            if measured is not None:  # once the plan's first step has run
                lines.append(f"  first step      : {measured}")
            if p.peak_by_group:
                lines.append("  peak by group   : " + ", ".join(f"{k} {mib(v)}" for k, v in p.peak_by_group.items()))
        if p.step_time_s is not None:
            lines.append(f"  predicted step  : {_ms(p.step_time_s)} (compute {_ms(p.compute_time_s)}, "
                         f"stall {_ms(p.stall_s)}; no swap {_ms(p.no_swap_step_time_s or 0)})")
        if self.swaps:
            lines.append(f"  top swaps ({min(top, len(self.swaps))} of {len(self.swaps)} by size):")
            rows = [(f"{s.bytes / 2**20:.2f}", s.producer_layer, si.trigger_layer, si.start_layer_of_consumers,
                     f"{si.predicted_stall_s * 1e3:.3f}", s.tensor if k == 0 else '  "')
                    for s in sorted(self.swaps, key=lambda s: (-s.bytes, s.tensor))[:top]
                    for k, si in enumerate(s.swap_ins)]
            table = tabulate(rows, headers=("MiB", "prod", "trig", "cons", "stall ms", "tensor"), tablefmt="plain",
                             colalign=("right",) * 5 + ("left",), disable_numparse=True)
            lines += ["    " + row for row in table.splitlines()]
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def diff(self, other: "Plan") -> list[str]:
        """Human-readable differences from ``other`` (empty when the plans agree)."""
        out: list[str] = []
        for f in ("policy", "device", "budget_bytes", "persistent_bytes", "batch_size", "num_layers"):
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f}: {a!r} != {b!r}")
        mine = {s.tensor: s for s in self.swaps}
        theirs = {s.tensor: s for s in other.swaps}
        for t in sorted(mine.keys() - theirs.keys()):
            out.append(f"+ swap {t} ({mib(mine[t].bytes)})")
        for t in sorted(theirs.keys() - mine.keys()):
            out.append(f"- swap {t} ({mib(theirs[t].bytes)})")
        for t in sorted(mine.keys() & theirs.keys()):
            a = [(si.trigger_op, sorted(si.consumers)) for si in mine[t].swap_ins]
            b = [(si.trigger_op, sorted(si.consumers)) for si in theirs[t].swap_ins]
            if a != b:
                out.append(f"~ swap-ins of {t}: {[x[0] for x in a]} != {[x[0] for x in b]}")
        changed = [k for k in sorted(set(self.mobility) | set(other.mobility))
                   if self.mobility.get(k) != other.mobility.get(k)]
        if changed:
            out.append(f"mobility differs for {len(changed)} ops (e.g. {changed[0]}: "
                       f"{self.mobility.get(changed[0])} != {other.mobility.get(changed[0])})")
        for k in ("peak_bytes", "step_time_s", "stall_s"):
            a, b = getattr(self.predicted, k), getattr(other.predicted, k)
            if a != b:
                out.append(f"predicted {k}: {a} != {b}")
        return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _known(cls, d: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``d`` that are fields of the dataclass ``cls`` (a new dict: ``d`` is not changed)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def _swap(d: dict[str, Any]) -> SwapDecision:
    """The :class:`SwapDecision` of its :meth:`Plan.to_dict` entry, keys it does not know left out at every level."""
    d = _known(SwapDecision, d)
    d["swap_ins"] = [SwapIn(**_known(SwapIn, si)) for si in d.get("swap_ins") or []]
    d["route"] = WeightRoute(**_known(WeightRoute, d["route"])) if d.get("route") else None
    d["recompute"] = RecomputeRoute(**_known(RecomputeRoute, d["recompute"])) if d.get("recompute") else None
    return SwapDecision(**d)
