"""The placement of a planned step: its simulated buffers replayed through GTBM's placer.

GTBM holds memory in pageblocks (2 MiB) owned by mobility groups, so a step reserves more than it has in use: the
partly used blocks of each group, and the blocks of the persistent group that variables gone to host memory left
with holes (DenseNet-121 32px with its optimizer state offloaded: 22 MiB reserved for 1.4 MiB in use before the
first step). The simulator models bytes in use; this stage predicts the bytes reserved:

* the step's own buffers (transient and mobile groups) are replayed in the simulated order through the GTBM placer
  of the C++ core (:func:`dymem_tf.memory.replay.replay_buffers`: the placement code the live allocator runs);
* the persistent group is taken as the step finds it (:class:`PersistentGroup`, measured before the probe step),
  and the variables the plan keeps on the device fill its holes before it grows;
* a variable whose update writes a new buffer (``AssignVariableOp`` adopts its input's: Keras's SGD momentum,
  batch-norm statistics) moves within the persistent group every step: its next buffer is allocated while the
  previous one lives, which is freed at the update. The holes this leaves drift over the steps: InceptionV3 75px +
  SGD, 65 MiB of momentum moving per step, the group's peak grew from 144 MiB in the first planned step to 160 MiB
  by the 12th, at 140.9 MiB in use; the same placer replaying that step's order over and over grows the same way
  and settles after about six steps. Such a plan is replayed whole for :data:`STEADY_STEPS` steps
  (:func:`steady_instance`): the moving buffers' peak and the step's own do not coincide (VGG16 32px + SGD: 72 MiB
  of momentum in flight during the update, while the feature maps are gone).

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
#: groups of ``SimResult.allocations`` (GTBM's, and ADOPTED: :data:`dymem_tf.planning.simulator.ADOPTED`)
PERSISTENT, TRANSIENT, MOBILE, ADOPTED = 0, 1, 2, 3
#: Steps of moving variables replayed to predict the persistent group's steady state: the replay of InceptionV3's
#: step settled after six (see the module docstring)
STEADY_STEPS = 8


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

    def without(self, resident_bytes: int) -> "PersistentGroup":
        """The group less ``resident_bytes`` of variables it already holds that a plan counts as kept: the group is
        measured before the probe step, with the variables the probe keeps on the device in it (EfficientNet-B0
        32px + Adam: 2.8 MiB in use, all of it variables the probe keeps; counted twice, they made a calibrated
        plan's persistent group 2.4 MiB larger than measured)."""
        return dataclasses.replace(self, in_use_bytes=max(self.in_use_bytes - max(int(resident_bytes), 0), 0))

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


def place(allocations: np.ndarray, group: PersistentGroup, steps: int = STEADY_STEPS) -> Placement:
    """The placement of a simulated step (``SimResult.allocations``: rows ``(lower, upper, bytes, group)``) that
    finds the persistent group as ``group``. With moving variables (:data:`ADOPTED` rows) the whole step is replayed
    ``steps`` times over them (:func:`steady_instance`), and the persistent group's share is the steady peak less
    the step's own blocks."""
    rows = _rows(allocations)
    own = rows[(rows[:, 3] == TRANSIENT) | (rows[:, 3] == MOBILE)]
    resident = resident_bytes(rows)
    in_use, reserved = _replayed(own, group.block_size)
    persistent = group.reserved_with(resident)
    moving = rows[rows[:, 3] == ADOPTED]
    if len(moving):
        instance = steady_instance(own, moving, group.in_use_bytes + resident, int(rows[:, 1].max()) + 1, steps)
        persistent = max(persistent, _replayed(instance, group.block_size)[1] - reserved)
    return Placement(in_use, reserved, resident, persistent)


def resident_bytes(allocations: np.ndarray) -> int:
    """Bytes of the variables a simulated step keeps on the device (its persistent rows)."""
    rows = _rows(allocations)
    return int(rows[rows[:, 3] == PERSISTENT, 2].sum())


def _rows(allocations: np.ndarray) -> np.ndarray:
    """``allocations`` as an ``(n, 4)`` int64 array."""
    return np.asarray(allocations, dtype=np.int64).reshape(-1, 4)


def _replayed(rows: np.ndarray, block_size: int) -> tuple[int, int]:
    """``(peak in use, peak reserved)`` of ``rows`` replayed through GTBM's placer in their own groups."""
    if not len(rows):
        return 0, 0
    result = replay_buffers(rows, "gtbm", block_size=block_size, alignment=64, groups="trace")
    return int(result.peak_in_use), int(result.footprint)


def steady_instance(own: np.ndarray, moving: np.ndarray, in_use_bytes: int, period: int,
                    steps: int = STEADY_STEPS) -> np.ndarray:
    """``steps`` steps of a plan as one replay instance (rows ``(lower, upper, bytes, group)``): the persistent
    group's ``in_use_bytes`` held all along, of which the moving variables' buffers (``moving``: each the next
    buffer of one variable, allocated at its row's start and adopted at its end) are allocated first and then move
    every step -- the buffer made in step k is freed at the adoption in step k+1 -- and the step's ``own`` buffers
    again in every step (events of a step ``period`` long)."""
    moving = moving[np.argsort(moving[:, 0], kind="stable")]
    n = len(moving)
    static = max(int(in_use_bytes) - int(moving[:, 2].sum()), 0)
    base = [n + 1 + k * period for k in range(steps + 1)]  # event index of each step's start
    end = base[-1] + period
    out = [np.array([(0, end, static, PERSISTENT)] if static else [], dtype=np.int64).reshape(-1, 4),
           np.stack([1 + np.arange(n), base[0] + moving[:, 1], moving[:, 2], np.zeros(n, np.int64)], axis=1)]
    for k in range(steps):
        out.append(np.stack([base[k] + moving[:, 0], np.minimum(base[k + 1] + moving[:, 1], end), moving[:, 2],
                             np.zeros(n, np.int64)], axis=1))
        out.append(own + np.array([base[k], base[k], 0, 0], dtype=np.int64))
    return np.concatenate(out).astype(np.int64)
