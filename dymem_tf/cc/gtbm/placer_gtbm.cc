// The GTBM placement policy: pageblocks owned by mobility groups.
#include <algorithm>
#include <cstdint>
#include <functional>
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

// GTBM: pageblocks owned by mobility groups (see gtbm_core.h).
//
// Block placement. When a group has no free chunk large enough it takes new blocks, choosing among
//   (a) extending one of its free chunks that borders a run of free blocks (the request uses the chunk plus the
//       fewest new blocks; a chunk on both sides of a short run can be bridged), and
//   (b) a fresh run of ceil(size / block) free blocks,
// the candidate that keeps the extent (end of the highest owned block) lowest, then the one that needs the fewest
// new blocks, then the lowest address. Every group draws from the same address-ordered free-block list, so holes
// are refilled before the pool grows and blocks freed by one group (activations released in the backward pass)
// are reused by another (gradients); what grouping buys is that every block holds tensors of one mobility only,
// so a block is freed as a whole when its group's tensors die, instead of being pinned by a long-lived neighbour.
//
// Why not grow the groups from opposite ends of the pool: with strict segregation each side needs its own peak,
// and the pool needs the sum of the groups' peaks. On TF training traces (ResNet-50, DenseNet-121, InceptionV3)
// the long-lived and short-lived peaks do not coincide and the sum exceeds the live peak by 5-20%, while the shared
// address-ordered block list stays within a few percent of it (bench: python -m dymem_tf.memory.replay).
class GtbmPlacer final : public Placer {
 public:
  GtbmPlacer(uint64_t capacity, uint64_t block, uint64_t alignment, bool grouped,
             std::function<void(uint64_t, uint64_t)> on_release, uint64_t release_cache)
      : block_(block),
        alignment_(alignment),
        nblocks_(capacity / block),
        grouped_(grouped),
        on_release_(std::move(on_release)),
        cache_blocks_(release_cache / block) {
    if (nblocks_ > 0) runs_.emplace(0, nblocks_);
  }

  uint64_t Granule() const override { return alignment_; }
  uint64_t Reserved() const override { return owned_total_ * block_; }
  uint64_t Extent() const override { return ExtentBlocks() * block_; }
  uint64_t GroupReserved(int group) const override { return owned_[group] * block_; }
  uint64_t CachedFree() const override { return cached_.size() * block_; }
  void TrimCache() override { EvictCache(0); }

  uint64_t Allocate(uint64_t rounded, int group, uint64_t limit, uint64_t* allocated) override {
    const int g = grouped_ ? group : kTransient;
    auto it = free_[g].lower_bound({rounded, 0});
    uint64_t off;
    if (it != free_[g].end()) {
      off = it->second;
    } else {
      off = Grow(g, rounded, limit);
      if (off == kInvalidOffset) return kInvalidOffset;
    }
    Take(off, rounded);
    *allocated = rounded;
    return off;
  }

  void Free(uint64_t offset) override {
    auto it = chunks_.find(offset);
    it->second.used = false;
    const int g = it->second.group;
    // Coalesce with free neighbours of the same group.
    if (it != chunks_.begin()) {
      auto prev = std::prev(it);
      if (!prev->second.used && prev->second.group == g && prev->first + prev->second.size == it->first) {
        free_[g].erase({prev->second.size, prev->first});
        prev->second.size += it->second.size;
        chunks_.erase(it);
        it = prev;
      }
    }
    auto next = std::next(it);
    if (next != chunks_.end() && !next->second.used && next->second.group == g &&
        it->first + it->second.size == next->first) {
      free_[g].erase({next->second.size, next->first});
      it->second.size += next->second.size;
      chunks_.erase(next);
    }
    const uint64_t start = it->first;
    const uint64_t size = it->second.size;
    chunks_.erase(it);
    PutFree(start, size, g);
  }

