// The flat form of PoolStats: stat names and FlattenStats (see gtbm_core.h).
#include <cstdint>
#include <string>

#include "gtbm_core.h"

namespace gtbm {

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

// The comma-separated names of the flattened stats: the scalars, then each group field per group.
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

int FlattenTraceInfo(const TraceInfo& info, int64_t* out, int n) {
  const int64_t values[] = {info.active ? 1 : 0, static_cast<int64_t>(info.records),
                            static_cast<int64_t>(info.dropped), static_cast<int64_t>(info.events),
                            static_cast<int64_t>(info.max_records)};
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  for (int i = 0; i < n && i < count; ++i) out[i] = values[i];
  return count;
}

}  // namespace gtbm
