// GTBM as TensorFlow's CPU device allocator: a RegionAllocator (region_allocator.h) over an mmap'ed range.
//
// The device region maps the GTBM core's offset space onto one virtual address range reserved with
// mmap(PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE): pages are only backed when touched, and
// pageblocks that go back to the shared free list are madvise(MADV_DONTNEED)'ed -- beyond a small cache of free
// blocks kept resident for immediate reuse (DYMEM_GTBM_RELEASE_CACHE) -- so the resident memory of the pool follows
// bytes_reserved (+ cached_free_bytes). The budget (DYMEM_DEVICE_MEMORY_LIMIT, or dymem_gtbm_set_limit at run time)
// caps bytes_reserved; an allocation beyond it returns nullptr, which TensorFlow turns into a ResourceExhausted
// error, as on a full GPU.
//
// Mobility of each allocation, first match wins:
//   1. the innermost dymem_gtbm_push_mobility() of the allocating thread (the swap kernels use it);
//   2. the op's entry in the mobility map installed from Python (executing op name -> group);
//   3. the annotation TF's runtimes set around every kernel (tsl::profiler::ScopedMemoryDebugAnnotation):
//      - no op at all (tensors made from Python values, runtime set-up)              -> PERSISTENT;
//      - a variable update (Assign*VariableOp, ResourceApply*): TF gives the variable a new buffer when the old
//        one is still shared (copy-on-write), and that buffer is the variable's storage -> PERSISTENT;
//      - a kernel of a tf.function, e.g. "StatefulPartitionedCall/model/conv1/Conv2D" -> TRANSIENT;
//      - the function-level annotation "__inference_..." with step id 0, which covers the allocations of a
//        running function that no kernel annotation claims                         -> TRANSIENT;
//      - an eager op: its annotation is the bare op name ("Fill", "VarHandleOp", no '/') with a fresh random
//        step id per op; eager ops build the variables and optimizer slots           -> PERSISTENT.
//   The step id alone cannot tell a train step from set-up work: on TF 2.21 eager ops carry non-zero step ids
//   and function-level allocations carry 0, hence the op-name test.
//
// Host memory for the input pipeline (DYMEM_HOST_INPUTS, default on; "0" counts everything, as before). The pool
// above is the emulated *device*: on a GPU, tf.data and the tensors it is built from live in host memory, not in
// the device's memory. Those allocations are served from a second arena ("host inputs") that the budget does not
// cap, reported as host_inputs_* in the statistics and left out of GetStats() (tf.config.experimental.
// get_memory_info('CPU:0') keeps reporting the device). An allocation goes to the host arena when, checked before
// the mobility map and the default rules above:
//   a. the allocating thread pushed the HOST override (dymem_gtbm_push_mobility(3)); dymem_tf does so around
//      tf.data's element normalization (tensorflow.python.data.util.structure.normalize_element), i.e. when
//      Dataset.from_tensors / from_tensor_slices -- and Keras's data adapter for NumPy inputs -- convert Python
//      values into tensors;
//   b. the thread is one of tf.data's (TF names the threads it starts; tf.data's are "tf_data_*": the private
//      thread pool running map functions, batching, shuffle buffers, and the prefetch threads);
//   c. the executing op is a tf.data op: iterator creation and element retrieval (MakeIterator, AnonymousIterator*,
//      Iterator*, e.g. a step's "IteratorGetNext", which re-creates or produces pipeline tensors on the calling
//      thread) or an eagerly run dataset constructor (a bare op name containing "Dataset").
//   d. only when the device pool refuses it, whatever the host-inputs setting: the annotation names a whole
//      function being instantiated (see IsFunctionInstantiation), whose constant folding cannot handle a refusal,
//      or there is no annotation at all: a tensor made from a Python value (TF_NewTensor copies into the buffer
//      without checking it), which would crash the process; a GPU would hold such a tensor in host memory too.
// Why not "no annotation means host": tensors converted from Python values carry no annotation, but so do the
// buffers that variables adopt: TF's AssignVariableOp takes over its input's buffer when it is the only reference,
// so tf.Variable(numpy_array), Variable.assign(numpy_array) and Keras's set_weights would leave weights uncounted.
// Eager ops stay on the device (a GPU runs them there, and variables and optimizer slots are built from their
// outputs); so do the step's kernels and variable updates. What the emulation still differs in: a GPU step copies
// each input batch from host to device memory; here the step reads the host batch, so one batch of inputs per step
// is not counted. (Also note TF issue #71744: since TF 2.17 a stock GPU run may place the tensors that
// from_tensor_slices converts on the GPU; the emulation models the input pipeline in host memory, as tf.data
// intends, and DYMEM_HOST_INPUTS=0 models the other case.)
//
// Registered with priority 300 (must exceed oneDNN's 200) from a static initializer: the library must be loaded
// before TensorFlow creates its CPU allocator (dymem_tf/memory/native.py makes sure of that).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "../gtbm/gtbm_core.h"
#include "c_api_util.h"
#include "config.h"
#include "mobility.h"
#include "region_allocator.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/allocator_registry.h"

