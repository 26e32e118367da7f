"""DymemSummaryWriter and the dashboard's reader: files and scalars written, read back the same, clear errors."""
import csv
import dataclasses
import json
import os
import types

import pytest
import tensorflow as tf

from dymem_tf.observe import summaries
from dymem_tf.passes.step_pass import RewriteReport, TraceRecord
from dymem_tf.planning import analysis, planner
from dymem_tf.planning.device_profiles import get_profile
from dymem_tf.planning.plan import Plan
from tensorboard_plugin_dymem import logdata

MiB = 1 << 20
TRACE_HEADER = "id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns"


def chain_graph(n: int = 10) -> analysis.StepGraph:
    """A linear network: forward f0..f{n-1}, a loss, backward g{n-1}..g0, each g_i reading f_i."""
    spec, prev = {}, None
    for i in range(n):
        spec[f"f{i}"] = {"inputs": [prev] if prev else [], "bytes": MiB * (1 + i % 3), "flops": 5e7}
        prev = f"f{i}"
    spec["loss"] = {"inputs": [prev], "bytes": 4}
    grad = "loss"
    for i in reversed(range(n)):
        spec[f"g{i}"] = {"inputs": [grad, f"f{i}"], "bytes": MiB * (1 + i % 3), "backward": True, "flops": 1e8}
        grad = f"g{i}"
    return analysis.StepGraph.from_spec(spec)


def make_record(budget=12 * MiB, profile=None):
    sg = chain_graph()
    profile = profile or get_profile("cpu")
    plan = planner.make_plan(sg, policy="dymem", budget_bytes=budget, persistent_bytes=MiB, batch_size=8,
                             profile=profile)
    return TraceRecord("train_function", 8, sg, plan, RewriteReport(swapped_tensors=len(plan.swaps))), profile


def write_trace_csv(path, rows):
    with open(path, "w", newline="") as fh:
        fh.write(TRACE_HEADER + "\n")
        csv.writer(fh).writerows(rows)
    return path


# A hand-made trace. Events: 0 alloc A, 1 alloc B, 2 alloc C, 3 free B, 4 alloc D, 5 free A, 6 free C, 7 free D.
# Live sets: after 2 {A,B,C} = 600; after 4 {A,C,D} = 100+300+400 = 800 (the peak); pool offsets below.
TRACE_ROWS = [
    # id, lower, upper, size, group, offset, op, step, alloc_ns, free_ns
    (0, 0, 5, 100, 0, 0, "weights", 0, 0, 5000),
    (1, 1, 3, 200, 1, 100, "conv1", 7, 1000, 3000),
    (2, 2, 6, 300, 2, 300, "swap_in", 7, 2000, 6000),
    (3, 4, 8, 400, 1, 700, "conv2", 7, 4000, -1),
]


def stats(step, plan):
    return {"bytes_in_use": 5 * MiB, "peak_bytes_in_use": (10 + step) * MiB, "bytes_reserved": 16 * MiB,
            "peak_bytes_reserved": 16 * MiB, "reserved_overhead": 0.25, "block_size": 100, "bytes_limit": 12 * MiB,
            "groups": {"mobile": {"in_use": MiB, "peak_in_use": 2 * MiB}, "transient": {"in_use": 3 * MiB}},
            "host_bytes_in_use": 2 * MiB, "host_bytes_swapped_out": (step + 1) * plan.swapped_bytes,
            "planned_swap_bytes": plan.swapped_bytes, "modelled_stall_s": plan.predicted.stall_s,
            "label": "not a number", "capacity": None}


def read_scalars(run_dir):
    """{tag: {step: value}} from the run's event files."""
    out = {}
    for name in os.listdir(run_dir):
        if not name.startswith("events.out.tfevents"):
            continue
        for event in tf.compat.v1.train.summary_iterator(os.path.join(run_dir, name)):
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return out


