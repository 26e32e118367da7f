"""The placement of a planned step (dymem_tf/memory/placement.py) and the calibration that uses it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dymem_tf.memory import devices, placement
from dymem_tf.memory.replay import replay_buffers
from dymem_tf.planning import first_step
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.simulator import simulate
from test_simulator import TOY, chain, swap_f1

MiB = 1 << 20


def test_the_persistent_group_fills_its_holes_before_it_grows():
    group = placement.PersistentGroup(reserved_bytes=22 * MiB, in_use_bytes=int(1.5 * MiB), block_size=2 * MiB)
    assert group.reserved_with(0) == 22 * MiB
    assert group.reserved_with(20 * MiB) == 22 * MiB  # 21.5 MiB in use: the holes hold it
    assert group.reserved_with(int(53.5 * MiB)) == 56 * MiB  # 55 MiB in use: whole blocks
    # measured before the probe, the group holds the variables the probe keeps: a plan counts them itself
    assert group.without(MiB).in_use_bytes == MiB // 2 and group.without(5 * MiB).in_use_bytes == 0
    assert group.without(MiB).reserved_bytes == group.reserved_bytes
    stats = {"block_size": 2 * MiB, "groups": {"persistent": {"reserved": 6 * MiB, "in_use": 3 * MiB}}}
    assert placement.PersistentGroup.from_stats(stats) == placement.PersistentGroup(6 * MiB, 3 * MiB, 2 * MiB)
    assert placement.PersistentGroup.from_stats({"bytes_in_use": 1}) is None  # TF's allocator: no groups
    assert placement.PersistentGroup.from_stats(None) is None


@pytest.mark.parametrize("swapped", [False, True])
def test_the_simulated_buffers_are_the_simulated_bytes_in_use(swapped):
    """SimResult.allocations: replayed without placement loss (a tiny block), their peak in use is the simulated
    peak, and the rows name the groups the live allocator would use (the swap-in and its original: mobile)."""
    res = simulate(chain(), [swap_f1()] if swapped else None, TOY, persistent_bytes=1000)
    rows = res.allocations
    assert rows.shape[1] == 4 and (rows[:, 1] > rows[:, 0]).all()
    assert replay_buffers(rows[:, :3], "first_fit", alignment=1).lower_bound == res.peak_bytes - 1000
    groups = sorted(set(rows[:, 3].tolist()))
    assert groups == ([1, 2] if swapped else [1])


def test_a_kept_variable_is_placed_in_the_persistent_group():
    """A variable's storage the plan keeps (a tensor of the step graph) is a persistent buffer: placed with the
    group's holes, not among the step's own buffers."""
    sg = StepGraph.from_spec({
        "v": {"bytes": 3 * MiB},
        "f": {"inputs": ["v"], "bytes": 1 * MiB, "flops": 1e6},
        "g": {"inputs": ["f", "v"], "bytes": 1 * MiB, "flops": 1e6, "backward": True},
    })
    sg.tensors["v:0"].variable = True  # as dymem_tf.planning.offload.mark models a variable's storage
    res = simulate(sg, None, TOY)
    rows = res.allocations
    assert rows[rows[:, 3] == 0, 2].tolist() == [3 * MiB]
    placed = placement.place(rows, placement.PersistentGroup(4 * MiB, 2 * MiB, 2 * MiB))
    assert placed.resident_bytes == 3 * MiB
    assert placed.persistent_reserved_bytes == 6 * MiB  # 2 + 3 MiB in use: three blocks
    assert placed.step_in_use_bytes == 2 * MiB and placed.step_reserved_bytes == 2 * MiB  # f and g share a block
    assert placed.reserved_bytes == 8 * MiB


def test_a_placed_calibration_predicts_what_its_own_step_measured_and_keeps_the_residual():
    """The probe: 40 MiB simulated and measured in use, 70 MiB reserved, 22 MiB of it the persistent group's holes.
    Placed, the probe's step explains 22 + 44 MiB; of the 4 MiB left, one pageblock is the placer's jitter and the
    other is kept and added to every placed prediction. A plan that keeps 50 MiB of variables fills the holes:
    22 MiB -> 52 MiB, not 22 + 50."""
    group = placement.PersistentGroup(22 * MiB, 1 * MiB, 2 * MiB)
    probe = placement.Placement(40 * MiB, 44 * MiB, 0, group.reserved_with(0))
    cal = first_step.Calibration.from_probe(150 * MiB, 40 * MiB, 70 * MiB, 0, measured_in_use=40 * MiB,
                                            placed=probe, group=group)
    assert cal.persistent_group == dataclasses.asdict(group)
    assert cal.placement_residual_bytes == 2 * MiB
    as_dict = dataclasses.asdict(cal)
    assert first_step.placed_prediction(as_dict, probe) == 68 * MiB
    plan = placement.Placement(55 * MiB, 58 * MiB, 50 * MiB, group.reserved_with(50 * MiB))
    assert first_step.placed_prediction(as_dict, plan) == 52 * MiB + 58 * MiB + 2 * MiB
    # a miss of one block is the placer's jitter (EfficientNet-B0's probe: -1 block, its calibrated plan: +1)
    jitter = first_step.Calibration.from_probe(150 * MiB, 40 * MiB, 68 * MiB, 0, measured_in_use=40 * MiB,
                                               placed=probe, group=group)
    assert jitter.placement_residual_bytes == 0
    # the old rule adds the probe's whole fragmentation (30 MiB) to the plan's bytes in use
    assert first_step.calibrated_prediction(as_dict, 105 * MiB) == 135 * MiB
    # a placement that explains more than was measured is not relied on: no negative residual
    over = first_step.Calibration.from_probe(150 * MiB, 40 * MiB, 60 * MiB, 0, measured_in_use=40 * MiB,
                                             placed=probe, group=group)
    assert over.placement_residual_bytes == 0
    # without the in-use measurement, or without groups, there is no placed calibration
    assert first_step.Calibration.from_probe(150 * MiB, 40 * MiB, 70 * MiB, 0, placed=probe,
                                             group=group).persistent_group is None
    assert first_step.Calibration.from_probe(150 * MiB, 40 * MiB, 70 * MiB, 0, measured_in_use=40 * MiB,
                                             placed=probe).persistent_group is None


def test_the_probe_s_miss_adds_to_the_steps_own_blocks_and_a_refined_step_s_ratio_scales_them():
    group = placement.PersistentGroup(2 * MiB, 1 * MiB, 2 * MiB)
    probe = placement.Placement(40 * MiB, 40 * MiB, 0, 2 * MiB)
    # 4 MiB (10%) more in use than simulated over the persistent bytes (0): the probe's miss, added in bytes
    cal = first_step.Calibration.from_probe(200 * MiB, 40 * MiB, 46 * MiB, 0, measured_in_use=44 * MiB,
                                            placed=probe, group=group)
    assert cal.placement_residual_bytes == 0  # 2 + 40 + 4 = 46
    plan = placement.Placement(100 * MiB, 100 * MiB, 0, 2 * MiB)
    assert first_step.placed_prediction(dataclasses.asdict(cal), plan) == 106 * MiB
    # a calibrated plan's own step, measured 10% over: the next plan's step blocks scale by 1.1
    again = first_step.Calibration.from_probe(200 * MiB, 40 * MiB, 46 * MiB, 0, measured_in_use=44 * MiB,
                                              placed=probe, group=group, source="calibrated")
    assert again.placement_residual_bytes == 0  # 2 + 1.1 * 40 = 46
    assert first_step.placed_prediction(dataclasses.asdict(again), plan) == 112 * MiB


def test_a_measurement_reports_the_placed_prediction_when_the_plan_has_one():
    before = {"peak_bytes_reserved": 0, "peak_bytes_in_use": 0}
    after = {"peak_bytes_reserved": 100 * MiB, "peak_bytes_in_use": 90 * MiB}
    cal = {"predicted_peak_bytes": 10 * MiB, "measured_peak_bytes": 30 * MiB, "persistent_bytes": 0,
           "measured_in_use_bytes": 10 * MiB}
    out = first_step.measurement(before, after, 90 * MiB, cal)
    assert out.calibrated_predicted_peak_bytes == 110 * MiB  # 90 + the probe's 20 MiB of fragmentation
    out = first_step.measurement(before, after, 90 * MiB, cal, calibrated_peak=98 * MiB)
    assert out.calibrated_predicted_peak_bytes == 98 * MiB


def test_placement_is_quick_on_a_large_step():
    """A step of 20,000 buffers is placed in well under a second (the calibrated re-plans place each plan)."""
    rng = np.random.default_rng(0)
    n = 20000
    lower = np.sort(rng.integers(0, 2 * n, n))
    rows = np.stack([lower, lower + 1 + rng.integers(0, 200, n), rng.integers(256, 4 * MiB, n),
                     rng.integers(0, 3, n)], axis=1)
    placed = placement.place(rows, placement.PersistentGroup(0, 0))
    assert placed.step_reserved_bytes >= placed.step_in_use_bytes > 0
    assert placed.resident_bytes == int(rows[rows[:, 3] == 0, 2].sum())


def test_the_sessions_persistent_group_leaves_out_what_other_models_hold():
    """Other models' bytes (held when fit began) are in GTBM's persistent group: a fit's own statistics
    (``FitSession.own``) and the group the calibration places from both leave them out."""
    stats = {"bytes_in_use": 30 * MiB, "peak_bytes_reserved": 50 * MiB, "block_size": 2 * MiB,
             "groups": {"persistent": {"in_use": 12 * MiB, "reserved": 16 * MiB, "peak_reserved": 18 * MiB},
                        "transient": {"in_use": 4 * MiB, "reserved": 6 * MiB}}}
    own = devices.less_others(stats, 10 * MiB)
    assert own["bytes_in_use"] == 20 * MiB and own["peak_bytes_reserved"] == 40 * MiB
    assert own["groups"]["persistent"] == {"in_use": 2 * MiB, "reserved": 6 * MiB, "peak_reserved": 8 * MiB}
    assert own["groups"]["transient"] == stats["groups"]["transient"]
    assert stats["groups"]["persistent"]["in_use"] == 12 * MiB  # the device's statistics are not changed
    assert placement.PersistentGroup.from_stats(own) == placement.PersistentGroup(6 * MiB, 2 * MiB, 2 * MiB)


def momentum_update():
    """A momentum update as Keras's SGD writes it: ``m = m * momentum - g * lr`` assigned with AssignVariableOp,
    whose input buffer (the Mul's, forwarded by the Sub) becomes m's storage; the weight is updated in place."""
    return StepGraph.from_spec({
        "m": {"type": "_Arg", "bytes": 8, "dtype": "resource", "persistent": True},
        "read_m": {"type": "ReadVariableOp", "inputs": ["m"], "bytes": 3 * MiB, "persistent": True},
        "f": {"bytes": 1 * MiB, "flops": 1e6},
        "g": {"inputs": ["f"], "bytes": 3 * MiB, "flops": 1e6, "backward": True},
        "decay": {"type": "Mul", "inputs": ["read_m"], "bytes": 3 * MiB, "phase": "update"},
        "step": {"type": "Mul", "inputs": ["g"], "bytes": 3 * MiB, "phase": "update"},
        "new_m": {"type": "Sub", "inputs": ["decay", "step"], "bytes": 3 * MiB, "phase": "update"},
        "assign": {"type": "AssignVariableOp", "inputs": ["m", "new_m"], "bytes": [], "phase": "update"},
    })


def test_a_variables_next_buffer_is_the_persistent_groups_not_the_steps():
    """The buffer AssignVariableOp adopts is found through the forwarding chain (decay -> new_m) and placed as a
    moving variable: out of the step's own buffers, into the persistent group's steady state."""
    from dymem_tf.planning.simulator import ADOPTED, adopted_values

    sg = momentum_update()
    assert adopted_values(sg) == {"new_m": "m:0", "decay": "m:0"}
    res = simulate(sg, None, TOY)
    rows = res.allocations
    assert rows[rows[:, 3] == ADOPTED, 2].tolist() == [3 * MiB]  # decay's buffer, which new_m writes in place
    group = placement.PersistentGroup(reserved_bytes=4 * MiB, in_use_bytes=3 * MiB, block_size=2 * MiB)
    placed = placement.place(rows, group)
    assert placed.step_in_use_bytes == 4 * MiB  # f and g, then g and step: the moving buffer is not the step's
    # m's 3 MiB and its next 3 MiB live together until the assign (three blocks, four where a block is shared
    # with a partly used one of the step's)
    assert 6 * MiB <= placed.persistent_reserved_bytes <= 8 * MiB
    assert placement.place(rows, group, steps=1).reserved_bytes <= placed.reserved_bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moving_variables_replay_their_steps_over_the_persistent_group(seed):
    """The instance holds the group's bytes in use at every step boundary, each moving variable twice only between
    its next buffer's allocation and its adoption, the step's own buffers once per step, and its placement never
    undercuts the bytes in use."""
    rng = np.random.default_rng(seed)
    n, period, steps = 40, 200, 5
    start = rng.integers(0, period - 20, n)
    moving = np.stack([start, start + rng.integers(1, 20, n), rng.integers(1, 4 * MiB, n), np.full(n, 3)], axis=1)
    own_start = rng.integers(0, period - 50, 30)
    own = np.stack([own_start, own_start + rng.integers(1, 50, 30), rng.integers(1, 8 * MiB, 30),
                    rng.integers(1, 3, 30)], axis=1)
    in_use = int(moving[:, 2].sum()) + 30 * MiB
    instance = placement.steady_instance(own, moving, in_use, period, steps)
    assert (instance[:, 1] > instance[:, 0]).all()
    assert sorted(set(instance[:, 3].tolist())) == [0, 1, 2] and (instance[:, 3] != 0).sum() == steps * len(own)
    persistent = instance[instance[:, 3] == 0]
    boundary = n + 3 * period  # the last event of the third step: every variable in exactly one buffer
    assert persistent[(persistent[:, 0] <= boundary) & (persistent[:, 1] > boundary), 2].sum() == in_use
    live = [instance[(instance[:, 0] <= t) & (instance[:, 1] > t), 2].sum() for t in range(n + 1, n + 1 + period)]
    bound = replay_buffers(instance[:, :3], "first_fit", alignment=1).lower_bound
    assert bound >= max(live)  # the first step's peak, and no later step holds less
    placed = placement.place(np.concatenate([own, moving]), placement.PersistentGroup(0, in_use, 2 * MiB), steps)
    assert placed.reserved_bytes >= bound


def test_an_offloaded_variable_does_not_move_in_the_persistent_group():
    """A variable the plan offloads comes back to the device for its update and leaves again: its next buffer is
    the swap-in's business, not the persistent group's."""
    from dymem_tf.planning import offload
    from dymem_tf.planning.plan import SwapDecision, SwapIn
    from dymem_tf.planning.simulator import ADOPTED

    sg = momentum_update()
    v = offload.OffloadableVariable("m:0", "float32", (3 * MiB // 4,), 3 * MiB)
    offload.mark(sg, [v])
    swap = SwapDecision("m:0", "m", 3 * MiB, 0, [], ["read_m", "assign"],
                        [SwapIn("f", 0, ["read_m", "assign"], 0)], kind="variable")
    rows = simulate(sg, [swap], TOY).allocations
    assert not (rows[:, 3] == ADOPTED).any()
    assert (simulate(sg, None, TOY).allocations[:, 3] == ADOPTED).any()
