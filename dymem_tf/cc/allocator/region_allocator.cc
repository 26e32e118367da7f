// RegionAllocator and its region sources (see region_allocator.h).
#include "region_allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "config.h"
#include "mobility.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"

namespace dymem {
namespace {

constexpr uint64_t kDeviceAlignment = 256;  // TF's GPU BFC allocator rounds every chunk to 256 bytes

// Rounds `n` up to a multiple of `unit` (> 0).
uint64_t RoundUpTo(uint64_t n, uint64_t unit) { return (n + unit - 1) / unit * unit; }

// Largest power of two dividing `p`, at most kBaseAlignment.
uint64_t AlignmentOf(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint64_t low = a == 0 ? kBaseAlignment : static_cast<uint64_t>(a & (~a + 1));
  return std::min(low, kBaseAlignment);
}

class MmapSource final : public RegionSource {
 public:
  // mmap(NORESERVE) of *bytes (halved while refused, down to min_bytes), base aligned to max(block, 1 GiB).
  char* Reserve(uint64_t* bytes, uint64_t min_bytes, uint64_t block, std::string* error) override {
    const uint64_t align = std::max(block, kBaseAlignment);
    void* raw = MAP_FAILED;
    while (true) {
      raw = mmap(nullptr, *bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1,
                 0);
      if (raw != MAP_FAILED || *bytes / 2 < min_bytes) break;
      *bytes = *bytes / 2 / block * block;  // strict overcommit settings: try a smaller reservation
    }
    if (raw == MAP_FAILED) {
      *error = "mmap of " + std::to_string(*bytes) + " bytes failed: " + std::strerror(errno);
      return nullptr;
    }
    return TrimToAlignment(static_cast<char*>(raw), *bytes, align);
  }

  void Release(char* base, uint64_t bytes) override { munmap(base, bytes); }

  // Gives the pages back: the block is free for every group, its contents are dead.
  void Discard(char* base, uint64_t offset, uint64_t length) override {
    madvise(base + offset, length, MADV_DONTNEED);
  }

  tsl::AllocatorMemoryType MemoryType() const override { return tsl::AllocatorMemoryType::kHostPageable; }

 private:
  // Unmaps the parts of [raw, raw + bytes + align) outside the aligned [base, base + bytes); returns base.
  static char* TrimToAlignment(char* raw, uint64_t bytes, uint64_t align) {
    const uintptr_t raw_addr = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t base = (raw_addr + align - 1) / align * align;
    if (base > raw_addr) munmap(raw, base - raw_addr);
    const uintptr_t tail = base + bytes;
    const uintptr_t raw_end = raw_addr + bytes + align;
    if (raw_end > tail) munmap(reinterpret_cast<void*>(tail), raw_end - tail);
    return reinterpret_cast<char*>(base);
  }
};

class SubAllocatorSource final : public RegionSource {
 public:
  SubAllocatorSource(tsl::SubAllocator* sub, bool owned) : sub_(sub), owned_(owned) {}
  ~SubAllocatorSource() override {
    if (owned_) delete sub_;
  }

  // One sub-allocation of *bytes, 10% less each time it is refused, down to min_bytes (as TF's BFC backs off).
  char* Reserve(uint64_t* bytes, uint64_t min_bytes, uint64_t block, std::string* error) override {
    for (uint64_t want = *bytes; want >= std::max<uint64_t>(min_bytes, 1); want = want / 10 * 9 / block * block) {
      size_t received = 0;
      void* p = sub_->Alloc(tensorflow::Allocator::kAllocatorAlignment, want, &received);
      if (p != nullptr) {
        received_ = std::max<uint64_t>(received, want);
        *bytes = want;
        return static_cast<char*>(p);
      }
    }
    *error = "the sub-allocator refused " + std::to_string(*bytes) + " bytes (and every size down to " +
             std::to_string(min_bytes) + ")";
    return nullptr;
  }

  void Release(char* base, uint64_t /*bytes*/) override { sub_->Free(base, received_); }

  tsl::AllocatorMemoryType MemoryType() const override { return sub_->GetMemoryType(); }

