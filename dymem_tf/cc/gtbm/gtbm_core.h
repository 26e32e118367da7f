// GTBM core: placement of tensors in an abstract offset space, grouped by mobility.
//
// Pure C++17, no TensorFlow dependency: the same code serves the live TensorFlow allocator
// (../allocator/gtbm_allocator.cc maps offsets onto an mmap'ed range), the trace replay engine (replay.cc) and the
// standalone/sanitizer tests (tests/gtbm_core_test.cc).
//
// This header is the core's API. Its implementation, one file per concern: parse.cc (ParseBytes, group and policy
// names), placer.h (the internal placement interface) with placer_gtbm.cc, placer_best_fit.cc and
// placer_first_fit.cc (one policy each), pool.cc (the Pool), stats.cc (stat names, flattening), trace.cc (trace
// recording, CSV dump); arith.h holds the byte arithmetic they share.
//
// Model. A Pool manages offsets [0, capacity). Memory is handed out in chunks aligned to `alignment`.
// Under the GTBM policy the space is cut into fixed-size pageblocks; each block is either free (in the shared
// free list) or owned by exactly one mobility group:
//   PERSISTENT (0) weights, optimizer slots, anything allocated outside a train step;
//   TRANSIENT  (1) short-lived intermediates;
//   MOBILE     (2) tensors that move between device and host (swap-in outputs, tensors planned for swap-out).
// A group serves a request from its own free chunks (exact best fit, then lowest offset; split; coalesce on
// free). Only when nothing fits does it take blocks from the shared free list: a contiguous run, merged with
// the group's free chunk next to it when that saves blocks, so a tensor larger than a block gets a contiguous
// run and the tail of its last block stays usable by the group. As soon as a whole block is free again it goes
// back to the shared list (and, past a small cache of resident free blocks, the live allocator returns its pages to
// the OS), so a group that shrinks gives its memory to the others: the Linux "group pages by mobility" scheme
// applied to tensors.
//
// Where groups grow (see GtbmPlacer in placer_gtbm.cc): all groups draw blocks from one address-ordered free list,
// lowest extent first, so memory released by one group is reused by the others; blocks stay mobility-homogeneous.
//
// Policies for comparison in replays: BEST_FIT mirrors TensorFlow's BFC allocator (256-byte rounding, 21
// power-of-two bins, best fit within bins, split only when the remainder is at least as large as the request,
// coalescing within a region, regions that double in size); FIRST_FIT is address-ordered first fit with
// splitting and coalescing; GTBM_NOGROUPS is GTBM with every tensor in one group (shows the grouping effect).
//
// Accounting definitions (all in bytes of the offset space):
//   bytes_in_use       sum of allocated (aligned) sizes of live allocations;
//   requested_in_use   sum of requested sizes of live allocations;
//   bytes_reserved     memory the pool holds: GTBM = blocks owned by groups (the live allocator returns free
//                      blocks to the OS, so its resident pool is this plus cached_free_bytes), BEST_FIT = total
//                      size of its regions, FIRST_FIT = its current top (end of the highest live chunk); the peak
//                      of bytes_reserved is the "footprint" that replays compare;
//   extent             end offset of the highest reserved byte: what a flat arena without page-level release
//                      must provide (for GTBM it exceeds bytes_reserved by the whole free blocks below it);
//   reserved overhead  1 - bytes_in_use / bytes_reserved (memory_stats' reserved_overhead; "fragmentation" on the
//                      dashboard is 1 - largest free gap / free bytes of the traced pool, another figure).
//
// Thread safety: every public method of Pool is safe to call concurrently (one mutex; each operation is a few
// ordered-map updates, O(log n), plus O(number of free block runs) when a group must grow).
#ifndef DYMEM_TF_CC_GTBM_GTBM_CORE_H_
#define DYMEM_TF_CC_GTBM_GTBM_CORE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace gtbm {

enum Group : int { kPersistent = 0, kTransient = 1, kMobile = 2 };
constexpr int kNumGroups = 3;

// "persistent", "transient", "mobile".
const char* GroupName(int group);
// Accepts a group name (case-insensitive) or its number; returns false on anything else.
bool ParseGroup(std::string_view text, int* group);

enum class Policy { kGtbm = 0, kGtbmNoGroups = 1, kBestFit = 2, kFirstFit = 3 };
constexpr int kNumPolicies = 4;

// "gtbm", "gtbm_nogroups", "best_fit", "first_fit".
const char* PolicyName(Policy policy);
// Accepts a policy name (case-insensitive); returns false on anything else.
bool ParsePolicy(std::string_view text, Policy* policy);

