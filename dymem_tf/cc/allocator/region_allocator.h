// RegionAllocator: a TensorFlow Allocator that serves every request from a gtbm::Pool laid over ONE region of
// memory taken, once, from a RegionSource -- the code shared by GTBM on the CPU device (gtbm_allocator.cc: the
// region is an mmap'ed range, plus a second region for host inputs) and GTBM on a GPU (gtbm_gpu.cc: the region is
// one device allocation from TensorFlow's own GPU sub-allocator). On the CPU the same class is also tested through
// a host tsl::SubAllocator standing in for the device one (region_selftest.cc).
//
// Placement: Classify (mobility.h) picks the group of each allocation; offsets of the pool are pointers
// base + offset. The budget is the pool's limit: an allocation beyond it returns nullptr (TensorFlow raises
// ResourceExhausted). Requests aligned beyond the region base's own alignment are refused (logged).
#ifndef DYMEM_TF_CC_ALLOCATOR_REGION_ALLOCATOR_H_
#define DYMEM_TF_CC_ALLOCATOR_REGION_ALLOCATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "../gtbm/gtbm_core.h"
#include "tensorflow/core/framework/allocator.h"

namespace dymem {

constexpr uint64_t kBaseAlignment = uint64_t{1} << 30;  // largest alignment AllocateRaw honours

// Where a region's memory comes from. One source holds at most one region at a time.
class RegionSource {
 public:
  virtual ~RegionSource() = default;
  // Takes a region of about *bytes (a multiple of `block`; may shrink down to `min_bytes`, *bytes is updated);
  // returns its base, or nullptr with *error set.
  virtual char* Reserve(uint64_t* bytes, uint64_t min_bytes, uint64_t block, std::string* error) = 0;
  // Gives back the region that Reserve returned.
  virtual void Release(char* base, uint64_t bytes) = 0;
  // The bytes [base + offset, + length) hold no live data any more; the source may give their pages back.
  virtual void Discard(char* /*base*/, uint64_t /*offset*/, uint64_t /*length*/) {}
  // The kind of memory the region is (reported by the allocator's GetMemoryType).
  virtual tsl::AllocatorMemoryType MemoryType() const = 0;
};

// Host address space: mmap(NORESERVE) halved while the kernel refuses, base aligned to kBaseAlignment;
// Discard madvise(MADV_DONTNEED)s the pages.
std::unique_ptr<RegionSource> NewMmapSource();

// One allocation of a tsl::SubAllocator (TensorFlow's DeviceMemAllocator on a GPU, a host stand-in in tests),
// backing off by 10% down to min_bytes while it refuses, as TensorFlow's BFC allocator does. `sub` must outlive
// the source; it is deleted with the source when `owned`.
std::unique_ptr<RegionSource> NewSubAllocatorSource(tsl::SubAllocator* sub, bool owned);

// How one region and its pool are sized.
struct RegionSpec {
  gtbm::PoolOptions pool;  // capacity is set from the region; limit 0 means the whole region
  uint64_t space = 0;      // bytes wanted
  uint64_t min_space = 0;  // the least the source may hand out instead
};

// A gtbm::Pool over one region of a RegionSource (given back on destruction).
class Region {
 public:
  Region() = default;
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  // Takes the region and creates the pool; false with *error set (nothing held) on failure.
  bool Init(std::unique_ptr<RegionSource> source, const RegionSpec& spec, std::string* error);
  // True when `ptr` lies inside the region (and the pool exists).
  bool Owns(const void* ptr) const;
  // Offset of `ptr`, an address inside the region, in the pool's offset space.
  uint64_t OffsetOf(const void* ptr) const;
  // The address of `offset`.
  char* At(uint64_t offset) const { return base_ + offset; }
  // nullptr until Init succeeded.
  gtbm::Pool* pool() const { return pool_.get(); }
  // Largest power of two dividing the base address, at most kBaseAlignment.
  uint64_t base_alignment() const { return base_alignment_; }
  // The region's memory type (kHostPageable before Init).
  tsl::AllocatorMemoryType memory_type() const;

