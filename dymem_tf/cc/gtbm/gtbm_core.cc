// GTBM core: see gtbm_core.h for the model and the accounting definitions.
#include "gtbm_core.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <utility>

namespace gtbm {

namespace {

constexpr uint64_t kMaxBytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Round up to a multiple of `unit` (a power of two); `v` is bounded by kMaxBytes by the callers.
uint64_t RoundUp(uint64_t v, uint64_t unit) { return (v + unit - 1) & ~(unit - 1); }

int FloorLog2(uint64_t v) {
  int r = -1;
  while (v != 0) {
    v >>= 1;
    ++r;
  }
  return r;
}

char Lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (Lower(a[i]) != Lower(b[i])) return false;
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Names and parsing.

const char* GroupName(int group) {
  switch (group) {
    case kPersistent:
      return "persistent";
    case kTransient:
      return "transient";
    case kMobile:
      return "mobile";
    default:
      return "invalid";
  }
}

bool ParseGroup(std::string_view text, int* group) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r')) text.remove_suffix(1);
  for (int g = 0; g < kNumGroups; ++g) {
    if (EqualsIgnoreCase(text, GroupName(g)) || (text.size() == 1 && text[0] == static_cast<char>('0' + g))) {
      *group = g;
      return true;
    }
  }
  return false;
}

const char* PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kGtbm:
      return "gtbm";
    case Policy::kGtbmNoGroups:
      return "gtbm_nogroups";
    case Policy::kBestFit:
      return "best_fit";
    case Policy::kFirstFit:
      return "first_fit";
  }
  return "invalid";
}

bool ParsePolicy(std::string_view text, Policy* policy) {
  for (int p = 0; p < kNumPolicies; ++p) {
    if (EqualsIgnoreCase(text, PolicyName(static_cast<Policy>(p)))) {
      *policy = static_cast<Policy>(p);
      return true;
    }
  }
  return false;
}