namespace dymem {
namespace {

constexpr char kLimitEnv[] = "DYMEM_DEVICE_MEMORY_LIMIT";
constexpr char kReleaseCacheEnv[] = "DYMEM_GTBM_RELEASE_CACHE";
constexpr char kHostInputsEnv[] = "DYMEM_HOST_INPUTS";
// Host-inputs arena: address space reserved (NORESERVE, pages backed when touched) and free blocks kept resident.
constexpr uint64_t kMinHostSpace = uint64_t{1} << 30;
constexpr uint64_t kHostReleaseCache = uint64_t{64} << 20;
// Free blocks kept resident before madvise: releasing a block and faulting it back in moments later cost ~0.8 s per
// ResNet-50 step (64x64, batch 32: ~900 MiB of blocks cycle through the free list every step); a cache of a few
// hundred MiB removes almost all of it. Default min(256 MiB, budget / 8).
constexpr uint64_t kMaxDefaultReleaseCache = uint64_t{256} << 20;
constexpr uint64_t kReleaseCacheBudgetDivisor = 8;

using GtbmAllocator = RegionAllocator;

// The CPU device's regions from the environment: the budgeted device region (address space covering the budget
// and at least the default budget, so the limit can later be raised up to it; NORESERVE makes the unused part
// free) and the host-inputs region (no budget, one group, 2 MiB blocks).
RegionAllocatorOptions CpuOptions() {
  const uint64_t default_limit = std::min(PhysicalMemory(), kDefaultMaxLimit);
  const uint64_t limit = BytesFromEnv(kLimitEnv, default_limit);
  RegionAllocatorOptions options;
  options.name = "gtbm";
  gtbm::PoolOptions& device = options.device.pool;
  device.policy = gtbm::Policy::kGtbm;
  device.limit = limit;
  device.block_size = BlockSizeFor(limit);
  device.alignment = tensorflow::Allocator::kAllocatorAlignment;
  device.release_cache = BytesFromEnv(
      kReleaseCacheEnv, std::min(kMaxDefaultReleaseCache, limit / kReleaseCacheBudgetDivisor), /*allow_zero=*/true);
  options.device.space = std::max(limit, default_limit);
  options.device.min_space = limit;
  gtbm::PoolOptions& host = options.host.pool;
  host.policy = gtbm::Policy::kGtbmNoGroups;
  host.block_size = kDefaultBlockSize;
  host.alignment = tensorflow::Allocator::kAllocatorAlignment;
  host.release_cache = kHostReleaseCache;
  options.host.space = std::max(PhysicalMemory(), kDefaultMaxLimit);
  options.host.min_space = kMinHostSpace;
  return options;
}

// The CPU device's allocator, configured from the environment (DYMEM_HOST_INPUTS is applied here).
GtbmAllocator* NewCpuAllocator() {
  SetHostInputsEnabled(FlagFromEnv(kHostInputsEnv, true));
  return new RegionAllocator(CpuOptions(), NewMmapSource(), NewMmapSource());
}

// The process-wide instance. TF's AllocatorFactoryRegistry (a leaked singleton) keeps the pointer returned by
// CreateAllocator for the life of the process, so the instance is never destroyed; the sub-allocator shares it so
// that everything TF obtains through the registry counts against the one budget.
std::atomic<GtbmAllocator*> g_instance{nullptr};
std::atomic<bool> g_created_by_tf{false};
std::mutex g_instance_mu;

// The process-wide allocator, created on first use (thread-safe).
GtbmAllocator* Instance() {
  GtbmAllocator* a = g_instance.load(std::memory_order_acquire);
  if (a != nullptr) return a;
  std::lock_guard<std::mutex> lock(g_instance_mu);
  a = g_instance.load(std::memory_order_relaxed);
  if (a == nullptr) {
    a = NewCpuAllocator();
    g_instance.store(a, std::memory_order_release);
  }
  return a;
}

// Allocates large regions for whoever builds an allocator on top of a SubAllocator (e.g. a BFC); they are
// long-lived, so they are placed as PERSISTENT.
class GtbmSubAllocator final : public tsl::SubAllocator {
 public:
  explicit GtbmSubAllocator(GtbmAllocator* allocator) : tsl::SubAllocator({}, {}), allocator_(allocator) {}