 private:
  std::unique_ptr<RegionSource> source_;
  char* base_ = nullptr;
  uint64_t space_ = 0;
  uint64_t base_alignment_ = 0;
  std::unique_ptr<gtbm::Pool> pool_;
};

struct RegionAllocatorOptions {
  std::string name = "gtbm";  // Allocator::Name()
  RegionSpec device;          // the budgeted region
  RegionSpec host;            // the host-inputs region (only with a host source)
  bool log_init_failure = true;  // print why a region could not be set up (the GPU hook prints its own message)
};

class RegionAllocator final : public tensorflow::Allocator {
 public:
  // Takes the regions (host: optional, nullptr for none). Never throws; pool() is nullptr when the device region
  // could not be set up (error() says why) and every allocation then fails.
  RegionAllocator(const RegionAllocatorOptions& options, std::unique_ptr<RegionSource> device,
                  std::unique_ptr<RegionSource> host);

  std::string Name() override { return name_; }
  // Places the request by Classify (mobility.h); nullptr beyond the budget or the region's base alignment.
  void* AllocateRaw(size_t alignment, size_t num_bytes) override;
  // Frees a pointer of either region; others are logged and ignored.
  void DeallocateRaw(void* ptr) override;
  bool TracksAllocationSizes() const override { return device_.pool() != nullptr; }
  size_t RequestedSize(const void* ptr) const override;
  size_t AllocatedSize(const void* ptr) const override;
  // The device region only: the host-inputs region is host memory.
  std::optional<tensorflow::AllocatorStats> GetStats() override;
  bool ClearStats() override;
  tsl::AllocatorMemoryType GetMemoryType() const override { return device_.memory_type(); }

  // The device region's pool (nullptr when it could not be set up).
  gtbm::Pool* pool() const { return device_.pool(); }
  // The host-inputs region's pool (nullptr without one).
  gtbm::Pool* host_pool() const { return host_.pool(); }
  // Why the device region could not be set up (empty when it was).
  const std::string& error() const { return error_; }
  // Group of the live allocation at `ptr` (kHost for the host-inputs region), or -1 when there is none.
  int GroupOf(const void* ptr) const;
  // Largest alignment AllocateRaw honours.
  uint64_t max_alignment() const { return device_.base_alignment(); }
  // How many refused device allocations OverflowToHost served from the host region, and their bytes.
  int64_t overflow_allocs() const { return overflow_allocs_.load(std::memory_order_relaxed); }
  int64_t overflow_bytes() const { return overflow_bytes_.load(std::memory_order_relaxed); }

 private:
  // Serves `num_bytes` from the host-inputs region; nullptr when it is full.
  void* AllocateHost(size_t num_bytes, size_t alignment, const gtbm::AllocTag& tag);
  // A refused device allocation of a function's instantiation (TF's constant folding cannot handle a refusal) or
  // without any op annotation (a tensor from a Python value: TF_NewTensor does not check) goes to the host region;
  // nullptr otherwise.
  void* OverflowToHost(size_t num_bytes, size_t alignment, const gtbm::AllocTag& tag);
  // The region holding `ptr`, or nullptr.
  const Region* RegionOf(const void* ptr) const;
  // Logs a refused allocation with the pool's state (the first kMaxFailureLogs refusals only).
  void LogFailure(gtbm::Pool* pool, size_t num_bytes, size_t alignment, int group, std::string_view op);

  static constexpr int kMaxFailureLogs = 10;
  std::string name_;
  Region device_;
  Region host_;
  std::string error_;
  std::atomic<int> failures_logged_{0};
  std::atomic<int64_t> overflow_allocs_{0};
  std::atomic<int64_t> overflow_bytes_{0};
};

// The options of a device's region: all of `total_bytes` (the limit TensorFlow computed for the device), taken at
// once and, when refused, down to half of it; budget = the region; 256-byte alignment (as TF's GPU BFC allocator);
// pageblocks by BlockSizeFor; no host-inputs region.
RegionAllocatorOptions DeviceRegionOptions(const std::string& name, uint64_t total_bytes);

// GTBM over one region of `total_bytes` from `sub` (TF's GPU sub-allocator, or a host stand-in in tests);
// nullptr with *error set when the region cannot be taken. The same function serves the GPU hook and the tests.
std::unique_ptr<RegionAllocator> NewDeviceRegionAllocator(const std::string& name, uint64_t total_bytes,
                                                          tsl::SubAllocator* sub, bool owned, std::string* error);

}  // namespace dymem

#endif  // DYMEM_TF_CC_ALLOCATOR_REGION_ALLOCATOR_H_
