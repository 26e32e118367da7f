"""The GPU path's Python side, on the CPU (issue #12, item 3): the device's capacity is read without a second
device set, and the GPU profiles charge the copy-completion latency (event polling) to every copy."""
from __future__ import annotations

import pytest

from dymem_tf.memory import devices
from dymem_tf.planning import device_profiles
from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.cost_model import CostModel
from dymem_tf.planning.device_profiles import DeviceProfile, get_profile
from dymem_tf.planning.plan import SwapDecision, SwapIn
from dymem_tf.planning.simulator import simulate

GPU_PRESETS = ("v100", "a100", "h100", "h200", "gh200")


def test_device_memory_is_read_from_the_context_not_from_a_new_device_set(monkeypatch):
    import tensorflow as tf
    from tensorflow.python.client import device_lib

    from dymem_tf import compat

    def no_second_device_set(*args, **kwargs):
        raise AssertionError("device_lib.list_local_devices creates a second set of devices")

    monkeypatch.setattr(device_lib, "list_local_devices", no_second_device_set)
    cpus = compat.local_device_memory("CPU")
    assert [name.rsplit("/", 1)[-1] for name, _ in cpus] == ["device:CPU:0"]
    assert all(limit > 0 for _, limit in cpus)
    assert compat.gpu_memory_limits() == []  # this machine has no GPU
    # with a GPU listed physically but none in the context (e.g. hidden with set_visible_devices): no capacity
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
                        if kind == "GPU" else [])
    assert devices.device_memory_capacity() is None


def test_the_context_reports_what_device_lib_reports():
    from tensorflow.python.client import device_lib

    from dymem_tf import compat

    expected = {d.name.split("device:")[-1]: d.memory_limit for d in device_lib.list_local_devices()
                if d.device_type == "CPU"}
    got = {name.split("device:")[-1]: limit for name, limit in compat.local_device_memory("CPU")}
    assert got == expected


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_profiles_include_the_event_polling_latency(name):
    profile = get_profile(name)
    # TF's EventMgr sleeps 10 us between polls of the copy's event (polling_active_delay_usecs' default)
    assert profile.copy_completion_s >= 10e-6
    cost = CostModel(profile)
    nbytes = 1 << 20
    for direction, rate in (("h2d", profile.h2d_bytes_per_s), ("d2h", profile.d2h_bytes_per_s)):
        assert cost.copy_time(nbytes, direction) == pytest.approx(
            nbytes / rate + profile.link_latency_s + profile.copy_completion_s)


def test_the_cpu_profile_has_no_completion_latency():
    # the CPU swap kernels copy synchronously inside the op
    assert get_profile("cpu").copy_completion_s == 0.0
    assert device_profiles.calibrate_cpu(0.05).copy_completion_s == 0.0


MS = 1e6  # flops of a 1 ms op on TOY
TOY = DeviceProfile("toy", flops_per_s=1e9, mem_bandwidth_bytes_per_s=1e18, h2d_bytes_per_s=1e9,
                    d2h_bytes_per_s=1e9, link="toy", memory_bytes=1 << 40, op_overhead_s=0.0, link_latency_s=0.0)


def test_a_swap_in_whose_copy_ends_just_in_time_stalls_by_the_completion_latency():
    """f1 is swapped in after b3 (1 ms of b2 to hide it); the copy takes exactly 1 ms: without completion latency
    no stall, with it the consumer b1 waits that long."""
    sg = StepGraph.from_spec({
        "f1": {"bytes": 10**6, "flops": MS}, "f2": {"inputs": ["f1"], "bytes": 100, "flops": MS},
        "b3": {"inputs": ["f2"], "bytes": 10, "flops": MS, "backward": True},
        "b2": {"inputs": ["b3"], "bytes": 10, "flops": MS, "backward": True},
        "b1": {"inputs": ["b2", "f1"], "bytes": 10, "flops": MS, "backward": True},
    })
    swap = SwapDecision("f1:0", "f1", 10**6, 0, ["f2"], ["b1"],
                        [SwapIn("b3", sg.ops["b3"].layer, ["b1"], sg.ops["b1"].layer)])
    assert simulate(sg, [swap], TOY).stall_s == pytest.approx(0.0, abs=1e-12)
    late = simulate(sg, [swap], get_profile(TOY, copy_completion_s=15e-6))
    assert late.stall_s == pytest.approx(15e-6)


