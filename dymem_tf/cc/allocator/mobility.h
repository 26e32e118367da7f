// Mobility of an allocation: which GTBM group (or the host-inputs arena) serves it. Shared by the CPU device's
// allocator (gtbm_allocator.cc) and the GPU hook (gtbm_gpu.cc); the rules are described at the top of
// gtbm_allocator.cc.
#ifndef DYMEM_TF_CC_ALLOCATOR_MOBILITY_H_
#define DYMEM_TF_CC_ALLOCATOR_MOBILITY_H_

#include <string>
#include <string_view>

#include "../gtbm/gtbm_core.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"

namespace dymem {

// Classification result beyond the pool's groups: serve from the host-inputs arena (not counted by the budget).
constexpr int kHost = gtbm::kNumGroups;

// The calling thread's innermost mobility override, or -1 when it has none.
int CurrentOverride();
// Pushes a per-thread override (`group` outside [0, kHost] pushes "no override", keeping pushes and pops balanced).
void PushOverride(int group);
// Drops the calling thread's innermost override (no-op when it has none).
void PopOverride();
// Pushes the calling thread's innermost override again when there is one, else `group` (balanced like a push).
void PushDefaultOverride(int group);

// Replaces the op-name -> group map from "op_name<TAB>group" lines; returns the entry count, or -1 with *error set
// (map unchanged) on a bad line.
int InstallMobilityMap(std::string_view text, std::string* error);
// Removes the op-name -> group map.
void ClearMobilityMap();
// Number of entries in the op-name -> group map.
int MobilityMapSize();

// Whether input-pipeline allocations go to the host-inputs arena (DYMEM_HOST_INPUTS, dymem_gtbm_set_host_inputs).
bool HostInputsEnabled();
// Turns the host-inputs rule on or off for new allocations.
void SetHostInputsEnabled(bool enabled);

// True when the annotation names a whole function being instantiated (rule d at the top of gtbm_allocator.cc).
bool IsFunctionInstantiation(std::string_view op);

// A pool group, or kHost, for an allocation made under `annotation` on the calling thread.
int Classify(const tsl::profiler::MemoryDebugAnnotation& annotation);

}  // namespace dymem

#endif  // DYMEM_TF_CC_ALLOCATOR_MOBILITY_H_
