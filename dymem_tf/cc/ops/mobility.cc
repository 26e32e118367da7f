// GTBM's mobility hooks looked up at run time (mobility.h).

#include "mobility.h"

#include <dlfcn.h>

#include <cstring>
#include <string>

#if defined(__linux__)
#include <link.h>
#endif

namespace dymem {
namespace {

struct MobilityHooks {
  void (*push)(int) = nullptr;
  void (*push_default)(int) = nullptr;
  void (*pop)() = nullptr;
};

#if defined(__linux__)
// tf.load_op_library opens libraries RTLD_LOCAL, which hides their symbols from RTLD_DEFAULT; find the GTBM library
// among the loaded objects and ask it directly.
int FindGtbmLibrary(struct dl_phdr_info* info, size_t /*size*/, void* data) {
  if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, "_dymem_gtbm") != nullptr) {
    *static_cast<std::string*>(data) = info->dlpi_name;
    return 1;
  }
  return 0;
}
#endif

// GTBM's dymem_gtbm_push/pop_mobility from the loaded libraries, both or neither.
MobilityHooks ResolveMobilityHooks() {
  MobilityHooks hooks;
  void* push = dlsym(RTLD_DEFAULT, "dymem_gtbm_push_mobility");
  void* push_default = dlsym(RTLD_DEFAULT, "dymem_gtbm_push_default_mobility");
  void* pop = dlsym(RTLD_DEFAULT, "dymem_gtbm_pop_mobility");
#if defined(__linux__)
  if (push == nullptr || pop == nullptr) {
    std::string path;
    dl_iterate_phdr(FindGtbmLibrary, &path);
    // RTLD_NOLOAD: only a library that is already loaded; the handle is kept for the life of the process.
    void* handle = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (handle != nullptr) {
      push = dlsym(handle, "dymem_gtbm_push_mobility");
      push_default = dlsym(handle, "dymem_gtbm_push_default_mobility");
      pop = dlsym(handle, "dymem_gtbm_pop_mobility");
    }
  }
#endif
  if (push != nullptr && pop != nullptr) {  // both or neither: an unbalanced push would leak a tag
    hooks.push = reinterpret_cast<void (*)(int)>(push);
    hooks.pop = reinterpret_cast<void (*)()>(pop);
    // the same library exports both pushes; without the second, a default push is a plain one
    hooks.push_default = reinterpret_cast<void (*)(int)>(push_default != nullptr ? push_default : push);
  }
  return hooks;
}

// Resolved once per process, at the first call. GTBM can only be loaded before TF's first allocation, hence
// before any kernel exists, so a later look-up could not find anything new.
const MobilityHooks& Hooks() {
  static const MobilityHooks hooks = ResolveMobilityHooks();
  return hooks;
}

}  // namespace

void GetMobilityHooks() { Hooks(); }

ScopedMobility::ScopedMobility(int group, bool yield_to_caller) {
  void (*push)(int) = yield_to_caller ? Hooks().push_default : Hooks().push;
  if (push != nullptr) push(group);
}

ScopedMobility::~ScopedMobility() {
  if (Hooks().pop != nullptr) Hooks().pop();
}

}  // namespace dymem