bool ParseBytes(std::string_view text, uint64_t* bytes, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error != nullptr) *error = "invalid byte count '" + std::string(text) + "': " + why;
    return false;
  };
  std::string_view s = text;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  if (s.empty()) return fail("empty");
  if (s.front() == '-') return fail("negative");
  if (s.front() == '+') s.remove_prefix(1);
  // Integer part and optional fraction, kept exact as digits.
  uint64_t integer = 0;
  size_t i = 0;
  size_t int_digits = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (integer > (kMaxBytes - d) / 10) return fail("too large");
    integer = integer * 10 + d;
    ++i;
    ++int_digits;
  }
  std::string frac;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') frac.push_back(s[i++]);
    if (frac.size() > 18) frac.resize(18);  // beyond 1e-18 of a unit nothing changes at byte granularity
  }
  if (int_digits == 0 && frac.empty()) return fail("expected a number, e.g. 512MiB, 2GB or 1073741824");
  while (i < s.size() && s[i] == ' ') ++i;
  const std::string_view unit = s.substr(i);
  struct Unit {
    const char* name;
    uint64_t mult;
  };
  static const Unit kUnits[] = {
      {"", 1},
      {"b", 1},
      {"k", uint64_t{1} << 10},
      {"kib", uint64_t{1} << 10},
      {"kb", 1000},
      {"m", uint64_t{1} << 20},
      {"mib", uint64_t{1} << 20},
      {"mb", 1000 * 1000},
      {"g", uint64_t{1} << 30},
      {"gib", uint64_t{1} << 30},
      {"gb", uint64_t{1000} * 1000 * 1000},
      {"t", uint64_t{1} << 40},
      {"tib", uint64_t{1} << 40},
      {"tb", uint64_t{1000} * 1000 * 1000 * 1000},
  };
  uint64_t mult = 0;
  for (const Unit& u : kUnits) {
    if (EqualsIgnoreCase(unit, u.name)) mult = u.mult;
  }
  if (mult == 0) return fail("unknown unit '" + std::string(unit) + "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
  if (integer != 0 && mult > kMaxBytes / integer) return fail("too large");
  uint64_t total = integer * mult;
  // Fraction: floor(0.frac * mult), computed exactly digit by digit on the remainder.
  uint64_t rem_num = 0;
  if (!frac.empty()) {
    // floor(0.frac * mult) exactly: num / 10^k * mult with 128-bit intermediates (num < 10^18, mult <= 2^40).
    unsigned __int128 num = 0;
    unsigned __int128 den = 1;
    for (char c : frac) {
      num = num * 10 + static_cast<unsigned>(c - '0');
      den *= 10;
    }
    const unsigned __int128 part = num * mult / den;
    rem_num = static_cast<uint64_t>(part);
  }
  if (rem_num > kMaxBytes - total) return fail("too large");
  total += rem_num;
  *bytes = total;
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Placement policies.

class Placer {
 public:
  virtual ~Placer() = default;
  // `rounded` is a positive multiple of Granule(). Returns the chunk offset or kInvalidOffset; *allocated is the
  // chunk size (>= rounded). `limit` bounds Reserved().
  virtual uint64_t Allocate(uint64_t rounded, int group, uint64_t limit, uint64_t* allocated) = 0;
  // Frees the live chunk at `offset` (the Pool guarantees it is live).
  virtual void Free(uint64_t offset) = 0;
  virtual uint64_t Granule() const = 0;
  virtual uint64_t Reserved() const = 0;
  virtual uint64_t Extent() const = 0;
  virtual uint64_t GroupReserved(int /*group*/) const { return 0; }
  virtual uint64_t CachedFree() const { return 0; }
  virtual void TrimCache() {}
  virtual uint64_t LargestFree(uint64_t limit) const = 0;
  virtual bool Check(std::string* error) const = 0;
};

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

  uint64_t ExtentBlocks() const {
    if (runs_.empty()) return nblocks_;
    const auto& last = *runs_.rbegin();
    return last.first + last.second == nblocks_ ? last.first : nblocks_;
  }

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

  static int BinNum(uint64_t bytes) {
    const uint64_t v = std::max<uint64_t>(bytes, kMinAllocationSize) >> 8;
    return std::min(kNumBins - 1, FloorLog2(v));
  }

  void InsertIntoBin(uint64_t off, uint64_t size) { bins_[BinNum(size)].insert({size, off}); }
  void RemoveFromBin(uint64_t off, uint64_t size) { bins_[BinNum(size)].erase({size, off}); }

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

// ---------------------------------------------------------------------------------------------------------------
// Pool.

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
      placer_.reset(new GtbmPlacer(options_.capacity, options.block_size, options.alignment,
                                   options.policy == Policy::kGtbm, options.on_release, options.release_cache));
      break;
    case Policy::kBestFit:
      placer_.reset(new BestFitPlacer(options.capacity, options.alignment, limit_));
      break;
    case Policy::kFirstFit:
      placer_.reset(new FirstFitPlacer(options.capacity, options.alignment));
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
  if (trace_active_) {
    if (trace_.size() < trace_max_records_) {
      TraceRecord rec{};
      rec.lower = trace_events_++;
      rec.upper = 0;
      rec.size = requested;
      rec.offset = offset;
      rec.step = tag != nullptr ? tag->step_id : 0;
      rec.alloc_ns = NowNsLocked();
      rec.free_ns = -1;
      rec.op = InternOpLocked(tag != nullptr ? tag->op_name : std::string_view());
      rec.group = group;
      live.trace_index = static_cast<int64_t>(trace_.size());
      live.trace_generation = trace_generation_;
      trace_.push_back(rec);
    } else {
      ++trace_dropped_;
    }
  }
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
  if (trace_active_ && live.trace_index >= 0 && live.trace_generation == trace_generation_) {
    TraceRecord& rec = trace_[static_cast<size_t>(live.trace_index)];
    rec.upper = trace_events_++;
    rec.free_ns = NowNsLocked();
  }
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

namespace {

// (name, accessor) of every flattened statistic; per-group values are expanded after the scalars.
struct ScalarField {
  const char* name;
  int64_t PoolStats::*member;
};
constexpr ScalarField kScalarFields[] = {
    {"bytes_in_use", &PoolStats::bytes_in_use},
    {"peak_bytes_in_use", &PoolStats::peak_bytes_in_use},
    {"requested_bytes_in_use", &PoolStats::requested_bytes_in_use},
    {"peak_requested_bytes_in_use", &PoolStats::peak_requested_bytes_in_use},
    {"bytes_reserved", &PoolStats::bytes_reserved},
    {"peak_bytes_reserved", &PoolStats::peak_bytes_reserved},
    {"extent", &PoolStats::extent},
    {"peak_extent", &PoolStats::peak_extent},
    {"reserved_at_peak_in_use", &PoolStats::reserved_at_peak_in_use},
    {"largest_free_block", &PoolStats::largest_free_block},
    {"cached_free_bytes", &PoolStats::cached_free_bytes},
    {"peak_used_end", &PoolStats::peak_used_end},
    {"largest_alloc_size", &PoolStats::largest_alloc_size},
    {"num_allocs", &PoolStats::num_allocs},
    {"num_frees", &PoolStats::num_frees},
    {"num_failed_allocs", &PoolStats::num_failed_allocs},
    {"live_allocations", &PoolStats::live_allocations},
    {"bytes_limit", &PoolStats::bytes_limit},
    {"capacity", &PoolStats::capacity},
    {"block_size", &PoolStats::block_size},
};
constexpr int kNumScalarFields = static_cast<int>(sizeof(kScalarFields) / sizeof(kScalarFields[0]));
struct GroupField {
  const char* name;
  int64_t (PoolStats::*member)[kNumGroups];
};
constexpr GroupField kGroupFields[] = {
    {"in_use", &PoolStats::group_in_use},
    {"peak_in_use", &PoolStats::group_peak_in_use},
    {"reserved", &PoolStats::group_reserved},
    {"peak_reserved", &PoolStats::group_peak_reserved},
    {"num_allocs", &PoolStats::group_num_allocs},
};
constexpr int kNumGroupFields = static_cast<int>(sizeof(kGroupFields) / sizeof(kGroupFields[0]));

std::string BuildStatNames() {
  std::string names;
  for (const ScalarField& f : kScalarFields) {
    if (!names.empty()) names += ",";
    names += f.name;
  }
  for (const GroupField& f : kGroupFields) {
    for (int g = 0; g < kNumGroups; ++g) names += std::string(",") + GroupName(g) + "_" + f.name;
  }
  return names;
}

}  // namespace

int NumStats() { return kNumScalarFields + kNumGroupFields * kNumGroups; }

const char* StatNames() {
  static const std::string* names = new std::string(BuildStatNames());
  return names->c_str();
}

int FlattenStats(const PoolStats& stats, int64_t* out, int n) {
  int i = 0;
  for (const ScalarField& f : kScalarFields) {
    if (i < n) out[i] = stats.*(f.member);
    ++i;
  }
  for (const GroupField& f : kGroupFields) {
    for (int g = 0; g < kNumGroups; ++g) {
      if (i < n) out[i] = (stats.*(f.member))[g];
      ++i;
    }
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// Trace.

int64_t Pool::NowNsLocked() const {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  return now - trace_t0_ns_;
}

uint32_t Pool::InternOpLocked(std::string_view name) {
  auto it = op_index_.find(std::string(name));
  if (it != op_index_.end()) return it->second;
  const uint32_t id = static_cast<uint32_t>(op_names_.size());
  op_names_.emplace_back(name);
  op_index_.emplace(op_names_.back(), id);
  return id;
}

void Pool::StartTrace(uint64_t max_records) {
  std::lock_guard<std::mutex> lock(mu_);
  trace_.clear();
  trace_.shrink_to_fit();
  op_names_.clear();
  op_index_.clear();
  ++trace_generation_;
  trace_max_records_ = max_records;
  trace_dropped_ = 0;
  trace_events_ = 0;
  trace_t0_ns_ = 0;
  trace_t0_ns_ = NowNsLocked();
  // Reserve up front only a modest amount; the vector grows geometrically up to max_records.
  trace_.reserve(static_cast<size_t>(std::min<uint64_t>(max_records, 1 << 16)));
  trace_active_ = true;
}

void Pool::StopTrace() {
  std::lock_guard<std::mutex> lock(mu_);
  trace_active_ = false;
}

TraceInfo Pool::GetTraceInfo() const {
  std::lock_guard<std::mutex> lock(mu_);
  TraceInfo info;
  info.active = trace_active_;
  info.records = trace_.size();
  info.dropped = trace_dropped_;
  info.events = trace_events_;
  info.max_records = trace_max_records_;
  return info;
}

namespace {

void WriteCsvField(FILE* f, const std::string& s) {
  const bool quote = s.find_first_of(",\"\n\r") != std::string::npos;
  if (!quote) {
    std::fwrite(s.data(), 1, s.size(), f);
    return;
  }
  std::fputc('"', f);
  for (char c : s) {
    if (c == '"') std::fputc('"', f);
    std::fputc(c, f);
  }
  std::fputc('"', f);
}

}  // namespace

bool Pool::DumpTrace(const std::string& path, std::string* error) const {
  std::vector<TraceRecord> records;
  std::vector<std::string> names;
  uint64_t events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    records = trace_;
    names = op_names_;
    events = trace_events_;
  }
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    if (error != nullptr) *error = "cannot open '" + path + "' for writing: " + std::strerror(errno);
    return false;
  }
  std::fputs("id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns\n", f);
  for (size_t i = 0; i < records.size(); ++i) {
    const TraceRecord& r = records[i];
    const uint64_t upper = r.upper != 0 ? r.upper : events;
    std::fprintf(f, "%zu,%llu,%llu,%llu,%d,%llu,", i, static_cast<unsigned long long>(r.lower),
                 static_cast<unsigned long long>(upper), static_cast<unsigned long long>(r.size), r.group,
                 static_cast<unsigned long long>(r.offset));
    WriteCsvField(f, names[r.op]);
    std::fprintf(f, ",%lld,%lld,%lld\n", static_cast<long long>(r.step), static_cast<long long>(r.alloc_ns),
                 static_cast<long long>(r.free_ns));
  }
  const bool write_error = std::ferror(f) != 0;
  if (std::fclose(f) != 0 || write_error) {
    if (error != nullptr) *error = "error while writing '" + path + "'";
    return false;
  }
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
