// GTBM as TensorFlow's CPU device allocator.
//
// GtbmAllocator maps the GTBM core's offset space onto one virtual address range reserved with
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
//      function being instantiated (see IsFunctionInstantiation), whose constant folding cannot handle a refusal.
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
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "../gtbm/gtbm_core.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/allocator_registry.h"
#include "tsl/platform/env.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"

namespace dymem {
namespace {

constexpr uint64_t kDefaultMaxLimit = uint64_t{64} << 30;  // default budget cap: min(physical RAM, 64 GiB)
constexpr uint64_t kDefaultBlockSize = uint64_t{2} << 20;  // pageblock: a huge page (and CUDA's VMM granule)
constexpr uint64_t kMinBlocksPerLimit = 32;
constexpr uint64_t kBaseAlignment = uint64_t{1} << 30;  // largest alignment AllocateRaw honours
constexpr char kLimitEnv[] = "DYMEM_DEVICE_MEMORY_LIMIT";
constexpr char kBlockSizeEnv[] = "DYMEM_GTBM_BLOCK_SIZE";
constexpr char kReleaseCacheEnv[] = "DYMEM_GTBM_RELEASE_CACHE";
constexpr char kHostInputsEnv[] = "DYMEM_HOST_INPUTS";
// Classification result beyond the pool's groups: serve from the host-inputs arena (not counted by the budget).
constexpr int kHost = gtbm::kNumGroups;
// Host-inputs arena: address space reserved (NORESERVE, pages backed when touched) and free blocks kept resident.
constexpr uint64_t kMinHostSpace = uint64_t{1} << 30;
constexpr uint64_t kHostReleaseCache = uint64_t{64} << 20;
// Free blocks kept resident before madvise: releasing a block and faulting it back in moments later cost ~0.8 s per
// ResNet-50 step (64x64, batch 32: ~900 MiB of blocks cycle through the free list every step); a cache of a few
// hundred MiB removes almost all of it. Default min(256 MiB, budget / 8).
constexpr uint64_t kMaxDefaultReleaseCache = uint64_t{256} << 20;
constexpr uint64_t kReleaseCacheBudgetDivisor = 8;

thread_local std::string g_last_error;

// Records `message` as this thread's last error; returns -1, for the caller to return.
int SetError(const std::string& message) {
  g_last_error = message;
  return -1;
}

// ------------------------------------------------------------------------------------------------------------
// Mobility: per-thread override stack and the op-name map.

constexpr int kMaxOverrideDepth = 64;
thread_local int t_override_depth = 0;
thread_local int t_override[kMaxOverrideDepth];

// The calling thread's innermost mobility override, or -1 when it has none.
int CurrentOverride() {
  const int depth = std::min(t_override_depth, kMaxOverrideDepth);
  return depth > 0 ? t_override[depth - 1] : -1;
}

// Entries beyond kMaxOverrideDepth are counted but not stored, so that pushes and pops always balance.
void PushOverride(int group) {
  if (t_override_depth < kMaxOverrideDepth) {
    t_override[t_override_depth] = (group >= 0 && group <= kHost) ? group : -1;
  }
  ++t_override_depth;
}

// Drops the calling thread's innermost mobility override (no-op when it has none).
void PopOverride() {
  if (t_override_depth > 0) --t_override_depth;
}

// Immutable once published; replaced as a whole by dymem_gtbm_set_mobility_map.
struct MobilityMap {
  std::vector<std::unique_ptr<std::string>> names;  // owns the keys' characters
  std::unordered_map<std::string_view, int> groups;
};
std::shared_ptr<const MobilityMap> g_mobility_map;  // accessed with std::atomic_load / std::atomic_store
std::atomic<bool> g_has_mobility_map{false};         // fast path: no map, no shared_ptr traffic per allocation

// The part of an op name after its last '/'.
std::string_view Leaf(std::string_view op) {
  const size_t slash = op.rfind('/');
  return slash == std::string_view::npos ? op : op.substr(slash + 1);
}

// True when `text` begins with `prefix`.
bool StartsWith(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

// Node names default to the op type ("AssignSubVariableOp_12"), and Keras/TF optimizers keep them.
bool IsVariableUpdate(std::string_view op) {
  const std::string_view leaf = Leaf(op);
  return StartsWith(leaf, "AssignVariableOp") || StartsWith(leaf, "AssignAddVariableOp") ||
         StartsWith(leaf, "AssignSubVariableOp") || StartsWith(leaf, "ResourceApply") ||
         StartsWith(leaf, "ResourceSparseApply") || StartsWith(leaf, "ResourceScatter");
}

// Rule c of the host-inputs classification (see the top of this file).
bool IsInputPipelineOp(std::string_view op) {
  if (op.empty()) return false;
  const std::string_view leaf = Leaf(op);
  if (StartsWith(leaf, "Iterator") || StartsWith(leaf, "MakeIterator") || StartsWith(leaf, "AnonymousIterator") ||
      StartsWith(leaf, "OneShotIterator") || StartsWith(leaf, "MultiDeviceIterator") ||
      StartsWith(leaf, "AnonymousMultiDeviceIterator") || StartsWith(leaf, "DeserializeIterator") ||
      StartsWith(leaf, "SerializeIterator")) {
    return true;
  }
  return leaf.size() == op.size() && op.find("Dataset") != std::string_view::npos;  // eager op: bare op type
}

// Rule d: the annotation is a whole function being instantiated ("__inference_step_123"), not one of its kernels:
// TF's per-device graph optimizer constant-folds the new function's graph with a GraphRunner on a host CPU device
// (on a GPU too), and that code copies folded tensors without checking the allocation: refusing one there kills
// the process. The folded values end up as constants in the graph, which the Const kernels then allocate.
bool IsFunctionInstantiation(std::string_view op) {
  return (StartsWith(op, "__inference_") || StartsWith(op, "__forward_") || StartsWith(op, "__backward_")) &&
         op.find('/') == std::string_view::npos;
}

// Rule b: TF registers a name for every thread it starts (tsl::Env::StartThread); tf.data's are "tf_data_*".
// A thread's name does not change, so the answer is cached per thread.
bool OnInputPipelineThread() {
  thread_local int cached = -1;
  if (cached < 0) {
    std::string name;
    cached = tsl::Env::Default()->GetCurrentThreadName(&name) && StartsWith(name, "tf_data") ? 1 : 0;
  }
  return cached == 1;
}

std::atomic<bool> g_host_inputs{true};  // DYMEM_HOST_INPUTS (read when the allocator is created), or the C API

// Returns a pool group, or kHost.
int Classify(const tsl::profiler::MemoryDebugAnnotation& annotation) {
  const int forced = CurrentOverride();
  const bool host_inputs = g_host_inputs.load(std::memory_order_relaxed);
  if (forced == kHost) {
    if (host_inputs) return kHost;
  } else if (forced >= 0) {
    return forced;
  }
  const std::string_view op(annotation.pending_op_name.data(), annotation.pending_op_name.size());
  if (host_inputs && (OnInputPipelineThread() || IsInputPipelineOp(op))) return kHost;
  if (!op.empty() && g_has_mobility_map.load(std::memory_order_acquire)) {
    std::shared_ptr<const MobilityMap> map = std::atomic_load(&g_mobility_map);
    if (map) {
      // The planner names ops as in the graph TF runs (it plans after Grappler): exact node names, so a bare leaf
      // such as "Relu" never matches another function's op.
      auto it = map->groups.find(op);
      if (it != map->groups.end()) return it->second;
    }
  }
  if (op.empty() || IsVariableUpdate(op)) return gtbm::kPersistent;  // a forced kHost with host inputs off too
  if (annotation.pending_step_id == 0) return gtbm::kTransient;
  return op.find('/') == std::string_view::npos ? gtbm::kPersistent : gtbm::kTransient;
}

// ------------------------------------------------------------------------------------------------------------
// Configuration from the environment.

uint64_t PhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return kDefaultMaxLimit;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
}

// Reads a byte count from `name`; unset -> `fallback`; invalid -> error on stderr and `fallback` (Python validates
// the variable before loading the library, so this only guards direct users).
uint64_t BytesFromEnv(const char* name, uint64_t fallback, bool allow_zero = false) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  uint64_t bytes = 0;
  std::string error;
  if (!gtbm::ParseBytes(value, &bytes, &error) || (bytes == 0 && !allow_zero)) {
    std::fprintf(stderr, "dymem_tf GTBM: ignoring %s: %s; using %llu bytes\n", name,
                 error.empty() ? "must be positive" : error.c_str(), static_cast<unsigned long long>(fallback));
    return fallback;
  }
  return bytes;
}

// ------------------------------------------------------------------------------------------------------------
// The allocator.

// DYMEM_HOST_INPUTS: unset or anything else -> on; "0", "false", "off", "no" (any case) -> off.
bool FlagFromEnv(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return fallback;
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(v == "0" || v == "false" || v == "off" || v == "no");
}

// One contiguous range of address space for a pool: mmap(NORESERVE) of about `space` bytes (halved while the
// kernel refuses, down to `min_space`), base aligned to `base_align`. Returns nullptr and sets *error on failure.
char* ReserveAddressSpace(uint64_t* space, uint64_t min_space, uint64_t block, uint64_t base_align,
                          std::string* error) {
  void* raw = MAP_FAILED;
  while (true) {
    raw = mmap(nullptr, *space + base_align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
               -1, 0);
    if (raw != MAP_FAILED || *space / 2 < min_space) break;
    *space = *space / 2 / block * block;  // strict overcommit settings: try a smaller reservation
  }
  if (raw == MAP_FAILED) {
    *error = "mmap of " + std::to_string(*space) + " bytes failed: " + std::strerror(errno);
    return nullptr;
  }
  const uintptr_t raw_addr = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t base = (raw_addr + base_align - 1) / base_align * base_align;
  if (base > raw_addr) munmap(raw, base - raw_addr);
  const uintptr_t tail = base + *space;
  const uintptr_t raw_end = raw_addr + *space + base_align;
  if (raw_end > tail) munmap(reinterpret_cast<void*>(tail), raw_end - tail);
  return reinterpret_cast<char*>(base);
}

// A gtbm::Pool over its own reserved range: offsets are pointers base + offset.
struct Arena {
  char* base = nullptr;
  uint64_t space = 0;
  std::unique_ptr<gtbm::Pool> pool;

