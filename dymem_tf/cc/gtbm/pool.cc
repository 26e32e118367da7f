// Pool: accounting, alignment and the budget around one Placer (see gtbm_core.h for the definitions).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "arith.h"
#include "gtbm_core.h"
#include "placer.h"

namespace gtbm {

std::unique_ptr<Pool> Pool::Create(const PoolOptions& options, std::string* error) {
  auto fail = [&](const std::string& why) -> std::unique_ptr<Pool> {
    if (error != nullptr) *error = why;
    return nullptr;
  };
  if (!IsPowerOfTwo(options.alignment)) return fail("alignment must be a power of two");
  if (options.capacity == 0 || options.capacity > kMaxBytes) return fail("capacity must be in [1, 2^63)");
  if (options.limit > options.capacity) return fail("limit exceeds the capacity");
  const bool gtbm = options.policy == Policy::kGtbm || options.policy == Policy::kGtbmNoGroups;
  if (gtbm) {
    if (options.block_size == 0 || options.block_size % options.alignment != 0) {
      return fail("block size must be a positive multiple of the alignment");
    }
    if (options.block_size > options.capacity) return fail("block size exceeds the capacity");
  }
  std::unique_ptr<Pool> pool(new Pool(options));
  return pool;
}

Pool::Pool(const PoolOptions& options) : options_(options) {
  limit_ = options.limit == 0 ? options.capacity : options.limit;
  switch (options.policy) {
    case Policy::kGtbm:
    case Policy::kGtbmNoGroups:
      options_.capacity = options.capacity / options.block_size * options.block_size;
      limit_ = std::min(limit_, options_.capacity);
      placer_ = NewGtbmPlacer(options_.capacity, options.block_size, options.alignment,
                              options.policy == Policy::kGtbm, options.on_release, options.release_cache);
      break;
    case Policy::kBestFit:
      placer_ = NewBestFitPlacer(options.capacity, options.alignment, limit_);
      break;
    case Policy::kFirstFit:
      placer_ = NewFirstFitPlacer(options.capacity, options.alignment);
      break;
  }
  stats_.bytes_limit = static_cast<int64_t>(limit_);
  stats_.capacity = static_cast<int64_t>(options_.capacity);
  stats_.block_size = gtbm_block_size();
}

int64_t Pool::gtbm_block_size() const {
  return (options_.policy == Policy::kGtbm || options_.policy == Policy::kGtbmNoGroups)
             ? static_cast<int64_t>(options_.block_size)
             : 0;
}

Pool::~Pool() = default;

void Pool::UpdatePeaksLocked() {
  const int64_t reserved = static_cast<int64_t>(placer_->Reserved());
  if (stats_.bytes_in_use > stats_.peak_bytes_in_use) {
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
    stats_.reserved_at_peak_in_use = reserved;
  }
  stats_.peak_requested_bytes_in_use = std::max(stats_.peak_requested_bytes_in_use, stats_.requested_bytes_in_use);
  stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, reserved);
  stats_.peak_extent = std::max(stats_.peak_extent, static_cast<int64_t>(placer_->Extent()));
  for (int g = 0; g < kNumGroups; ++g) {
    stats_.group_peak_in_use[g] = std::max(stats_.group_peak_in_use[g], stats_.group_in_use[g]);
    stats_.group_peak_reserved[g] =
        std::max(stats_.group_peak_reserved[g], static_cast<int64_t>(placer_->GroupReserved(g)));
  }
}

uint64_t Pool::Allocate(uint64_t bytes, int group, uint64_t alignment, const AllocTag* tag) {
  const uint64_t requested = std::max<uint64_t>(bytes, 1);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t granule = placer_->Granule();
  const uint64_t align = std::max(alignment, options_.alignment);
  if (group < 0 || group >= kNumGroups || (alignment != 0 && !IsPowerOfTwo(alignment)) ||
      requested > options_.capacity || align > options_.capacity) {
    ++stats_.num_failed_allocs;
    return kInvalidOffset;
  }
  // Over-aligned requests get padding so that an aligned offset always exists inside the chunk.
  const uint64_t padding = align > granule ? align - granule : 0;
  const uint64_t rounded = RoundUp(requested, granule) + padding;
  uint64_t allocated = 0;
  const uint64_t base = placer_->Allocate(rounded, group, limit_, &allocated);
  if (base == kInvalidOffset) {
    ++stats_.num_failed_allocs;
    return kInvalidOffset;
  }
  const uint64_t offset = RoundUp(base, align);
  stats_.peak_used_end = std::max(stats_.peak_used_end, static_cast<int64_t>(base + allocated));
  Live live{base, requested, allocated, group, -1, 0};
  ++stats_.num_allocs;
  ++stats_.group_num_allocs[group];
  stats_.bytes_in_use += static_cast<int64_t>(allocated);
  stats_.requested_bytes_in_use += static_cast<int64_t>(requested);
  stats_.group_in_use[group] += static_cast<int64_t>(allocated);
  stats_.largest_alloc_size = std::max(stats_.largest_alloc_size, static_cast<int64_t>(allocated));
  UpdatePeaksLocked();
  TraceAllocLocked(offset, tag, &live);
  live_.emplace(offset, live);
  return offset;
}

