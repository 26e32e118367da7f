// Replay engine: runs a dynamic storage allocation instance (CSV `id,lower,upper,size[,group,...]`, half-open
// lifetimes [lower, upper)) online through one placement policy of the GTBM core and reports the footprint.
//
// Built into two libraries: `_dymem_replay` (ctypes only, no TensorFlow registration, safe to load at any time)
// and `_dymem_gtbm` (next to the live allocator). Only plain C types cross the boundary; errors are reported by
// return codes and dymem_replay_last_error().
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "gtbm_core.h"

namespace gtbm {
namespace {

thread_local std::string g_replay_error;

struct Buffer {
  uint64_t lower;
  uint64_t upper;
  uint64_t size;
  int group;  // -1 when the file has no group column
};

// Splits one CSV line (RFC 4180 quoting) into fields.
std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> fields;
  std::string cur;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          cur.push_back('"');
          ++i;
        } else {
          quoted = false;
        }
      } else {
        cur.push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur.push_back(c);
    }
  }
  fields.push_back(cur);
  return fields;
}

// `s` without leading and trailing spaces and tabs.
std::string Trim(const std::string& s) {
  size_t b = 0;
  size_t e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return s.substr(b, e - b);
}

// Parses a decimal of at most 19 digits (spaces around it allowed); false on anything else.
bool ParseU64(const std::string& text, uint64_t* v) {
  const std::string s = Trim(text);
  if (s.empty() || s.size() > 19) return false;
  uint64_t r = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    r = r * 10 + static_cast<uint64_t>(c - '0');
  }
  *v = r;
  return true;
}

// Reads one line (also a last line without a newline); false at end of file.
bool ReadLine(FILE* f, std::string* line) {
  line->clear();
  int c;
  bool any = false;
  while ((c = std::fgetc(f)) != EOF) {
    any = true;
    if (c == '\n') return true;
    line->push_back(static_cast<char>(c));
  }
  return any;
}

// has_group: the file has a group column; recorded: it was written by the live allocator (has an offset column),
// so its sizes are real TensorFlow byte counts.
bool LoadInstance(const char* path, std::vector<Buffer>* buffers, bool* has_group, bool* recorded,
                  std::string* error) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) {
    *error = std::string("cannot open '") + path + "': " + std::strerror(errno);
    return false;
  }
  std::string line;
  if (!ReadLine(f, &line)) {
    std::fclose(f);
    *error = std::string("'") + path + "' is empty";
    return false;
  }
  const std::vector<std::string> header = SplitCsv(line);
  int col_lower = -1, col_upper = -1, col_size = -1, col_group = -1;
  for (size_t i = 0; i < header.size(); ++i) {
    const std::string h = Trim(header[i]);
    if (h == "lower") col_lower = static_cast<int>(i);
    if (h == "upper") col_upper = static_cast<int>(i);
    if (h == "size") col_size = static_cast<int>(i);
    if (h == "group") col_group = static_cast<int>(i);
    if (h == "offset") *recorded = true;
  }
  if (col_lower < 0 || col_upper < 0 || col_size < 0) {
    std::fclose(f);
    *error = std::string("'") + path + "': header must name the columns lower, upper and size (got '" + line + "')";
    return false;
  }
  *has_group = col_group >= 0;
  const size_t needed = static_cast<size_t>(std::max({col_lower, col_upper, col_size, col_group})) + 1;
  size_t lineno = 1;
  while (ReadLine(f, &line)) {
    ++lineno;
    if (Trim(line).empty()) continue;
    const std::vector<std::string> fields = SplitCsv(line);
    Buffer b{0, 0, 0, -1};
    bool ok = fields.size() >= needed && ParseU64(fields[col_lower], &b.lower) &&
              ParseU64(fields[col_upper], &b.upper) && ParseU64(fields[col_size], &b.size);
    if (ok && col_group >= 0) ok = ParseGroup(fields[col_group], &b.group);
    if (!ok || b.upper < b.lower) {
      std::fclose(f);
      *error = std::string("'") + path + "' line " + std::to_string(lineno) + ": cannot parse '" + line +
               "' (expected non-negative integers with lower <= upper" + (col_group >= 0 ? " and a group" : "") +
               ")";
      return false;
    }
    buffers->push_back(b);
  }
  std::fclose(f);
  return true;
}

// Mobility of a buffer from its lifetime, as a planner that knows the step's dataflow graph would assign it:
// alive over (nearly) the whole horizon -> PERSISTENT; alive long enough that a planner would consider swapping it
// out (a feature map kept from the forward pass for the backward pass) -> MOBILE; otherwise TRANSIENT.
constexpr int64_t kTfAlignment = 64;
constexpr uint64_t kBlocksPerLowerBound = 256;
constexpr double kPersistentFraction = 0.9;
constexpr double kMobileFraction = 0.1;

