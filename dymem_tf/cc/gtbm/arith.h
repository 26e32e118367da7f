// Byte arithmetic shared by the files of the GTBM core (internal: not part of gtbm_core.h's API).
#ifndef DYMEM_TF_CC_GTBM_ARITH_H_
#define DYMEM_TF_CC_GTBM_ARITH_H_

#include <cstdint>
#include <limits>

namespace gtbm {

// The largest byte count the core accepts: sizes are reported as int64.
constexpr uint64_t kMaxBytes = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// True when `v` is a power of two (0 is not).
inline bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// a / b rounded up; b > 0.
inline uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Round up to a multiple of `unit` (a power of two); `v` is bounded by kMaxBytes by the callers.
inline uint64_t RoundUp(uint64_t v, uint64_t unit) { return (v + unit - 1) & ~(unit - 1); }

// floor(log2(v)); -1 for 0.
inline int FloorLog2(uint64_t v) {
  int r = -1;
  while (v != 0) {
    v >>= 1;
    ++r;
  }
  return r;
}

}  // namespace gtbm

#endif  // DYMEM_TF_CC_GTBM_ARITH_H_
