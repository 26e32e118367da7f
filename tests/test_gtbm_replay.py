"""Offline replay of DSA instances and recorded traces through the GTBM core (dymem_tf.memory.replay)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dymem_tf.memory import replay as rp

# shared/ sits beside the checkout (here and in CI)
DSA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared",
                   "benchmarks", "dsa")
EXAMPLE = os.path.join(DSA, "minimalloc", "examples", "input.12.csv")
CHALLENGING = [os.path.join(DSA, "minimalloc", "challenging", f"{k}.1048576.csv") for k in ("A", "D", "J")]
SOMAS_RESNET = os.path.join(DSA, "idealloc", "somas_tensors", "resnet50.csv")
# max-live lower bounds published next to the instances (STATS.txt)
KNOWN_LB = {"input.12.csv": 12, "A.1048576.csv": 1048576, "D.1048576.csv": 986112, "J.1048576.csv": 989184,
            "resnet50.csv": 1515472556}

needs_dsa = pytest.mark.skipif(not os.path.isdir(DSA), reason="DSA benchmark instances not available")


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@needs_dsa
@pytest.mark.parametrize("policy", rp.POLICIES)
def test_example_instance(policy):
    r = rp.replay(EXAMPLE, policy)
    assert r.lower_bound == 12 and r.num_buffers == 5 and r.num_failed == 0
    assert r.footprint >= r.lower_bound and r.peak_extent >= r.used_extent >= r.lower_bound
    assert r.alignment == 4  # abstract units: the sizes' own granularity, not 64
    if policy != "best_fit":
        assert r.footprint == 12  # 5 buffers of 4 units, three live at most: every policy here packs it exactly
    else:
        assert r.footprint == 2 << 20  # TF's BFC starts with a 2 MiB region


@needs_dsa
@pytest.mark.parametrize("path", CHALLENGING + [SOMAS_RESNET])
def test_benchmark_instances_sane(path):
    for r in rp.replay_all([path]):
        assert r.lower_bound == KNOWN_LB[os.path.basename(path)]
        assert r.num_failed == 0
        assert r.footprint >= r.lower_bound, r
        assert r.peak_extent >= r.footprint and r.used_extent >= r.lower_bound
        assert r.ratio < 3.0, r
        assert r.time_ns > 0


@needs_dsa
def test_gtbm_close_to_bound_on_training_graph_and_below_bfc():
    """MindSpore SOMAS ResNet-50 training-graph lifetimes: GTBM within 5% of max-live and below the BFC mirror."""
    gtbm = rp.replay(SOMAS_RESNET, "gtbm")
    bfc = rp.replay(SOMAS_RESNET, "best_fit")
    assert gtbm.ratio < 1.05, gtbm
    assert gtbm.footprint < bfc.footprint
    assert gtbm.buffers_persistent + gtbm.buffers_transient + gtbm.buffers_mobile == gtbm.num_buffers
    assert not gtbm.groups_from_trace  # no group column: the lifetime rule


def test_recorded_trace_format_groups_and_quoting(tmp_path):
    path = _write(tmp_path / "t.csv", "\n".join([
        "id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns",
        '0,0,10,1000,0,0,"w/a,b",0,1,-1',
        "1,1,3,500000,1,4096,conv/Conv2D,7,2,3",
        "2,2,4,700000,1,8192,conv/Relu,7,3,4",
        "3,4,9,300000,2,0,swap_in,7,4,5",
        "4,5,5,123,1,0,empty,7,5,5",  # empty lifetime: never live
        "",
    ]))
    r = rp.replay(path, "gtbm")
    assert r.groups_from_trace and (r.buffers_persistent, r.buffers_transient, r.buffers_mobile) == (1, 2, 1)
    assert r.lower_bound == 1000 + 500000 + 700000
    assert r.alignment == 64  # a recorded trace: TF's alignment
    r = rp.replay(path, "gtbm", groups="none")
    assert (r.buffers_persistent, r.buffers_transient, r.buffers_mobile) == (0, 4, 0)
    r = rp.replay(path, "gtbm", groups="lifetime", block_size="64KiB")
    assert not r.groups_from_trace and r.block_size == 64 << 10
    assert r.buffers_persistent == 1  # alive over the whole horizon


def test_frees_before_allocations_at_equal_time(tmp_path):
    path = _write(tmp_path / "seq.csv", "id,lower,upper,size\na,0,5,100\nb,5,9,100\nc,9,12,100\n")
    for policy in rp.POLICIES:
        r = rp.replay(path, policy)
        assert r.lower_bound == 100
        assert r.used_extent == 100 or policy == "best_fit"  # the same 100 units are reused every time


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot open"):
        rp.replay(tmp_path / "missing.csv")
    bad = _write(tmp_path / "bad.csv", "id,lower,upper,size\n0,5,3,10\n")
    with pytest.raises(ValueError, match="line 2"):
        rp.replay(bad)
    nohdr = _write(tmp_path / "nohdr.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="lower, upper and size"):
        rp.replay(nohdr)
    plain = _write(tmp_path / "plain.csv", "id,lower,upper,size\n0,0,3,10\n")
    with pytest.raises(ValueError, match="no group column"):
        rp.replay(plain, groups="trace")
    with pytest.raises(ValueError, match="unknown policy"):
        rp.replay(plain, "worst_fit")
    with pytest.raises(ValueError, match="power of two"):
        rp.replay(plain, alignment=48)
    with pytest.raises(ValueError):
        rp.replay(plain, block_size="-1MiB")


def test_cli_table_and_json(tmp_path, capsys):
    path = _write(tmp_path / "cli.csv", "id,lower,upper,size\n0,0,3,4096\n1,1,4,8192\n2,3,6,4096\n")
    assert rp.main([path]) == 0
    out = capsys.readouterr().out
    assert "lower bound 12,288" in out and all(p in out for p in rp.POLICIES)
    assert rp.main([path, "--policy", "gtbm", "--json", "--block-size", "4KiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data) == 1 and data[0]["policy"] == "gtbm" and data[0]["block_size"] == 4096
    assert data[0]["footprint"] >= data[0]["lower_bound"] == 12288 and data[0]["ratio"] >= 1.0
    assert rp.main([str(tmp_path / "nope.csv")]) == 2
    assert "error:" in capsys.readouterr().err


def _random_instance(rng, n: int, groups: bool):
    lower = rng.integers(0, 200, n)
    rows = [lower, lower + rng.integers(0, 50, n), rng.integers(0, 3 << 20, n)]
    if groups:
        rows.append(rng.integers(0, 3, n))
    return np.stack(rows, axis=1)


@pytest.mark.parametrize("seed", range(4))
def test_an_instance_in_memory_replays_as_the_same_instance_in_a_file(tmp_path, seed):
    """replay_buffers (arrays through ctypes) and replay (a CSV file) run the same engine: random instances with and
    without groups, every policy, the same statistics but the time."""
    rng = np.random.default_rng(seed)
    inst = _random_instance(rng, 300, groups=seed % 2 == 0)
    cols = ["lower", "upper", "size"] + (["group"] if inst.shape[1] == 4 else [])
    # offset: the file is a recorded trace (its sizes are TF bytes: alignment 64, as for arrays)
    text = ",".join(["id"] + cols + ["offset"]) + "\n" + "".join(
        ",".join(str(v) for v in [i, *row, 0]) + "\n" for i, row in enumerate(inst.tolist()))
    path = _write(tmp_path / "inst.csv", text)
    for policy in rp.POLICIES:
        a = rp.replay_buffers(inst, policy, block_size="1MiB").to_dict()
        b = rp.replay(path, policy, block_size="1MiB").to_dict()
        for key in ("time_ns", "path", "ratio", "extent_ratio"):
            a.pop(key), b.pop(key)
        assert a == b
        assert a["num_failed"] == 0 and a["footprint"] >= a["lower_bound"]


def test_an_instance_in_memory_is_checked():
    assert rp.replay_buffers(np.zeros((0, 4), dtype=np.int64)).footprint == 0
    with pytest.raises(ValueError, match="3 or 4 columns"):
        rp.replay_buffers([[0, 1]])
    with pytest.raises(ValueError, match="buffer 1"):
        rp.replay_buffers([[0, 1, 10, 1], [3, 2, 10, 1]])
    with pytest.raises(ValueError, match="buffer 0"):
        rp.replay_buffers([[0, 1, 10, 7]])
    with pytest.raises(ValueError, match="no group column"):
        rp.replay_buffers([[0, 1, 10]], groups="trace")
    with pytest.raises(ValueError, match="unknown policy"):
        rp.replay_buffers([[0, 1, 10]], "worst_fit")