  uint64_t LargestFree(uint64_t limit) const override {
    uint64_t best = 0;
    for (int g = 0; g < kNumGroups; ++g) {
      if (!free_[g].empty()) best = std::max(best, free_[g].rbegin()->first);
    }
    const uint64_t budget_blocks = limit / block_ > owned_total_ ? limit / block_ - owned_total_ : 0;
    for (const auto& run : runs_) best = std::max(best, std::min(run.second, budget_blocks) * block_);
    return best;
  }

  bool Check(std::string* error) const override {
    auto fail = [&](const std::string& why) {
      *error = "gtbm: " + why;
      return false;
    };
    uint64_t free_blocks = 0;
    uint64_t prev_end = 0;
    bool first = true;
    for (const auto& run : runs_) {
      if (run.second == 0) return fail("empty free run");
      if (!first && run.first <= prev_end) return fail("free runs overlap or are not coalesced");
      if (run.first + run.second > nblocks_) return fail("free run beyond capacity");
      prev_end = run.first + run.second;
      first = false;
      free_blocks += run.second;
    }
    if (free_blocks + owned_total_ != nblocks_) return fail("free + owned blocks != total blocks");
    if (cached_.size() > cache_blocks_) return fail("release cache over its bound");
    for (uint64_t b : cached_) {
      auto r = runs_.upper_bound(b);
      if (r == runs_.begin() || b >= std::prev(r)->first + std::prev(r)->second) return fail("cached block is owned");
    }
    uint64_t bytes[kNumGroups] = {0, 0, 0};
    size_t free_count[kNumGroups] = {0, 0, 0};
    std::map<uint64_t, int> block_group;
    uint64_t last_end = 0;
    int last_group = -1;
    bool last_free = false;
    for (const auto& [off, c] : chunks_) {
      if (c.size == 0 || off % alignment_ != 0 || c.size % alignment_ != 0) return fail("bad chunk geometry");
      if (off < last_end) return fail("chunks overlap");
      if (off == last_end && !c.used && last_free && c.group == last_group) return fail("uncoalesced free chunks");
      for (uint64_t b = off / block_; b < CeilDiv(off + c.size, block_); ++b) {
        auto ins = block_group.emplace(b, c.group);
        if (!ins.second && ins.first->second != c.group) return fail("block shared by two groups");
        auto r = runs_.upper_bound(b);
        if (r != runs_.begin()) {
          --r;
          if (b < r->first + r->second) return fail("chunk inside a free block");
        }
      }
      if (!c.used) {
        ++free_count[c.group];
        if (free_[c.group].count({c.size, off}) == 0) return fail("free chunk missing from its free set");
        if (CeilDiv(off, block_) < (off + c.size) / block_) return fail("free chunk covers a whole block");
      }
      bytes[c.group] += c.size;
      last_end = off + c.size;
      last_group = c.group;
      last_free = !c.used;
    }
    uint64_t owned = 0;
    for (int g = 0; g < kNumGroups; ++g) {
      if (bytes[g] != owned_[g] * block_) return fail("chunks do not tile the blocks of group " + std::to_string(g));
      if (free_count[g] != free_[g].size()) return fail("stale entries in a free set");
      owned += owned_[g];
    }
    if (owned != owned_total_) return fail("owned block counters disagree");
    return true;
  }

 private:
  struct Chunk {
    uint64_t size;
    int group;
    bool used;
  };

  // End of the highest owned block, in blocks.
  uint64_t ExtentBlocks() const {
    if (runs_.empty()) return nblocks_;
    const auto& last = *runs_.rbegin();
    return last.first + last.second == nblocks_ ? last.first : nblocks_;
  }

  // Records [off, off+size) as a free chunk of group g (chunks_ and its free set).
  void AddFreeChunk(uint64_t off, uint64_t size, int g) {
    chunks_.emplace(off, Chunk{size, g, false});
    free_[g].insert({size, off});
  }

