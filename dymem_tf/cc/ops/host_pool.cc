#include "host_pool.h"

#include <stdlib.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/framework/variant.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/platform/errors.h"

namespace dymem {

using tensorflow::AllocationDescription;
using tensorflow::DataType;
using tensorflow::Tensor;
using tensorflow::TensorBuffer;
using tensorflow::TensorShape;

const char* const kHostPoolStatNames[kNumHostPoolStats] = {
    "bytes_in_use",  "peak_bytes_in_use", "num_allocs",   "live_buffers", "bytes_swapped_out",
    "bytes_swapped_in", "num_swap_outs",  "num_swap_ins", "bytes_cached", "cache_hits",
    "cache_limit",   "bytes_limit",       "largest_alloc",
};

namespace {

// A tensor buffer whose memory belongs to the host pool. size() is the tensor's payload; the (possibly larger)
// block size is what the pool accounts for and what GetAllocatedBytes reports.
class HostPoolBuffer : public TensorBuffer {
 public:
  HostPoolBuffer(HostPool* pool, void* data, size_t payload_bytes, size_t block_bytes)
      : TensorBuffer(data), pool_(pool), payload_bytes_(payload_bytes), block_bytes_(block_bytes) {}

  ~HostPoolBuffer() override { pool_->Deallocate(data(), block_bytes_); }

  size_t size() const override { return payload_bytes_; }
  TensorBuffer* root_buffer() override { return this; }

  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(payload_bytes_));
    proto->set_allocated_bytes(static_cast<int64_t>(block_bytes_));
    proto->set_allocator_name("dymem_host_pool");
    proto->set_ptr(reinterpret_cast<uintptr_t>(data()));
  }

  bool GetAllocatedBytes(size_t* out_bytes) const override {
    *out_bytes = block_bytes_;
    return true;
  }

  tensorflow::AllocatorMemoryType GetMemoryType() const override {
    return tensorflow::AllocatorMemoryType::kHostPageable;
  }

 private:
  HostPool* const pool_;
  const size_t payload_bytes_;
  const size_t block_bytes_;
};

// A tensor buffer of `count` Variants in a block of the host pool: constructed (empty) with the buffer, destroyed
// before the block goes back (the base's destructor runs after this one's), as TF's own allocators do for variant
// tensors.
class HostPoolVariantBuffer final : public HostPoolBuffer {
 public:
  HostPoolVariantBuffer(HostPool* pool, void* data, int64_t count, size_t block_bytes)
      : HostPoolBuffer(pool, data, static_cast<size_t>(count) * sizeof(tensorflow::Variant), block_bytes),
        count_(count) {
    auto* values = static_cast<tensorflow::Variant*>(data);
    for (int64_t i = 0; i < count_; ++i) new (values + i) tensorflow::Variant();
  }

  ~HostPoolVariantBuffer() override {
    auto* values = static_cast<tensorflow::Variant*>(data());
    for (int64_t i = 0; i < count_; ++i) values[i].~Variant();
  }

 private:
  const int64_t count_;
};

// A tensor buffer that `base` allocated and `pool` counts (pinned host memory on a GPU): freed by `base`, then
// uncounted, when the last reference goes away.
class ChargedBuffer final : public TensorBuffer {
 public:
  ChargedBuffer(HostPool* pool, tensorflow::Allocator* base, void* data, size_t bytes)
      : TensorBuffer(data), pool_(pool), base_(base), bytes_(bytes) {}

  ~ChargedBuffer() override {
    base_->DeallocateRaw(data(), tensorflow::Allocator::kAllocatorAlignment, bytes_);
    pool_->Release(bytes_);
  }

  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }

  void FillAllocationDescription(AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocated_bytes(static_cast<int64_t>(bytes_));
    proto->set_allocator_name(base_->Name());
    proto->set_ptr(reinterpret_cast<uintptr_t>(data()));
  }

  tensorflow::AllocatorMemoryType GetMemoryType() const override { return base_->GetMemoryType(); }

 private:
  HostPool* const pool_;
  tensorflow::Allocator* const base_;
  const size_t bytes_;
};

// Payload bytes of a `dtype` tensor of `shape`; InvalidArgument when its elements are not plain bytes.
absl::Status PayloadBytes(DataType dtype, const TensorShape& shape, size_t* bytes) {
  if (!tensorflow::DataTypeCanUseMemcpy(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("dymem host pool: dtype ", tensorflow::DataTypeString(dtype),
                                                   " cannot be stored as raw bytes"));
  }
  // int64 arithmetic on purpose: tensors above 2 GiB are legal.
  *bytes = static_cast<size_t>(shape.num_elements()) * tensorflow::DataTypeSize(dtype);
  return absl::OkStatus();
}

}  // namespace

