"""The GPU path's Python side, on the CPU (issue #12, item 3): the device's capacity is read without a second
device set, and the GPU profiles charge the copy-completion latency (event polling) to every copy."""
from __future__ import annotations

import pytest

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
    from dymem_tf.keras import callback

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
    assert callback.device_memory_capacity() is None


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

    from dymem_tf.keras import callback

    infos = {"GPU:0": {"current": 100, "peak": 700}, "GPU:1": {"current": 300, "peak": 500}}
    resets = []
    monkeypatch.setattr(callback, "training_gpus", lambda: list(infos))
    monkeypatch.setattr(tf.config.experimental, "get_memory_info", lambda gpu: infos[gpu])
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", resets.append)
    assert callback.device_memory_stats() == {"bytes_in_use": 300, "peak_bytes_in_use": 700,
                                              "peak_bytes_reserved": 700}
    callback.reset_device_peaks()
    assert resets == ["GPU:0", "GPU:1"]
    cb = callback.DymemCallback(memory_budget="1MiB", verbose=0)
    cb._cap_device_at_budget()
    assert cb._saved_limit is None  # the CPU pool keeps its limit


def test_device_memory_stats_are_gtbms_on_the_cpu():
    from dymem_tf.keras import callback
    from dymem_tf.memory import allocator

    assert callback.training_gpus() == []
    stats = callback.device_memory_stats()
    assert (stats is None) == (not allocator.is_active())
    if stats is not None:
        assert stats["peak_bytes_reserved"] >= stats["peak_bytes_in_use"] >= 0
