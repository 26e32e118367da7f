// Configuration read from the environment by the GTBM allocators (CPU device and GPU hook).
#ifndef DYMEM_TF_CC_ALLOCATOR_CONFIG_H_
#define DYMEM_TF_CC_ALLOCATOR_CONFIG_H_

#include <cstdint>

namespace dymem {

constexpr uint64_t kDefaultMaxLimit = uint64_t{64} << 30;  // default CPU budget cap: min(physical RAM, 64 GiB)
constexpr uint64_t kDefaultBlockSize = uint64_t{2} << 20;  // pageblock: a huge page (and CUDA's VMM granule)
constexpr char kBlockSizeEnv[] = "DYMEM_GTBM_BLOCK_SIZE";

// Bytes of physical memory (kDefaultMaxLimit when unknown).
uint64_t PhysicalMemory();

// Reads a byte count from `name`; unset -> `fallback`; invalid -> error on stderr and `fallback` (Python validates
// the variable before loading the library, so this only guards direct users).
uint64_t BytesFromEnv(const char* name, uint64_t fallback, bool allow_zero = false);

// Unset -> `fallback`; "0", "false", "off", "no" (any case) -> false; anything else -> true.
bool FlagFromEnv(const char* name, bool fallback);

// Pageblock size for a pool of `limit` bytes: DYMEM_GTBM_BLOCK_SIZE, else 2 MiB halved (down to the page size)
// until the limit holds at least 256 blocks. An invalid variable is reported on stderr and ignored.
uint64_t BlockSizeFor(uint64_t limit);

}  // namespace dymem

#endif  // DYMEM_TF_CC_ALLOCATOR_CONFIG_H_