  // Records [start, start+size) (already coalesced, not in chunks_) as free memory of group g: whole blocks go
  // back to the shared free list, the partial blocks at either end stay with the group.
  void PutFree(uint64_t start, uint64_t size, int g) {
    const uint64_t end = start + size;
    const uint64_t bs = CeilDiv(start, block_);
    const uint64_t be = end / block_;
    if (be <= bs) {
      AddFreeChunk(start, size, g);
      return;
    }
    if (start < bs * block_) AddFreeChunk(start, bs * block_ - start, g);
    if (be * block_ < end) AddFreeChunk(be * block_, end - be * block_, g);
    ReleaseBlocks(g, bs, be - bs);
  }

  // Marks the free chunk at `off` used, splitting off the remainder beyond `rounded`.
  void Take(uint64_t off, uint64_t rounded) {
    auto it = chunks_.find(off);
    Chunk& c = it->second;
    const int g = c.group;
    free_[g].erase({c.size, off});
    c.used = true;
    if (c.size > rounded) {
      const uint64_t rest = c.size - rounded;
      c.size = rounded;
      PutFree(off + rounded, rest, g);
    }
  }

  // Free chunk of group g ending exactly at byte `pos`, or chunks_.end().
  std::map<uint64_t, Chunk>::iterator FreeChunkEndingAt(uint64_t pos, int g) {
    auto it = chunks_.lower_bound(pos);
    if (it == chunks_.begin()) return chunks_.end();
    --it;
    if (it->first + it->second.size == pos && !it->second.used && it->second.group == g) return it;
    return chunks_.end();
  }

  // Free chunk of group g starting exactly at byte `pos`, or chunks_.end().
  std::map<uint64_t, Chunk>::iterator FreeChunkAt(uint64_t pos, int g) {
    auto it = chunks_.find(pos);
    if (it != chunks_.end() && !it->second.used && it->second.group == g) return it;
    return chunks_.end();
  }

  // Takes new blocks for group g so that a free chunk of at least `rounded` bytes exists; returns its offset.
  uint64_t Grow(int g, uint64_t rounded, uint64_t limit) {
    const uint64_t limit_blocks = limit / block_;
    const uint64_t budget = limit_blocks > owned_total_ ? limit_blocks - owned_total_ : 0;
    if (budget == 0) return kInvalidOffset;
    const uint64_t extent = ExtentBlocks();

    struct Candidate {
      uint64_t start = 0;  // first new block
      uint64_t count = 0;  // new blocks
      uint64_t new_extent = 0;
    };
    bool found = false;
    Candidate best;
    auto consider = [&](uint64_t start, uint64_t count) {
      if (count == 0 || count > budget) return;
      Candidate c{start, count, std::max(extent, start + count)};
      bool better;
      if (!found) {
        better = true;
      } else if (c.new_extent != best.new_extent) {
        better = c.new_extent < best.new_extent;
      } else if (c.count != best.count) {
        better = c.count < best.count;
      } else {
        better = c.start < best.start;
      }
      if (better) {
        best = c;
        found = true;
      }
    };
    const uint64_t plain = CeilDiv(rounded, block_);
    for (const auto& [rs, len] : runs_) {
      const uint64_t re = rs + len;
      uint64_t before = 0;
      uint64_t after = 0;
      auto b = FreeChunkEndingAt(rs * block_, g);
      if (b != chunks_.end()) before = b->second.size;
      if (re < nblocks_) {
        auto a = FreeChunkAt(re * block_, g);
        if (a != chunks_.end()) after = a->second.size;
      }
      // (b) a fresh run at the start of this free run.
      if (plain <= len) consider(rs, plain);
      // (a) extend the group's free chunk below / above the run, or bridge both.
      if (before > 0) {
        const uint64_t need = CeilDiv(rounded - before, block_);
        if (need <= len) consider(rs, need);
      }
      if (after > 0) {
        const uint64_t need = CeilDiv(rounded - after, block_);
        if (need <= len) consider(re - need, need);
      }
      if (before > 0 && after > 0 && rounded <= before + after + len * block_) consider(rs, len);
    }
    if (!found) return kInvalidOffset;
    TakeBlocks(g, best.start, best.count);
    // The new blocks form one free chunk; merge it with the group's free neighbours and use the result.
    uint64_t off = best.start * block_;
    uint64_t size = best.count * block_;
    auto b = FreeChunkEndingAt(off, g);
    if (b != chunks_.end()) {
      free_[g].erase({b->second.size, b->first});
      off = b->first;
      size += b->second.size;
      chunks_.erase(b);
    }
    auto a = FreeChunkAt(best.start * block_ + best.count * block_, g);
    if (a != chunks_.end()) {
      free_[g].erase({a->second.size, a->first});
      size += a->second.size;
      chunks_.erase(a);
    }
    AddFreeChunk(off, size, g);
    return off;
  }