@pytest.fixture
def written(tmp_path):
    """A run written by hand: plan, three steps, a trace."""
    record, profile = make_record()
    log_dir = tmp_path / "logs"
    trace = write_trace_csv(tmp_path / "trace.csv", TRACE_ROWS)
    with summaries.DymemSummaryWriter(str(log_dir), profile=profile) as writer:
        writer.write_plan(record)
        for step in range(3):
            writer.write_step(step, stats(step, record.plan))
        assert writer.write_trace(str(trace))
    return log_dir, record


def test_writer_lays_out_the_run(written):
    log_dir, _ = written
    run_dir = log_dir / "dymem"
    files = sorted(os.listdir(run_dir / "plugins" / "dymem"))
    assert files == sorted(logdata.DATA_FILES), "every data file, and no temporary files left behind"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    assert logdata.list_runs(str(log_dir)) == ["dymem"]


def test_plan_json_is_the_plan(written):
    log_dir, record = written
    loaded = Plan.load(str(log_dir / "dymem" / "plugins" / "dymem" / "plan.json"))
    assert loaded == record.plan
    assert loaded.diff(record.plan) == []


def test_scalars_are_tf_summaries_with_the_stats(written):
    log_dir, record = written
    scalars = read_scalars(log_dir / "dymem")
    assert scalars["dymem/device/peak_bytes_in_use"] == {0: 10 * MiB, 1: 11 * MiB, 2: 12 * MiB}
    assert scalars["dymem/device/bytes_reserved"][2] == 16 * MiB
    assert scalars["dymem/device/reserved_overhead"][0] == pytest.approx(0.25)
    assert not [tag for tag in scalars if "fragmentation" in tag]  # the pool map's figure, not a step scalar
    assert scalars["dymem/device/groups/mobile/peak_in_use"][1] == 2 * MiB
    assert scalars["dymem/host/bytes_in_use"][0] == 2 * MiB
    # bytes swapped per step: differences of the host pool's cumulative counter
    assert scalars["dymem/host/bytes_swapped_out_per_step"] == {s: record.plan.swapped_bytes for s in range(3)}
    assert scalars["dymem/plan/planned_swap_bytes"][0] == record.plan.swapped_bytes
    assert scalars["dymem/plan/modelled_stall_s"][0] == pytest.approx(record.plan.predicted.stall_s)
    # configuration counters and non-numbers are not plotted
    assert not any(tag.endswith(("/label", "/capacity", "/block_size")) for tag in scalars)


def test_missing_stats_keys_are_simply_not_written(tmp_path):
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_step(0, {"bytes_in_use": 123, "reserved_overhead": float("nan")})
        writer.write_step(1, {})
    assert set(read_scalars(tmp_path / "dymem")) == {"dymem/device/bytes_in_use"}
    rows, notes = logdata.read_steps(str(tmp_path / "dymem" / "plugins" / "dymem" / "steps.jsonl"))
    assert [r["step"] for r in rows] == [0, 1] and notes == []
    assert "reserved_overhead" not in rows[0] and rows[0]["bytes_in_use"] == 123