// The group of `b` by the rule above, over the horizon [t0, t1).
int LifetimeGroup(const Buffer& b, uint64_t t0, uint64_t t1) {
  const double horizon = static_cast<double>(t1 - t0);
  const double life = static_cast<double>(b.upper - b.lower);
  if (horizon <= 0) return kTransient;
  if (life >= kPersistentFraction * horizon || (b.lower == t0 && b.upper == t1)) return kPersistent;
  if (life >= kMobileFraction * horizon) return kMobile;
  return kTransient;
}

// The largest power of two <= v (1 for v < 2).
uint64_t FloorPow2(uint64_t v) {
  uint64_t p = 1;
  while (p <= v / 2) p *= 2;
  return p;
}

// Field order of the output array (keep in sync with kStatNames).
//   footprint    peak bytes_reserved: the memory the allocator holds at its worst moment (GTBM: pageblocks owned by
//                groups, free blocks being returned to the OS / unmapped; BEST_FIT: its regions; FIRST_FIT: its top);
//   peak_extent  peak end of the highest reserved byte: the arena a pool without page-level release would need;
//   used_extent  highest end of any allocation ever handed out;
//   lower_bound  peak of the live requested bytes (no placement can do better).
enum Field {
  kFootprint,
  kPeakExtent,
  kUsedExtent,
  kLowerBound,
  kPeakInUse,
  kReservedAtPeakInUse,
  kNumBuffers,
  kNumFailed,
  kTimeNs,
  kBlockSize,
  kAlignment,
  kBuffersPersistent,
  kBuffersTransient,
  kBuffersMobile,
  kGroupsFromTrace,
  kNumFields
};

constexpr const char* kStatNames =
    "footprint,peak_extent,used_extent,lower_bound,peak_in_use,reserved_at_peak_in_use,num_buffers,num_failed,"
    "time_ns,block_size,alignment,buffers_persistent,buffers_transient,buffers_mobile,groups_from_trace";

// Checks the arguments shared by both entry points; false with g_replay_error set on a bad one.
bool CheckArgs(const char* policy_name, int64_t block_size, int64_t alignment, const std::string& mode,
               int64_t* out, int out_len, Policy* policy) {
  if (policy_name == nullptr || out == nullptr) {
    g_replay_error = "null argument";
    return false;
  }
  if (out_len < kNumFields) {
    g_replay_error = "output array too short: need " + std::to_string(kNumFields) + " int64 values";
    return false;
  }
  if (!ParsePolicy(policy_name, policy)) {
    g_replay_error = std::string("unknown policy '") + policy_name + "' (gtbm, gtbm_nogroups, best_fit, first_fit)";
    return false;
  }
  if (mode != "auto" && mode != "trace" && mode != "lifetime" && mode != "none") {
    g_replay_error = "unknown groups mode '" + mode + "' (auto, trace, lifetime, none)";
    return false;
  }
  if (alignment < 0 || (alignment & (alignment - 1)) != 0) {
    g_replay_error = "alignment must be a power of two";
    return false;
  }
  if (block_size < 0) {
    g_replay_error = "block size must be positive (or 0 for automatic)";
    return false;
  }
  return true;
}

