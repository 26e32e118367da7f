"""Roofline-style time model of ops and host<->device copies.

* op time   = scale * (max(flops / flops_per_s, bytes_accessed / mem_bandwidth) + op_overhead)
* copy time = bytes / link bandwidth (per direction) + link latency + copy-completion latency (GPU event
  polling; see :mod:`dymem_tf.planning.device_profiles`)

Free ops (constants, graph inputs, no-ops) take no time; metadata ops (``Shape`` ...) cost only the overhead.
``scale`` is 1.0 (the profile's rates as they are) everywhere in dymem_tf: the callback and the dry run hand
:func:`dymem_tf.planning.planner.make_plan` a profile, which :func:`as_cost_model` wraps unscaled; no step is measured.
:func:`calibrate` returns a model whose ``scale`` makes the modelled step match a measured one; only a caller of
``make_plan`` that passes such a model gets a scale other than 1 (the tests do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dymem_tf.planning.analysis import FREE_OP_TYPES, METADATA_OP_TYPES, OpInfo, StepGraph
from dymem_tf.planning.device_profiles import DeviceProfile, get_profile

Direction = Literal["h2d", "d2h"]


@dataclass(frozen=True)
class CostModel:
    """Times of ops and copies on one :class:`DeviceProfile`; ``compute_scale`` multiplies every op time."""

    profile: DeviceProfile
    compute_scale: float = 1.0

    def op_time(self, op: OpInfo) -> float:
        """Modelled seconds of one op on the compute stream."""
        if op.type in FREE_OP_TYPES:
            return 0.0
        p = self.profile
        if op.type in METADATA_OP_TYPES:
            return self.compute_scale * p.op_overhead_s
        work = max(op.flops / p.flops_per_s, op.bytes_accessed / p.mem_bandwidth_bytes_per_s)
        return self.compute_scale * (work + p.op_overhead_s)

    def op_times(self, step_graph: StepGraph) -> dict[str, float]:
        """Modelled seconds of every op."""
        return {name: self.op_time(op) for name, op in step_graph.ops.items()}

    def copy_time(self, nbytes: int, direction: Direction = "h2d") -> float:
        """Modelled seconds from a swap op's start until its copy is done as TensorFlow sees it (``"h2d"`` swap-in,
        ``"d2h"`` swap-out): the transfer over the host link plus the issue and completion latencies."""
        p = self.profile
        bw = p.h2d_bytes_per_s if direction == "h2d" else p.d2h_bytes_per_s
        return nbytes / bw + p.link_latency_s + p.copy_completion_s

    def round_trip_time(self, nbytes: int) -> float:
        """Swap-out plus swap-in time of ``nbytes``."""
        return self.copy_time(nbytes, "d2h") + self.copy_time(nbytes, "h2d")

    def step_time(self, step_graph: StepGraph) -> float:
        """Modelled compute time of the whole step on one stream (no copies, no stalls)."""
        return sum(self.op_times(step_graph).values())

    def calibrated(self, step_graph: StepGraph, measured_step_s: float) -> "CostModel":
        """A copy whose modelled step time equals ``measured_step_s``."""
        if measured_step_s <= 0:
            raise ValueError(f"measured step time must be positive, got {measured_step_s}")
        base = CostModel(self.profile).step_time(step_graph)
        if base <= 0:
            raise ValueError("the step graph has no modelled compute (no ops with cost), cannot calibrate")
        return CostModel(self.profile, measured_step_s / base)


def as_cost_model(profile: "str | DeviceProfile | CostModel") -> CostModel:
    """Accept a profile name, a :class:`DeviceProfile` or a ready :class:`CostModel`."""
    if isinstance(profile, CostModel):
        return profile
    return CostModel(get_profile(profile))


def calibrate(step_graph: StepGraph, measured_step_s: float,
              profile: "str | DeviceProfile | CostModel" = "cpu") -> CostModel:
    """Cost model on ``profile`` with compute scaled so that the modelled step takes ``measured_step_s``."""
    return as_cost_model(profile).calibrated(step_graph, measured_step_s)
