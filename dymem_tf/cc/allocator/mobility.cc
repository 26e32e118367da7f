// Mobility classification (see mobility.h; the rules are documented at the top of gtbm_allocator.cc).
#include "mobility.h"

#include <algorithm>
#include <iterator>
#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tsl/platform/env.h"

namespace dymem {
namespace {

constexpr int kMaxOverrideDepth = 64;
thread_local int t_override_depth = 0;
thread_local int t_override[kMaxOverrideDepth];

// Immutable once published; replaced as a whole by InstallMobilityMap.
struct MobilityMap {
  std::vector<std::unique_ptr<std::string>> names;  // owns the keys' characters
  std::unordered_map<std::string_view, int> groups;
};
std::shared_ptr<const MobilityMap> g_mobility_map;  // accessed with std::atomic_load / std::atomic_store
std::atomic<bool> g_has_mobility_map{false};         // fast path: no map, no shared_ptr traffic per allocation
std::atomic<bool> g_host_inputs{true};

// The part of an op name after its last '/'.
std::string_view Leaf(std::string_view op) {
  const size_t slash = op.rfind('/');
  return slash == std::string_view::npos ? op : op.substr(slash + 1);
}

// True when `text` begins with `prefix`.
bool StartsWith(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

// The op sets shared with the Python planner (op_sets.h).
#define DYMEM_OP_SET(name, ...) [[maybe_unused]] constexpr std::string_view name[] = {__VA_ARGS__};
#include "../op_sets.h"
#undef DYMEM_OP_SET

// Node names default to the op type ("AssignSubVariableOp_12"), and Keras/TF optimizers keep them.
bool IsVariableUpdate(std::string_view op) {
  const std::string_view leaf = Leaf(op);
  return std::any_of(std::begin(kVariableUpdatePrefixes), std::end(kVariableUpdatePrefixes),
                     [&](std::string_view prefix) { return StartsWith(leaf, prefix); });
}

// Rule c of the host-inputs classification: tf.data's iterator ops and eagerly run dataset constructors.
bool IsInputPipelineOp(std::string_view op) {
  if (op.empty()) return false;
  const std::string_view leaf = Leaf(op);
  if (StartsWith(leaf, "Iterator") || StartsWith(leaf, "MakeIterator") || StartsWith(leaf, "AnonymousIterator") ||
      StartsWith(leaf, "OneShotIterator") || StartsWith(leaf, "MultiDeviceIterator") ||
      StartsWith(leaf, "AnonymousMultiDeviceIterator") || StartsWith(leaf, "DeserializeIterator") ||
      StartsWith(leaf, "SerializeIterator")) {
    return true;
  }
  return leaf.size() == op.size() && op.find("Dataset") != std::string_view::npos;  // eager op: bare op type
}

// Rule b: TF names every thread it starts (tsl::Env::StartThread); tf.data's are "tf_data_*". Cached per thread.
bool OnInputPipelineThread() {
  thread_local int cached = -1;
  if (cached < 0) {
    std::string name;
    cached = tsl::Env::Default()->GetCurrentThreadName(&name) && StartsWith(name, "tf_data") ? 1 : 0;
  }
  return cached == 1;
}

// The mapped group of `op`, or -1 when the map has no entry for it.
int MappedGroup(std::string_view op) {
  if (op.empty() || !g_has_mobility_map.load(std::memory_order_acquire)) return -1;
  std::shared_ptr<const MobilityMap> map = std::atomic_load(&g_mobility_map);
  if (!map) return -1;
  // The planner names ops as in the graph TF runs (it plans after Grappler): exact node names only.
  auto it = map->groups.find(op);
  return it == map->groups.end() ? -1 : it->second;
}

// Adds one "op_name<TAB>group" line to `map`; false when it is malformed.
bool AddMapLine(std::string_view line, MobilityMap* map) {
  const size_t tab = line.rfind('\t');
  int group = -1;
  if (tab == std::string_view::npos || tab == 0 || !gtbm::ParseGroup(line.substr(tab + 1), &group)) return false;
  map->names.push_back(std::make_unique<std::string>(line.substr(0, tab)));
  map->groups[*map->names.back()] = group;
  return true;
}

}  // namespace

int CurrentOverride() {
  const int depth = std::min(t_override_depth, kMaxOverrideDepth);
  return depth > 0 ? t_override[depth - 1] : -1;
}

void PushDefaultOverride(int group) {
  const int current = CurrentOverride();
  PushOverride(current >= 0 ? current : group);
}

void PushOverride(int group) {
  if (t_override_depth < kMaxOverrideDepth) {
    t_override[t_override_depth] = (group >= 0 && group <= kHost) ? group : -1;
  }
  ++t_override_depth;  // entries beyond kMaxOverrideDepth are counted, not stored
}

void PopOverride() {
  if (t_override_depth > 0) --t_override_depth;
}

int InstallMobilityMap(std::string_view text, std::string* error) {
  auto map = std::make_shared<MobilityMap>();
  int lineno = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || AddMapLine(line, map.get())) continue;
    *error = "mobility map line " + std::to_string(lineno) + ": expected 'op_name<TAB>group', got '" +
             std::string(line) + "'";
    return -1;
  }
  const int n = static_cast<int>(map->groups.size());
  std::shared_ptr<const MobilityMap> published = std::move(map);
  std::atomic_store(&g_mobility_map, published);
  g_has_mobility_map.store(n > 0, std::memory_order_release);
  return n;
}

void ClearMobilityMap() {
  g_has_mobility_map.store(false, std::memory_order_release);
  std::atomic_store(&g_mobility_map, std::shared_ptr<const MobilityMap>());
}

int MobilityMapSize() {
  std::shared_ptr<const MobilityMap> map = std::atomic_load(&g_mobility_map);
  return map ? static_cast<int>(map->groups.size()) : 0;
}

bool HostInputsEnabled() { return g_host_inputs.load(std::memory_order_relaxed); }

void SetHostInputsEnabled(bool enabled) { g_host_inputs.store(enabled, std::memory_order_relaxed); }

// Rule d: TF's per-device graph optimizer constant-folds a new function's graph with a GraphRunner, and that code
// copies folded tensors without checking the allocation: refusing one there kills the process.
bool IsFunctionInstantiation(std::string_view op) {
  return (StartsWith(op, "__inference_") || StartsWith(op, "__forward_") || StartsWith(op, "__backward_")) &&
         op.find('/') == std::string_view::npos;
}

int Classify(const tsl::profiler::MemoryDebugAnnotation& annotation) {
  const int forced = CurrentOverride();
  const bool host_inputs = HostInputsEnabled();
  if (forced == kHost) {
    if (host_inputs) return kHost;
  } else if (forced >= 0) {
    return forced;
  }
  const std::string_view op(annotation.pending_op_name.data(), annotation.pending_op_name.size());
  if (host_inputs && (OnInputPipelineThread() || IsInputPipelineOp(op))) return kHost;
  const int mapped = MappedGroup(op);
  if (mapped >= 0) return mapped;
  if (op.empty() || IsVariableUpdate(op)) return gtbm::kPersistent;  // a forced kHost with host inputs off too
  if (annotation.pending_step_id == 0) return gtbm::kTransient;
  return op.find('/') == std::string_view::npos ? gtbm::kPersistent : gtbm::kTransient;
}

}  // namespace dymem