 private:
  tsl::SubAllocator* sub_;
  bool owned_;
  uint64_t received_ = 0;  // what the sub-allocator reported for the region it handed out
};

}  // namespace

std::unique_ptr<RegionSource> NewMmapSource() { return std::make_unique<MmapSource>(); }

std::unique_ptr<RegionSource> NewSubAllocatorSource(tsl::SubAllocator* sub, bool owned) {
  return std::make_unique<SubAllocatorSource>(sub, owned);
}

// ------------------------------------------------------------------------------------------------------------
// Region.

Region::~Region() {
  pool_.reset();
  if (base_ != nullptr) source_->Release(base_, space_);
}

bool Region::Init(std::unique_ptr<RegionSource> source, const RegionSpec& spec, std::string* error) {
  gtbm::PoolOptions options = spec.pool;
  uint64_t space = RoundUpTo(std::max<uint64_t>(spec.space, 1), options.block_size);
  char* base = source->Reserve(&space, std::max(spec.min_space, options.block_size), options.block_size, error);
  if (base == nullptr) return false;
  options.capacity = space;
  options.limit = std::min(options.limit == 0 ? space : options.limit, space);
  RegionSource* raw_source = source.get();
  options.on_release = [raw_source, base](uint64_t offset, uint64_t length) {
    raw_source->Discard(base, offset, length);
  };
  pool_ = gtbm::Pool::Create(options, error);
  if (pool_ == nullptr) {
    source->Release(base, space);
    return false;
  }
  source_ = std::move(source);
  base_ = base;
  space_ = space;
  base_alignment_ = AlignmentOf(base);
  return true;
}

bool Region::Owns(const void* ptr) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t b = reinterpret_cast<uintptr_t>(base_);
  return pool_ != nullptr && p >= b && p < b + space_;
}

uint64_t Region::OffsetOf(const void* ptr) const {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(base_));
}

tsl::AllocatorMemoryType Region::memory_type() const {
  return source_ != nullptr ? source_->MemoryType() : tsl::AllocatorMemoryType::kHostPageable;
}

// ------------------------------------------------------------------------------------------------------------
// RegionAllocator.

RegionAllocator::RegionAllocator(const RegionAllocatorOptions& options, std::unique_ptr<RegionSource> device,
                                 std::unique_ptr<RegionSource> host)
    : name_(options.name) {
  if (!device_.Init(std::move(device), options.device, &error_)) {
    if (!options.log_init_failure) return;
    std::fprintf(stderr, "dymem_tf GTBM: cannot create the pool: %s; every allocation will fail\n",
                 error_.c_str());
    return;
  }
  std::string host_error;
  if (host != nullptr && !host_.Init(std::move(host), options.host, &host_error)) {
    std::fprintf(stderr,
                 "dymem_tf GTBM: no host-inputs arena (%s): input-pipeline tensors count against the device "
                 "budget\n",
                 host_error.c_str());
  }
}

void* RegionAllocator::AllocateRaw(size_t alignment, size_t num_bytes) {
  if (device_.pool() == nullptr) return nullptr;
  if (alignment > device_.base_alignment()) {
    if (failures_logged_.fetch_add(1, std::memory_order_relaxed) < kMaxFailureLogs) {
      std::fprintf(stderr, "dymem_tf GTBM: alignment %zu is not supported (at most %llu)\n", alignment,
                   static_cast<unsigned long long>(device_.base_alignment()));
    }
    return nullptr;
  }
  const tsl::profiler::MemoryDebugAnnotation& annotation =
      tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation();
  int group = Classify(annotation);
  gtbm::AllocTag tag;
  tag.op_name = std::string_view(annotation.pending_op_name.data(), annotation.pending_op_name.size());
  tag.step_id = annotation.pending_step_id;
  if (group == kHost) {
    if (host_.pool() != nullptr) return AllocateHost(num_bytes, alignment, tag);
    group = gtbm::kPersistent;  // no host region: count it, as with DYMEM_HOST_INPUTS=0
  }
  const uint64_t offset = device_.pool()->Allocate(num_bytes, group, alignment, &tag);
  if (offset == gtbm::kInvalidOffset) {
    LogFailure(device_.pool(), num_bytes, alignment, group, tag.op_name);
    return OverflowToHost(num_bytes, alignment, tag);
  }
  return device_.At(offset);
}

void* RegionAllocator::AllocateHost(size_t num_bytes, size_t alignment, const gtbm::AllocTag& tag) {
  const uint64_t offset = host_.pool()->Allocate(num_bytes, gtbm::kPersistent, alignment, &tag);
  if (offset != gtbm::kInvalidOffset) return host_.At(offset);
  LogFailure(host_.pool(), num_bytes, alignment, kHost, tag.op_name);
  return nullptr;
}