// DYMEM_HOST_POOL_CACHE_BYTES is parsed in Python (dymem_tf.units) when the library loads and applied with
// dymem_host_pool_set_cache_limit: one parser, and a malformed value raises instead of falling back.
HostPool::HostPool() { stats_[kCacheLimit] = kDefaultCacheLimit; }

HostPool* HostPool::Global() {
  static HostPool* const pool = new HostPool();
  return pool;
}

size_t HostPool::RoundUp(size_t bytes) {
  // Fine granularity for small blocks, page granularity for large ones (they come from mmap anyway).
  const size_t granule = bytes < (size_t{64} << 10) ? kAlignment : size_t{4096};
  return (bytes + granule - 1) / granule * granule;
}

void* HostPool::TakeCachedLocked(size_t bytes, size_t* block_bytes) {
  // Best fit among cached blocks, accepting up to 1/8 slack so that nearly equal sizes share blocks without
  // letting a small tensor pin a huge block.
  auto it = by_size_.lower_bound(bytes);
  if (it == by_size_.end() || it->first > bytes + bytes / 8) return nullptr;
  const LruList::iterator node = it->second;
  void* ptr = node->ptr;
  *block_bytes = node->bytes;
  stats_[kBytesCached] -= static_cast<int64_t>(node->bytes);
  by_size_.erase(it);
  lru_.erase(node);
  ++stats_[kCacheHits];
  return ptr;
}

void HostPool::RecordAllocLocked(size_t block_bytes) {
  const int64_t b = static_cast<int64_t>(block_bytes);
  stats_[kBytesInUse] += b;
  stats_[kPeakBytesInUse] = std::max(stats_[kPeakBytesInUse], stats_[kBytesInUse]);
  stats_[kLargestAlloc] = std::max(stats_[kLargestAlloc], b);
  ++stats_[kNumAllocs];
  ++stats_[kLiveBuffers];
}

void HostPool::RecordFreeLocked(size_t block_bytes) {
  stats_[kBytesInUse] -= static_cast<int64_t>(block_bytes);
  --stats_[kLiveBuffers];
}

void HostPool::EvictLocked(int64_t target_cached_bytes, LruList* victims) {
  while (stats_[kBytesCached] > target_cached_bytes && !lru_.empty()) {
    const LruList::iterator oldest = std::prev(lru_.end());
    auto range = by_size_.equal_range(oldest->bytes);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == oldest) {
        by_size_.erase(it);
        break;
      }
    }
    stats_[kBytesCached] -= static_cast<int64_t>(oldest->bytes);
    victims->splice(victims->end(), lru_, oldest);
  }
}

void HostPool::FreeAll(LruList* blocks) {
  for (const FreeBlock& b : *blocks) free(b.ptr);
  blocks->clear();
}

absl::Status HostPool::AdmitLocked(int64_t need, LruList* victims) {
  const int64_t limit = stats_[kBytesLimit];
  if (limit <= 0) return absl::OkStatus();
  const int64_t held = stats_[kBytesInUse] + pending_bytes_;
  if (held + need > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "dymem host pool: cannot allocate ", need, " bytes for a swapped-out tensor: ", held, " of the pool's ",
        limit, " byte limit are in use (raise it with dymem_tf.memory.host_pool.set_host_pool_limit)"));
  }
  // Cached blocks count against the limit too: drop as many as needed to make room.
  EvictLocked(limit - held - need, victims);
  return absl::OkStatus();
}

absl::Status HostPool::CheckSize(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("dymem host pool: zero-byte allocation");
  if (bytes > (size_t{1} << 62)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("dymem host pool: cannot allocate ", bytes, " bytes for a swapped-out tensor (size out of range)"));
  }
  return absl::OkStatus();
}

absl::Status HostPool::Reserve(size_t bytes) {
  TF_RETURN_IF_ERROR(CheckSize(bytes));
  LruList victims;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = AdmitLocked(static_cast<int64_t>(bytes), &victims);
    // Held until Commit or Cancel, so that concurrent allocations respect the limit.
    if (status.ok()) pending_bytes_ += static_cast<int64_t>(bytes);
  }
  FreeAll(&victims);
  return status;
}