def test_reader_returns_what_was_written(written):
    log_dir, record = written
    plan = record.plan
    data = logdata.load_run(str(log_dir), "dymem")
    assert data["messages"] == []
    summary = data["plan"]
    assert summary["num_swaps"] == len(plan.swaps) > 0
    assert summary["swapped_bytes"] == plan.swapped_bytes
    assert summary["predicted"]["peak_bytes"] == plan.predicted.peak_bytes
    assert data["meta"]["policy"] == "dymem" and data["meta"]["batch_size"] == 8
    assert data["meta"]["graph_name"] == "train_function" and data["meta"]["block_size"] == 100

    schedule = data["schedule"]
    assert schedule["timed"] and schedule["num_layers"] == plan.num_layers
    assert [s["tensor"] for s in schedule["swaps"]] == [s.tensor for s in plan.swaps]
    for written_swap, decision in zip(schedule["swaps"], plan.swaps, strict=True):
        assert written_swap["producer_layer"] == decision.producer_layer
        assert written_swap["swap_out"]["start_layer"] >= decision.producer_layer
        for si, planned in zip(written_swap["swap_ins"], decision.swap_ins, strict=True):
            assert si["trigger_layer"] == planned.trigger_layer
            assert si["consumer_layer"] == planned.start_layer_of_consumers
            assert si["stall_s"] == pytest.approx(planned.predicted_stall_s)
            # the copy starts after its trigger and completes before its consumer starts
            assert planned.trigger_layer < si["start_layer"] <= si["end_layer"] <= si["consumer_start_layer"]
    assert schedule["stall_s"] == pytest.approx(plan.predicted.stall_s)

    timeline = data["timeline"]
    totals = [sum(p[g] for g in logdata.GROUPS) for p in timeline["points"]]
    assert len(totals) == plan.num_layers
    assert max(totals) == timeline["peak"]["bytes"] == plan.predicted.peak_bytes
    assert max(p["no_swap"] for p in timeline["points"]) == plan.predicted.no_swap_peak_bytes
    assert all(p["persistent"] == plan.persistent_bytes for p in timeline["points"])
    # the backward pass starts right after the loss
    assert timeline["first_backward_layer"] == record.step_graph.ops["loss"].layer + 1
    assert timeline["budget_bytes"] == plan.budget_bytes

    assert [r["step"] for r in data["steps"]] == [0, 1, 2]
    assert data["steps"][1]["peak_bytes_in_use"] == 11 * MiB
    assert data["steps"][2]["groups/mobile/in_use"] == MiB


def test_trace_analysis_finds_the_peak_and_the_pool_map(written):
    data = logdata.load_run(str(written[0]), "dymem")
    pool = data["pool"]
    assert pool["event"] == 4 and pool["in_use_bytes"] == 800
    assert [(b["offset"], b["size"], b["group"], b["op"]) for b in pool["blocks"]] == [
        (0, 100, "persistent", "weights"), (300, 300, "mobile", "swap_in"), (700, 400, "transient", "conv2")]
    assert pool["gaps"] == [{"offset": 100, "size": 200}, {"offset": 600, "size": 100}]
    assert pool["extent_bytes"] == 1100 and pool["free_bytes"] == 300 and pool["largest_free_bytes"] == 200
    assert pool["fragmentation"] == pytest.approx(1 - 200 / 300)
    assert pool["by_group"] == {"persistent": 100, "mobile": 300, "transient": 400}
    assert pool["step"] == 7  # the TensorFlow step id of the allocation that reached the peak

    tensors = data["tensors"]
    assert tensors["source"] == "trace" and tensors["count"] == 3 and tensors["total_bytes"] == 800
    assert [r["size"] for r in tensors["rows"]] == [400, 300, 100]
    assert tensors["rows"][0]["lifetime"] is None  # conv2 was never freed during the trace
    assert tensors["rows"][1]["lifetime"] == 4

    measured = data["measured_timeline"]
    assert measured["step"] == 7 and measured["x_label"].startswith("ms")
    points = {p["t"]: p for p in measured["points"]}
    assert points[4]["transient"] == 400 and points[4]["mobile"] == 300 and points[4]["persistent"] == 100
    assert points[4]["x"] == pytest.approx(0.003)  # 4000 ns after the step's first allocation at 1000 ns
    # block_size 100 from the stats: blocks 0, 3-5, 7-10 hold live bytes at event 4
    assert points[4]["reserved"] == 800 and points[4]["extent"] == 1100


def test_trace_rows_with_names_and_unfreed_buffers(tmp_path):
    rows = logdata.read_trace(write_trace_csv(tmp_path / "t.csv", [(0, 0, 2, 64, "mobile", 0, "a,b", 3, "", "")]))
    assert rows[0].group == "mobile" and rows[0].op == "a,b" and rows[0].alloc_ns is None and rows[0].free_ns is None


