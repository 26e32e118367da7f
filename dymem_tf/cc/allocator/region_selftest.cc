// The randomised, multi-threaded RegionAllocator test (see region_selftest.h) and its C entry point.
#include "region_selftest.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "c_api_util.h"
#include "mobility.h"
#include "region_allocator.h"

namespace dymem {
namespace {

constexpr uint64_t kStandInAlignment = uint64_t{2} << 20;
constexpr size_t kCheckedBytes = 256;  // bytes of each buffer's head and tail that carry its pattern

// Host memory in place of TensorFlow's DeviceMemAllocator: malloc'ed, base alignment chosen by the test, reported
// as device memory, counting what it hands out and gets back.
class HostStandIn final : public tsl::SubAllocator {
 public:
  HostStandIn(uint64_t base_alignment, uint64_t refuse_above)
      : tsl::SubAllocator({}, {}), align_(base_alignment), refuse_above_(refuse_above) {}

  void* Alloc(size_t /*alignment*/, size_t num_bytes, size_t* bytes_received) override {
    *bytes_received = 0;
    if (refuse_above_ != 0 && num_bytes > refuse_above_) return nullptr;
    const uint64_t big = align_ == 0 ? kStandInAlignment : 2 * align_;
    char* raw = static_cast<char*>(std::malloc(num_bytes + 2 * big));
    if (raw == nullptr) return nullptr;
    // Aligned to `big`, then moved by align_ so that the base is aligned to exactly align_ (when set).
    const uintptr_t a = (reinterpret_cast<uintptr_t>(raw) + big - 1) / big * big + (align_ == 0 ? 0 : align_);
    std::lock_guard<std::mutex> lock(mu_);
    raw_[reinterpret_cast<void*>(a)] = raw;
    ++allocs_;
    *bytes_received = num_bytes;
    return reinterpret_cast<void*>(a);
  }

  void Free(void* ptr, size_t /*num_bytes*/) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = raw_.find(ptr);
    if (it == raw_.end()) return;  // counted as missing: sub_frees stays low
    std::free(it->second);
    raw_.erase(it);
    ++frees_;
  }

  bool SupportsCoalescing() const override { return false; }
  tsl::AllocatorMemoryType GetMemoryType() const override { return tsl::AllocatorMemoryType::kDevice; }
  int64_t allocs() const { return allocs_; }
  int64_t frees() const { return frees_; }

 private:
  uint64_t align_;
  uint64_t refuse_above_;
  std::mutex mu_;
  std::unordered_map<void*, char*> raw_;
  int64_t allocs_ = 0;
  int64_t frees_ = 0;
};

struct LiveBuffer {
  char* ptr;
  size_t bytes;
  unsigned char pattern;
};

// Shared state of one run: the allocator under test, the first error, the counters.
struct Run {
  RegionAllocator* allocator;
  std::mutex mu;
  std::string error;
  std::atomic<int64_t> allocations{0}, refusals{0}, over_aligned{0};

  // Records the first failure (thread-safe).
  void Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.empty()) error = what;
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu);
    return !error.empty();
  }
};

// Writes `pattern` into the head and tail of the buffer.
void Stamp(const LiveBuffer& b) {
  const size_t n = std::min(b.bytes, kCheckedBytes);
  std::memset(b.ptr, b.pattern, n);
  std::memset(b.ptr + b.bytes - n, b.pattern, n);
}

// True when the head and tail still hold the pattern (no other buffer overlapped them).
bool Intact(const LiveBuffer& b) {
  const size_t n = std::min(b.bytes, kCheckedBytes);
  for (size_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(b.ptr[i]) != b.pattern ||
        static_cast<unsigned char>(b.ptr[b.bytes - n + i]) != b.pattern) {
      return false;
    }
  }
  return true;
}

// A request size: mostly small, some medium, a few large, a few empty.
size_t RandomSize(std::mt19937_64& rng) {
  const int r = static_cast<int>(rng() % 100);
  if (r < 2) return 0;
  if (r < 60) return 1 + rng() % 4096;
  if (r < 92) return 4096 + rng() % (256 << 10);
  return (256 << 10) + rng() % (4 << 20);
}

