// GTBM serving GPU memory (opt-in: DYMEM_GTBM_GPU=1; never run on a GPU so far, see docs/gpu.md).
//
// TensorFlow has no allocator registry for GPUs: BaseGPUDeviceFactory::CreateDevices asks
// GPUProcessState::singleton()->GetGPUAllocator(options, tf_device_id, total_bytes, peers) -- a virtual call -- for
// each GPU device it creates, with total_bytes the limit it computed (memory_limit, virtual devices). The singleton
// is a function-local static: the first call of GPUProcessState::singleton(ps) decides it. This file's static
// initializer (run when _dymem_gtbm loads, which dymem_tf arranges right after `import tensorflow`) makes that first
// call with a GtbmGpuProcessState when DYMEM_GTBM_GPU=1. If TensorFlow's own instance already exists, it is not
// installed and dymem_gtbm_gpu_hook_state() says so (Python warns once); nothing else changes.
//
// GtbmGpuProcessState::GetGPUAllocator lets the base class build TensorFlow's allocator as usual (a GPUBFCAllocator
// over a DeviceMemAllocator; the BFC takes no device memory until its first allocation, which never comes), then
// takes ONE region of total_bytes from that BFC's sub-allocator and serves the device from a RegionAllocator over
// it: the same pool, placement by mobility group, budget, statistics and trace as GTBM on the CPU device.
// It falls back to TensorFlow's allocator (with a message on stderr, and the reason in dymem_gtbm_gpu_reason) when:
//   - memory growth is on (set_memory_growth, GPUOptions.allow_growth, TF_FORCE_GPU_ALLOW_GROWTH=true): a region
//     taken up front would defeat it;
//   - TensorFlow's allocator is not its plain BFC allocator (TF_GPU_ALLOCATOR=cuda_malloc_async / cuda_malloc /
//     memory_guard, memory-type recording): there is no sub-allocator to take the region from;
//   - the region cannot be allocated, even at half the size.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../gtbm/gtbm_core.h"
#include "c_api_util.h"
#include "config.h"
#include "region_allocator.h"

#ifndef DYMEM_GPU_KERNELS
#define DYMEM_GPU_KERNELS 0
#endif
#if DYMEM_GPU_KERNELS
#include "tensorflow/core/common_runtime/gpu/gpu_bfc_allocator.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"
#endif

namespace dymem {
namespace {

constexpr char kGpuEnv[] = "DYMEM_GTBM_GPU";

// dymem_gtbm_gpu_hook_state values.
enum HookState : int { kNotRequested = 0, kInstalled = 1, kNotInstalled = 2, kNotCompiled = 3 };

// One GPU device TensorFlow asked an allocator for.
struct GpuEntry {
  int tf_device_id = -1;
  uint64_t total_bytes = 0;
  RegionAllocator* allocator = nullptr;  // nullptr: TensorFlow's own allocator serves it (see reason)
  std::string reason;
};

std::mutex g_gpu_mu;
std::vector<GpuEntry>* g_gpu_entries = new std::vector<GpuEntry>();  // guarded by g_gpu_mu; leaked on purpose
HookState g_hook_state = kNotRequested;                               // written once, by the static initializer
std::string* g_hook_reason = new std::string();

// The entry of `tf_device_id`, or nullptr; g_gpu_mu held.
GpuEntry* FindEntryLocked(int tf_device_id) {
  for (GpuEntry& e : *g_gpu_entries) {
    if (e.tf_device_id == tf_device_id) return &e;
  }
  return nullptr;
}

// TF's rule (GetAllowGrowthValue in TF's GPU BFC set-up): TF_FORCE_GPU_ALLOW_GROWTH "true"/"false" overrides the
// option; any other value is ignored.
bool AllowGrowth(bool option) {
  const char* force = std::getenv("TF_FORCE_GPU_ALLOW_GROWTH");
  if (force == nullptr) return option;
  if (std::strcmp(force, "true") == 0) return true;
  if (std::strcmp(force, "false") == 0) return false;
  return option;
}

#if DYMEM_GPU_KERNELS

// Records what serves `tf_device_id` and says it on stderr; g_gpu_mu held. Returns the entry.
GpuEntry* RecordLocked(int tf_device_id, uint64_t total_bytes, RegionAllocator* allocator, const std::string& why) {
  g_gpu_entries->push_back(GpuEntry{tf_device_id, total_bytes, allocator, why});
  if (allocator != nullptr) {
    std::fprintf(stderr, "dymem_tf GTBM: serves GPU:%d from one region of %llu bytes (DYMEM_GTBM_GPU=1)\n",
                 tf_device_id, static_cast<unsigned long long>(allocator->pool()->Stats().capacity));
  } else {
    std::fprintf(stderr, "dymem_tf GTBM: GPU:%d stays on TensorFlow's own allocator: %s\n", tf_device_id,
                 why.c_str());
  }
  return &g_gpu_entries->back();
}

// The GPUProcessState whose GetGPUAllocator serves each GPU from GTBM (see the top of this file).
class GtbmGpuProcessState final : public tensorflow::GPUProcessState {
 public:
  GtbmGpuProcessState() = default;

