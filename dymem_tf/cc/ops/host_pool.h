// Host memory pool for swapped-out tensors.
//
// On the CPU device the device allocator is GTBM with a byte budget; tensors swapped out to "host memory" must not
// count against that budget, so DymemSwapOut's CPU kernel places them here instead of going through the device
// allocator. On a GPU, swapped-out tensors live in TF's pinned host memory (the copy must be a real DMA), which this
// pool cannot hand out; AllocateChargedTensor charges them to the pool's byte limit and live/peak bytes instead, so
// the limit and the statistics cover both kinds of host copies. Pinned buffers never enter the pool's cache.
//
// The pool caches freed blocks (up to a configurable byte limit) and hands them out again to requests of nearly the
// same size: a training step swaps the same feature-map sizes every step, and reusing a block avoids an mmap/munmap
// pair plus a page fault per 4 KiB for every swap-out.
#ifndef DYMEM_TF_CC_OPS_HOST_POOL_H_
#define DYMEM_TF_CC_OPS_HOST_POOL_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>

#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"

namespace dymem {

// Indices of the values reported by HostPool::GetStats and dymem_host_pool_stats(); names in kHostPoolStatNames.
enum HostPoolStat : int {
  kBytesInUse = 0,       // bytes of blocks (and charged pinned buffers) currently held by live tensors
  kPeakBytesInUse,       // high-water mark of kBytesInUse since start or the last ResetPeak()
  kNumAllocs,            // blocks and charged buffers handed out so far (cache hits included)
  kLiveBuffers,          // blocks and charged buffers currently held by live tensors
  kBytesSwappedOut,      // total payload bytes copied by DymemSwapOut (all devices)
  kBytesSwappedIn,       // total payload bytes copied by DymemSwapIn (all devices)
  kNumSwapOuts,          // DymemSwapOut executions
  kNumSwapIns,           // DymemSwapIn executions
  kBytesCached,          // bytes of freed blocks kept for reuse
  kCacheHits,            // allocations served from the cache
  kCacheLimit,           // upper bound of kBytesCached
  kBytesLimit,           // upper bound of kBytesInUse + kBytesCached (0: unlimited)
  kLargestAlloc,         // largest block handed out
  kNumHostPoolStats,
};

extern const char* const kHostPoolStatNames[kNumHostPoolStats];

class HostPool {
 public:
  // All blocks are aligned to Eigen's maximum alignment, which TF requires of tensor buffers.
  static constexpr size_t kAlignment = 64;
  static constexpr int64_t kDefaultCacheLimit = int64_t{1} << 30;  // 1 GiB; see dymem_tf/memory/native.py

  // The process-wide pool. Intentionally leaked: tensors may be released after static destructors have run.
  static HostPool* Global();

  // Hands out a block of at least `bytes` (> 0) bytes; `*block_bytes` receives its real size, which is what the
  // pool accounts for. Fails with ResourceExhausted when the byte limit or the host memory is exhausted.
  absl::Status Allocate(size_t bytes, void** ptr, size_t* block_bytes);
  // Returns a block obtained from Allocate; `block_bytes` is the size it reported.
  void Deallocate(void* ptr, size_t block_bytes);

  // Accounting of memory that another allocator hands out (pinned host memory on a GPU), in three steps:
  // Reserve admits `bytes` (> 0) under the byte limit, evicting cached blocks to make room, and holds them as
  // pending; ResourceExhausted naming the limit when they do not fit.
  absl::Status Reserve(size_t bytes);
  // Counts reserved bytes as one live block (bytes in use, peak, allocations).
  void Commit(size_t bytes);
  // Drops reserved bytes whose allocation failed.
  void Cancel(size_t bytes);
  // Uncounts a committed block that its own allocator freed (it never enters the cache).
  void Release(size_t bytes);

  // Counts one swap-out (DymemSwapOut) of `bytes` payload bytes.
  void RecordSwapOut(int64_t bytes);
  // Counts one swap-in (DymemSwapIn) of `bytes` payload bytes.
  void RecordSwapIn(int64_t bytes);

  // Fills out[0..kNumHostPoolStats) in HostPoolStat order.
  void GetStats(int64_t out[kNumHostPoolStats]) const;
  // kPeakBytesInUse restarts from the bytes in use.
  void ResetPeak();
  // Frees every cached block; returns the number of bytes given back to the system.
  int64_t ReleaseCache();
  // Negative values are treated as 0 (no caching). Shrinking the limit evicts cached blocks at once.
  void SetCacheLimit(int64_t bytes);
  // 0 or negative: unlimited.
  void SetBytesLimit(int64_t bytes);

