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
  and settles after about six steps (:func:`steady_persistent_reserved`, :data:`STEADY_STEPS`).

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
    own = rows[(rows[:, 3] == TRANSIENT) | (rows[:, 3] == MOBILE)]
    resident = int(rows[rows[:, 3] == PERSISTENT, 2].sum())
    if len(own):
        result = replay_buffers(own, "gtbm", block_size=group.block_size, alignment=64, groups="trace")
        in_use, reserved = int(result.peak_in_use), int(result.footprint)
    else:
        in_use = reserved = 0
    persistent = group.reserved_with(resident)
    moving = rows[rows[:, 3] == ADOPTED]
    if len(moving):
        steady = steady_persistent_reserved(moving, group.in_use_bytes + resident, group.block_size,
                                            int(rows[:, 1].max()) + 1)
        persistent = max(persistent, steady)
    return Placement(in_use, reserved, resident, persistent)


def moving_variables_instance(moving: np.ndarray, in_use_bytes: int, period: int, steps: int = STEADY_STEPS
                              ) -> np.ndarray:
    """The persistent group over ``steps`` steps as a replay instance (rows ``(lower, upper, bytes, 0)``):
    ``in_use_bytes`` held all along, of which the moving variables' buffers (``moving``: each the next buffer of
    one variable, allocated at its row's start and adopted at its end, in events of a step ``period`` long) are
    allocated first and then moved every step: the buffer made in step k is freed at the adoption in step k+1."""
    moving = moving[np.argsort(moving[:, 0], kind="stable")]
    n = len(moving)
    static = max(int(in_use_bytes) - int(moving[:, 2].sum()), 0)
    base = [n + 1 + k * period for k in range(steps + 1)]  # event index of each step's start
    end = base[-1] + period
    out = [(0, end, static, PERSISTENT)] if static else []
    out += [(1 + i, base[0] + int(m[1]), int(m[2]), PERSISTENT) for i, m in enumerate(moving)]
    for k in range(steps):
        out += [(base[k] + int(m[0]), min(base[k + 1] + int(m[1]), end), int(m[2]), PERSISTENT) for m in moving]
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def steady_persistent_reserved(moving: np.ndarray, in_use_bytes: int, block_size: int, period: int,
                               steps: int = STEADY_STEPS) -> int:
    """Peak bytes GTBM's persistent group reserves over ``steps`` steps of moving variables
    (:func:`moving_variables_instance`), replayed through the live allocator's placer."""
    instance = moving_variables_instance(moving, in_use_bytes, period, steps)
    return int(replay_buffers(instance, "gtbm", block_size=block_size, alignment=64, groups="trace").footprint)