constexpr uint64_t kInvalidOffset = ~uint64_t{0};

// Parses a byte count: a non-negative integer or decimal with an optional unit (B, KB, MB, GB, TB = powers of
// 1000; KiB, MiB, GiB, TiB = powers of 1024; K, M, G, T = powers of 1024; case-insensitive, spaces allowed
// between number and unit). Returns false (and sets *error) on anything else, including overflow.
bool ParseBytes(std::string_view text, uint64_t* bytes, std::string* error);

struct PoolOptions {
  Policy policy = Policy::kGtbm;
  // Size of the offset space [0, capacity). Rounded down to whole blocks (GTBM policies).
  uint64_t capacity = 0;
  // Budget on bytes_reserved; 0 means `capacity`. Can be changed later with Pool::SetLimit.
  uint64_t limit = 0;
  // Pageblock size of the GTBM policies; a multiple of `alignment`.
  uint64_t block_size = uint64_t{2} << 20;
  // Minimum alignment of every chunk (power of two). BEST_FIT uses max(alignment, 256) like TF's BFC.
  uint64_t alignment = 64;
  // GTBM only: called with the pool lock held whenever blocks go back to the shared free list (offset and
  // length in bytes), e.g. to madvise(MADV_DONTNEED) them. Must not call back into the Pool.
  std::function<void(uint64_t offset, uint64_t length)> on_release;
  // GTBM only: up to this many bytes of free blocks are kept "resident" before on_release is called for them
  // (highest addresses first, as the placer reuses the lowest free blocks first). Releasing a block and faulting it
  // back in moments later costs more than the step's compute on some models; a block taken from the cache is reused
  // without any callback. 0 releases at once. Cached blocks are free: they count in cached_free_bytes, not in
  // bytes_reserved or against the limit.
  uint64_t release_cache = 0;
};

// A consistent snapshot of the pool's counters (see the definitions at the top of this file).
struct PoolStats {
  int64_t bytes_in_use = 0;
  int64_t peak_bytes_in_use = 0;
  int64_t requested_bytes_in_use = 0;
  int64_t peak_requested_bytes_in_use = 0;
  int64_t bytes_reserved = 0;
  int64_t peak_bytes_reserved = 0;
  int64_t extent = 0;
  int64_t peak_extent = 0;
  // bytes_reserved at the moment bytes_in_use last reached its peak (reserved overhead at the peak).
  int64_t reserved_at_peak_in_use = 0;
  int64_t largest_free_block = 0;
  // Free blocks not yet passed to on_release (see PoolOptions::release_cache).
  int64_t cached_free_bytes = 0;
  // Highest end offset (chunk offset + allocated size) ever handed out: the arena a perfect reuse of freed
  // reserved memory would need. Compare with peak_extent to see the cost of the policy's reservation unit.
  int64_t peak_used_end = 0;
  int64_t largest_alloc_size = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_failed_allocs = 0;
  int64_t live_allocations = 0;
  int64_t bytes_limit = 0;
  int64_t capacity = 0;
  int64_t block_size = 0;
  int64_t group_in_use[kNumGroups] = {0, 0, 0};
  int64_t group_peak_in_use[kNumGroups] = {0, 0, 0};
  int64_t group_reserved[kNumGroups] = {0, 0, 0};
  int64_t group_peak_reserved[kNumGroups] = {0, 0, 0};
  int64_t group_num_allocs[kNumGroups] = {0, 0, 0};
};

// Flattens stats into `out` in the order of StatNames() (comma-separated, stable: new fields are appended).
// Writes min(n, NumStats()) values and returns NumStats().
int FlattenStats(const PoolStats& stats, int64_t* out, int n);
const char* StatNames();
int NumStats();

// Who asked for an allocation; only used when a trace is being recorded.
struct AllocTag {
  std::string_view op_name;
  int64_t step_id = 0;
};

struct TraceInfo {
  bool active = false;
  uint64_t records = 0;   // allocation records held
  uint64_t dropped = 0;   // allocations not recorded because max_records was reached
  uint64_t events = 0;    // alloc + free events recorded
  uint64_t max_records = 0;
};

// Writes min(n, 5) of {active, records, dropped, events, max_records} into `out`; returns 5.
int FlattenTraceInfo(const TraceInfo& info, int64_t* out, int n);

class Placer;  // one placement policy (placer.h)

