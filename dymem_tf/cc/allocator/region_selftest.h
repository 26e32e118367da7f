// A randomised, multi-threaded test of RegionAllocator on the CPU, through NewDeviceRegionAllocator -- the code
// path of the GPU hook -- with a host tsl::SubAllocator standing in for TensorFlow's device one. Called from Python
// (dymem_gtbm_region_selftest, tests/test_gpu_path.py) and from the standalone AddressSanitizer binary
// (tests/region_allocator_test.cc, `make region-asan`).
#ifndef DYMEM_TF_CC_ALLOCATOR_REGION_SELFTEST_H_
#define DYMEM_TF_CC_ALLOCATOR_REGION_SELFTEST_H_

#include <cstdint>
#include <string>

namespace dymem {

struct SelfTestOptions {
  int threads = 4;
  int64_t ops_per_thread = 2000;
  uint64_t seed = 1;
  uint64_t region_bytes = uint64_t{64} << 20;  // the "total_bytes" TensorFlow would pass
  uint64_t base_alignment = 0;                 // 0: 2 MiB-aligned region base; else exactly this power of two
  uint64_t refuse_above = 0;                   // the stand-in refuses larger allocations (0: never)
};

// What the run did (every field is also checked against the allocator's own statistics).
struct SelfTestReport {
  int64_t allocations = 0;         // successful AllocateRaw calls
  int64_t refusals = 0;            // AllocateRaw calls refused within the alignment limit (budget)
  int64_t over_aligned = 0;        // requests aligned beyond the region base, all refused
  int64_t peak_bytes_in_use = 0;
  int64_t capacity = 0;            // the pool's capacity (the region actually taken)
  int64_t max_alignment = 0;       // RegionAllocator::max_alignment()
  int64_t sub_allocs = 0;          // regions the stand-in handed out (1)
  int64_t sub_frees = 0;           // regions given back when the allocator was destroyed (1)
};

// Runs the test; false with *error describing the first violation.
bool RunRegionSelfTest(const SelfTestOptions& options, SelfTestReport* report, std::string* error);

}  // namespace dymem

#endif  // DYMEM_TF_CC_ALLOCATOR_REGION_SELFTEST_H_