def test_thinning_keeps_the_peak():
    points = [{"t": i, "persistent": 0, "transient": (i * 37) % 101, "mobile": 0} for i in range(10_000)]
    thinned = logdata._thin(points, 100)
    assert len(thinned) <= 100
    assert max(p["transient"] for p in thinned) == 100
    assert thinned[0] is points[0] and thinned[-1] is points[-1]


def test_stalls_are_recorded_in_the_schedule(tmp_path):
    slow = get_profile("cpu", h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    with pytest.raises(planner.BudgetTooSmallError) as too_small:
        make_record(budget=MiB, profile=slow)
    # the tightest budget the planner can meet swaps tensors whose copies a slow link cannot hide
    record, _ = make_record(budget=too_small.value.min_peak_bytes, profile=slow)
    assert record.plan.predicted.stall_s > 0, "the slow link should make some swap-in late"
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:  # the profile recorded in the plan is used
        writer.write_plan(record)
    schedule = logdata.load_run(str(tmp_path), "dymem")["schedule"]
    stalls = [si["stall_s"] for s in schedule["swaps"] for si in s["swap_ins"]]
    planned = [si.predicted_stall_s for s in record.plan.swaps for si in s.swap_ins]
    assert stalls == pytest.approx(planned) and sum(stalls) == pytest.approx(record.plan.predicted.stall_s)


def test_unknown_profile_writes_the_plan_without_timings(tmp_path):
    record, _ = make_record()
    with pytest.warns(RuntimeWarning, match="without simulated timings"):
        with summaries.DymemSummaryWriter(str(tmp_path), profile="no-such-device") as writer:
            writer.write_plan(record)
    data = logdata.load_run(str(tmp_path), "dymem")
    assert data["timeline"] is None and not data["schedule"]["timed"]
    assert len(data["schedule"]["swaps"]) == len(record.plan.swaps)
    assert any("simulation failed" in note for note in data["meta"]["notes"])


def test_a_new_writer_starts_the_run_afresh(written):
    log_dir, _ = written
    with summaries.DymemSummaryWriter(str(log_dir)) as writer:
        writer.write_step(0, {"bytes_in_use": 1})
    assert sorted(os.listdir(log_dir / "dymem" / "plugins" / "dymem")) == ["meta.json", "steps.jsonl"]


def test_keras_tensorboard_log_dir_gets_a_separate_run(tmp_path):
    """A log dir shared with Keras' TensorBoard callback (the user passes it to both) gets its own run ``dymem``."""
    for run in ("train", "validation"):
        with tf.summary.create_file_writer(str(tmp_path / run)).as_default():
            tf.summary.scalar("loss", 1.0, step=0)
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_step(0, {"bytes_in_use": 1})
    assert sorted(os.listdir(tmp_path)) == ["dymem", "train", "validation"]
    assert logdata.list_runs(str(tmp_path)) == ["dymem"]


def test_write_trace_rejects_missing_and_foreign_files(tmp_path):
    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    with summaries.DymemSummaryWriter(str(tmp_path / "logs")) as writer:
        with pytest.warns(RuntimeWarning, match="cannot read"):
            assert not writer.write_trace(str(tmp_path / "missing.csv"))
        with pytest.warns(RuntimeWarning, match="not an allocator trace"):
            assert not writer.write_trace(str(foreign))
    assert not os.path.exists(tmp_path / "logs" / "dymem" / "plugins" / "dymem" / "trace.csv")


def test_closed_writer_refuses_writes(tmp_path):
    writer = summaries.DymemSummaryWriter(str(tmp_path))
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_step(0, {})


# ------------------------------------------------------------------------------------- partial and corrupt runs
def plugin_file(log_dir, name):
    return log_dir / "dymem" / "plugins" / "dymem" / name


def messages(log_dir):
    return {(m["file"], m["level"]): m["text"] for m in logdata.load_run(str(log_dir), "dymem")["messages"]}


def test_truncated_plan_is_reported_and_the_schedule_still_shows(written):
    log_dir, _ = written
    path = plugin_file(log_dir, "plan.json")
    path.write_text(path.read_text()[:200])
    data = logdata.load_run(str(log_dir), "dymem")
    text = messages(log_dir)[("plan.json", "error")]
    assert text.startswith("plan.json is not valid JSON (line")
    assert data["plan"] is None and data["schedule"] is not None and data["pool"] is not None


@pytest.mark.parametrize("name, content, expected", [
    ("timeline.json", "", "timeline.json is empty"),
    ("timeline.json", "[1, 2]", "timeline.json should hold a JSON object, found list"),
    ("timeline.json", '{"points": [{"layer": 0, "mobile": -5}]}', "points[0].mobile should be a non-negative"),
    ("timeline.json", '{"version": 99, "points": []}', "format version 99"),
    ("schedule.json", '{"num_layers": 3, "swaps": [{"tensor": "x:0"}]}', "lacks the field swaps[0].'bytes'"),
    ("plan.json", '{"swaps": "many", "num_layers": 1}', "field 'swaps' should be list, found str"),
    ("meta.json", "\x00\x01garbage", "meta.json is not valid JSON"),
    ("trace.csv", "", "trace.csv is empty (no header line)"),
    ("trace.csv", "id,lower,upper,size\n0,0,1,8\n", "trace.csv lacks the column(s) group, offset, op"),
    ("trace.csv", TRACE_HEADER + "\n0,0,1,8,1,0,op,1,0,1\n1,1,2,8,1", "trace.csv line 3: 5 fields"),
    ("trace.csv", TRACE_HEADER + "\n0,0,1,eight,1,0,op,1,0,1\n", "line 2: column 'size' should be an integer"),
    ("trace.csv", TRACE_HEADER + "\n0,5,5,8,1,0,op,1,0,1\n", "line 2: upper (5) must exceed lower (5)"),
    ("trace.csv", TRACE_HEADER + "\n0,0,1,8,7,0,op,1,0,1\n", "line 2: unknown group '7'"),
])
def test_corrupt_files_give_clear_messages(written, name, content, expected):
    log_dir, _ = written
    plugin_file(log_dir, name).write_text(content)
    found = messages(log_dir)
    assert expected in found[(name, "error")], found


def test_torn_and_garbage_step_lines(written):
    log_dir, _ = written
    path = plugin_file(log_dir, "steps.jsonl")
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n" + lines[2][:20])
    data = logdata.load_run(str(log_dir), "dymem")
    assert [r["step"] for r in data["steps"]] == [0, 1]  # the torn last line is still being written
    assert messages(log_dir)[("steps.jsonl", "warning")] == "steps.jsonl: skipped 1 unreadable line(s) (line 2)"


def test_partial_run_says_what_is_missing(tmp_path):
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_step(0, {"bytes_in_use": 1})
    data = logdata.load_run(str(tmp_path), "dymem")
    assert data["plan"] is None and data["schedule"] is None and data["pool"] is None
    texts = " ".join(m["text"] for m in data["messages"])
    assert "No plan yet" in texts and "No allocator trace" in texts


def test_missing_schedule_falls_back_to_the_plan(written):
    log_dir, record = written
    os.remove(plugin_file(log_dir, "schedule.json"))
    data = logdata.load_run(str(log_dir), "dymem")
    assert [s["tensor"] for s in data["schedule"]["swaps"]] == [s.tensor for s in record.plan.swaps]
    assert not data["schedule"]["timed"]
    assert "taken from plan.json" in messages(log_dir)[("schedule.json", "info")]


def test_model_tensors_stand_in_for_a_missing_trace(written):
    log_dir, record = written
    os.remove(plugin_file(log_dir, "trace.csv"))
    tensors = logdata.load_run(str(log_dir), "dymem")["tensors"]
    assert tensors["source"] == "model" and tensors["rows"]
    live = sum(r["size"] for r in tensors["rows"])
    assert live == record.plan.predicted.peak_bytes - record.plan.persistent_bytes
    assert tensors["total_bytes"] == live  # what the caption says the listed tensors hold


def test_runs_are_found_and_names_are_checked(tmp_path):
    for run in ("a", "b/c", ".hidden/d"):
        with summaries.DymemSummaryWriter(str(tmp_path / run)) as writer:
            writer.write_step(0, {"bytes_in_use": 1})
    (tmp_path / "empty" / "plugins" / "dymem").mkdir(parents=True)
    assert logdata.list_runs(str(tmp_path)) == ["a/dymem", "b/c/dymem"]
    assert logdata.list_runs(str(tmp_path / "a" / "dymem")) == ["."]
    assert logdata.list_runs(str(tmp_path / "nowhere")) == []
    for bad, why in [("", "no run given"), ("../x", "outside the log directory"), ("empty", "has no Dymem data")]:
        with pytest.raises(logdata.DataError, match=why):
            logdata.load_run(str(tmp_path), bad)
    json.dumps(logdata.load_run(str(tmp_path), "b/c/dymem"), allow_nan=False)  # the payload is plain JSON


def conv_reshape_graph() -> analysis.StepGraph:
    """Conv2D -> Relu (written in place into the conv's buffer) -> Reshape (an alias) -> Dense, and its backward
    pass, whose Reshape and ReluGrad also share buffers: 20 MiB of buffers at the peak, 28 MiB of tensors."""
    return analysis.StepGraph.from_spec({
        "x": {"bytes": 4 * MiB, "type": "IteratorGetNext"},
        "conv": {"inputs": ["x"], "bytes": 8 * MiB, "type": "Conv2D", "flops": 1e8},
        "relu": {"inputs": ["conv"], "bytes": 8 * MiB, "type": "Relu", "flops": 1e6},
        "reshape": {"inputs": ["relu"], "bytes": 8 * MiB, "type": "Reshape"},
        "dense": {"inputs": ["reshape"], "bytes": 4, "type": "MatMul", "flops": 1e6},
        "gdense": {"inputs": ["dense", "reshape"], "bytes": 8 * MiB, "type": "MatMul", "backward": True,
                   "flops": 1e6},
        "gflat": {"inputs": ["gdense"], "bytes": 8 * MiB, "type": "Reshape", "backward": True},
        "grelu": {"inputs": ["gflat", "relu"], "bytes": 8 * MiB, "type": "ReluGrad", "backward": True, "flops": 1e6},
        "gconv": {"inputs": ["grelu", "x"], "bytes": 64, "type": "Conv2DBackpropFilter", "backward": True,
                  "flops": 1e8},
    })


@pytest.mark.parametrize("policy", ["none", "dymem"])
def test_tensors_at_the_peak_count_each_buffer_once(policy):
    """Aliases and tensors forwarded into an input's buffer are not counted again: the table holds exactly the
    simulated peak's transient and mobile bytes."""
    sg, profile = conv_reshape_graph(), get_profile("cpu")
    plan = planner.make_plan(sg, policy=policy, persistent_bytes=MiB, batch_size=8, profile=profile,
                             min_swap_bytes=0)
    timeline, _ = summaries.plan_views(plan, sg, profile)
    rows = timeline["peak_tensors"]
    assert timeline["peak_tensor_count"] == len(rows)
    assert sum(r["size"] for r in rows) == timeline["peak"]["bytes"] - plan.persistent_bytes
    assert not {"reshape:0", "gflat:0"} & {r["tensor"] for r in rows}  # aliases own no buffer
    if policy == "none":
        # the peak is gdense's start: x, conv's buffer (relu, reshape), dense's 4 bytes and gdense; conv's buffer
        # is freed when grelu ends, before gconv's 64 bytes are allocated
        assert sum(r["size"] for r in rows) == 20 * MiB + 4
    else:
        assert plan.swaps and any(r["group"] == "mobile" for r in rows)


def test_steps_written_before_reserved_overhead_had_its_name_are_read_under_it(tmp_path):
    """Runs written when ``1 - in use / reserved`` was called "fragmentation" show it as the reserved overhead:
    the dashboard keeps "fragmentation" for the pool map's ``1 - largest gap / free``."""
    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 0, "fragmentation": 0.25}\n{"step": 1, "reserved_overhead": 0.5}\n')
    rows, _ = logdata.read_steps(str(path))
    assert rows == [{"step": 0, "reserved_overhead": 0.25}, {"step": 1, "reserved_overhead": 0.5}]