void* RegionAllocator::OverflowToHost(size_t num_bytes, size_t alignment, const gtbm::AllocTag& tag) {
  const bool instantiation = IsFunctionInstantiation(tag.op_name);
  if (host_.pool() == nullptr || !(instantiation || tag.op_name.empty())) return nullptr;
  const uint64_t offset = host_.pool()->Allocate(num_bytes, gtbm::kPersistent, alignment, &tag);
  if (offset == gtbm::kInvalidOffset) return nullptr;
  overflow_allocs_.fetch_add(1, std::memory_order_relaxed);
  overflow_bytes_.fetch_add(static_cast<int64_t>(num_bytes), std::memory_order_relaxed);
  std::fprintf(stderr, "dymem_tf GTBM: served the %zu bytes from host memory instead: %s cannot handle a refused "
               "allocation\n", num_bytes, instantiation ? "TensorFlow's function instantiation (constant folding)"
                                                        : "a tensor made from a Python value (TF_NewTensor)");
  return host_.At(offset);
}

void RegionAllocator::DeallocateRaw(void* ptr) {
  if (ptr == nullptr) return;
  const Region* region = RegionOf(ptr);
  if (region == nullptr || region->pool()->Free(region->OffsetOf(ptr)) == 0) {
    std::fprintf(stderr, "dymem_tf GTBM: DeallocateRaw(%p) of a pointer it did not allocate (ignored)\n", ptr);
  }
}

size_t RegionAllocator::RequestedSize(const void* ptr) const {
  uint64_t requested = 0;
  if (const Region* region = RegionOf(ptr)) region->pool()->Lookup(region->OffsetOf(ptr), &requested, nullptr, nullptr);
  return requested;
}

size_t RegionAllocator::AllocatedSize(const void* ptr) const {
  uint64_t allocated = 0;
  if (const Region* region = RegionOf(ptr)) region->pool()->Lookup(region->OffsetOf(ptr), nullptr, &allocated, nullptr);
  return allocated;
}

int RegionAllocator::GroupOf(const void* ptr) const {
  const Region* region = RegionOf(ptr);
  int group = -1;
  if (region == nullptr || !region->pool()->Lookup(region->OffsetOf(ptr), nullptr, nullptr, &group)) return -1;
  return region == &host_ ? kHost : group;
}

std::optional<tensorflow::AllocatorStats> RegionAllocator::GetStats() {
  if (device_.pool() == nullptr) return std::nullopt;
  const gtbm::PoolStats s = device_.pool()->Stats();
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

bool RegionAllocator::ClearStats() {
  if (device_.pool() == nullptr) return false;
  device_.pool()->ClearCounters();
  if (host_.pool() != nullptr) host_.pool()->ClearCounters();
  return true;
}

const Region* RegionAllocator::RegionOf(const void* ptr) const {
  if (device_.Owns(ptr)) return &device_;
  if (host_.Owns(ptr)) return &host_;
  return nullptr;
}

void RegionAllocator::LogFailure(gtbm::Pool* pool, size_t num_bytes, size_t alignment, int group,
                                 std::string_view op) {
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

// ------------------------------------------------------------------------------------------------------------
// Device regions (GPU hook, tests).

RegionAllocatorOptions DeviceRegionOptions(const std::string& name, uint64_t total_bytes) {
  RegionAllocatorOptions options;
  options.name = name;
  options.log_init_failure = false;
  gtbm::PoolOptions& pool = options.device.pool;
  pool.policy = gtbm::Policy::kGtbm;
  pool.block_size = BlockSizeFor(total_bytes);
  pool.alignment = kDeviceAlignment;
  pool.release_cache = 0;  // device memory is not given back page by page: Discard is a no-op
  options.device.space = total_bytes / pool.block_size * pool.block_size;
  options.device.min_space = options.device.space / 2 / pool.block_size * pool.block_size;
  return options;
}

std::unique_ptr<RegionAllocator> NewDeviceRegionAllocator(const std::string& name, uint64_t total_bytes,
                                                          tsl::SubAllocator* sub, bool owned, std::string* error) {
  const RegionAllocatorOptions options = DeviceRegionOptions(name, total_bytes);
  if (options.device.space == 0) {
    if (owned) delete sub;
    *error = "the device's memory limit (" + std::to_string(total_bytes) + " bytes) is below one pageblock (" +
             std::to_string(options.device.pool.block_size) + " bytes)";
    return nullptr;
  }
  auto allocator = std::make_unique<RegionAllocator>(options, NewSubAllocatorSource(sub, owned), nullptr);
  if (allocator->pool() != nullptr) return allocator;
  *error = allocator->error();
  return nullptr;
}

}  // namespace dymem
