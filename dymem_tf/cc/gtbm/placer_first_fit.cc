// The FIRST_FIT placement policy: address-ordered first fit, for comparison in replays.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <string>

#include "placer.h"

namespace gtbm {

namespace {

// FIRST_FIT: address-ordered first fit with splitting and coalescing over a heap that grows at its top; the top
// comes down when the highest chunk is freed. Reserved() = Extent() = current top.
class FirstFitPlacer final : public Placer {
 public:
  FirstFitPlacer(uint64_t capacity, uint64_t alignment) : alignment_(alignment), capacity_(capacity) {}

  uint64_t Granule() const override { return alignment_; }
  uint64_t Reserved() const override { return top_; }
  uint64_t Extent() const override { return top_; }

  uint64_t Allocate(uint64_t rounded, int /*group*/, uint64_t limit, uint64_t* allocated) override {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < rounded) continue;
      const uint64_t off = it->first;
      const uint64_t size = it->second;
      free_.erase(it);
      Chunk& c = chunks_.at(off);
      if (size > rounded) {
        c.size = rounded;
        chunks_.emplace(off + rounded, Chunk{size - rounded, false});
        free_.emplace(off + rounded, size - rounded);
      }
      c.used = true;
      *allocated = rounded;
      return off;
    }
    // Grow at the top, starting inside a free chunk that ends at the top if there is one.
    uint64_t start = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) start = last->first;
    }
    const uint64_t room = std::min(limit, capacity_);
    if (start > room || rounded > room - start) return kInvalidOffset;
    if (start != top_) {
      free_.erase(start);
      chunks_.erase(start);
    }
    chunks_.emplace(start, Chunk{rounded, true});
    top_ = start + rounded;
    *allocated = rounded;
    return start;
  }

  void Free(uint64_t offset) override {
    auto it = chunks_.find(offset);
    it->second.used = false;
    if (it != chunks_.begin()) {
      auto prev = std::prev(it);
      if (!prev->second.used) {
        free_.erase(prev->first);
        prev->second.size += it->second.size;
        chunks_.erase(it);
        it = prev;
      }
    }
    auto next = std::next(it);
    if (next != chunks_.end() && !next->second.used) {
      free_.erase(next->first);
      it->second.size += next->second.size;
      chunks_.erase(next);
    }
    if (it->first + it->second.size == top_) {
      top_ = it->first;
      chunks_.erase(it);
    } else {
      free_.emplace(it->first, it->second.size);
    }
  }

  uint64_t LargestFree(uint64_t limit) const override {
    uint64_t best = 0;
    for (const auto& f : free_) best = std::max(best, f.second);
    const uint64_t room = std::min(limit, capacity_);
    return std::max(best, room > top_ ? room - top_ : 0);
  }

  bool Check(std::string* error) const override {
    uint64_t expect = 0;
    size_t nfree = 0;
    for (const auto& [off, c] : chunks_) {
      if (off != expect || c.size == 0) {
        *error = "first_fit: chunks do not tile [0, top)";
        return false;
      }
      if (!c.used) {
        ++nfree;
        auto f = free_.find(off);
        if (f == free_.end() || f->second != c.size) {
          *error = "first_fit: free chunk missing from the free list";
          return false;
        }
      }
      expect = off + c.size;
    }
    if (expect != top_ || nfree != free_.size()) {
      *error = "first_fit: top or free list inconsistent";
      return false;
    }
    return true;
  }

 private:
  struct Chunk {
    uint64_t size;
    bool used;
  };
  const uint64_t alignment_;
  const uint64_t capacity_;
  uint64_t top_ = 0;
  std::map<uint64_t, Chunk> chunks_;
  std::map<uint64_t, uint64_t> free_;  // free chunks below the top, by address
};

}  // namespace

std::unique_ptr<Placer> NewFirstFitPlacer(uint64_t capacity, uint64_t alignment) {
  return std::make_unique<FirstFitPlacer>(capacity, alignment);
}

}  // namespace gtbm
