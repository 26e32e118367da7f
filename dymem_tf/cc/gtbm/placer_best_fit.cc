// The BEST_FIT placement policy: a mirror of TensorFlow's BFC allocator, for comparison in replays.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "arith.h"
#include "placer.h"

namespace gtbm {

namespace {

// BEST_FIT: a mirror of TensorFlow's BFCAllocator (xla/tsl/framework/bfc_allocator.cc) with allow_growth:
// sizes rounded to 256 bytes; 21 bins of power-of-two size classes starting at 256 bytes, each ordered by
// (size, address); the first chunk that fits in the lowest suitable bin is used and split only when it is at least
// twice the request or the remainder reaches 128 MiB; freed chunks coalesce with free neighbours of the same
// region. When nothing fits, a new region is appended: 2 MiB first, the region size doubling on every extension
// (or doubled until the request fits). Regions are never returned (TF's garbage collection of free regions only
// runs on a GPU out-of-memory retry), so Reserved() = Extent() = total region bytes.
class BestFitPlacer final : public Placer {
 public:
  BestFitPlacer(uint64_t capacity, uint64_t alignment, uint64_t initial_limit)
      : unit_(std::max<uint64_t>(alignment, kMinAllocationSize)), capacity_(capacity) {
    curr_region_ = RoundUp(std::min<uint64_t>(initial_limit, uint64_t{2} << 20), unit_);
    if (curr_region_ == 0) curr_region_ = unit_;
  }

  uint64_t Granule() const override { return unit_; }
  uint64_t Reserved() const override { return pool_bytes_; }
  uint64_t Extent() const override { return pool_bytes_; }

  uint64_t Allocate(uint64_t rounded, int /*group*/, uint64_t limit, uint64_t* allocated) override {
    const uint64_t r = RoundUp(rounded, unit_);
    uint64_t off = Find(r);
    if (off == kInvalidOffset) {
      if (!Extend(r, limit)) return kInvalidOffset;
      off = Find(r);
      if (off == kInvalidOffset) return kInvalidOffset;
    }
    *allocated = chunks_.at(off).size;
    return off;
  }

  void Free(uint64_t offset) override {
    auto it = chunks_.find(offset);
    it->second.used = false;
    if (it != chunks_.begin()) {
      auto prev = std::prev(it);
      if (!prev->second.used && prev->second.region == it->second.region) {
        RemoveFromBin(prev->first, prev->second.size);
        prev->second.size += it->second.size;
        chunks_.erase(it);
        it = prev;
      }
    }
    auto next = std::next(it);
    if (next != chunks_.end() && !next->second.used && next->second.region == it->second.region) {
      RemoveFromBin(next->first, next->second.size);
      it->second.size += next->second.size;
      chunks_.erase(next);
    }
    InsertIntoBin(it->first, it->second.size);
  }

  uint64_t LargestFree(uint64_t limit) const override {
    uint64_t best = 0;
    for (int b = kNumBins - 1; b >= 0; --b) {
      if (!bins_[b].empty()) {
        best = bins_[b].rbegin()->first;
        break;
      }
    }
    const uint64_t room = std::min(limit, capacity_);
    return std::max(best, room > pool_bytes_ ? (room - pool_bytes_) / unit_ * unit_ : 0);
  }

  bool Check(std::string* error) const override {
    uint64_t expect = 0;
    size_t nfree = 0;
    for (const auto& [off, c] : chunks_) {
      if (off != expect) {
        *error = "best_fit: chunks do not tile the regions";
        return false;
      }
      if (!c.used) {
        ++nfree;
        if (bins_[BinNum(c.size)].count({c.size, off}) == 0) {
          *error = "best_fit: free chunk missing from its bin";
          return false;
        }
      }
      expect = off + c.size;
    }
    size_t binned = 0;
    for (const auto& b : bins_) binned += b.size();
    if (expect != pool_bytes_ || binned != nfree) {
      *error = "best_fit: region bytes or bins inconsistent";
      return false;
    }
    return true;
  }

 private:
  static constexpr uint64_t kMinAllocationSize = 256;
  static constexpr int kNumBins = 21;
  static constexpr uint64_t kMaxInternalFragmentation = uint64_t{128} << 20;

  struct Chunk {
    uint64_t size;
    uint32_t region;
    bool used;
  };

  // The bin of a chunk of `bytes`: floor(log2(bytes / 256)), at most the last bin.
  static int BinNum(uint64_t bytes) {
    const uint64_t v = std::max<uint64_t>(bytes, kMinAllocationSize) >> 8;
    return std::min(kNumBins - 1, FloorLog2(v));
  }

  // Adds the free chunk at `off` to its bin.
  void InsertIntoBin(uint64_t off, uint64_t size) { bins_[BinNum(size)].insert({size, off}); }
  // Removes the free chunk at `off` from its bin.
  void RemoveFromBin(uint64_t off, uint64_t size) { bins_[BinNum(size)].erase({size, off}); }

  // Takes the smallest free chunk of at least `r` bytes in the lowest bin holding one (split by BFC's rule); its
  // offset, or kInvalidOffset.
  uint64_t Find(uint64_t r) {
    for (int b = BinNum(r); b < kNumBins; ++b) {
      auto it = bins_[b].lower_bound({r, 0});
      if (it == bins_[b].end()) continue;
      const uint64_t off = it->second;
      bins_[b].erase(it);
      Chunk& c = chunks_.at(off);
      if (c.size >= 2 * r || c.size - r >= kMaxInternalFragmentation) {
        const uint64_t rest = c.size - r;
        c.size = r;
        chunks_.emplace(off + r, Chunk{rest, c.region, false});
        InsertIntoBin(off + r, rest);
      }
      c.used = true;
      return off;
    }
    return kInvalidOffset;
  }

  // Appends a free region that holds `r` bytes (doubling the region size); false when `limit` leaves no room.
  bool Extend(uint64_t r, uint64_t limit) {
    const uint64_t room = std::min(limit, capacity_);
    const uint64_t available = room > pool_bytes_ ? (room - pool_bytes_) / unit_ * unit_ : 0;
    if (r > available) return false;
    bool increased = false;
    while (r > curr_region_) {
      curr_region_ *= 2;
      increased = true;
    }
    const uint64_t bytes = std::min(curr_region_, available);
    if (!increased) curr_region_ *= 2;
    const uint32_t region = num_regions_++;
    chunks_.emplace(pool_bytes_, Chunk{bytes, region, false});
    InsertIntoBin(pool_bytes_, bytes);
    pool_bytes_ += bytes;
    return true;
  }

  const uint64_t unit_;
  const uint64_t capacity_;
  uint64_t curr_region_;
  uint64_t pool_bytes_ = 0;
  uint32_t num_regions_ = 0;
  std::map<uint64_t, Chunk> chunks_;
  std::set<std::pair<uint64_t, uint64_t>> bins_[kNumBins];
};

}  // namespace

std::unique_ptr<Placer> NewBestFitPlacer(uint64_t capacity, uint64_t alignment, uint64_t initial_limit) {
  return std::make_unique<BestFitPlacer>(capacity, alignment, initial_limit);
}

}  // namespace gtbm
