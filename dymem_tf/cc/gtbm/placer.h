// The placement policy behind a Pool (internal: the Pool's lock serialises every call).
//
// A Placer hands out chunks of an offset space [0, capacity) and knows what it reserves; the Pool adds the
// accounting, alignment, the budget and the trace. One implementation per policy: placer_gtbm.cc (GTBM and
// GTBM_NOGROUPS), placer_best_fit.cc (BEST_FIT), placer_first_fit.cc (FIRST_FIT).
#ifndef DYMEM_TF_CC_GTBM_PLACER_H_
#define DYMEM_TF_CC_GTBM_PLACER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "gtbm_core.h"

namespace gtbm {

class Placer {
 public:
  virtual ~Placer() = default;
  // `rounded` is a positive multiple of Granule(). Returns the chunk offset or kInvalidOffset; *allocated is the
  // chunk size (>= rounded). `limit` bounds Reserved().
  virtual uint64_t Allocate(uint64_t rounded, int group, uint64_t limit, uint64_t* allocated) = 0;
  // Frees the live chunk at `offset` (the Pool guarantees it is live).
  virtual void Free(uint64_t offset) = 0;
  // The unit every chunk size and offset is a multiple of.
  virtual uint64_t Granule() const = 0;
  // Bytes the policy holds (PoolStats::bytes_reserved).
  virtual uint64_t Reserved() const = 0;
  // End of the highest reserved byte (PoolStats::extent).
  virtual uint64_t Extent() const = 0;
  // Bytes reserved by one mobility group (GTBM only).
  virtual uint64_t GroupReserved(int /*group*/) const { return 0; }
  // Free bytes kept resident before on_release (GTBM only).
  virtual uint64_t CachedFree() const { return 0; }
  // Releases every cached free block now (GTBM only).
  virtual void TrimCache() {}
  // The largest contiguous free space, counting room to grow within `limit` (PoolStats::largest_free_block).
  virtual uint64_t LargestFree(uint64_t limit) const = 0;
  // Verifies the policy's internal invariants; false with the first violation in *error.
  virtual bool Check(std::string* error) const = 0;
};

// GTBM's pageblocks owned by mobility groups (`grouped` false: every tensor in one group, GTBM_NOGROUPS).
std::unique_ptr<Placer> NewGtbmPlacer(uint64_t capacity, uint64_t block, uint64_t alignment, bool grouped,
                                      std::function<void(uint64_t, uint64_t)> on_release, uint64_t release_cache);
// A mirror of TensorFlow's BFC allocator; its first region is min(initial_limit, 2 MiB) rounded to its unit.
std::unique_ptr<Placer> NewBestFitPlacer(uint64_t capacity, uint64_t alignment, uint64_t initial_limit);
// Address-ordered first fit over a heap that grows at its top.
std::unique_ptr<Placer> NewFirstFitPlacer(uint64_t capacity, uint64_t alignment);

}  // namespace gtbm

#endif  // DYMEM_TF_CC_GTBM_PLACER_H_