// Checks one fresh allocation: alignment, sizes, group; stamps it. False (with the run failed) on a violation.
bool CheckFresh(Run& run, const LiveBuffer& b, size_t alignment, int group) {
  const int expected = group == kHost ? gtbm::kPersistent : group;  // no host region on a device
  if (reinterpret_cast<uintptr_t>(b.ptr) % alignment != 0) run.Fail("misaligned pointer");
  else if (run.allocator->RequestedSize(b.ptr) != std::max<size_t>(b.bytes, 1)) run.Fail("RequestedSize differs");
  else if (run.allocator->AllocatedSize(b.ptr) < b.bytes) run.Fail("AllocatedSize below the request");
  else if (run.allocator->GroupOf(b.ptr) != expected) run.Fail("allocation placed in the wrong group");
  else if (b.bytes > 0) Stamp(b);
  return !run.failed();
}

// One allocation attempt by the calling thread; a success is appended to `live`.
void AllocateOne(Run& run, std::mt19937_64& rng, std::vector<LiveBuffer>* live) {
  static constexpr size_t kAlignments[] = {64, 256, 1024, 4096, 65536};
  const size_t alignment = kAlignments[rng() % 5];
  const int group = static_cast<int>(rng() % 4);  // persistent, transient, mobile, host
  const LiveBuffer b{nullptr, RandomSize(rng), static_cast<unsigned char>(1 + rng() % 255)};
  PushOverride(group);
  char* p = static_cast<char*>(run.allocator->AllocateRaw(alignment, b.bytes));
  PopOverride();
  if (alignment > run.allocator->max_alignment()) {
    if (p != nullptr) run.Fail("an over-aligned request was served");
    ++run.over_aligned;
    return;
  }
  if (p == nullptr) {
    ++run.refusals;
    return;
  }
  ++run.allocations;
  if (CheckFresh(run, LiveBuffer{p, b.bytes, b.pattern}, alignment, group)) live->push_back({p, b.bytes, b.pattern});
}

// Frees a random live buffer after checking its pattern.
void FreeOne(Run& run, std::mt19937_64& rng, std::vector<LiveBuffer>* live) {
  const size_t i = rng() % live->size();
  const LiveBuffer b = (*live)[i];
  if (!Intact(b)) run.Fail("a live buffer was overwritten (overlapping allocations)");
  run.allocator->DeallocateRaw(b.ptr);
  (*live)[i] = live->back();
  live->pop_back();
}

// The budget holds: reserved bytes never exceed the limit, and a request beyond the region is refused.
void CheckBudget(Run& run) {
  const gtbm::PoolStats s = run.allocator->pool()->Stats();
  if (s.bytes_reserved > s.bytes_limit) run.Fail("reserved bytes exceed the budget");
  if (run.allocator->AllocateRaw(64, static_cast<size_t>(s.capacity) + 1) != nullptr) {
    run.Fail("a request larger than the region was served");
  }
  ++run.refusals;
}

// One thread's random mix of allocations and frees; frees everything it holds at the end.
void Worker(Run& run, uint64_t seed, int64_t ops) {
  std::mt19937_64 rng(seed);
  std::vector<LiveBuffer> live;
  for (int64_t i = 0; i < ops && !run.failed(); ++i) {
    if (live.empty() || rng() % 100 < 55) AllocateOne(run, rng, &live);
    else FreeOne(run, rng, &live);
    if (i % 257 == 0) CheckBudget(run);
  }
  while (!live.empty()) FreeOne(run, rng, &live);
}

// After every thread finished: nothing is live, the invariants hold, the counters agree with the run.
bool CheckDrained(Run& run, SelfTestReport* report) {
  gtbm::Pool* pool = run.allocator->pool();
  const gtbm::PoolStats s = pool->Stats();
  std::string why;
  if (s.bytes_in_use != 0 || s.live_allocations != 0) run.Fail("bytes still in use after every free");
  else if (!pool->CheckInvariants(&why)) run.Fail("pool invariants: " + why);
  else if (s.num_allocs != run.allocations.load()) run.Fail("the pool counted another number of allocations");
  else if (run.allocator->GetStats()->peak_bytes_in_use != s.peak_bytes_in_use) run.Fail("GetStats disagrees");
  else if (pool->GetTraceInfo().records != static_cast<uint64_t>(s.num_allocs)) run.Fail("trace missed allocations");
  report->allocations = run.allocations;
  report->refusals = run.refusals;
  report->over_aligned = run.over_aligned;
  report->peak_bytes_in_use = s.peak_bytes_in_use;
  report->capacity = s.capacity;
  report->max_alignment = static_cast<int64_t>(run.allocator->max_alignment());
  return !run.failed();
}

