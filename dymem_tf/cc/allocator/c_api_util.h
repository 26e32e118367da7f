// Error reporting shared by the C APIs of _dymem_gtbm (CPU allocator, GPU hook, region self-test): functions that
// return int use 0 (or a count) for success and -1 for failure with the thread's last error set; nothing throws
// across the C boundary.
#ifndef DYMEM_TF_CC_ALLOCATOR_C_API_UTIL_H_
#define DYMEM_TF_CC_ALLOCATOR_C_API_UTIL_H_

#include <exception>
#include <string>

namespace dymem {

// Message of the last failed C API call on this thread (dymem_gtbm_last_error).
inline thread_local std::string g_last_error;

// Records `message` as this thread's last error; returns -1, for the caller to return.
inline int SetError(const std::string& message) {
  g_last_error = message;
  return -1;
}

// Runs `f` (returning int); an exception becomes -1 with the last error set, so that nothing crosses the C API.
template <typename F>
int Guard(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return SetError(std::string("internal error: ") + e.what());
  } catch (...) {
    return SetError("internal error");
  }
}

}  // namespace dymem

#endif  // DYMEM_TF_CC_ALLOCATOR_C_API_UTIL_H_