# ---------------------------------------------------------------------------------- predicted vs measured per plan
def measured_record(budget, predicted_shift=0, calibration=None, measured=None):
    """A record whose plan has been through its first step: ``measured`` (its fields) as the callback keeps it, and
    ``calibration`` (the fields of a :class:`~dymem_tf.planning.first_step.Calibration`)."""
    from dymem_tf.planning.first_step import Calibration, Measurement

    record, _ = make_record(budget=budget)
    plan = record.plan
    if calibration is not None:
        plan.params.stage = "calibrated"
        plan.predicted.calibration = Calibration(**calibration)
    if measured:
        plan.measured = Measurement(**measured)
    return record


def test_each_plan_is_written_with_its_predicted_and_measured_peak(tmp_path):
    """summaries -> plans.jsonl -> logdata: every plan of the run, predicted against measured, the calibration of a
    calibrated plan, and each step row names the plan it ran."""
    from dymem_tf.planning import first_step

    probe = measured_record(None)
    probe.plan.params.stage = "probe"
    predicted = probe.plan.predicted.peak_bytes
    probe.plan.measured = first_step.measurement(
        {"peak_bytes_in_use": MiB, "peak_bytes_reserved": 2 * MiB},
        {"peak_bytes_in_use": predicted + 2 * MiB, "peak_bytes_reserved": predicted + 3 * MiB}, predicted)
    calibration = {"budget_bytes": 12 * MiB, "predicted_peak_bytes": predicted,
                   "measured_peak_bytes": predicted + 3 * MiB, "persistent_bytes": MiB, "headroom": 0.25}
    calibrated = measured_record(12 * MiB, calibration=calibration)
    cal_predicted = calibrated.plan.predicted.peak_bytes
    calibrated.plan.measured = first_step.measurement(
        {"peak_bytes_in_use": 0, "peak_bytes_reserved": 0},
        {"peak_bytes_in_use": cal_predicted, "peak_bytes_reserved": cal_predicted + MiB}, cal_predicted,
        calibration)
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_step(0, {"peak_bytes_reserved": 3 * MiB})  # before any plan: no plan index
        writer.write_plan(probe)
        writer.write_step(1, {"peak_bytes_reserved": predicted + 3 * MiB})
        writer.write_plan(calibrated)
        for step in (2, 3):
            writer.write_step(step, {"peak_bytes_reserved": cal_predicted + MiB})
    data = logdata.load_run(str(tmp_path), "dymem")
    assert all(m["level"] == "info" for m in data["messages"]), data["messages"]
    assert [s.get("plan") for s in data["steps"]] == [None, 0, 1, 1]
    first, second = data["plans"]
    assert (first["index"], first["stage"], first["function_name"]) == (0, "probe", "train_function")
    assert first["predicted_peak_bytes"] == predicted
    assert first["measured_peak_bytes"] == predicted + 3 * MiB and first["measured_peak_bytes_in_use"] == \
        predicted + 2 * MiB
    assert first["outcome"] == "ran" and first["measured_exact"] is True
    assert first["error"] == pytest.approx(3 * MiB / (predicted + 3 * MiB))
    assert first["calibration"] is None and first["budget_bytes"] is None
    assert second["stage"] == "calibrated" and second["budget_bytes"] == 12 * MiB
    assert second["error"] == pytest.approx(MiB / (cal_predicted + MiB))
    assert second["calibration"] == {"predicted_peak_bytes": predicted, "measured_peak_bytes": predicted + 3 * MiB,
                                     "error": pytest.approx(3 * MiB / (predicted + 3 * MiB)), "headroom": 0.25,
                                     "budget_bytes": 12 * MiB, "persistent_bytes": MiB}
    assert second["calibrated_predicted_peak_bytes"] == first_step.calibrated_prediction(calibration, cal_predicted)
    # plan.json is the newest plan, measured included
    assert data["plan"]["measured"] == dataclasses.asdict(calibrated.plan.measured)
    assert data["plan"]["stage"] == "calibrated"
    assert {k: data["plan"]["calibration"][k] for k in calibration} == calibration
    json.dumps(data, allow_nan=False)