  void* Alloc(size_t alignment, size_t num_bytes, size_t* bytes_received) override {
    PushOverride(gtbm::kPersistent);
    void* p = allocator_->AllocateRaw(alignment, num_bytes);
    PopOverride();
    *bytes_received = p != nullptr ? num_bytes : 0;
    return p;
  }

  void Free(void* ptr, size_t /*num_bytes*/) override { allocator_->DeallocateRaw(ptr); }

  bool SupportsCoalescing() const override { return false; }

  tsl::AllocatorMemoryType GetMemoryType() const override { return tsl::AllocatorMemoryType::kHostPageable; }

 private:
  GtbmAllocator* allocator_;
};

class GtbmAllocatorFactory final : public tensorflow::AllocatorFactory {
 public:
  tensorflow::Allocator* CreateAllocator() override {
    GtbmAllocator* a = Instance();
    g_created_by_tf.store(true, std::memory_order_release);
    return a;
  }

  tsl::SubAllocator* CreateSubAllocator(int /*numa_node*/) override { return new GtbmSubAllocator(Instance()); }
};

GtbmAllocator* ActiveAllocator();

// The pool of the instance TensorFlow uses, or nullptr with the error set.
gtbm::Pool* ActivePool() {
  GtbmAllocator* a = ActiveAllocator();
  return a == nullptr ? nullptr : a->pool();
}

// Statistics of the host-inputs arena appended to the pool's (dymem_gtbm_stat_names / get_stats).
constexpr const char* kHostStatNames[] = {
    "host_inputs_enabled",           "host_inputs_bytes_in_use",      "host_inputs_peak_bytes_in_use",
    "host_inputs_bytes_reserved",    "host_inputs_peak_bytes_reserved", "host_inputs_num_allocs",
    "host_inputs_live_allocations",  "host_inputs_largest_alloc_size", "host_inputs_capacity",
    "overflow_to_host_allocs",       "overflow_to_host_bytes",
};
constexpr int kNumHostStats = static_cast<int>(sizeof(kHostStatNames) / sizeof(kHostStatNames[0]));

// Writes the host-inputs arena's values in kHostStatNames order (all zeros without an arena), with the device
// allocations it took over because the device refused them (RegionAllocator::OverflowToHost).
void HostStats(const RegionAllocator& a, int64_t out[kNumHostStats]) {
  gtbm::Pool* host = a.host_pool();
  const gtbm::PoolStats s = host != nullptr ? host->Stats() : gtbm::PoolStats();
  const int64_t values[kNumHostStats] = {
      HostInputsEnabled() && host != nullptr ? 1 : 0,
      s.bytes_in_use, s.peak_bytes_in_use, s.bytes_reserved, s.peak_bytes_reserved, s.num_allocs,
      s.live_allocations, s.largest_alloc_size, s.capacity, a.overflow_allocs(), a.overflow_bytes(),
  };
  std::copy(values, values + kNumHostStats, out);
}

// The instance TensorFlow uses with a working pool, or nullptr with the error set.
GtbmAllocator* ActiveAllocator() {
  if (!g_created_by_tf.load(std::memory_order_acquire)) {
    SetError(
        "the GTBM allocator is not active: TensorFlow did not create it (dymem_tf must be imported right after "
        "tensorflow, before the first tensor, and DYMEM_GTBM must not be 0)");
    return nullptr;
  }
  GtbmAllocator* a = g_instance.load(std::memory_order_acquire);
  if (a == nullptr || a->pool() == nullptr) {
    SetError("the GTBM allocator failed to initialise: " + (a != nullptr ? a->error() : std::string("no instance")));
    return nullptr;
  }
  return a;
}


}  // namespace
}  // namespace dymem

// The registration macro expects to expand inside TensorFlow's namespace.
namespace tensorflow {
REGISTER_MEM_ALLOCATOR("DymemGTBM", 300, ::dymem::GtbmAllocatorFactory);
}  // namespace tensorflow