  // True when `ptr` lies inside this arena's reserved range.
  bool Owns(const void* ptr) const {
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    const uintptr_t b = reinterpret_cast<uintptr_t>(base);
    return pool != nullptr && p >= b && p < b + space;
  }
  // Offset of `ptr`, an address inside the arena, in its pool's offset space.
  uint64_t OffsetOf(const void* ptr) const {
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(base));
  }

  // Reserves the range and creates the pool; options.capacity is set here. Returns false with *error set.
  bool Init(gtbm::PoolOptions options, uint64_t space_wanted, uint64_t min_space, std::string* error) {
    space = (space_wanted + options.block_size - 1) / options.block_size * options.block_size;
    // Over-reserve to align the base to kBaseAlignment: offsets aligned to A are then pointers aligned to A for
    // any A up to it (over-aligned requests), and blocks are huge-page aligned.
    base = ReserveAddressSpace(&space, std::max(min_space, options.block_size), options.block_size,
                               std::max(options.block_size, kBaseAlignment), error);
    if (base == nullptr) return false;
    options.capacity = space;
    options.limit = std::min(options.limit == 0 ? space : options.limit, space);
    char* const mem = base;
    options.on_release = [mem](uint64_t offset, uint64_t length) {
      // Give the pages back: the block is free for every group, its contents are dead.
      madvise(mem + offset, length, MADV_DONTNEED);
    };
    pool = gtbm::Pool::Create(options, error);
    return pool != nullptr;
  }

