"""Hardware profiles for the cost model: compute rate, memory bandwidth, host link, memory size, per-op overhead.

The GPU presets use vendor datasheet numbers for dense FP32 (non-tensor-core) throughput and HBM bandwidth, and
*effective* host-link bandwidths for pinned-memory copies (what ``cudaMemcpyAsync`` reaches, roughly 75-85 % of the
link's theoretical rate). They are starting points: :func:`dymem_tf.planning.cost_model.calibrate` rescales compute so that
the modelled step matches a measured one, and any field can be overridden through :func:`get_profile`.

Every copy costs ``bytes / rate + link_latency_s + copy_completion_s`` (:meth:`CostModel.copy_time
<dymem_tf.planning.cost_model.CostModel.copy_time>`); the planner places each swap-in's trigger that long before its
consumer (the *trigger lead*), and the simulator releases a swapped tensor's consumers that late. The two fixed
terms, per copy, from TensorFlow 2.21's source (not measured on a GPU: none has run this code):

* ``link_latency_s``: issuing the copy (``cudaMemcpyAsync`` on TF's host-to-device or device-to-host stream, after a
  cross-stream event wait) until the DMA moves data: a few microseconds over PCIe, ~2 us over NVLink-C2C.
* ``copy_completion_s``: the DMA has ended, but the swap op finishes only when TF notices. The GPU kernels
  (``cc/ops/swap_ops.cc``) copy through ``GPUDeviceContext``, whose ``done`` callback runs from TF's ``EventMgr``
  (``core/common_runtime/device/device_event_mgr.cc``): one polling thread queries the stream's events, sleeps
  ``polling_active_delay_usecs`` between rounds (default 10 us, ``GPUOptions.Experimental`` can change it), and hands
  each completed callback to a two-thread pool, from which the executor schedules the consumer. Worst case: one
  10 us polling period plus the event query and the thread hand-off (~5 us), so 15 us. On the CPU the swap kernels
  copy synchronously inside the op: no completion latency.

The simulator and planner also charge the completion latency to the copy channel, which over-counts its busy time
by ~15 us per copy (the next DMA can start before the host has noticed the previous one): conservative, and small
against a feature map's copy (a 10 MiB tensor takes ~200 us at 50 GB/s).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class DeviceProfile:
    """One device and its host link. Rates are per second; ``link_latency_s`` (issuing a copy until the DMA moves
    data) and ``copy_completion_s`` (the DMA's end until TensorFlow completes the op: GPU event polling) are added to
    every copy (see the module's docstring for the values' source)."""

    name: str
    flops_per_s: float
    mem_bandwidth_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    link: str
    memory_bytes: int
    op_overhead_s: float
    link_latency_s: float = 10e-6
    copy_completion_s: float = 0.0

    def replace(self, **overrides: object) -> "DeviceProfile":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **overrides)  # type: ignore[arg-type]


#: Copy-completion latency of TF's GPU device context: one EventMgr polling period (10 us by default) plus the event
#: query and the hand-off to its callback threads (~5 us); see the module's docstring.
GPU_COPY_COMPLETION_S = 15e-6
#: Issue latency of a pinned-memory ``cudaMemcpyAsync`` over PCIe (launch, cross-stream wait, DMA start).
PCIE_LINK_LATENCY_S = 5e-6

# The CPU default is what TensorFlow reaches on a 2-core AVX-512 cloud VM of this project: numpy's matmul peaks near
# 150 GFLOP/s there and oneDNN convolutions reach ~100 GFLOP/s (ResNet-50 at 64x64, batch 32: ~60 GFLOP and ~8 GB
# of memory traffic per step, measured ~0.7 s); a large memcpy ~10-16 GB/s (so ~30 GB/s of memory traffic); TF
# executor overhead ~10 us/op. The "device" is the CPU device and the "host" is a second pool in
# the same DRAM, so both copy directions are a memcpy. calibrate_cpu() measures the machine at hand.
_CPU = DeviceProfile(
    name="cpu", flops_per_s=100e9, mem_bandwidth_bytes_per_s=30e9, h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9,
    link="memcpy (same DRAM)", memory_bytes=16 * GiB, op_overhead_s=10e-6, link_latency_s=5e-6)

PRESETS: dict[str, DeviceProfile] = {
    "cpu": _CPU,
    # NVIDIA V100 (SXM2/PCIe): 15.7 / 14 TFLOP/s FP32, 900 GB/s HBM2, 16/32 GB; host link PCIe 3.0 x16
    # (15.75 GB/s theoretical, ~12 GB/s effective with pinned memory).
    "v100": DeviceProfile("v100", 14e12, 900e9, 12e9, 12e9, "PCIe 3.0 x16", 32 * GiB, 8e-6,
                          PCIE_LINK_LATENCY_S, GPU_COPY_COMPLETION_S),
    # NVIDIA A100 40 GB: 19.5 TFLOP/s FP32, 1555 GB/s HBM2e; PCIe 4.0 x16 (31.5 GB/s theoretical, ~24 effective).
    "a100": DeviceProfile("a100", 19.5e12, 1555e9, 24e9, 24e9, "PCIe 4.0 x16", 40 * GiB, 6e-6,
                          PCIE_LINK_LATENCY_S, GPU_COPY_COMPLETION_S),
    # NVIDIA H100 SXM5 80 GB: 67 TFLOP/s FP32, 3.35 TB/s HBM3; PCIe 5.0 x16 host link (63 GB/s theoretical,
    # ~50 effective).
    "h100": DeviceProfile("h100", 67e12, 3350e9, 50e9, 50e9, "PCIe 5.0 x16", 80 * GiB, 5e-6,
                          PCIE_LINK_LATENCY_S, GPU_COPY_COMPLETION_S),
    # NVIDIA H200 141 GB: 67 TFLOP/s FP32, 4.8 TB/s HBM3e; in an x86 server the host link is PCIe 5.0 x16
    # (~55 GB/s effective). The NVLink-C2C variant is the separate "gh200" preset.
    "h200": DeviceProfile("h200", 67e12, 4800e9, 55e9, 55e9, "PCIe 5.0 x16", 141 * GiB, 5e-6,
                          PCIE_LINK_LATENCY_S, GPU_COPY_COMPLETION_S),
    # NVIDIA GH200 Grace Hopper (144 GB HBM3e module): 67 TFLOP/s FP32, 4.9 TB/s HBM3e; CPU-GPU NVLink-C2C
    # 900 GB/s bidirectional = 450 GB/s per direction.
    "gh200": DeviceProfile("gh200", 67e12, 4900e9, 450e9, 450e9, "NVLink-C2C", 144 * GiB, 5e-6, 2e-6,
                           GPU_COPY_COMPLETION_S),
}


def known_profiles() -> list[str]:
    """Names accepted by :func:`get_profile`."""
    return sorted(PRESETS)


def get_profile(name_or_profile: str | DeviceProfile, **overrides: object) -> DeviceProfile:
    """A preset by name (case-insensitive) or a given profile, with fields overridden by keyword.

    ``get_profile("h200", h2d_bytes_per_s=25e9)``. Raises ValueError for unknown names or fields.
    """
    if isinstance(name_or_profile, DeviceProfile):
        profile = name_or_profile
    else:
        key = str(name_or_profile).strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown device profile {name_or_profile!r}; known profiles: {', '.join(known_profiles())}")
        profile = PRESETS[key]
    if overrides:
        valid = {f.name for f in dataclasses.fields(DeviceProfile)}
        bad = sorted(set(overrides) - valid)
        if bad:
            raise ValueError(f"unknown DeviceProfile field(s) {bad}; fields: {sorted(valid)}")
        profile = profile.replace(**overrides)
    return profile


def calibrate_cpu(budget_s: float = 0.5) -> DeviceProfile:
    """Measure this machine (numpy matmul FLOP/s and memcpy bandwidth) in well under a second.

    Returns the "cpu" preset with ``flops_per_s``, ``mem_bandwidth_bytes_per_s`` and both copy rates measured.
    The numbers are best-of-several timings (peak rates: a TF step reaches a fraction of the matmul rate, which
    :func:`dymem_tf.planning.cost_model.calibrate` can correct against a measured step; dymem_tf itself does not call it).
    """
    import numpy as np

    deadline = time.perf_counter() + max(budget_s, 0.05)
    n = 256
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    best_mm = float("inf")
    a @ b  # warm-up (BLAS thread start)
    for _ in range(20):
        t0 = time.perf_counter()
        a @ b
        best_mm = min(best_mm, time.perf_counter() - t0)
        if time.perf_counter() > deadline - budget_s / 2:
            break
    flops = 2.0 * n**3 / max(best_mm, 1e-9)

    src = np.ones(16 * 1024 * 1024 // 4, dtype=np.float32)  # 16 MiB: well beyond the caches
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best_cp = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best_cp = min(best_cp, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    copy_bw = src.nbytes / max(best_cp, 1e-9)
    # A memcpy reads and writes every byte: the memory system moves twice the copied bytes.
    return _CPU.replace(flops_per_s=flops, mem_bandwidth_bytes_per_s=2 * copy_bw,
                        h2d_bytes_per_s=copy_bw, d2h_bytes_per_s=copy_bw, name="cpu")