  // TensorFlow's allocator for the device is built first; GTBM replaces it when it can (else it is returned).
  tensorflow::Allocator* GetGPUAllocator(const tensorflow::GPUOptions& options, tsl::TfDeviceId tf_device_id,
                                         size_t total_bytes,
                                         const std::vector<tsl::TfDeviceId>& peer_gpu_ids) override {
    tensorflow::Allocator* tf_allocator =
        GPUProcessState::GetGPUAllocator(options, tf_device_id, total_bytes, peer_gpu_ids);
    if (tf_allocator == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(g_gpu_mu);
    GpuEntry* entry = FindEntryLocked(tf_device_id.value());
    if (entry == nullptr) {
      std::string why;
      RegionAllocator* gtbm = Build(options, tf_device_id.value(), total_bytes, tf_allocator, &why);
      entry = RecordLocked(tf_device_id.value(), total_bytes, gtbm, why);
    }
    return entry->allocator != nullptr ? entry->allocator : tf_allocator;
  }

 private:
  // GTBM for the device, or nullptr with *why set. Lives for the process, as TensorFlow's GPU allocators do.
  RegionAllocator* Build(const tensorflow::GPUOptions& options, int id, size_t total_bytes,
                         tensorflow::Allocator* tf_allocator, std::string* why) {
    if (AllowGrowth(options.allow_growth())) {
      *why = "memory growth is on (set_memory_growth, allow_growth or TF_FORCE_GPU_ALLOW_GROWTH=true), and GTBM "
             "takes the device's whole memory limit up front; turn growth off (or cap the device with a "
             "memory_limit) to use GTBM";
      return nullptr;
    }
    tsl::SubAllocator* sub = TfSubAllocator(id, tf_allocator, why);
    if (sub == nullptr) return nullptr;
    std::unique_ptr<RegionAllocator> gtbm =
        NewDeviceRegionAllocator("GPU_" + std::to_string(id) + "_gtbm", total_bytes, sub, /*owned=*/false, why);
    return gtbm.release();
  }

  // The sub-allocator of TensorFlow's BFC allocator for `id` when that BFC is what TF returned; else nullptr.
  tsl::SubAllocator* TfSubAllocator(int id, tensorflow::Allocator* tf_allocator, std::string* why) {
    tensorflow::mutex_lock lock(mu_);
    if (id < 0 || static_cast<size_t>(id) >= gpu_allocators_.size()) {
      *why = "TensorFlow has no allocator record for this device";
      return nullptr;
    }
    const AllocatorParts& parts = gpu_allocators_[id];
    const tensorflow::Allocator* bfc = parts.bfc_allocator;
    if (bfc == nullptr || parts.sub_allocator == nullptr || bfc != tf_allocator) {
      const char* env = std::getenv("TF_GPU_ALLOCATOR");
      *why = std::string("TensorFlow's allocator for this device is not its plain BFC allocator (TF_GPU_ALLOCATOR=") +
             (env != nullptr ? env : "unset") + "), so there is no sub-allocator to take GTBM's region from";
      return nullptr;
    }
    return parts.sub_allocator;
  }
};

// ABI checks against the wheel's libtensorflow_framework.so.2 (TF 2.21: `operator new(0x98)` in
// GPUProcessState::singleton): a subclass must have the base's layout, or its members would be misplaced.
static_assert(sizeof(tensorflow::GPUProcessState) == 0x98, "GPUProcessState's layout differs from TF 2.21's");

// Makes the first GPUProcessState::singleton call with a GtbmGpuProcessState; false when TF's already existed.
bool TryInstall() {
  auto* ours = new GtbmGpuProcessState();
  if (tensorflow::GPUProcessState::singleton(ours) == ours) return true;
  delete ours;
  return false;
}

#endif  // DYMEM_GPU_KERNELS

// Static initializer: installs the GPU hook when DYMEM_GTBM_GPU=1 (see the top of this file).
int InstallFromEnv() {
  if (!FlagFromEnv(kGpuEnv, false)) return g_hook_state = kNotRequested;
#if DYMEM_GPU_KERNELS
  if (TryInstall()) return g_hook_state = kInstalled;
  *g_hook_reason = "TensorFlow's GPU process state already existed when dymem_tf's allocator library loaded "
                   "(import dymem_tf right after tensorflow, before any tensor or device is created)";
  std::fprintf(stderr, "dymem_tf GTBM: %s=1 but GTBM cannot serve GPUs: %s\n", kGpuEnv, g_hook_reason->c_str());
  return g_hook_state = kNotInstalled;
#else
  *g_hook_reason = "this build has no GPU support (TensorFlow without GPU: DYMEM_GPU_KERNELS is not set)";
  return g_hook_state = kNotCompiled;
#endif
}

const int g_installed = InstallFromEnv();

// The GTBM allocator serving GPU `tf_device_id`, or nullptr with the last error set; g_gpu_mu held.
RegionAllocator* ServedLocked(int tf_device_id) {
  const GpuEntry* entry = FindEntryLocked(tf_device_id);
  if (entry != nullptr && entry->allocator != nullptr) return entry->allocator;
  SetError("GTBM does not serve GPU:" + std::to_string(tf_device_id) +
           (entry != nullptr ? ": " + entry->reason : std::string(": TensorFlow created no such GPU device with the "
                                                                   "GTBM hook installed")));
  return nullptr;
}

// Runs `f(pool)` on the pool serving GPU `tf_device_id` under g_gpu_mu; -1 with the last error when none does.
template <typename F>
int WithGpuPool(int tf_device_id, F&& f) {
  return Guard([&]() -> int {
    std::lock_guard<std::mutex> lock(g_gpu_mu);
    RegionAllocator* a = ServedLocked(tf_device_id);
    return a == nullptr ? -1 : f(a->pool());
  });
}

}  // namespace
}  // namespace dymem

// ---------------------------------------------------------------------------------------------------------------
// C API of the GPU hook (ctypes from dymem_tf/memory/allocator.py). int functions: 0 / a count, or -1 with
// dymem_gtbm_last_error() set; nothing throws across this boundary.
extern "C" {

// 1 when the GPU hook is compiled in (TensorFlow with GPU support), else 0.
int dymem_gtbm_gpu_compiled(void) { return DYMEM_GPU_KERNELS ? 1 : 0; }

// 0 not requested (DYMEM_GTBM_GPU unset or 0), 1 installed, 2 requested but not installed, 3 not compiled.
int dymem_gtbm_gpu_hook_state(void) { return dymem::g_installed >= 0 ? dymem::g_hook_state : 0; }

// Why the hook is not installed (empty when it is or was not requested).
const char* dymem_gtbm_gpu_hook_reason(void) { return dymem::g_hook_reason->c_str(); }

// TF's memory-growth rule for an option value (0/1) under the current TF_FORCE_GPU_ALLOW_GROWTH: 1 or 0.
int dymem_gtbm_gpu_allow_growth(int option) { return dymem::AllowGrowth(option != 0) ? 1 : 0; }

// Number of GPU devices TensorFlow asked the hook for an allocator (served or not).
int dymem_gtbm_gpu_num_devices(void) {
  std::lock_guard<std::mutex> lock(dymem::g_gpu_mu);
  return static_cast<int>(dymem::g_gpu_entries->size());
}

// 1 when GTBM serves GPU `tf_device_id`, else 0 (dymem_gtbm_last_error says why).
int dymem_gtbm_gpu_serves(int tf_device_id) {
  return dymem::WithGpuPool(tf_device_id, [](gtbm::Pool*) { return 1; }) == 1 ? 1 : 0;
}

// Statistics of GPU `tf_device_id`'s pool, in gtbm::StatNames order: writes min(n, count), returns the count.
int dymem_gtbm_gpu_get_stats(int tf_device_id, int64_t* out, int n) {
  if (out == nullptr || n < 0) return dymem::SetError("invalid output array");
  return dymem::WithGpuPool(tf_device_id, [&](gtbm::Pool* pool) { return gtbm::FlattenStats(pool->Stats(), out, n); });
}

// Budget of GPU `tf_device_id`'s pool (at most its region); fails below the bytes in use.
int dymem_gtbm_gpu_set_limit(int tf_device_id, int64_t bytes) {
  if (bytes <= 0) return dymem::SetError("the memory limit must be positive");
  return dymem::WithGpuPool(tf_device_id, [&](gtbm::Pool* pool) {
    std::string error;
    return pool->SetLimit(static_cast<uint64_t>(bytes), &error) ? 0 : dymem::SetError(error);
  });
}

// Budget of GPU `tf_device_id`'s pool, or -1.
int64_t dymem_gtbm_gpu_get_limit(int tf_device_id) {
  int64_t limit = -1;
  dymem::WithGpuPool(tf_device_id, [&](gtbm::Pool* pool) {
    limit = static_cast<int64_t>(pool->limit());
    return 0;
  });
  return limit;
}

// Peaks of GPU `tf_device_id`'s pool restart from the current values.
int dymem_gtbm_gpu_reset_peak_stats(int tf_device_id) {
  return dymem::WithGpuPool(tf_device_id, [](gtbm::Pool* pool) {
    pool->ResetPeaks();
    return 0;
  });
}

// Trace of GPU `tf_device_id`'s pool: start (max_records > 0), stop, dump as CSV (gtbm::Pool::DumpTrace).
int dymem_gtbm_gpu_trace_start(int tf_device_id, int64_t max_records) {
  if (max_records <= 0) return dymem::SetError("max_records must be positive");
  return dymem::WithGpuPool(tf_device_id, [&](gtbm::Pool* pool) {
    pool->StartTrace(static_cast<uint64_t>(max_records));
    return 0;
  });
}

// Stops GPU `tf_device_id`'s trace (kept for dymem_gtbm_gpu_trace_dump).
int dymem_gtbm_gpu_trace_stop(int tf_device_id) {
  return dymem::WithGpuPool(tf_device_id, [](gtbm::Pool* pool) {
    pool->StopTrace();
    return 0;
  });
}

// Writes min(n, 5) of {active, records, dropped, events, max_records} of GPU `tf_device_id`'s trace; returns 5.
int dymem_gtbm_gpu_trace_info(int tf_device_id, int64_t* out, int n) {
  if (out == nullptr || n < 0) return dymem::SetError("invalid output array");
  return dymem::WithGpuPool(tf_device_id,
                            [&](gtbm::Pool* pool) { return gtbm::FlattenTraceInfo(pool->GetTraceInfo(), out, n); });
}

// Writes GPU `tf_device_id`'s trace to `path`.
int dymem_gtbm_gpu_trace_dump(int tf_device_id, const char* path) {
  if (path == nullptr) return dymem::SetError("null path");
  return dymem::WithGpuPool(tf_device_id, [&](gtbm::Pool* pool) {
    std::string error;
    return pool->DumpTrace(path, &error) ? 0 : dymem::SetError(error);
  });
}

}  // extern "C"