void HostPool::Commit(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_bytes_ -= static_cast<int64_t>(bytes);
  RecordAllocLocked(bytes);
}

void HostPool::Cancel(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_bytes_ -= static_cast<int64_t>(bytes);
}

void HostPool::Release(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  RecordFreeLocked(bytes);
}

absl::Status HostPool::Allocate(size_t bytes, void** ptr, size_t* block_bytes) {
  TF_RETURN_IF_ERROR(CheckSize(bytes));
  const size_t rounded = RoundUp(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (void* cached = TakeCachedLocked(rounded, block_bytes)) {
      RecordAllocLocked(*block_bytes);
      *ptr = cached;
      return absl::OkStatus();
    }
  }
  TF_RETURN_IF_ERROR(Reserve(rounded));
  void* mem = nullptr;
  int rc = posix_memalign(&mem, kAlignment, rounded);
  if (rc != 0) {
    // Host memory is short: give the cache back to the system and try once more.
    ReleaseCache();
    mem = nullptr;
    rc = posix_memalign(&mem, kAlignment, rounded);
  }
  if (rc != 0 || mem == nullptr) {
    Cancel(rounded);
    return absl::ResourceExhaustedError(
        absl::StrCat("dymem host pool: cannot allocate ", rounded, " bytes of host memory for a swapped-out tensor (",
                     rc == ENOMEM ? "out of memory" : "posix_memalign failed", ")"));
  }
  Commit(rounded);
  *ptr = mem;
  *block_bytes = rounded;
  return absl::OkStatus();
}

void HostPool::Deallocate(void* ptr, size_t block_bytes) {
  if (ptr == nullptr) return;
  const int64_t b = static_cast<int64_t>(block_bytes);
  LruList victims;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RecordFreeLocked(block_bytes);
    const int64_t limit = stats_[kBytesLimit];
    int64_t room = stats_[kCacheLimit];
    if (limit > 0) room = std::min(room, limit - stats_[kBytesInUse] - pending_bytes_);
    if (b <= room) {
      EvictLocked(room - b, &victims);
      lru_.push_front(FreeBlock{ptr, block_bytes});
      by_size_.emplace(block_bytes, lru_.begin());
      stats_[kBytesCached] += b;
      cached = true;
    }
  }
  FreeAll(&victims);
  if (!cached) free(ptr);
}

void HostPool::RecordSwapOut(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_[kBytesSwappedOut] += bytes;
  ++stats_[kNumSwapOuts];
}

void HostPool::RecordSwapIn(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_[kBytesSwappedIn] += bytes;
  ++stats_[kNumSwapIns];
}

void HostPool::GetStats(int64_t out[kNumHostPoolStats]) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::memcpy(out, stats_, sizeof(stats_));
}

void HostPool::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_[kPeakBytesInUse] = stats_[kBytesInUse];
}

int64_t HostPool::ReleaseCache() {
  LruList victims;
  int64_t released = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    released = stats_[kBytesCached];
    EvictLocked(0, &victims);
  }
  FreeAll(&victims);
  return released;
}

void HostPool::SetCacheLimit(int64_t bytes) {
  LruList victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_[kCacheLimit] = std::max<int64_t>(bytes, 0);
    EvictLocked(stats_[kCacheLimit], &victims);
  }
  FreeAll(&victims);
}

void HostPool::SetBytesLimit(int64_t bytes) {
  LruList victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_[kBytesLimit] = std::max<int64_t>(bytes, 0);
    if (stats_[kBytesLimit] > 0) {
      EvictLocked(std::max<int64_t>(stats_[kBytesLimit] - stats_[kBytesInUse] - pending_bytes_, 0), &victims);
    }
  }
  FreeAll(&victims);
}

absl::Status AllocateHostPoolTensor(DataType dtype, const TensorShape& shape, Tensor* out) {
  size_t bytes = 0;
  TF_RETURN_IF_ERROR(PayloadBytes(dtype, shape, &bytes));
  if (bytes == 0) {
    *out = Tensor(dtype, shape);  // no elements: TF represents these without a buffer
    return absl::OkStatus();
  }
  HostPool* pool = HostPool::Global();
  void* ptr = nullptr;
  size_t block_bytes = 0;
  TF_RETURN_IF_ERROR(pool->Allocate(bytes, &ptr, &block_bytes));
  auto* buffer = new HostPoolBuffer(pool, ptr, bytes, block_bytes);
  *out = Tensor(dtype, shape, buffer);  // the tensor takes its own reference...
  buffer->Unref();                      // ...so drop the one `new` gave us
  return absl::OkStatus();
}

