// Standalone tests of the GTBM core (no TensorFlow): randomised single-threaded sequences against a reference model
// for every policy, a multi-threaded stress test with an overlap detector, and unit checks (parsing, limits,
// alignment, traces, the BFC mirror).
//
//   make native-test   (g++ -std=c++17 -O2 -pthread, the core's dymem_tf/cc/gtbm/*.cc but replay.cc, and this file)
//   ./gtbm_core_test [--seeds N] [--ops N] [--threads N] [--thread-ops N]
// Exit status 0 when every check passes. Built under ASan/UBSan by `make asan` / `make ubsan`.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../gtbm_core.h"

namespace {

std::atomic<int> g_failures{0};

#define CHECK(cond, ...)                                                    \
  do {                                                                      \
    if (!(cond)) {                                                          \
      if (g_failures.fetch_add(1) < 30) {                                   \
        std::fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
        std::fprintf(stderr, __VA_ARGS__);                                  \
        std::fprintf(stderr, "\n");                                         \
      }                                                                     \
    }                                                                       \
  } while (0)

using gtbm::kInvalidOffset;
using gtbm::Policy;
using gtbm::Pool;
using gtbm::PoolOptions;
using gtbm::PoolStats;

constexpr Policy kPolicies[] = {Policy::kGtbm, Policy::kGtbmNoGroups, Policy::kBestFit, Policy::kFirstFit};

// True for the pageblock policies.
bool IsGtbm(Policy p) { return p == Policy::kGtbm || p == Policy::kGtbmNoGroups; }

// A pool with options `o`; fails the test when they are rejected.
std::unique_ptr<Pool> MakePool(const PoolOptions& o) {
  std::string error;
  std::unique_ptr<Pool> pool = Pool::Create(o, &error);
  CHECK(pool != nullptr, "Pool::Create failed: %s", error.c_str());
  return pool;
}

// Fails the test, naming `where`, when the pool's invariants do not hold.
void CheckPool(const Pool& pool, const char* where) {
  std::string error;
  CHECK(pool.CheckInvariants(&error), "%s: invariant violated: %s", where, error.c_str());
}

// ----------------------------------------------------------------------------------------------------------------
// Randomised sequences against a reference model.

struct LiveRef {
  uint64_t requested;
  uint64_t allocated;
  int group;
};

// A size drawn log-uniformly from [lo, hi).
uint64_t LogUniform(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
  std::uniform_real_distribution<double> d(std::log(static_cast<double>(lo)), std::log(static_cast<double>(hi)));
  return static_cast<uint64_t>(std::exp(d(rng)));
}

// `ops` random allocations and frees checked against a reference model; `tight`: under a small budget.
void RandomSequence(Policy policy, uint64_t seed, int ops, bool tight) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(policy));
  PoolOptions o;
  o.policy = policy;
  o.alignment = uint64_t{8} << (rng() % 6);                  // 8 .. 256
  o.block_size = std::max(o.alignment, uint64_t{4096} << (rng() % 7));  // 4 KiB .. 256 KiB
  const uint64_t max_size = o.block_size * 3;
  // Roomy pools never fail; tight ones have a budget well below the peak demand.
  o.capacity = uint64_t{1} << 32;
  o.limit = tight ? (uint64_t{1} << 20) + o.block_size * (rng() % 16) : 0;
  if (IsGtbm(policy) && rng() % 2 == 0) o.release_cache = o.block_size * (rng() % 9);
  std::map<uint64_t, LiveRef> live;  // offset -> reference
  uint64_t freeing = kInvalidOffset;  // the allocation being freed while on_release may run
  uint64_t released_total = 0;
  o.on_release = [&](uint64_t off, uint64_t len) {
    CHECK(off % o.block_size == 0 && len % o.block_size == 0 && len > 0, "release not block aligned");
    // Pages of a live allocation must never be given back.
    for (const auto& [loff, l] : live) {
      if (loff == freeing) continue;
      CHECK(loff + l.requested <= off || off + len <= loff, "released [%llu, +%llu) overlaps a live allocation",
            static_cast<unsigned long long>(off), static_cast<unsigned long long>(len));
    }
    released_total += len;
  };
  std::unique_ptr<Pool> pool = MakePool(o);
  if (!pool) return;
  const uint64_t limit = pool->limit();
  int64_t failures = 0;
  for (int i = 0; i < ops; ++i) {
    const bool do_alloc = live.empty() || (rng() % 100) < (live.size() < 200 ? 60u : 40u);
    if (do_alloc) {
      uint64_t size = (rng() % 50 == 0) ? 0 : LogUniform(rng, 1, max_size);
      uint64_t align = (rng() % 10 == 0) ? (uint64_t{1} << (rng() % 13)) : 0;  // sometimes over-aligned (<= 4 KiB)
      const int group = static_cast<int>(rng() % gtbm::kNumGroups);
      const PoolStats before = pool->Stats();
      const uint64_t off = pool->Allocate(size, group, align);
      const PoolStats after = pool->Stats();
      if (off == kInvalidOffset) {
        ++failures;
        CHECK(tight, "allocation of %llu bytes failed in a roomy pool (policy %s, seed %llu)",
              static_cast<unsigned long long>(size), gtbm::PolicyName(policy), static_cast<unsigned long long>(seed));
        CHECK(after.num_failed_allocs == before.num_failed_allocs + 1, "failure not counted");
        CHECK(after.bytes_in_use == before.bytes_in_use, "failed allocation changed bytes in use");
        continue;
      }
      const uint64_t need = std::max<uint64_t>(size, 1);
      CHECK(off % std::max(align, o.alignment) == 0, "offset %llu not aligned to %llu",
            static_cast<unsigned long long>(off), static_cast<unsigned long long>(std::max(align, o.alignment)));
      CHECK(off + need <= o.capacity, "allocation beyond the capacity");
      // No overlap with the neighbours of [off, off + need).
      auto next = live.lower_bound(off);
      if (next != live.end()) {
        CHECK(off + need <= next->first, "overlap with the next live allocation");
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        CHECK(prev->first + prev->second.requested <= off, "overlap with the previous live allocation");
      }
      uint64_t requested = 0, allocated = 0;
      int g = -1;
      CHECK(pool->Lookup(off, &requested, &allocated, &g), "Lookup of a live allocation failed");
      CHECK(requested == need && allocated >= need && g == group, "Lookup returned wrong sizes or group");
      CHECK(after.bytes_reserved <= std::max<int64_t>(static_cast<int64_t>(limit), before.bytes_reserved),
            "reserved %lld exceeds the limit %llu", static_cast<long long>(after.bytes_reserved),
            static_cast<unsigned long long>(limit));
      live[off] = LiveRef{need, allocated, group};
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      freeing = it->first;
      const uint64_t freed = pool->Free(it->first);
      freeing = kInvalidOffset;
      CHECK(freed == it->second.allocated, "Free returned %llu, expected %llu", static_cast<unsigned long long>(freed),
            static_cast<unsigned long long>(it->second.allocated));
      CHECK(pool->Free(it->first) == 0, "double free was not rejected");
      live.erase(it);
    }
    if (i % 97 == 0 || i == ops - 1) {
      const PoolStats s = pool->Stats();
      int64_t in_use = 0, requested = 0, group[gtbm::kNumGroups] = {0, 0, 0};
      for (const auto& [off, l] : live) {
        in_use += static_cast<int64_t>(l.allocated);
        requested += static_cast<int64_t>(l.requested);
        group[l.group] += static_cast<int64_t>(l.allocated);
      }
      CHECK(s.bytes_in_use == in_use, "bytes_in_use %lld != sum of live %lld", static_cast<long long>(s.bytes_in_use),
            static_cast<long long>(in_use));
      CHECK(s.requested_bytes_in_use == requested, "requested bytes disagree");
      for (int g = 0; g < gtbm::kNumGroups; ++g) CHECK(s.group_in_use[g] == group[g], "group %d in use disagrees", g);
      CHECK(s.live_allocations == static_cast<int64_t>(live.size()), "live count disagrees");
      CHECK(s.peak_bytes_in_use >= s.bytes_in_use && s.peak_bytes_reserved >= s.bytes_reserved &&
                s.peak_extent >= s.extent && s.bytes_reserved >= s.bytes_in_use,
            "peaks or reserved inconsistent");
      CHECK(s.num_failed_allocs == failures, "failed allocation count disagrees");
      if (IsGtbm(policy)) {
        int64_t reserved = 0;
        for (int g = 0; g < gtbm::kNumGroups; ++g) reserved += s.group_reserved[g];
        CHECK(reserved == s.bytes_reserved, "per-group reserved does not add up");
        CHECK(s.bytes_reserved % static_cast<int64_t>(o.block_size) == 0, "reserved is not whole blocks");
        CHECK(s.cached_free_bytes <= static_cast<int64_t>(o.release_cache), "release cache over its bound");
      }
      CheckPool(*pool, gtbm::PolicyName(policy));
    }
  }
  while (!live.empty()) {
    freeing = live.begin()->first;
    pool->Free(freeing);
    live.erase(live.begin());
  }
  freeing = kInvalidOffset;
  pool->TrimCache();
  const PoolStats s = pool->Stats();
  CHECK(s.bytes_in_use == 0 && s.requested_bytes_in_use == 0 && s.live_allocations == 0, "leak after freeing all");
  if (IsGtbm(policy)) {
    CHECK(s.bytes_reserved == 0, "GTBM kept %lld reserved bytes after everything was freed",
          static_cast<long long>(s.bytes_reserved));
    CHECK(s.cached_free_bytes == 0, "TrimCache left cached blocks");
    CHECK(released_total > 0 || s.peak_bytes_reserved == 0, "no block release was reported");
  }
  if (policy == Policy::kFirstFit) CHECK(s.bytes_reserved == 0, "first fit top did not come down");
  CheckPool(*pool, "after freeing all");
}