 private:
  struct FreeBlock {
    void* ptr;
    size_t bytes;
  };
  using LruList = std::list<FreeBlock>;

  HostPool();
  // OK for 0 < `bytes` <= 2^62, else InvalidArgument (zero) or ResourceExhausted (out of range).
  static absl::Status CheckSize(size_t bytes);
  // `bytes` rounded to the block granule: 64 bytes below 64 KiB, 4 KiB pages above.
  static size_t RoundUp(size_t bytes);
  // Both require mu_. Evicted blocks are appended to `victims` and freed by the caller outside the lock.
  void EvictLocked(int64_t target_cached_bytes, LruList* victims);
  // A cached block of `bytes` to 9/8 of it (best fit; its size in *block_bytes), or nullptr.
  void* TakeCachedLocked(size_t bytes, size_t* block_bytes);
  // Counts a block of `block_bytes` handed out.
  void RecordAllocLocked(size_t block_bytes);
  // Uncounts a live block of `block_bytes`.
  void RecordFreeLocked(size_t block_bytes);
  // OK when `need` more bytes fit under the byte limit (cached blocks evicted into `victims` to make room), else
  // ResourceExhausted naming the limit and how to raise it.
  absl::Status AdmitLocked(int64_t need, LruList* victims);
  // Frees every block of `blocks` and empties the list.
  static void FreeAll(LruList* blocks);

  mutable std::mutex mu_;
  LruList lru_;                                         // cached blocks, most recently freed first
  std::multimap<size_t, LruList::iterator> by_size_;    // the same blocks ordered by size (best-fit lookup)
  int64_t stats_[kNumHostPoolStats] = {};
  int64_t pending_bytes_ = 0;  // admitted under the byte limit, not yet allocated
};

// Makes `*out` a tensor of `dtype`/`shape` whose buffer lives in the global host pool; the memory returns to the
// pool when the last reference to the buffer goes away. Zero-element tensors get no buffer at all.
absl::Status AllocateHostPoolTensor(tensorflow::DataType dtype, const tensorflow::TensorShape& shape,
                                    tensorflow::Tensor* out);

// Makes `*out` a DT_VARIANT tensor of `shape` whose Variants (empty) live in the global host pool, outside the device
// budget (a swapped-out TensorList's container); they are destroyed, and the memory returns to the pool, when the last
// reference to the buffer goes away.
absl::Status AllocateHostPoolVariantTensor(const tensorflow::TensorShape& shape, tensorflow::Tensor* out);

// Makes `*out` a tensor of `dtype`/`shape` whose buffer `base` allocates (DymemSwapOut's GPU kernel: TF's pinned host
// allocator), charged to `pool`: its bytes are reserved under the pool's byte limit first (ResourceExhausted when
// they do not fit) and released when the last reference to the buffer goes away. Zero-element tensors get no buffer.
absl::Status AllocateChargedTensor(HostPool* pool, tensorflow::Allocator* base, tensorflow::DataType dtype,
                                   const tensorflow::TensorShape& shape, tensorflow::Tensor* out);

}  // namespace dymem

// C interface for Python (ctypes); see dymem_tf/memory/host_pool.py.
extern "C" {
// The C interface mirrors HostPool::Global()'s methods of the same names.
int dymem_host_pool_num_stats(void);
const char* dymem_host_pool_stat_name(int index);  // nullptr when out of range
int dymem_host_pool_stats(int64_t* out, int n);    // writes min(n, num_stats) values, returns that count
void dymem_host_pool_reset_peak(void);
int64_t dymem_host_pool_release_cache(void);
void dymem_host_pool_set_cache_limit(int64_t bytes);
void dymem_host_pool_set_bytes_limit(int64_t bytes);
// Test hooks for AllocateChargedTensor with TF's CPU allocator standing in for the pinned host allocator
// (tests/test_swap_ops.py). The first returns a handle to a buffer of `bytes` bytes charged to the global pool, or
// nullptr with the error message copied into `error` (at most `error_len` bytes, NUL-terminated).
void* dymem_host_pool_charged_alloc(int64_t bytes, char* error, int error_len);
void dymem_host_pool_charged_free(void* handle);  // frees a handle of dymem_host_pool_charged_alloc (nullptr: no-op)
}

#endif  // DYMEM_TF_CC_OPS_HOST_POOL_H_