  ~Arena() {
    if (base != nullptr) munmap(base, space);
  }
};

class GtbmAllocator final : public tensorflow::Allocator {
 public:
  GtbmAllocator() {
    g_host_inputs.store(FlagFromEnv(kHostInputsEnv, true), std::memory_order_relaxed);
    const uint64_t default_limit = std::min(PhysicalMemory(), kDefaultMaxLimit);
    const uint64_t limit = BytesFromEnv(kLimitEnv, default_limit);
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    // 2 MiB blocks, smaller for small budgets so that the budget holds at least kMinBlocksPerLimit blocks.
    uint64_t auto_block = kDefaultBlockSize;
    while (auto_block > page && auto_block * kMinBlocksPerLimit > limit) auto_block /= 2;
    uint64_t block = BytesFromEnv(kBlockSizeEnv, auto_block);
    if (block % page != 0 || (block & (block - 1)) != 0) {
      std::fprintf(stderr, "dymem_tf GTBM: %s must be a power-of-two multiple of the page size (%llu); using %llu\n",
                   kBlockSizeEnv, static_cast<unsigned long long>(page),
                   static_cast<unsigned long long>(auto_block));
      block = auto_block;
    }

    gtbm::PoolOptions options;
    options.policy = gtbm::Policy::kGtbm;
    options.limit = limit;
    options.block_size = block;
    options.alignment = tensorflow::Allocator::kAllocatorAlignment;
    options.release_cache = BytesFromEnv(kReleaseCacheEnv, std::min(kMaxDefaultReleaseCache,
                                                                    limit / kReleaseCacheBudgetDivisor),
                                         /*allow_zero=*/true);
    // The address space covers the budget and at least the default budget, so the limit can later be raised
    // up to it; NORESERVE makes the unused part free.
    if (!device_.Init(options, std::max(limit, default_limit), limit, &error_)) {
      std::fprintf(stderr, "dymem_tf GTBM: cannot create the pool: %s; every allocation will fail\n",
                   error_.c_str());
      return;
    }

    // The host-inputs arena: no budget (limit = its whole range), one group, 2 MiB blocks.
    gtbm::PoolOptions host;
    host.policy = gtbm::Policy::kGtbmNoGroups;
    host.block_size = kDefaultBlockSize;
    host.alignment = tensorflow::Allocator::kAllocatorAlignment;
    host.release_cache = kHostReleaseCache;
    std::string host_error;
    if (!host_.Init(host, std::max(PhysicalMemory(), kDefaultMaxLimit), kMinHostSpace, &host_error)) {
      std::fprintf(stderr,
                   "dymem_tf GTBM: no host-inputs arena (%s): input-pipeline tensors count against the device "
                   "budget\n",
                   host_error.c_str());
    }
  }