// ----------------------------------------------------------------------------------------------------------------
// Multi-threaded stress with an overlap detector: every 64-byte granule of a live allocation is owned (CAS) by the
// thread that holds it.

void ThreadStress(Policy policy, int threads, int ops_per_thread) {
  PoolOptions o;
  o.policy = policy;
  o.capacity = uint64_t{256} << 20;
  o.block_size = uint64_t{64} << 10;
  o.alignment = 64;
  o.release_cache = o.block_size * 8;
  std::atomic<uint64_t> released_bytes{0};
  o.on_release = [&released_bytes](uint64_t, uint64_t len) { released_bytes += len; };
  std::unique_ptr<Pool> pool = MakePool(o);
  if (!pool) return;
  const uint64_t granules = o.capacity / 64;
  std::vector<std::atomic<uint8_t>> owner(granules);
  for (auto& g : owner) g.store(0, std::memory_order_relaxed);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> failures{0};

  auto worker = [&](int id) {
    std::mt19937_64 rng(static_cast<uint64_t>(id) * 104729 + 17);
    std::vector<std::pair<uint64_t, uint64_t>> mine;  // offset, requested
    const uint8_t tag = static_cast<uint8_t>(id + 1);
    for (int i = 0; i < ops_per_thread; ++i) {
      const bool do_alloc = mine.empty() || (rng() % 100) < (mine.size() < 64 ? 60u : 40u);
      if (do_alloc) {
        const uint64_t size = (rng() % 200 == 0) ? LogUniform(rng, o.block_size, 5 * o.block_size)
                                                  : LogUniform(rng, 1, uint64_t{64} << 10);
        const int group = static_cast<int>(rng() % gtbm::kNumGroups);
        const uint64_t off = pool->Allocate(size, group);
        if (off == kInvalidOffset) {
          ++failures;
          continue;
        }
        for (uint64_t g = off / 64; g < (off + size + 63) / 64; ++g) {
          uint8_t expected = 0;
          if (!owner[g].compare_exchange_strong(expected, tag)) {
            CHECK(false, "granule %llu of [%llu, +%llu) already owned by thread %d (policy %s)",
                  static_cast<unsigned long long>(g), static_cast<unsigned long long>(off),
                  static_cast<unsigned long long>(size), expected - 1, gtbm::PolicyName(policy));
            break;
          }
        }
        mine.emplace_back(off, size);
      } else {
        const size_t k = static_cast<size_t>(rng() % mine.size());
        const auto [off, size] = mine[k];
        mine[k] = mine.back();
        mine.pop_back();
        for (uint64_t g = off / 64; g < (off + size + 63) / 64; ++g) {
          uint8_t expected = tag;
          CHECK(owner[g].compare_exchange_strong(expected, 0), "granule lost its owner");
        }
        CHECK(pool->Free(off) > 0, "Free of a live allocation failed");
      }
    }
    for (const auto& [off, size] : mine) {
      for (uint64_t g = off / 64; g < (off + size + 63) / 64; ++g) owner[g].store(0);
      pool->Free(off);
    }
  };
  // A concurrent observer: statistics, peaks, invariants and trace recording while the workers run.
  auto observer = [&]() {
    int round = 0;
    while (!stop.load()) {
      const PoolStats s = pool->Stats();
      CHECK(s.bytes_in_use >= 0 && s.peak_bytes_in_use >= s.bytes_in_use, "inconsistent concurrent stats");
      if (round % 5 == 0) pool->ResetPeaks();
      if (round % 7 == 0) pool->StartTrace(1 << 14);
      if (round % 7 == 3) pool->StopTrace();
      if (round % 11 == 0) CheckPool(*pool, "concurrent");
      ++round;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  };
  std::vector<std::thread> ts;
  std::thread obs(observer);
  for (int t = 0; t < threads; ++t) ts.emplace_back(worker, t);
  for (auto& t : ts) t.join();
  stop = true;
  obs.join();
  const PoolStats s = pool->Stats();
  CHECK(failures.load() == 0, "%lld allocations failed in a roomy pool", static_cast<long long>(failures.load()));
  CHECK(s.bytes_in_use == 0 && s.live_allocations == 0, "leak after the stress test");
  CHECK(s.num_allocs == s.num_frees, "allocs %lld != frees %lld", static_cast<long long>(s.num_allocs),
        static_cast<long long>(s.num_frees));
  if (IsGtbm(policy)) {
    CHECK(s.bytes_reserved == 0 && released_bytes.load() > 0, "blocks not all released");
    CHECK(s.cached_free_bytes <= static_cast<int64_t>(o.release_cache), "release cache over its bound");
  }
  CheckPool(*pool, "after stress");
}

// ----------------------------------------------------------------------------------------------------------------
// Unit checks.

void TestParseBytes() {
  struct Case {
    const char* text;
    bool ok;
    uint64_t value;
  };
  const Case cases[] = {
      {"0", true, 0},
      {"1073741824", true, 1073741824},
      {"512MiB", true, 512ull << 20},
      {"512 mib", true, 512ull << 20},
      {"2GB", true, 2000000000},
      {"1.5GiB", true, 3ull << 29},
      {"64M", true, 64ull << 20},
      {"0.5KB", true, 500},
      {"1.1B", true, 1},
      {" 7 ", true, 7},
      {".5KiB", true, 512},
      {"+3k", true, 3072},
      {"", false, 0},
      {"-1", false, 0},
      {"-1MiB", false, 0},
      {"abc", false, 0},
      {"12XB", false, 0},
      {"1.2.3", false, 0},
      {"MiB", false, 0},
      {"9223372036854775807", true, 9223372036854775807ull},
      {"9223372036854775808", false, 0},
      {"99999999999TB", false, 0},
  };
  for (const Case& c : cases) {
    uint64_t v = 0;
    std::string error;
    const bool ok = gtbm::ParseBytes(c.text, &v, &error);
    CHECK(ok == c.ok, "ParseBytes('%s') returned %d", c.text, ok);
    if (ok && c.ok) CHECK(v == c.value, "ParseBytes('%s') = %llu", c.text, static_cast<unsigned long long>(v));
    if (!ok) CHECK(!error.empty(), "ParseBytes('%s') failed without a message", c.text);
  }
}

// Pool::Create rejects invalid options with an error.
void TestCreateValidation() {
  std::string error;
  PoolOptions o;
  o.capacity = 1 << 20;
  o.alignment = 48;
  CHECK(!Pool::Create(o, &error) && !error.empty(), "non power-of-two alignment accepted");
  o.alignment = 64;
  o.block_size = 100;
  CHECK(!Pool::Create(o, &error), "block size not a multiple of the alignment accepted");
  o.block_size = 4096;
  o.limit = o.capacity + 1;
  CHECK(!Pool::Create(o, &error), "limit above capacity accepted");
  o.limit = 0;
  o.capacity = 0;
  CHECK(!Pool::Create(o, &error), "zero capacity accepted");
}

// The budget, for every policy: refusals above it, failure counts, SetLimit's bounds.
void TestLimits() {
  for (Policy p : kPolicies) {
    PoolOptions o;
    o.policy = p;
    o.capacity = uint64_t{64} << 20;
    o.limit = uint64_t{8} << 20;
    o.block_size = uint64_t{1} << 20;
    std::unique_ptr<Pool> pool = MakePool(o);
    if (!pool) continue;
    // BFC's first region is min(limit, 2 MiB), doubling: an exact-limit allocation fails there (as in TF).
    const uint64_t a = pool->Allocate(uint64_t{3} << 20, gtbm::kTransient);
    CHECK(a != kInvalidOffset, "%s: 3 MiB in an 8 MiB budget failed", gtbm::PolicyName(p));
    CHECK(pool->Allocate(uint64_t{9} << 20, gtbm::kTransient) == kInvalidOffset, "%s: over-budget allocation served",
          gtbm::PolicyName(p));
    CHECK(pool->Stats().num_failed_allocs == 1, "failure not counted");
    std::string error;
    CHECK(!pool->SetLimit(uint64_t{1} << 20, &error) && !error.empty(), "limit below in-use accepted");
    CHECK(!pool->SetLimit(o.capacity + 1, &error), "limit above capacity accepted");
    CHECK(pool->SetLimit(uint64_t{32} << 20, &error), "raising the limit failed: %s", error.c_str());
    CHECK(pool->limit() == uint64_t{32} << 20 && pool->Stats().bytes_limit == int64_t{32} << 20, "limit not set");
    const uint64_t b = pool->Allocate(uint64_t{9} << 20, gtbm::kMobile);
    CHECK(b != kInvalidOffset, "%s: allocation after raising the limit failed", gtbm::PolicyName(p));
    pool->Free(a);
    pool->Free(b);
    CheckPool(*pool, "limits");
  }
}

// Per-group accounting and the peaks, on a GTBM pool.
void TestPeaksAndGroups() {
  PoolOptions o;
  o.capacity = uint64_t{64} << 20;
  o.block_size = uint64_t{1} << 20;
  std::unique_ptr<Pool> pool = MakePool(o);
  const uint64_t p = pool->Allocate(1000, gtbm::kPersistent);
  const uint64_t t = pool->Allocate(3000, gtbm::kTransient);
  const uint64_t m = pool->Allocate(uint64_t{5} << 19, gtbm::kMobile);  // 2.5 blocks: a run of 3
  PoolStats s = pool->Stats();
  CHECK(s.group_in_use[0] == 1024 && s.group_in_use[1] == 3008 && s.group_in_use[2] == int64_t{5} << 19,
        "per-group bytes in use");
  CHECK(s.group_reserved[0] == 1 << 20 && s.group_reserved[1] == 1 << 20 && s.group_reserved[2] == 3 << 20,
        "per-group reserved blocks (%lld %lld %lld)", static_cast<long long>(s.group_reserved[0]),
        static_cast<long long>(s.group_reserved[1]), static_cast<long long>(s.group_reserved[2]));
  CHECK(p / o.block_size != t / o.block_size, "two groups share a block");
  // The tail of the mobile run stays with the mobile group.
  const uint64_t m2 = pool->Allocate(uint64_t{1} << 19, gtbm::kMobile);
  CHECK(m2 == m + (uint64_t{5} << 19), "tail of a multi-block run not reused by its group");
  CHECK(pool->Stats().group_reserved[2] == 3 << 20, "tail reuse took a new block");
  pool->Free(m);
  pool->Free(m2);
  s = pool->Stats();
  CHECK(s.group_reserved[2] == 0 && s.bytes_reserved == 2 << 20, "freed blocks not returned");
  CHECK(s.peak_bytes_reserved == 5 << 20 && s.peak_bytes_in_use == 1024 + 3008 + (int64_t{3} << 20), "peaks");
  pool->ResetPeaks();
  s = pool->Stats();
  CHECK(s.peak_bytes_in_use == s.bytes_in_use && s.peak_bytes_reserved == s.bytes_reserved &&
            s.group_peak_in_use[2] == 0 && s.largest_alloc_size == 0,
        "ResetPeaks");
  CHECK(s.num_allocs == 4 && s.num_frees == 2, "counters kept by ResetPeaks");
  pool->ClearCounters();
  CHECK(pool->Stats().num_allocs == 0 && pool->Stats().num_frees == 0, "ClearCounters");
  CHECK(pool->Allocate(10, 3) == kInvalidOffset && pool->Allocate(10, -1) == kInvalidOffset, "invalid group served");
  CHECK(pool->Allocate(10, 0, 48) == kInvalidOffset, "non power-of-two alignment served");
  CHECK(pool->Free(12345) == 0, "free of an unknown offset");
  pool->Free(p);
  pool->Free(t);
  CHECK(pool->Stats().bytes_reserved == 0, "pool not empty");
  // Flattened statistics: names and values line up.
  int64_t values[128];
  const int n = gtbm::FlattenStats(pool->Stats(), values, 128);
  CHECK(n == gtbm::NumStats(), "FlattenStats count");
  std::string names = gtbm::StatNames();
  CHECK(static_cast<int>(std::count(names.begin(), names.end(), ',')) + 1 == n, "StatNames count");
  CHECK(names.rfind("bytes_in_use,peak_bytes_in_use", 0) == 0, "StatNames order");
}

// Free blocks stay resident up to release_cache, then go to on_release; TrimCache releases the rest.
void TestReleaseCache() {
  PoolOptions o;
  o.capacity = uint64_t{64} << 20;
  o.block_size = uint64_t{1} << 20;
  o.release_cache = uint64_t{2} << 20;
  std::vector<std::pair<uint64_t, uint64_t>> released;
  o.on_release = [&released](uint64_t off, uint64_t len) { released.emplace_back(off, len); };
  std::unique_ptr<Pool> pool = MakePool(o);
  const uint64_t a = pool->Allocate(uint64_t{4} << 20, gtbm::kTransient);  // blocks 0-3
  pool->Free(a);
  // Four blocks free: the two highest are released, the two lowest stay cached.
  CHECK(released.size() == 1 && released[0].first == uint64_t{2} << 20 && released[0].second == uint64_t{2} << 20,
        "cache eviction order (%zu releases)", released.size());
  CHECK(pool->Stats().cached_free_bytes == 2 << 20 && pool->Stats().bytes_reserved == 0, "cache accounting");
  const uint64_t b = pool->Allocate(uint64_t{1} << 20, gtbm::kPersistent);  // reuses cached block 0
  CHECK(b == 0 && pool->Stats().cached_free_bytes == 1 << 20 && released.size() == 1, "cached block reuse");
  pool->TrimCache();
  CHECK(released.size() == 2 && released[1].first == uint64_t{1} << 20 && pool->Stats().cached_free_bytes == 0,
        "TrimCache");
  pool->Free(b);
  CheckPool(*pool, "cache");
}

// BEST_FIT follows BFC's rounding, split and region-growth rules.
void TestBestFitMirror() {
  PoolOptions o;
  o.policy = Policy::kBestFit;
  o.capacity = uint64_t{1} << 30;
  std::unique_ptr<Pool> pool = MakePool(o);
  const uint64_t a = pool->Allocate(100, 0);
  PoolStats s = pool->Stats();
  CHECK(a == 0 && s.bytes_in_use == 256 && s.bytes_reserved == 2 << 20, "first BFC region is 2 MiB, 256 B units");
  // A chunk less than twice the request is not split (TF's rule): 1.5 MiB in the 2 MiB - 256 remainder.
  const uint64_t b = pool->Allocate(uint64_t{3} << 19, 0);
  uint64_t allocated = 0;
  pool->Lookup(b, nullptr, &allocated, nullptr);
  CHECK(allocated == (uint64_t{2} << 20) - 256, "BFC split a chunk smaller than twice the request (%llu)",
        static_cast<unsigned long long>(allocated));
  // Next region doubles: 4 MiB.
  pool->Allocate(100, 0);
  CHECK(pool->Stats().bytes_reserved == 6 << 20, "BFC region doubling");
  CheckPool(*pool, "bfc");
}

// Trace recording: lifetimes, op names with CSV quoting, the record bound, a bad dump path.
void TestTrace() {
  PoolOptions o;
  o.capacity = uint64_t{64} << 20;
  o.block_size = uint64_t{1} << 20;
  std::unique_ptr<Pool> pool = MakePool(o);
  const uint64_t before = pool->Allocate(10, 0);  // not traced
  pool->StartTrace(3);
  gtbm::AllocTag tag{"model/conv,1/\"Conv2D\"", 42};
  const uint64_t a = pool->Allocate(100, 1, 0, &tag);
  const uint64_t b = pool->Allocate(200, 2);
  pool->Free(a);
  pool->Free(before);  // allocated before the trace: no record
  const uint64_t c = pool->Allocate(300, 0, 0, &tag);
  pool->Allocate(400, 1);  // beyond max_records: dropped
  gtbm::TraceInfo info = pool->GetTraceInfo();
  CHECK(info.active && info.records == 3 && info.dropped == 1 && info.events == 4, "trace info (%llu %llu %llu)",
        static_cast<unsigned long long>(info.records), static_cast<unsigned long long>(info.dropped),
        static_cast<unsigned long long>(info.events));
  pool->StopTrace();
  pool->Free(b);  // after stop: not recorded
  const char* path = std::getenv("GTBM_TEST_TRACE");
  const std::string file = path != nullptr ? path : "build/gtbm_core_test_trace.csv";
  std::string error;
  if (!pool->DumpTrace(file, &error)) {
    CHECK(false, "DumpTrace: %s", error.c_str());
    return;
  }
  std::ifstream in(file);
  std::string line;
  std::vector<std::string> lines;
  while (std::getline(in, line)) lines.push_back(line);
  CHECK(lines.size() == 4, "trace has %zu lines", lines.size());
  if (lines.size() == 4) {
    CHECK(lines[0] == "id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns", "header: %s", lines[0].c_str());
    CHECK(lines[1].rfind("0,0,2,100,1," + std::to_string(a) + ",\"model/conv,1/\"\"Conv2D\"\"\",42,", 0) == 0,
          "record a: %s", lines[1].c_str());
    // b was never freed while recording: upper = last event + 1 = 4, free_ns = -1.
    CHECK(lines[2].rfind("1,1,4,200,2,", 0) == 0 && lines[2].size() > 3 &&
              lines[2].substr(lines[2].size() - 3) == ",-1",
          "record b: %s", lines[2].c_str());
    CHECK(lines[3].rfind("2,3,4,300,0," + std::to_string(c), 0) == 0, "record c: %s", lines[3].c_str());
  }
  std::remove(file.c_str());
  CHECK(!pool->DumpTrace("/nonexistent-dir/x.csv", &error) && !error.empty(), "dump to a bad path succeeded");
}

// The integer after `name` on the command line, or `fallback`.
int IntArg(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int seeds = IntArg(argc, argv, "--seeds", 40);
  const int ops = IntArg(argc, argv, "--ops", 3000);
  const int threads = IntArg(argc, argv, "--threads", 4);
  const int thread_ops = IntArg(argc, argv, "--thread-ops", 150000);

  TestParseBytes();
  TestCreateValidation();
  TestLimits();
  TestPeaksAndGroups();
  TestReleaseCache();
  TestBestFitMirror();
  TestTrace();
  for (Policy p : kPolicies) {
    for (int seed = 0; seed < seeds; ++seed) RandomSequence(p, static_cast<uint64_t>(seed), ops, seed % 4 == 3);
  }
  std::printf("random sequences: %d seeds x %d ops x %zu policies done\n", seeds, ops,
              sizeof(kPolicies) / sizeof(kPolicies[0]));
  ThreadStress(Policy::kGtbm, threads, thread_ops);
  ThreadStress(Policy::kBestFit, threads, thread_ops / 4);
  std::printf("thread stress: %d threads x %d ops done\n", threads, thread_ops);

  const int failures = g_failures.load();
  if (failures != 0) {
    std::printf("FAILED: %d check(s)\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