def test_device_memory_stats_read_the_gpus_when_the_step_trains_on_gpus(monkeypatch):
    """With GPUs visible, the probe measures the GPUs' peak (TF's allocator), not GTBM's CPU pool, and the CPU pool
    is not capped at the budget (faked device list: this machine has no GPU)."""
    import tensorflow as tf


    infos = {"GPU:0": {"current": 100, "peak": 700}, "GPU:1": {"current": 300, "peak": 500}}
    resets = []
    monkeypatch.setattr(devices, "training_gpus", lambda: list(infos))
    monkeypatch.setattr(tf.config.experimental, "get_memory_info", lambda gpu: infos[gpu])
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", resets.append)
    assert devices.device_memory_stats() == {"bytes_in_use": 300, "peak_bytes_in_use": 700,
                                              "peak_bytes_reserved": 700}
    devices.reset_device_peaks()
    assert resets == ["GPU:0", "GPU:1"]
    assert devices.cap_at(1 << 20) == {}  # what a session caps under a budget: the CPU pool keeps its limit


def test_gpus_that_gtbm_serves_are_measured_and_capped_through_its_pools(monkeypatch):
    """With every training GPU served by GTBM (DYMEM_GTBM_GPU=1), the probe reads GTBM's GPU pools (reserved bytes:
    the fragmentation is measured) and the budget caps them for the fit; a GPU on TF's allocator among them sends
    everything back to get_memory_info. Faked devices and pools: this machine has no GPU, and the pools' own code is
    tested through the region allocator on the CPU (test_region_allocator_*)."""
    import tensorflow as tf

    from dymem_tf.memory import allocator

    pools = {"GPU:0": {"bytes_in_use": 10, "peak_bytes_in_use": 60, "peak_bytes_reserved": 64},
             "GPU:1": {"bytes_in_use": 20, "peak_bytes_in_use": 50, "peak_bytes_reserved": 80}}
    limits = {"GPU:0": 1 << 30, "GPU:1": 1 << 30}
    served, resets = set(pools), []
    monkeypatch.setattr(devices, "training_gpus", lambda: list(pools))
    monkeypatch.setattr(allocator, "is_active", lambda: True)
    monkeypatch.setattr(allocator, "serves_gpu", lambda gpu: gpu in served)
    monkeypatch.setattr(allocator, "memory_stats", lambda device=None: dict(pools[device]))
    monkeypatch.setattr(allocator, "reset_peak_stats", lambda device=None: resets.append(("gtbm", device)))
    monkeypatch.setattr(allocator, "get_memory_limit", lambda device=None: limits[device])
    monkeypatch.setattr(allocator, "set_memory_limit", lambda value, device=None: limits.__setitem__(device, value))
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", lambda gpu: resets.append(("tf", gpu)))
    monkeypatch.setattr(tf.config.experimental, "get_memory_info", lambda gpu: {"current": 1, "peak": 2})
    assert devices.device_memory_stats() == pools["GPU:1"]  # the largest reserved peak
    assert devices.trace_device() is False  # two GPUs: one plan per replica, no single pool to trace
    devices.reset_device_peaks()
    assert ("gtbm", "GPU:0") in resets and ("gtbm", "GPU:1") in resets
    saved = devices.cap_at(256 << 20)  # what a session does under a budget of 256 MiB
    assert limits == {"GPU:0": 256 << 20, "GPU:1": 256 << 20}
    devices.restore_limits(saved)  # and at the end of the fit
    assert limits == {"GPU:0": 1 << 30, "GPU:1": 1 << 30}
    monkeypatch.setattr(devices, "training_gpus", lambda: ["GPU:0"])
    assert devices.trace_device() == "GPU:0"  # the probe and the dashboard trace that GPU's pool
    monkeypatch.setattr(devices, "training_gpus", lambda: list(pools))
    served.discard("GPU:1")  # one GPU on TF's allocator: GTBM's pools no longer describe the device set
    assert devices.device_memory_stats() == {"bytes_in_use": 1, "peak_bytes_in_use": 2, "peak_bytes_reserved": 2}
    assert devices.cap_at(256 << 20) == {} and limits["GPU:0"] == 1 << 30


def test_device_memory_stats_are_gtbms_on_the_cpu():
    from dymem_tf.memory import allocator

    assert devices.training_gpus() == []
    assert devices.trace_device() is (None if allocator.is_active() else False)
    stats = devices.device_memory_stats()
    assert (stats is None) == (not allocator.is_active())
    if stats is not None:
        assert stats["peak_bytes_reserved"] >= stats["peak_bytes_in_use"] >= 0