  std::string Name() override { return "gtbm"; }

  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    if (!device_.pool) return nullptr;
    if (alignment > kBaseAlignment) {
      std::fprintf(stderr, "dymem_tf GTBM: alignment %zu is not supported (at most %llu)\n", alignment,
                   static_cast<unsigned long long>(kBaseAlignment));
      return nullptr;
    }
    const tsl::profiler::MemoryDebugAnnotation& annotation =
        tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation();
    int group = Classify(annotation);
    gtbm::AllocTag tag;
    tag.op_name = std::string_view(annotation.pending_op_name.data(), annotation.pending_op_name.size());
    tag.step_id = annotation.pending_step_id;
    if (group == kHost) {
      if (host_.pool) {
        const uint64_t offset = host_.pool->Allocate(num_bytes, gtbm::kPersistent, alignment, &tag);
        if (offset != gtbm::kInvalidOffset) return host_.base + offset;
        LogFailure(host_.pool.get(), num_bytes, alignment, kHost, tag.op_name);
        return nullptr;
      }
      group = gtbm::kPersistent;  // no host arena: count it, as with DYMEM_HOST_INPUTS=0
    }
    const uint64_t offset = device_.pool->Allocate(num_bytes, group, alignment, &tag);
    if (offset == gtbm::kInvalidOffset) {
      LogFailure(device_.pool.get(), num_bytes, alignment, group, tag.op_name);
      return OverflowToHost(num_bytes, alignment, &tag);
    }
    return device_.base + offset;
  }

  // A refused allocation of a function's instantiation (rule d at the top of this file) is served from the host
  // arena instead: TF's code there does not check for null and would crash the process. Null otherwise.
  void* OverflowToHost(size_t num_bytes, size_t alignment, gtbm::AllocTag* tag) {
    if (!host_.pool || !IsFunctionInstantiation(tag->op_name)) return nullptr;
    const uint64_t offset = host_.pool->Allocate(num_bytes, gtbm::kPersistent, alignment, tag);
    if (offset == gtbm::kInvalidOffset) return nullptr;
    std::fprintf(stderr, "dymem_tf GTBM: served the %zu bytes from host memory instead: TensorFlow's function "
                 "instantiation (constant folding) cannot handle a refused allocation\n", num_bytes);
    return host_.base + offset;
  }

  void DeallocateRaw(void* ptr) override {
    if (ptr == nullptr) return;
    const Arena* arena = ArenaOf(ptr);
    if (arena == nullptr || arena->pool->Free(arena->OffsetOf(ptr)) == 0) {
      std::fprintf(stderr, "dymem_tf GTBM: DeallocateRaw(%p) of a pointer it did not allocate (ignored)\n", ptr);
    }
  }

  bool TracksAllocationSizes() const override { return device_.pool != nullptr; }

  size_t RequestedSize(const void* ptr) const override {
    uint64_t requested = 0;
    if (const Arena* arena = ArenaOf(ptr)) arena->pool->Lookup(arena->OffsetOf(ptr), &requested, nullptr, nullptr);
    return requested;
  }

  size_t AllocatedSize(const void* ptr) const override {
    uint64_t allocated = 0;
    if (const Arena* arena = ArenaOf(ptr)) arena->pool->Lookup(arena->OffsetOf(ptr), nullptr, &allocated, nullptr);
    return allocated;
  }

  // The device pool only: the host-inputs arena is host memory (see dymem_gtbm_get_stats for it).
  std::optional<tensorflow::AllocatorStats> GetStats() override {
    if (!device_.pool) return std::nullopt;
    const gtbm::PoolStats s = device_.pool->Stats();
    tensorflow::AllocatorStats stats;
    stats.num_allocs = s.num_allocs;
    stats.bytes_in_use = s.bytes_in_use;
    stats.peak_bytes_in_use = s.peak_bytes_in_use;
    stats.largest_alloc_size = s.largest_alloc_size;
    stats.bytes_limit = s.bytes_limit;
    stats.bytes_reserved = s.bytes_reserved;
    stats.peak_bytes_reserved = s.peak_bytes_reserved;
    stats.bytes_reservable_limit = s.bytes_limit;
    stats.largest_free_block_bytes = s.largest_free_block;
    stats.pool_bytes = s.bytes_reserved;
    stats.peak_pool_bytes = s.peak_bytes_reserved;
    return stats;
  }

  bool ClearStats() override {
    if (!device_.pool) return false;
    device_.pool->ClearCounters();
    if (host_.pool) host_.pool->ClearCounters();
    return true;
  }

  tsl::AllocatorMemoryType GetMemoryType() const override { return tsl::AllocatorMemoryType::kHostPageable; }

  // The device arena's pool (nullptr when it could not be reserved).
  gtbm::Pool* pool() { return device_.pool.get(); }
  // nullptr when the host-inputs arena could not be reserved.
  gtbm::Pool* host_pool() { return host_.pool.get(); }
  // Why the device arena could not be set up (empty when it was).
  const std::string& error() const { return error_; }

 private:
  // The arena (device or host inputs) holding `ptr`, or nullptr.
  const Arena* ArenaOf(const void* ptr) const {
    if (device_.Owns(ptr)) return &device_;
    if (host_.Owns(ptr)) return &host_;
    return nullptr;
  }

  // Logs a refused allocation with the pool's state (the first kMaxFailureLogs refusals only).
  void LogFailure(gtbm::Pool* pool, size_t num_bytes, size_t alignment, int group, std::string_view op) {
    // Out-of-budget is an expected, recoverable condition (TF raises ResourceExhausted): log the first few only.
    const int n = failures_logged_.fetch_add(1, std::memory_order_relaxed);
    if (n >= kMaxFailureLogs) return;
    const gtbm::PoolStats s = pool->Stats();
    std::fprintf(stderr,
                 "dymem_tf GTBM: out of %s allocating %zu bytes (alignment %zu, group %s, op '%.*s'): "
                 "in use %lld, reserved %lld, limit %lld, largest free block %lld%s\n",
                 group == kHost ? "host-inputs address space" : "budget", num_bytes, alignment,
                 group == kHost ? "host" : gtbm::GroupName(group), static_cast<int>(op.size()), op.data(),
                 static_cast<long long>(s.bytes_in_use), static_cast<long long>(s.bytes_reserved),
                 static_cast<long long>(s.bytes_limit), static_cast<long long>(s.largest_free_block),
                 n + 1 == kMaxFailureLogs ? " (further failures are not logged)" : "");
  }

  static constexpr int kMaxFailureLogs = 10;
  Arena device_;  // the emulated device: GTBM groups under the budget
  Arena host_;    // host inputs: not capped, not in GetStats()
  std::string error_;
  std::atomic<int> failures_logged_{0};
};

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
    a = new GtbmAllocator();
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
};
constexpr int kNumHostStats = static_cast<int>(sizeof(kHostStatNames) / sizeof(kHostStatNames[0]));