@pytest.mark.parametrize("measured, outcome, exact, error", [
    ({}, None, None, None),  # written before its step ran
    ({"outcome": "ran", "peak_bytes": 20 * MiB, "peak_bytes_in_use": 18 * MiB, "peak_bytes_reserved": 20 * MiB,
      "exact": False}, "ran", False, None),  # an earlier step hid this one's peak: no error claimed
    ({"outcome": "out_of_memory", "peak_bytes": 12 * MiB, "peak_bytes_in_use": 11 * MiB,
      "peak_bytes_reserved": 12 * MiB, "exact": True}, "out_of_memory", True, None),
])
def test_plans_not_measured_bounded_or_out_of_memory_claim_no_error(tmp_path, measured, outcome, exact, error):
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_plan(measured_record(12 * MiB, measured=measured))
    (plan,) = logdata.load_run(str(tmp_path), "dymem")["plans"]
    assert (plan["outcome"], plan["measured_exact"], plan["error"]) == (outcome, exact, error)
    assert plan["measured_peak_bytes"] == measured.get("peak_bytes")


def test_torn_and_garbage_plan_lines(tmp_path):
    with summaries.DymemSummaryWriter(str(tmp_path)) as writer:
        writer.write_plan(measured_record(12 * MiB))
        writer.write_plan(measured_record(10 * MiB))
    path = plugin_file(tmp_path, "plans.jsonl")
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + '\n{"index": "one"}\n' + lines[1][:30])
    data = logdata.load_run(str(tmp_path), "dymem")
    assert [p["index"] for p in data["plans"]] == [0]
    assert messages(tmp_path)[("plans.jsonl", "warning")] == "plans.jsonl: skipped 1 unreadable line(s) (line 2)"


def test_a_run_without_plans_jsonl_shows_its_one_plan(written):
    """Runs written before plans.jsonl existed: the plan of plan.json, with what it says it measured."""
    log_dir, record = written
    os.remove(plugin_file(log_dir, "plans.jsonl"))
    (plan,) = logdata.load_run(str(log_dir), "dymem")["plans"]
    assert plan["predicted_peak_bytes"] == record.plan.predicted.peak_bytes and plan["outcome"] is None
    doc = json.loads(plugin_file(log_dir, "plan.json").read_text())
    doc.pop("measured")  # as an older writer left it
    doc["predicted"]["peak_bytes"] = 4 * MiB
    plugin_file(log_dir, "plan.json").write_text(json.dumps(doc))
    (plan,) = logdata.load_run(str(log_dir), "dymem")["plans"]
    assert plan["predicted_peak_bytes"] == 4 * MiB and plan["measured_peak_bytes"] is None