def _gpu_graph_ops():
    """Ops of a graph built under ``/device:GPU:0`` (no placement happens: this machine has no GPU), by name."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:GPU:0"):
        x = tf.compat.v1.placeholder(tf.float32, [None, 8], name="x")
        tf.shape(x, out_type=tf.int64, name="shape64")
        tf.size(x, out_type=tf.int64, name="size64")
        tf.raw_ops.ShapeN(input=[x, x], out_type=tf.int64, name="shapes64")
        tf.raw_ops.BroadcastGradientArgs(s0=tf.constant([2, 1], tf.int64), s1=tf.constant([1, 3], tf.int64),
                                         name="bga64")
        tf.reshape(x, tf.constant([-1], tf.int64), name="flat")
        tf.matmul(x, tf.ones([8, 2]), name="mm")
    return {op.name: op for op in graph.get_operations()}


def test_the_wheel_registers_gpu_kernels_that_keep_shape_outputs_in_host_memory():
    from dymem_tf import compat

    gpu = [k for k in compat.registered_kernel_defs("Shape") if k.device_type == "GPU"]
    if not gpu:
        pytest.skip("this TensorFlow registers no GPU kernels")
    assert all("output" in k.host_memory_arg for k in gpu)
    assert compat.registered_op_def("Shape").output_arg[0].name == "output"
    assert compat.registered_kernel_defs("NoSuchOp") == [] and compat.registered_op_def("NoSuchOp") is None


@pytest.mark.parametrize("name, expected", [
    ("shape64", {0}), ("size64", {0}), ("shapes64", {0, 1}),  # GPU kernels: HostMemory("output")
    ("bga64", {0, 1}),  # no GPU kernel: TF falls back to the DEVICE_DEFAULT one, HostMemory("r0", "r1")
    ("flat", set()), ("mm", set())])  # a float Reshape's and a MatMul's outputs stay on the device
def test_host_memory_outputs_follow_the_kernel_registry(name, expected):
    from dymem_tf import compat
    from dymem_tf.passes.host_memory import host_memory_outputs

    if "GPU" not in compat.registered_kernel_devices("Shape"):
        pytest.skip("this TensorFlow registers no GPU kernels")
    op = _gpu_graph_ops()[name]
    assert host_memory_outputs(op, "GPU") == expected


def test_in_host_memory_asks_the_registry_only_on_accelerators():
    from dymem_tf import compat
    from dymem_tf.passes.graph_capture import in_host_memory

    if "GPU" not in compat.registered_kernel_devices("Shape"):
        pytest.skip("this TensorFlow registers no GPU kernels")
    ops = _gpu_graph_ops()
    shape, mm = ops["shape64"], ops["mm"]
    assert in_host_memory(shape.device, "int64", shape, 0)
    # the CPU kernel registers HostMemory("output") too, but on the CPU host memory is the device's memory
    assert not in_host_memory("/job:localhost/replica:0/task:0/device:CPU:0", "int64", shape, 0)
    assert not in_host_memory(shape.device, "int64")  # without the op only the dtype rule applies
    assert in_host_memory(mm.device, "int32") and not in_host_memory(mm.device, "float32", mm, 0)


def test_the_kernel_registry_is_read_once_per_op_type_and_device_type(monkeypatch):
    from dymem_tf import compat
    from dymem_tf.passes import host_memory

    calls = []
    original = compat.registered_kernel_defs
    monkeypatch.setattr(compat, "registered_kernel_defs", lambda op_type: calls.append(op_type) or original(op_type))
    host_memory.kernel_host_args.cache_clear()
    host_memory._registers_host_outputs.cache_clear()  # pylint: disable=protected-access
    try:
        ops = _gpu_graph_ops()
        for _ in range(3):
            for op in ops.values():
                host_memory.host_memory_outputs(op, "GPU")
        # one read per (op type, device type) met ("DEFAULT" too, for ops no GPU kernel matches), none after
        info = host_memory.kernel_host_args.cache_info()
        assert len(calls) == info.currsize and info.hits > 0
        assert calls.count("BroadcastGradientArgs") == 2  # GPU, then DEFAULT
    finally:
        host_memory.kernel_host_args.cache_clear()


# ------------------------------------------------------------------------------------------------------------------
# GTBM serving GPU memory (issue #12, item 2): opt-in DYMEM_GTBM_GPU=1. No GPU here: what runs is the opt-in without
# a GPU, the symbols and layout the hook relies on, TF's memory-growth rule, and the region + placement code of the
# hook through a host stand-in for TF's GPU sub-allocator.
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from dymem_tf.memory import allocator, native  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, **env) -> dict:
    """Runs `script` in a fresh interpreter with `env` added; returns the JSON it prints last."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("DYMEM_")}
    full.update(env, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


OPT_IN_WITHOUT_GPU = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import tensorflow as tf
    import dymem_tf
    from dymem_tf.memory import allocator
    total = float(tf.reduce_sum(tf.ones([64, 64])))
    status = allocator.gpu_status()
print(json.dumps({"status": status, "serves": allocator.serves_gpu("GPU:0"), "cpu": allocator.is_active(),
                  "total": total, "warnings": [str(w.message) for w in caught if "GTBM" in str(w.message)]}))
"""


def test_gpu_opt_in_without_a_gpu_installs_the_hook_does_nothing_and_says_so():
    out = _run(OPT_IN_WITHOUT_GPU, DYMEM_GTBM_GPU="1")
    status = out["status"]
    assert status["requested"] and status["hook"] == "installed" and status["devices"] == {}
    assert "does nothing without a GPU" in status["summary"]
    assert out["serves"] is False and out["cpu"] is True and out["total"] == 4096.0
    assert out["warnings"] == []  # nothing went wrong: there is just no GPU


def test_gpu_not_requested_in_this_session():
    status = allocator.gpu_status()
    assert status["hook"] in ("not requested", "not loaded") and not status["requested"]
    assert "opt-in" in status["summary"] and not allocator.serves_gpu()


LATE_IMPORT = """
import json, warnings
import tensorflow as tf
tf.constant(1.0) + 1.0  # TF's runtime (and, on a GPU machine, its GPU devices) exists before dymem_tf loads
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dymem_tf
    from dymem_tf.memory import allocator
    status = allocator.gpu_status()
print(json.dumps({"hook": status["hook"], "warnings": [str(w.message) for w in caught if "GTBM" in str(w.message)]}))
"""


def test_gpu_opt_in_after_tensorflow_initialised_warns_once_and_runs_without_gtbm():
    out = _run(LATE_IMPORT, DYMEM_GTBM_GPU="1")
    assert out["hook"] == "not loaded"
    assert len(out["warnings"]) == 1 and "nor serve GPUs" in out["warnings"][0]


def test_gpu_device_arguments():
    with pytest.raises(allocator.GtbmNotActiveError, match="GPU:0"):
        allocator.memory_stats("GPU:0")
    with pytest.raises(allocator.GtbmNotActiveError):
        allocator.set_memory_limit("1GiB", device="/device:GPU:0")
    for call in (lambda: allocator.start_trace(10, device="GPU:0"), lambda: allocator.stop_trace("GPU:0"),
                 lambda: allocator.trace_info("GPU:0"), lambda: allocator.dump_trace("/nonexistent", "GPU:0")):
        with pytest.raises(allocator.GtbmNotActiveError, match="GPU:0"):  # the GPU pools' trace, none served here
            call()
    with pytest.raises(ValueError, match="unknown device"):
        allocator.get_memory_limit("TPU:0")
    assert allocator._gpu_index("/job:localhost/replica:0/task:0/device:GPU:3") == 3
    assert allocator._gpu_index("CPU:0") is None


@pytest.mark.parametrize("force, option, expected", [
    (None, 0, 0), (None, 1, 1), ("true", 0, 1), ("false", 1, 0), ("bogus", 1, 1), ("bogus", 0, 0)])
def test_memory_growth_rule_matches_tensorflows(monkeypatch, force, option, expected):
    """GTBM refuses memory growth (the GPU stays on TF's allocator); it reads growth as TF does, including
    TF_FORCE_GPU_ALLOW_GROWTH (exactly "true"/"false", anything else ignored)."""
    if force is None:
        monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    else:
        monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", force)
    lib = allocator._declare(native.gtbm_cdll())
    assert lib.dymem_gtbm_gpu_allow_growth(option) == expected


def _nm(path: str, *flags: str) -> set[str]:
    """Demangled dynamic symbol names of `path` (nm -D -C with `flags`)."""
    out = subprocess.run(["nm", "-D", "-C", *flags, path], capture_output=True, text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"^\s*(?:[0-9a-f]+\s+)?[A-Za-z]\s+(.+)$", out, re.M)}


def test_the_gpu_hook_is_compiled_and_every_tf_symbol_it_needs_is_exported():
    import tensorflow as tf

    lib = allocator._declare(native.gtbm_cdll())
    assert lib.dymem_gtbm_gpu_compiled() == int(tf.test.is_built_with_gpu_support())
    if not tf.test.is_built_with_gpu_support():
        pytest.skip("TensorFlow without GPU support: the hook is not compiled")
    ours = native.library_path("gtbm")
    framework = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    needed = {s for s in _nm(ours, "--undefined-only")
              if "GPUProcessState" in s or "SubAllocator" in s or "absl" in s and "Mutex" in s}
    assert any("GPUProcessState::singleton" in s for s in needed)
    assert any("GPUProcessState::GetGPUAllocator" in s for s in needed)
    exported = _nm(framework, "--defined-only")
    assert needed - exported == set()


@pytest.mark.parametrize("threads, seed, region, base_alignment, refuse_above", [
    (1, 1, 64 << 20, 0, 0),
    (8, 2, 64 << 20, 0, 0),
    (4, 3, 32 << 20, 256, 0),          # a base aligned like cudaMalloc's (256 B): larger alignments are refused
    (4, 4, 96 << 20, 0, 80 << 20),     # the sub-allocator refuses the full size: backs off by 10% steps
    (6, 5, (3 << 20) + 12345, 4096, 0),  # a small limit: smaller pageblocks
])
def test_region_allocator_through_a_host_stand_in_for_the_gpu_sub_allocator(threads, seed, region, base_alignment,
                                                                              refuse_above):
    """The hook's own code path (NewDeviceRegionAllocator -> RegionAllocator -> gtbm::Pool) over host memory:
    random sizes, alignments and mobility groups from several threads; every buffer's bytes checked on free; the
    budget, the statistics, the trace and the invariants checked at the end; the region given back once."""
    report = allocator.region_selftest(threads=threads, ops_per_thread=3000, seed=seed, region_bytes=region,
                                       base_alignment=base_alignment, refuse_above=refuse_above)
    assert report["allocations"] > 1000 and report["sub_allocs"] == report["sub_frees"] == 1
    assert region // 2 <= report["capacity"] <= region
    if refuse_above:
        assert report["capacity"] <= refuse_above
    if base_alignment:
        assert report["max_alignment"] == base_alignment and report["over_aligned"] > 0


def test_region_selftest_reports_invalid_arguments():
    with pytest.raises(RuntimeError, match="invalid"):
        allocator.region_selftest(base_alignment=3)


def test_the_out_of_memory_hint_on_a_gpu_names_the_gpu_not_the_cpu_pool(monkeypatch):
    """On a GPU the step's memory is the GPU's: the hint must not send the user to DYMEM_DEVICE_MEMORY_LIMIT (the
    CPU device's pool, which does nothing there) but say what frees or enlarges GPU memory (faked device list)."""
    from dymem_tf.keras import callback

    monkeypatch.setattr(devices, "training_gpus", lambda: ["GPU:0"])
    monkeypatch.setattr(devices, "device_memory_capacity", lambda: 40 << 30)
    hint = callback.DymemCallback(memory_budget="30GiB", verbose=0).out_of_memory_hint()
    assert "DYMEM_DEVICE_MEMORY_LIMIT" not in hint and "set_memory_limit" not in hint and "GTBM device" not in hint
    assert "GPU:0" in hint and "40.0 GiB" in hint and "memory_budget=30.0 GiB" in hint
    assert "lower the batch size" in hint and "GPU with more memory" in hint
    monkeypatch.setattr(devices, "training_gpus", lambda: [])  # the CPU keeps its own advice
    assert "GPU" not in callback.DymemCallback(memory_budget=None, verbose=0).out_of_memory_hint()


def test_an_unknown_gpu_says_which_profile_it_falls_back_to(monkeypatch):
    import tensorflow as tf

    from dymem_tf import compat
    from dymem_tf.keras import arguments

    warned = []
    monkeypatch.setattr(compat, "warn_user", warned.append)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU:0"] if kind == "GPU" else [])
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"])
    monkeypatch.setattr(tf.config.experimental, "get_device_details", lambda gpu: {"device_name": next(names)})
    assert arguments.default_device_profile() == "h100" and warned == []
    assert arguments.default_device_profile() == "a100"
    assert len(warned) == 1 and "NVIDIA GeForce RTX 4090" in warned[0] and "'a100'" in warned[0]
    assert "profile=" in warned[0]