// The allocator as the GPU hook builds it, over `stand_in`; checks what it reports about itself.
std::unique_ptr<RegionAllocator> Build(const SelfTestOptions& o, HostStandIn* stand_in, std::string* error) {
  std::unique_ptr<RegionAllocator> a = NewDeviceRegionAllocator("GPU_0_gtbm", o.region_bytes, stand_in, false, error);
  if (a == nullptr) return nullptr;
  if (a->GetMemoryType() != tsl::AllocatorMemoryType::kDevice) *error = "the region's memory type was not passed on";
  else if (a->Name() != "GPU_0_gtbm") *error = "wrong allocator name";
  else if (o.base_alignment != 0 && a->max_alignment() != o.base_alignment) *error = "wrong base alignment";
  else if (a->pool()->Stats().capacity > static_cast<int64_t>(o.region_bytes)) *error = "region larger than asked";
  if (!error->empty()) return nullptr;
  return a;
}

// A stand-in that refuses everything: no allocator, an error, nothing held.
bool CheckRefusedRegion(const SelfTestOptions& o, std::string* error) {
  HostStandIn refusing(o.base_alignment, 1);
  std::string why;
  if (NewDeviceRegionAllocator("GPU_0_gtbm", o.region_bytes, &refusing, false, &why) != nullptr || why.empty() ||
      refusing.allocs() != 0) {
    *error = "a refused region did not fail cleanly";
    return false;
  }
  return true;
}

// Runs the threads against `allocator`; fills the report.
bool RunThreads(const SelfTestOptions& o, RegionAllocator* allocator, SelfTestReport* report, std::string* error) {
  Run run;
  run.allocator = allocator;
  allocator->pool()->StartTrace(uint64_t{1} << 24);
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) threads.emplace_back(Worker, std::ref(run), o.seed * 1000003 + t, o.ops_per_thread);
  for (std::thread& t : threads) t.join();
  const bool ok = !run.failed() && CheckDrained(run, report);
  if (!ok) *error = run.error;
  return ok;
}

}  // namespace

bool RunRegionSelfTest(const SelfTestOptions& o, SelfTestReport* report, std::string* error) {
  if (o.threads < 1 || o.ops_per_thread < 0 || (o.base_alignment & (o.base_alignment - 1)) != 0 ||
      (o.base_alignment != 0 && o.base_alignment < 64)) {
    *error = "invalid self-test options";
    return false;
  }
  if (!CheckRefusedRegion(o, error)) return false;
  HostStandIn stand_in(o.base_alignment, o.refuse_above);
  {
    std::unique_ptr<RegionAllocator> allocator = Build(o, &stand_in, error);
    if (allocator == nullptr || !RunThreads(o, allocator.get(), report, error)) return false;
  }  // destroying the allocator gives the region back
  report->sub_allocs = stand_in.allocs();
  report->sub_frees = stand_in.frees();
  if (report->sub_allocs != 1 || report->sub_frees != 1) *error = "the region was not taken once and given back";
  return error->empty();
}

}  // namespace dymem

extern "C" {

// Runs the RegionAllocator self-test (region_selftest.h). Writes min(n, 8) report values {allocations, refusals,
// over_aligned, peak_bytes_in_use, capacity, max_alignment, sub_allocs, sub_frees}; returns 8, or -1 with
// dymem_gtbm_last_error() describing the first violation.
int dymem_gtbm_region_selftest(int threads, int64_t ops_per_thread, uint64_t seed, int64_t region_bytes,
                               int64_t base_alignment, int64_t refuse_above, int64_t* out, int n) {
  return dymem::Guard([&]() -> int {
    if (region_bytes <= 0 || base_alignment < 0 || refuse_above < 0) return dymem::SetError("invalid arguments");
    dymem::SelfTestOptions o;
    o.threads = threads;
    o.ops_per_thread = ops_per_thread;
    o.seed = seed;
    o.region_bytes = static_cast<uint64_t>(region_bytes);
    o.base_alignment = static_cast<uint64_t>(base_alignment);
    o.refuse_above = static_cast<uint64_t>(refuse_above);
    dymem::SelfTestReport r;
    std::string error;
    if (!dymem::RunRegionSelfTest(o, &r, &error)) return dymem::SetError(error);
    const int64_t values[] = {r.allocations, r.refusals, r.over_aligned, r.peak_bytes_in_use,
                              r.capacity, r.max_alignment, r.sub_allocs, r.sub_frees};
    const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
    for (int i = 0; i < std::min(n, count) && out != nullptr; ++i) out[i] = values[i];
    return count;
  });
}

}  // extern "C"