absl::Status AllocateHostPoolVariantTensor(const TensorShape& shape, Tensor* out) {
  const int64_t count = shape.num_elements();
  if (count == 0) {
    *out = Tensor(tensorflow::DT_VARIANT, shape);  // no elements: no buffer
    return absl::OkStatus();
  }
  HostPool* pool = HostPool::Global();
  void* ptr = nullptr;
  size_t block_bytes = 0;
  TF_RETURN_IF_ERROR(pool->Allocate(static_cast<size_t>(count) * sizeof(tensorflow::Variant), &ptr, &block_bytes));
  auto* buffer = new HostPoolVariantBuffer(pool, ptr, count, block_bytes);
  *out = Tensor(tensorflow::DT_VARIANT, shape, buffer);
  buffer->Unref();
  return absl::OkStatus();
}

absl::Status AllocateChargedTensor(HostPool* pool, tensorflow::Allocator* base, DataType dtype,
                                   const TensorShape& shape, Tensor* out) {
  size_t bytes = 0;
  TF_RETURN_IF_ERROR(PayloadBytes(dtype, shape, &bytes));
  if (bytes == 0) {
    *out = Tensor(dtype, shape);
    return absl::OkStatus();
  }
  if (base == nullptr) return absl::InternalError("dymem host pool: no host allocator to charge");
  TF_RETURN_IF_ERROR(pool->Reserve(bytes));
  void* ptr = base->AllocateRaw(tensorflow::Allocator::kAllocatorAlignment, bytes);
  if (ptr == nullptr) {
    pool->Cancel(bytes);
    return absl::ResourceExhaustedError(absl::StrCat("dymem host pool: ", base->Name(), " could not allocate ", bytes,
                                                     " bytes for a swapped-out tensor"));
  }
  pool->Commit(bytes);
  auto* buffer = new ChargedBuffer(pool, base, ptr, bytes);
  *out = Tensor(dtype, shape, buffer);
  buffer->Unref();
  return absl::OkStatus();
}

}  // namespace dymem

extern "C" {

int dymem_host_pool_num_stats(void) { return dymem::kNumHostPoolStats; }

const char* dymem_host_pool_stat_name(int index) {
  if (index < 0 || index >= dymem::kNumHostPoolStats) return nullptr;
  return dymem::kHostPoolStatNames[index];
}

int dymem_host_pool_stats(int64_t* out, int n) {
  if (out == nullptr || n <= 0) return 0;
  int64_t all[dymem::kNumHostPoolStats];
  dymem::HostPool::Global()->GetStats(all);
  const int count = std::min(n, static_cast<int>(dymem::kNumHostPoolStats));
  std::memcpy(out, all, sizeof(int64_t) * static_cast<size_t>(count));
  return count;
}

void dymem_host_pool_reset_peak(void) { dymem::HostPool::Global()->ResetPeak(); }

int64_t dymem_host_pool_release_cache(void) { return dymem::HostPool::Global()->ReleaseCache(); }

void dymem_host_pool_set_cache_limit(int64_t bytes) { dymem::HostPool::Global()->SetCacheLimit(bytes); }

void dymem_host_pool_set_bytes_limit(int64_t bytes) { dymem::HostPool::Global()->SetBytesLimit(bytes); }

void* dymem_host_pool_charged_alloc(int64_t bytes, char* error, int error_len) {
  auto tensor = std::make_unique<tensorflow::Tensor>();
  const absl::Status status =
      bytes < 0 ? absl::InvalidArgumentError("dymem host pool: negative size")
                : dymem::AllocateChargedTensor(dymem::HostPool::Global(), tensorflow::cpu_allocator(),
                                               tensorflow::DT_UINT8, tensorflow::TensorShape({bytes}), tensor.get());
  if (status.ok()) {
    if (tensor->TotalBytes() > 0) std::memset(tensor->data(), 0xA5, tensor->TotalBytes());  // really writable
    return tensor.release();
  }
  if (error != nullptr && error_len > 0) {
    const std::string message = status.ToString();
    const size_t n = std::min(message.size(), static_cast<size_t>(error_len) - 1);
    std::memcpy(error, message.data(), n);
    error[n] = '\0';
  }
  return nullptr;
}

void dymem_host_pool_charged_free(void* handle) { delete static_cast<tensorflow::Tensor*>(handle); }

}  // extern "C"
