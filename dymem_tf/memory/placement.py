"""The placement of a planned step: its simulated buffers replayed through GTBM's placer.

GTBM holds memory in pageblocks (2 MiB) owned by mobility groups, so a step reserves more than it has in use: the
partly used blocks of each group, and the blocks of the persistent group that variables gone to host memory left
with holes (DenseNet-121 32px with its optimizer state offloaded: 22 MiB reserved for 1.4 MiB in use before the
first step). The simulator models bytes in use; this stage predicts the bytes reserved:

* the step's own buffers (transient and mobile groups) are replayed in the simulated order through the GTBM placer
  of the C++ core (:func:`dymem_tf.memory.replay.replay_buffers`: the placement code the live allocator runs);
* the persistent group is taken as the step finds it (:class:`PersistentGroup`, measured before the probe step),
  and the variables the plan keeps on the device fill its holes before it grows.

Plain data and the TF-free replay library only (no TensorFlow): the planning package's calibration
(:func:`dymem_tf.planning.first_step.placed_prediction`) takes its results as data.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from dymem_tf.memory.replay import replay_buffers

#: GTBM's pageblock (the live allocator's default)
DEFAULT_BLOCK_SIZE = 2 << 20
PERSISTENT, TRANSIENT, MOBILE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PersistentGroup:
    """GTBM's persistent group as a step finds it: the bytes its pageblocks hold and the bytes in use in them."""

    reserved_bytes: int
    in_use_bytes: int
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> "PersistentGroup | None":
        """The group in GTBM's ``memory_stats()`` (None when the statistics have no groups: TF's own allocator)."""
        group = ((stats or {}).get("groups") or {}).get("persistent")
        if not group:
            return None
        return cls(int(group["reserved"]), int(group["in_use"]), int(stats.get("block_size") or DEFAULT_BLOCK_SIZE))

    def reserved_with(self, resident_bytes: int) -> int:
        """Bytes the group holds once ``resident_bytes`` more are in it: its holes are filled first, then it grows
        by whole blocks."""
        needed = self.in_use_bytes + max(int(resident_bytes), 0)
        blocks = -(-needed // self.block_size)
        return max(self.reserved_bytes, blocks * self.block_size)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Predicted placement of one step: ``step_in_use_bytes`` / ``step_reserved_bytes`` are the peaks of the step's
    own buffers (transient and mobile groups) and of the blocks they hold; ``resident_bytes`` the variables the plan
    keeps on the device (persistent group); ``persistent_reserved_bytes`` the persistent group's blocks with them."""

    step_in_use_bytes: int
    step_reserved_bytes: int
    resident_bytes: int
    persistent_reserved_bytes: int

    @property
    def reserved_bytes(self) -> int:
        """The predicted device peak of reserved bytes (the persistent group does not shrink during a step)."""
        return self.persistent_reserved_bytes + self.step_reserved_bytes


def place(allocations: np.ndarray, group: PersistentGroup) -> Placement:
    """The placement of a simulated step (``SimResult.allocations``: rows ``(lower, upper, bytes, group)``) that
    finds the persistent group as ``group``."""
    rows = np.asarray(allocations, dtype=np.int64).reshape(-1, 4)
    own = rows[rows[:, 3] != PERSISTENT]
    resident = int(rows[rows[:, 3] == PERSISTENT, 2].sum())
    if len(own):
        result = replay_buffers(own, "gtbm", block_size=group.block_size, alignment=64, groups="trace")
        in_use, reserved = int(result.peak_in_use), int(result.footprint)
    else:
        in_use = reserved = 0
    return Placement(in_use, reserved, resident, group.reserved_with(resident))
