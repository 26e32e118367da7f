// Standalone test of RegionAllocator (the region + placement code shared by GTBM on the CPU device and on GPUs)
// through a host sub-allocator standing in for TensorFlow's device one: randomised, multi-threaded, linked against
// libtensorflow_framework.so.2. `make region-test`; `make region-asan` builds it with AddressSanitizer + UBSan.
#include <cstdio>
#include <string>

#include "../region_selftest.h"

namespace {

// Runs one configuration; prints a line; true when it passed.
bool RunCase(int threads, int64_t ops, uint64_t seed, uint64_t region, uint64_t base_alignment, uint64_t refuse) {
  dymem::SelfTestOptions o;
  o.threads = threads;
  o.ops_per_thread = ops;
  o.seed = seed;
  o.region_bytes = region;
  o.base_alignment = base_alignment;
  o.refuse_above = refuse;
  dymem::SelfTestReport r;
  std::string error;
  const bool ok = dymem::RunRegionSelfTest(o, &r, &error);
  std::printf("%s threads=%d seed=%llu region=%llu base_align=%llu refuse_above=%llu: allocs=%lld refused=%lld "
              "over_aligned=%lld peak=%lld capacity=%lld %s\n",
              ok ? "ok  " : "FAIL", threads, static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(region), static_cast<unsigned long long>(base_alignment),
              static_cast<unsigned long long>(refuse), static_cast<long long>(r.allocations),
              static_cast<long long>(r.refusals), static_cast<long long>(r.over_aligned),
              static_cast<long long>(r.peak_bytes_in_use), static_cast<long long>(r.capacity), error.c_str());
  return ok;
}

}  // namespace

int main() {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  int failures = 0;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    failures += !RunCase(1, 3000, seed, 64 * kMiB, 0, 0);
    failures += !RunCase(8, 1500, seed, 64 * kMiB, 0, 0);
    failures += !RunCase(4, 1500, seed, 32 * kMiB, 256, 0);     // base aligned to exactly 256 bytes (cudaMalloc)
    failures += !RunCase(4, 1500, seed, 96 * kMiB, 0, 80 * kMiB);  // the sub-allocator refuses: backs off
    failures += !RunCase(6, 1000, seed, 3 * kMiB + 12345, 4096, 0);  // small region: small blocks
  }
  std::printf("%s: %d failure(s)\n", failures == 0 ? "PASSED" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
