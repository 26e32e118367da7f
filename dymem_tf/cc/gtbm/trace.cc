// Trace recording of a Pool's allocations and frees, and its CSV dump (see gtbm_core.h).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gtbm_core.h"

namespace gtbm {

int64_t Pool::NowNsLocked() const {
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  return now - trace_t0_ns_;
}

// Records the allocation `live` (just made at `offset`) when a trace is active: its record, or a dropped count.
void Pool::TraceAllocLocked(uint64_t offset, const AllocTag* tag, Live* live) {
  if (!trace_active_) return;
  if (trace_.size() >= trace_max_records_) {
    ++trace_dropped_;
    return;
  }
  TraceRecord rec{};
  rec.lower = trace_events_++;
  rec.upper = 0;
  rec.size = live->requested;
  rec.offset = offset;
  rec.step = tag != nullptr ? tag->step_id : 0;
  rec.alloc_ns = NowNsLocked();
  rec.free_ns = -1;
  rec.op = InternOpLocked(tag != nullptr ? tag->op_name : std::string_view());
  rec.group = live->group;
  live->trace_index = static_cast<int64_t>(trace_.size());
  live->trace_generation = trace_generation_;
  trace_.push_back(rec);
}

// Closes the lifetime of the freed `live` in the trace, when it was recorded by the trace now active.
void Pool::TraceFreeLocked(const Live& live) {
  if (!trace_active_ || live.trace_index < 0 || live.trace_generation != trace_generation_) return;
  TraceRecord& rec = trace_[static_cast<size_t>(live.trace_index)];
  rec.upper = trace_events_++;
  rec.free_ns = NowNsLocked();
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

// Writes `s` as one CSV field, quoted (RFC 4180) when it holds a comma, a quote or a line break.
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

}  // namespace gtbm
