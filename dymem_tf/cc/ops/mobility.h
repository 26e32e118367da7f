// Mobility tagging for GTBM from the op kernels. The allocator lives in another library (_dymem_gtbm) that may not
// be loaded, so its hooks are looked up at run time instead of being linked; without GTBM every call is a no-op.
#ifndef DYMEM_TF_CC_OPS_MOBILITY_H_
#define DYMEM_TF_CC_OPS_MOBILITY_H_

namespace dymem {

// GTBM group ids: 0 PERSISTENT, 1 TRANSIENT, 2 MOBILE.
constexpr int kMobilityPersistent = 0;
constexpr int kMobilityMobile = 2;

// Resolves GTBM's hooks once per process (call from a kernel's constructor: GTBM loads before any kernel exists).
void GetMobilityHooks();

// Tags the allocations made on this thread while it lives (GTBM keeps the tag in a thread-local stack).
class ScopedMobility {
 public:
  // `yield_to_caller`: a group the thread already set (allocator.mobility in Python) wins over `group`.
  explicit ScopedMobility(int group, bool yield_to_caller = false);
  ~ScopedMobility();
  ScopedMobility(const ScopedMobility&) = delete;
  ScopedMobility& operator=(const ScopedMobility&) = delete;
};

}  // namespace dymem

#endif  // DYMEM_TF_CC_OPS_MOBILITY_H_