uint64_t Pool::Free(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(offset);
  if (it == live_.end()) return 0;
  const Live live = it->second;
  live_.erase(it);
  placer_->Free(live.base);
  ++stats_.num_frees;
  stats_.bytes_in_use -= static_cast<int64_t>(live.allocated);
  stats_.requested_bytes_in_use -= static_cast<int64_t>(live.requested);
  stats_.group_in_use[live.group] -= static_cast<int64_t>(live.allocated);
  // Reserved memory only shrinks on a free, but the per-group peaks are cheap to keep exact.
  UpdatePeaksLocked();
  TraceFreeLocked(live);
  return live.allocated;
}

bool Pool::SetLimit(uint64_t limit, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (limit > options_.capacity) {
    if (error != nullptr) {
      *error = "limit " + std::to_string(limit) + " exceeds the pool capacity " + std::to_string(options_.capacity);
    }
    return false;
  }
  if (static_cast<int64_t>(limit) < stats_.bytes_in_use) {
    if (error != nullptr) {
      *error = "limit " + std::to_string(limit) + " is below the bytes in use (" +
               std::to_string(stats_.bytes_in_use) + ")";
    }
    return false;
  }
  limit_ = limit;
  stats_.bytes_limit = static_cast<int64_t>(limit);
  return true;
}

uint64_t Pool::limit() const {
  std::lock_guard<std::mutex> lock(mu_);
  return limit_;
}

PoolStats Pool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats s = stats_;
  s.bytes_reserved = static_cast<int64_t>(placer_->Reserved());
  s.extent = static_cast<int64_t>(placer_->Extent());
  s.largest_free_block = static_cast<int64_t>(placer_->LargestFree(limit_));
  s.cached_free_bytes = static_cast<int64_t>(placer_->CachedFree());
  s.live_allocations = static_cast<int64_t>(live_.size());
  for (int g = 0; g < kNumGroups; ++g) s.group_reserved[g] = static_cast<int64_t>(placer_->GroupReserved(g));
  return s;
}

void Pool::ResetPeaksLocked() {
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
  stats_.peak_requested_bytes_in_use = stats_.requested_bytes_in_use;
  stats_.reserved_at_peak_in_use = static_cast<int64_t>(placer_->Reserved());
  stats_.peak_bytes_reserved = static_cast<int64_t>(placer_->Reserved());
  stats_.peak_extent = static_cast<int64_t>(placer_->Extent());
  stats_.peak_used_end = stats_.peak_extent;
  stats_.largest_alloc_size = 0;
  for (int g = 0; g < kNumGroups; ++g) {
    stats_.group_peak_in_use[g] = stats_.group_in_use[g];
    stats_.group_peak_reserved[g] = static_cast<int64_t>(placer_->GroupReserved(g));
  }
}

void Pool::TrimCache() {
  std::lock_guard<std::mutex> lock(mu_);
  placer_->TrimCache();
}

void Pool::ResetPeaks() {
  std::lock_guard<std::mutex> lock(mu_);
  ResetPeaksLocked();
}

void Pool::ClearCounters() {
  std::lock_guard<std::mutex> lock(mu_);
  ResetPeaksLocked();
  stats_.num_allocs = 0;
  stats_.num_frees = 0;
  stats_.num_failed_allocs = 0;
  for (int g = 0; g < kNumGroups; ++g) stats_.group_num_allocs[g] = 0;
}

bool Pool::Lookup(uint64_t offset, uint64_t* requested, uint64_t* allocated, int* group) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(offset);
  if (it == live_.end()) return false;
  if (requested != nullptr) *requested = it->second.requested;
  if (allocated != nullptr) *allocated = it->second.allocated;
  if (group != nullptr) *group = it->second.group;
  return true;
}

bool Pool::CheckInvariants(std::string* error) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!placer_->Check(error)) return false;
  int64_t in_use = 0;
  int64_t requested = 0;
  int64_t group[kNumGroups] = {0, 0, 0};
  for (const auto& [off, l] : live_) {
    if (off % options_.alignment != 0) {
      *error = "misaligned live offset";
      return false;
    }
    in_use += static_cast<int64_t>(l.allocated);
    requested += static_cast<int64_t>(l.requested);
    group[l.group] += static_cast<int64_t>(l.allocated);
  }
  if (in_use != stats_.bytes_in_use || requested != stats_.requested_bytes_in_use) {
    *error = "bytes in use disagree with the live allocations";
    return false;
  }
  for (int g = 0; g < kNumGroups; ++g) {
    if (group[g] != stats_.group_in_use[g]) {
      *error = "per-group bytes in use disagree with the live allocations";
      return false;
    }
  }
  if (static_cast<uint64_t>(stats_.bytes_in_use) > placer_->Reserved() ||
      placer_->Reserved() > placer_->Extent()) {
    *error = "in use > reserved or reserved > extent";
    return false;
  }
  return true;
}

}  // namespace gtbm