// Replays `buffers` online (see dymem_replay_run): 0 with `out` written, or -1 with g_replay_error set. `name`
// names the instance in errors.
int ReplayBuffers(const std::vector<Buffer>& buffers, bool has_group, bool recorded, Policy policy,
                  int64_t block_size, int64_t alignment, const std::string& mode, const std::string& name,
                  int64_t* out, int out_len) {
  if (mode == "trace" && !has_group) {
    g_replay_error = name + " has no group column (groups mode 'trace')";
    return -1;
  }
  const bool from_trace = has_group && (mode == "auto" || mode == "trace");

  // Events: frees before allocations at the same time (half-open lifetimes); ties keep file order.
  struct Event {
    uint64_t time;
    int kind;  // 0 = free, 1 = alloc
    uint32_t index;
  };
  std::vector<Event> events;
  events.reserve(buffers.size() * 2);
  uint64_t t0 = std::numeric_limits<uint64_t>::max();
  uint64_t t1 = 0;
  const uint64_t kLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 4;
  uint64_t total = 0;
  for (uint32_t i = 0; i < buffers.size(); ++i) {
    const Buffer& b = buffers[i];
    if (b.size > kLimit / 2) {
      g_replay_error = "buffer size too large: " + std::to_string(b.size);
      return -1;
    }
    if (b.upper == b.lower) continue;  // never live
    t0 = std::min(t0, b.lower);
    t1 = std::max(t1, b.upper);
    events.push_back({b.lower, 1, i});
    events.push_back({b.upper, 0, i});
    total = std::min(kLimit, total + b.size);
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.kind != b.kind) return a.kind < b.kind;
    return a.index < b.index;
  });

  std::vector<int> groups(buffers.size(), kTransient);
  int64_t group_count[kNumGroups] = {0, 0, 0};
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (mode == "none") {
      groups[i] = kTransient;
    } else if (from_trace) {
      groups[i] = buffers[i].group;
    } else {
      groups[i] = LifetimeGroup(buffers[i], t0, t1);
    }
    if (buffers[i].upper != buffers[i].lower) ++group_count[groups[i]];
  }

  // Lower bound: peak of live requested bytes.
  uint64_t live = 0;
  uint64_t lower_bound = 0;
  for (const Event& e : events) {
    if (e.kind == 0) {
      live -= buffers[e.index].size;
    } else {
      live += buffers[e.index].size;
      lower_bound = std::max(lower_bound, live);
    }
  }

  // Automatic alignment: 64 bytes (TensorFlow's) for traces recorded by the live allocator; for abstract
  // instances the largest power of two up to 64 that divides every size, so that units are not inflated.
  if (alignment == 0) {
    alignment = kTfAlignment;
    if (!recorded) {
      for (const Buffer& b : buffers) {
        while (alignment > 1 && b.size % static_cast<uint64_t>(alignment) != 0) alignment /= 2;
      }
    }
  }
  // Automatic block size: the lower bound / 256 rounded down to a power of two (1 MiB for a 300 MB step, 2 MiB,
  // the live allocator's default, for 512 MB-1 GB), at least the alignment.
  uint64_t block = static_cast<uint64_t>(block_size);
  if (block == 0) {
    block = std::max<uint64_t>(static_cast<uint64_t>(alignment),
                               FloorPow2(std::max<uint64_t>(lower_bound / kBlocksPerLowerBound, 1)));
  }
  block = (block + static_cast<uint64_t>(alignment) - 1) / static_cast<uint64_t>(alignment) *
          static_cast<uint64_t>(alignment);

  // The offset space is large enough for any of the policies on this instance (every buffer live at once, each
  // in its own blocks, plus BFC's region doubling), so a failure can only be a bug; it is reported, not hidden.
  const uint64_t per_buffer = block + 256 + static_cast<uint64_t>(alignment);
  uint64_t capacity = total;
  capacity = std::min(kLimit, capacity + static_cast<uint64_t>(buffers.size()) * per_buffer);
  capacity = std::min(kLimit, capacity * 2 + (uint64_t{4} << 20) + 2 * block);

  PoolOptions options;
  options.policy = policy;
  options.capacity = capacity;
  options.block_size = block;
  options.alignment = static_cast<uint64_t>(alignment);
  std::string error;
  std::unique_ptr<Pool> pool = Pool::Create(options, &error);
  if (!pool) {
    g_replay_error = "cannot create the pool: " + error;
    return -1;
  }
  std::vector<uint64_t> offsets(buffers.size(), kInvalidOffset);
  int64_t failed = 0;
  const auto start = std::chrono::steady_clock::now();
  for (const Event& e : events) {
    if (e.kind == 0) {
      if (offsets[e.index] != kInvalidOffset) pool->Free(offsets[e.index]);
    } else {
      offsets[e.index] = pool->Allocate(buffers[e.index].size, groups[e.index]);
      if (offsets[e.index] == kInvalidOffset) ++failed;
    }
  }
  const auto stop = std::chrono::steady_clock::now();
  const PoolStats s = pool->Stats();

  for (int i = 0; i < out_len; ++i) out[i] = 0;
  out[kFootprint] = s.peak_bytes_reserved;
  out[kPeakExtent] = s.peak_extent;
  out[kUsedExtent] = s.peak_used_end;
  out[kLowerBound] = static_cast<int64_t>(lower_bound);
  out[kPeakInUse] = s.peak_bytes_in_use;
  out[kReservedAtPeakInUse] = s.reserved_at_peak_in_use;
  out[kNumBuffers] = static_cast<int64_t>(buffers.size());
  out[kNumFailed] = failed;
  out[kTimeNs] = std::chrono::duration_cast<std::chrono::nanoseconds>(stop - start).count();
  out[kBlockSize] = (policy == Policy::kGtbm || policy == Policy::kGtbmNoGroups) ? static_cast<int64_t>(block) : 0;
  out[kAlignment] = alignment;
  out[kBuffersPersistent] = group_count[kPersistent];
  out[kBuffersTransient] = group_count[kTransient];
  out[kBuffersMobile] = group_count[kMobile];
  out[kGroupsFromTrace] = from_trace ? 1 : 0;
  return 0;
}