class Pool {
 public:
  // Returns nullptr and sets *error when the options are invalid.
  static std::unique_ptr<Pool> Create(const PoolOptions& options, std::string* error);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Allocates `bytes` (0 is served as one alignment unit) for `group`, aligned to max(alignment, pool
  // alignment); `alignment` must be a power of two (0 = pool alignment). Returns the offset, or kInvalidOffset
  // when it does not fit in the budget or the offset space (counted in num_failed_allocs). Never throws.
  uint64_t Allocate(uint64_t bytes, int group, uint64_t alignment = 0, const AllocTag* tag = nullptr);

  // Frees the allocation at `offset`; returns its allocated size, or 0 if no live allocation starts there.
  uint64_t Free(uint64_t offset);

  // Changes the budget. Fails (returns false, sets *error) below bytes_in_use or above the capacity. A budget
  // below bytes_reserved is accepted: new allocations that need more memory fail until frees bring it down.
  bool SetLimit(uint64_t limit, std::string* error);
  uint64_t limit() const;

  PoolStats Stats() const;
  // Passes every cached free block to on_release now (GTBM; no-op otherwise).
  void TrimCache();

  // Peaks (in use, reserved, extent, per group) restart from the current values; largest_alloc_size restarts.
  void ResetPeaks();
  // ResetPeaks plus num_allocs / num_frees / num_failed_allocs back to zero (TensorFlow's ClearStats).
  void ClearCounters();

  // Requested and allocated size of the live allocation at `offset`; false if there is none.
  bool Lookup(uint64_t offset, uint64_t* requested, uint64_t* allocated, int* group) const;

  // Trace recording of every allocation and free (bounded: at most max_records allocations are kept; later ones
  // are counted as dropped). StartTrace discards the previous trace.
  void StartTrace(uint64_t max_records);
  void StopTrace();
  TraceInfo GetTraceInfo() const;
  // Writes the trace as CSV with MiniMalloc-compatible first columns:
  //   id,lower,upper,size,group,offset,op,step,alloc_ns,free_ns
  // lower/upper are event indices (allocation, free) of a half-open lifetime; a buffer not freed while
  // recording gets upper = last event index + 1 and free_ns = -1.
  bool DumpTrace(const std::string& path, std::string* error) const;

  // The options the pool was created with (capacity rounded down to whole blocks for GTBM).
  const PoolOptions& options() const { return options_; }

  // Verifies the internal invariants (chunks tile the reserved space, free lists consistent, counters match);
  // used by tests. Returns false and describes the first violation in *error.
  bool CheckInvariants(std::string* error) const;

 private:
  explicit Pool(const PoolOptions& options);

  struct Live {
    uint64_t base;       // chunk offset inside the placer (<= the returned offset when over-aligned)
    uint64_t requested;
    uint64_t allocated;  // bytes taken from the placer
    int group;
    int64_t trace_index;  // index in trace_ or -1
    uint64_t trace_generation;
  };
  struct TraceRecord {
    uint64_t lower;
    uint64_t upper;  // 0 while live (an alloc event always precedes its free, so 0 is never a free index)
    uint64_t size;
    uint64_t offset;
    int64_t step;
    int64_t alloc_ns;
    int64_t free_ns;
    uint32_t op;
    int32_t group;
  };

  // Block size of the GTBM policies, 0 for the others (PoolStats::block_size).
  int64_t gtbm_block_size() const;
  // Raises the peaks to the current values (and records reserved_at_peak_in_use on a new in-use peak).
  void UpdatePeaksLocked();
  // Peaks restart from the current values.
  void ResetPeaksLocked();
  // Trace recording (trace.cc); each is a no-op while no trace is active.
  void TraceAllocLocked(uint64_t offset, const AllocTag* tag, Live* live);
  void TraceFreeLocked(const Live& live);
  // Index of `name` in op_names_, added if new.
  uint32_t InternOpLocked(std::string_view name);
  // Nanoseconds since the trace started.
  int64_t NowNsLocked() const;

  PoolOptions options_;
  mutable std::mutex mu_;
  std::unique_ptr<Placer> placer_;
  uint64_t limit_ = 0;
  std::unordered_map<uint64_t, Live> live_;
  PoolStats stats_;  // counters; reserved/extent/largest_free are taken from the placer on demand

  // Trace state.
  bool trace_active_ = false;
  uint64_t trace_generation_ = 0;
  uint64_t trace_max_records_ = 0;
  uint64_t trace_dropped_ = 0;
  uint64_t trace_events_ = 0;
  int64_t trace_t0_ns_ = 0;
  std::vector<TraceRecord> trace_;
  std::vector<std::string> op_names_;
  std::unordered_map<std::string, uint32_t> op_index_;
};

}  // namespace gtbm

#endif  // DYMEM_TF_CC_GTBM_GTBM_CORE_H_