// Writes the host-inputs arena's values in kHostStatNames order (all zeros without an arena).
void HostStats(gtbm::Pool* host, int64_t out[kNumHostStats]) {
  const gtbm::PoolStats s = host != nullptr ? host->Stats() : gtbm::PoolStats();
  const int64_t values[kNumHostStats] = {
      g_host_inputs.load(std::memory_order_relaxed) && host != nullptr ? 1 : 0,
      s.bytes_in_use, s.peak_bytes_in_use, s.bytes_reserved, s.peak_bytes_reserved, s.num_allocs,
      s.live_allocations, s.largest_alloc_size, s.capacity,
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

template <typename F>
int Guard(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return SetError(std::string("internal error: ") + e.what());
  } catch (...) {
    return SetError("internal error");
  }
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

// Ends the calling thread's innermost dymem_gtbm_push_mobility.
void dymem_gtbm_pop_mobility(void) { dymem::PopOverride(); }

// Replaces the op-name -> mobility map. `text`: lines "op_name<TAB>group", group a name (persistent, transient,
// mobile) or number; empty lines are skipped. Returns the number of entries, or -1 (map unchanged) on a bad line.
int dymem_gtbm_set_mobility_map(const char* text) {
  return dymem::Guard([&]() -> int {
    if (text == nullptr) return dymem::SetError("null mobility map");
    auto map = std::make_shared<dymem::MobilityMap>();
    std::string_view rest(text);
    int lineno = 0;
    while (!rest.empty()) {
      const size_t nl = rest.find('\n');
      std::string_view line = rest.substr(0, nl);
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) continue;
      const size_t tab = line.rfind('\t');
      int group = -1;
      if (tab == std::string_view::npos || tab == 0 || !gtbm::ParseGroup(line.substr(tab + 1), &group)) {
        return dymem::SetError("mobility map line " + std::to_string(lineno) + ": expected 'op_name<TAB>group', got '" +
                               std::string(line) + "'");
      }
      map->names.push_back(std::make_unique<std::string>(line.substr(0, tab)));
      map->groups[*map->names.back()] = group;
    }
    const int n = static_cast<int>(map->groups.size());
    std::shared_ptr<const dymem::MobilityMap> published = std::move(map);
    std::atomic_store(&dymem::g_mobility_map, published);
    dymem::g_has_mobility_map.store(n > 0, std::memory_order_release);
    return n;
  });
}

// Removes the op-name -> mobility map; returns 0.
int dymem_gtbm_clear_mobility_map(void) {
  dymem::g_has_mobility_map.store(false, std::memory_order_release);
  std::atomic_store(&dymem::g_mobility_map, std::shared_ptr<const dymem::MobilityMap>());
  return 0;
}

// Number of entries in the mobility map.
int dymem_gtbm_mobility_map_size(void) {
  std::shared_ptr<const dymem::MobilityMap> map = std::atomic_load(&dymem::g_mobility_map);
  return map ? static_cast<int>(map->groups.size()) : 0;
}

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
    dymem::HostStats(a->host_pool(), host);
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
  dymem::g_host_inputs.store(enabled != 0, std::memory_order_relaxed);
  return 0;
}

// 1 when input-pipeline allocations are served from the host-inputs arena, 0 when they count, -1 when inactive.
int dymem_gtbm_host_inputs(void) {
  dymem::GtbmAllocator* a = dymem::ActiveAllocator();
  if (a == nullptr) return -1;
  return dymem::g_host_inputs.load(std::memory_order_relaxed) && a->host_pool() != nullptr ? 1 : 0;
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
  const gtbm::TraceInfo info = pool->GetTraceInfo();
  const int64_t values[] = {info.active ? 1 : 0, static_cast<int64_t>(info.records),
                            static_cast<int64_t>(info.dropped), static_cast<int64_t>(info.events),
                            static_cast<int64_t>(info.max_records)};
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  for (int i = 0; i < std::min(n, count); ++i) out[i] = values[i];
  return count;
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