// ---------------------------------------------------------------------------------------------------------------
// C API (ctypes from dymem_tf/memory/allocator.py; dlsym from the swap kernels). Functions returning int use 0 for
// success and -1 for failure with dymem_gtbm_last_error() set; nothing throws across this boundary.
extern "C" {

// Message of the last failed call on this thread.
const char* dymem_gtbm_last_error(void) { return dymem::g_last_error.c_str(); }

// 1 when TensorFlow created the GTBM allocator (it serves the CPU device) and its pool works, else 0.
int dymem_gtbm_is_active(void) {
  dymem::GtbmAllocator* a = dymem::g_instance.load(std::memory_order_acquire);
  return dymem::g_created_by_tf.load(std::memory_order_acquire) && a != nullptr && a->pool() != nullptr ? 1 : 0;
}

// Mobility override for allocations made by the calling thread until the matching pop (nestable). `group`:
// 0 persistent, 1 transient, 2 mobile, 3 host (the host-inputs arena, not counted by the budget; ignored while host
// inputs are off); any other value pushes "no override" (keeps push/pop balanced).
void dymem_gtbm_push_mobility(int group) { dymem::PushOverride(group); }

// As dymem_gtbm_push_mobility, but an override the thread already has wins (the variable swap-in's default
// "mobile" gives way to a caller's explicit group, e.g. persistent when dymem_tf re-places the weights).
void dymem_gtbm_push_default_mobility(int group) { dymem::PushDefaultOverride(group); }

// Ends the calling thread's innermost dymem_gtbm_push_mobility.
void dymem_gtbm_pop_mobility(void) { dymem::PopOverride(); }

// Replaces the op-name -> mobility map. `text`: lines "op_name<TAB>group", group a name (persistent, transient,
// mobile) or number; empty lines are skipped. Returns the number of entries, or -1 (map unchanged) on a bad line.
int dymem_gtbm_set_mobility_map(const char* text) {
  return dymem::Guard([&]() -> int {
    if (text == nullptr) return dymem::SetError("null mobility map");
    std::string error;
    const int n = dymem::InstallMobilityMap(text, &error);
    return n < 0 ? dymem::SetError(error) : n;
  });
}

// Removes the op-name -> mobility map; returns 0.
int dymem_gtbm_clear_mobility_map(void) {
  dymem::ClearMobilityMap();
  return 0;
}

// Number of entries in the op-name -> mobility map.
int dymem_gtbm_mobility_map_size(void) { return dymem::MobilityMapSize(); }

// Budget on reserved bytes. set: fails below the bytes in use or above the reserved address space.
int dymem_gtbm_set_limit(int64_t bytes) {
  return dymem::Guard([&]() -> int {
    gtbm::Pool* pool = dymem::ActivePool();
    if (pool == nullptr) return -1;
    if (bytes <= 0) return dymem::SetError("the memory limit must be positive");
    std::string error;
    if (!pool->SetLimit(static_cast<uint64_t>(bytes), &error)) return dymem::SetError(error);
    return 0;
  });
}

// Current budget in bytes, or -1 when inactive.
int64_t dymem_gtbm_get_limit(void) {
  gtbm::Pool* pool = dymem::ActivePool();
  return pool == nullptr ? -1 : static_cast<int64_t>(pool->limit());
}

// Statistics: dymem_gtbm_stat_names() lists the comma-separated names of the values dymem_gtbm_get_stats writes
// (min(n, dymem_gtbm_num_stats()) int64 values). get_stats returns the number of values available, or -1.
// The device pool's values (gtbm::StatNames) come first, then the host-inputs arena's (host_inputs_*).
const char* dymem_gtbm_stat_names(void) {
  static const std::string* names = [] {
    auto* all = new std::string(gtbm::StatNames());
    for (const char* name : dymem::kHostStatNames) *all += std::string(",") + name;
    return all;
  }();
  return names->c_str();
}
// Number of values dymem_gtbm_get_stats has.
int dymem_gtbm_num_stats(void) { return gtbm::NumStats() + dymem::kNumHostStats; }

// Writes min(n, dymem_gtbm_num_stats()) values; returns dymem_gtbm_num_stats(), or -1.
int dymem_gtbm_get_stats(int64_t* out, int n) {
  return dymem::Guard([&]() -> int {
    dymem::GtbmAllocator* a = dymem::ActiveAllocator();
    if (a == nullptr) return -1;
    if (out == nullptr || n < 0) return dymem::SetError("invalid output array");
    const int device = gtbm::FlattenStats(a->pool()->Stats(), out, n);
    int64_t host[dymem::kNumHostStats];
    dymem::HostStats(*a, host);
    for (int i = 0; i < dymem::kNumHostStats && device + i < n; ++i) out[device + i] = host[i];
    return device + dymem::kNumHostStats;
  });
}

// Gives every cached free block of both arenas back to the OS now (see DYMEM_GTBM_RELEASE_CACHE).
int dymem_gtbm_trim(void) {
  dymem::GtbmAllocator* a = dymem::ActiveAllocator();
  if (a == nullptr) return -1;
  a->pool()->TrimCache();
  if (a->host_pool() != nullptr) a->host_pool()->TrimCache();
  return 0;
}

// Peaks of both arenas restart from the current values (counters are kept).
int dymem_gtbm_reset_peak_stats(void) {
  dymem::GtbmAllocator* a = dymem::ActiveAllocator();
  if (a == nullptr) return -1;
  a->pool()->ResetPeaks();
  if (a->host_pool() != nullptr) a->host_pool()->ResetPeaks();
  return 0;
}

// Host memory for the input pipeline (DYMEM_HOST_INPUTS; see the top of this file): 1 to serve it from the
// host-inputs arena (default), 0 to count every allocation against the device budget. Takes effect for new
// allocations; live buffers stay where they are. Fails when the allocator is inactive or, for 1, when the arena
// could not be reserved.
int dymem_gtbm_set_host_inputs(int enabled) {
  dymem::GtbmAllocator* a = dymem::ActiveAllocator();
  if (a == nullptr) return -1;
  if (enabled && a->host_pool() == nullptr) return dymem::SetError("the host-inputs arena could not be reserved");
  dymem::SetHostInputsEnabled(enabled != 0);
  return 0;
}

// 1 when input-pipeline allocations are served from the host-inputs arena, 0 when they count, -1 when inactive.
int dymem_gtbm_host_inputs(void) {
  dymem::GtbmAllocator* a = dymem::ActiveAllocator();
  if (a == nullptr) return -1;
  return dymem::HostInputsEnabled() && a->host_pool() != nullptr ? 1 : 0;
}

// Trace recording: start (discarding any previous trace) with room for max_records allocations, stop, dump as
// CSV, count of allocation records. trace_info writes {active, records, dropped, events, max_records}.
int dymem_gtbm_trace_start(int64_t max_records) {
  return dymem::Guard([&]() -> int {
    gtbm::Pool* pool = dymem::ActivePool();
    if (pool == nullptr) return -1;
    if (max_records <= 0) return dymem::SetError("max_records must be positive");
    pool->StartTrace(static_cast<uint64_t>(max_records));
    return 0;
  });
}

// Stops recording (the trace is kept for dymem_gtbm_trace_dump); 0, or -1 when inactive.
int dymem_gtbm_trace_stop(void) {
  gtbm::Pool* pool = dymem::ActivePool();
  if (pool == nullptr) return -1;
  pool->StopTrace();
  return 0;
}

// Writes the trace to `path` as CSV (columns of gtbm::Pool::DumpTrace); 0 or -1.
int dymem_gtbm_trace_dump(const char* path) {
  return dymem::Guard([&]() -> int {
    gtbm::Pool* pool = dymem::ActivePool();
    if (pool == nullptr) return -1;
    if (path == nullptr) return dymem::SetError("null path");
    std::string error;
    if (!pool->DumpTrace(path, &error)) return dymem::SetError(error);
    return 0;
  });
}

// Allocation records held, or -1 when inactive.
int64_t dymem_gtbm_trace_count(void) {
  gtbm::Pool* pool = dymem::ActivePool();
  return pool == nullptr ? -1 : static_cast<int64_t>(pool->GetTraceInfo().records);
}

// Writes min(n, 5) of {active, records, dropped, events, max_records}; returns 5, or -1 when inactive.
int dymem_gtbm_trace_info(int64_t* out, int n) {
  gtbm::Pool* pool = dymem::ActivePool();
  if (pool == nullptr) return -1;
  return gtbm::FlattenTraceInfo(pool->GetTraceInfo(), out, n);
}

// Byte-count parser shared with the C++ side (for consistency checks from Python): 0 and *out set, or -1.
int dymem_gtbm_parse_bytes(const char* text, int64_t* out) {
  return dymem::Guard([&]() -> int {
    if (text == nullptr || out == nullptr) return dymem::SetError("null argument");
    uint64_t bytes = 0;
    std::string error;
    if (!gtbm::ParseBytes(text, &bytes, &error)) return dymem::SetError(error);
    *out = static_cast<int64_t>(bytes);
    return 0;
  });
}

}  // extern "C"