// dymem_replay_run without the exception guard.
int Replay(const char* csv_path, const char* policy_name, int64_t block_size, int64_t alignment,
           const char* groups_mode, int64_t* out, int out_len) {
  const std::string mode = groups_mode == nullptr ? "auto" : groups_mode;
  Policy policy;
  if (!CheckArgs(policy_name, block_size, alignment, mode, out, out_len, &policy)) return -1;
  if (csv_path == nullptr) {
    g_replay_error = "null argument";
    return -1;
  }
  std::vector<Buffer> buffers;
  bool has_group = false;
  bool recorded = false;
  if (!LoadInstance(csv_path, &buffers, &has_group, &recorded, &g_replay_error)) return -1;
  return ReplayBuffers(buffers, has_group, recorded, policy, block_size, alignment, mode,
                       std::string("'") + csv_path + "'", out, out_len);
}

// dymem_replay_buffers without the exception guard.
int ReplayArrays(const int64_t* lower, const int64_t* upper, const int64_t* size, const int32_t* group, int64_t n,
                 const char* policy_name, int64_t block_size, int64_t alignment, const char* groups_mode,
                 int64_t* out, int out_len) {
  const std::string mode = groups_mode == nullptr ? "auto" : groups_mode;
  Policy policy;
  if (!CheckArgs(policy_name, block_size, alignment, mode, out, out_len, &policy)) return -1;
  if (n < 0 || (n > 0 && (lower == nullptr || upper == nullptr || size == nullptr))) {
    g_replay_error = "null argument";
    return -1;
  }
  std::vector<Buffer> buffers(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int g = group == nullptr ? -1 : group[i];
    if (lower[i] < 0 || upper[i] < lower[i] || size[i] < 0 || (group != nullptr && (g < 0 || g >= kNumGroups))) {
      g_replay_error = "buffer " + std::to_string(i) + ": expected 0 <= lower <= upper, size >= 0 and a group 0-2";
      return -1;
    }
    buffers[static_cast<size_t>(i)] = {static_cast<uint64_t>(lower[i]), static_cast<uint64_t>(upper[i]),
                                       static_cast<uint64_t>(size[i]), g};
  }
  // sizes are TensorFlow byte counts: automatic alignment is TF's 64 bytes, as for a recorded trace
  return ReplayBuffers(buffers, group != nullptr, true, policy, block_size, alignment, mode, "the instance", out,
                       out_len);
}

}  // namespace
}  // namespace gtbm

extern "C" {

// Comma-separated names of the int64 values written by dymem_replay_run, in order.
const char* dymem_replay_stat_names(void) { return gtbm::kStatNames; }

// Number of int64 values dymem_replay_run writes.
int dymem_replay_num_stats(void) { return gtbm::kNumFields; }

// Replays `csv_path` with `policy` ("gtbm", "gtbm_nogroups", "best_fit", "first_fit"). block_size 0 = automatic
// (lower bound / 256, power of two), alignment 0 = automatic (64 for recorded traces); groups_mode: "auto" (the
// file's group column if any, else the lifetime rule), "trace", "lifetime" or "none". Writes
// dymem_replay_num_stats() values to `out`. Returns 0, or -1 with dymem_replay_last_error() set.
int dymem_replay_run(const char* csv_path, const char* policy, int64_t block_size, int64_t alignment,
                     const char* groups_mode, int64_t* out, int out_len) {
  try {
    return gtbm::Replay(csv_path, policy, block_size, alignment, groups_mode, out, out_len);
  } catch (const std::exception& e) {
    gtbm::g_replay_error = std::string("internal error: ") + e.what();
  } catch (...) {
    gtbm::g_replay_error = "internal error";
  }
  return -1;
}

// dymem_replay_run on an instance in memory: buffer i lives over [lower[i], upper[i]) with size[i] bytes, in
// group[i] (0 persistent, 1 transient, 2 mobile; `group` may be null: no group column). Sizes are TensorFlow byte
// counts (automatic alignment 64). Returns 0, or -1 with dymem_replay_last_error() set.
int dymem_replay_buffers(const int64_t* lower, const int64_t* upper, const int64_t* size, const int32_t* group,
                         int64_t n, const char* policy, int64_t block_size, int64_t alignment,
                         const char* groups_mode, int64_t* out, int out_len) {
  try {
    return gtbm::ReplayArrays(lower, upper, size, group, n, policy, block_size, alignment, groups_mode, out,
                              out_len);
  } catch (const std::exception& e) {
    gtbm::g_replay_error = std::string("internal error: ") + e.what();
  } catch (...) {
    gtbm::g_replay_error = "internal error";
  }
  return -1;
}

// The last error of dymem_replay_run or dymem_replay_buffers on this thread ("" if none).
const char* dymem_replay_last_error(void) { return gtbm::g_replay_error.c_str(); }

}  // extern "C"