  // Gives blocks [start, start+count), inside one free run, to group g (and out of the release cache).
  void TakeBlocks(int g, uint64_t start, uint64_t count) {
    auto it = std::prev(runs_.upper_bound(start));
    const uint64_t rs = it->first;
    const uint64_t re = rs + it->second;
    runs_.erase(it);
    if (rs < start) runs_.emplace(rs, start - rs);
    if (start + count < re) runs_.emplace(start + count, re - start - count);
    owned_[g] += count;
    owned_total_ += count;
    if (!cached_.empty()) {
      for (uint64_t b = start; b < start + count; ++b) cached_.erase(b);  // reused while still resident
    }
  }

  // Passes the highest cached blocks to on_release until at most `keep` remain.
  void EvictCache(uint64_t keep) {
    while (cached_.size() > keep) {
      // Coalesce a run of consecutive highest blocks into one callback.
      uint64_t last = *cached_.rbegin();
      uint64_t first = last;
      cached_.erase(std::prev(cached_.end()));
      while (cached_.size() > keep && !cached_.empty() && *cached_.rbegin() + 1 == first) {
        first = *cached_.rbegin();
        cached_.erase(std::prev(cached_.end()));
      }
      if (on_release_) on_release_(first * block_, (last - first + 1) * block_);
    }
  }

  // Returns blocks [start, start+count) of group g to the shared free list, then caches or releases them.
  void ReleaseBlocks(int g, uint64_t start, uint64_t count) {
    owned_[g] -= count;
    owned_total_ -= count;
    uint64_t s = start;
    uint64_t len = count;
    auto next = runs_.lower_bound(start);
    if (next != runs_.end() && next->first == start + count) {
      len += next->second;
      next = runs_.erase(next);
    }
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        s = prev->first;
        len += prev->second;
        runs_.erase(prev);
      }
    }
    runs_.emplace(s, len);
    if (cache_blocks_ == 0) {
      if (on_release_) on_release_(start * block_, count * block_);
      return;
    }
    for (uint64_t b = start; b < start + count; ++b) cached_.insert(b);
    EvictCache(cache_blocks_);
  }

  const uint64_t block_;
  const uint64_t alignment_;
  const uint64_t nblocks_;
  const bool grouped_;
  const std::function<void(uint64_t, uint64_t)> on_release_;
  const uint64_t cache_blocks_;
  std::set<uint64_t> cached_;          // free blocks not yet passed to on_release
  std::map<uint64_t, uint64_t> runs_;  // free block runs: first block -> length, coalesced
  std::map<uint64_t, Chunk> chunks_;   // every chunk inside owned blocks, by offset
  std::set<std::pair<uint64_t, uint64_t>> free_[kNumGroups];  // (size, offset) of free chunks per group
  uint64_t owned_[kNumGroups] = {0, 0, 0};
  uint64_t owned_total_ = 0;
};

}  // namespace

std::unique_ptr<Placer> NewGtbmPlacer(uint64_t capacity, uint64_t block, uint64_t alignment, bool grouped,
                                      std::function<void(uint64_t, uint64_t)> on_release, uint64_t release_cache) {
  return std::make_unique<GtbmPlacer>(capacity, block, alignment, grouped, std::move(on_release), release_cache);
}

}  // namespace gtbm
