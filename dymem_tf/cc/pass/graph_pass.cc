// Dymem's graph pass: runs on the graph TensorFlow will execute, after Grappler (POST_REWRITE_FOR_EXEC), once per
// function instantiation. It hands the graph to the Python planner through a C function pointer set with ctypes
// and applies the plan the planner returns (step_plan.h). Nothing happens unless Python installed a handler and
// armed the pass (DymemCallback arms it while its train function runs), and only for graphs with gradient ops.
//
// Why after Grappler: the plan is then made for the graph that runs (fused ops, removed identities, rewritten
// AddNs), and the inserted swap ops cannot change what Grappler does, so training stays bit-identical.

#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "step_plan.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/graph/algorithm.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/graph/graph.h"

namespace dymem {
namespace {

// The Python side: called with the call's state, the function's name and its serialized GraphDef; returns
// kContinue (run the graph as it now is) or kFail (fail the instantiation with the message set by
// dymem_pass_fail, used by the dry run to capture a graph without running it).
using Handler = int (*)(void* call, const char* function_name, const char* graph_def, size_t size);
constexpr int kContinue = 0;
constexpr int kFail = 1;

// The two phases of POST_REWRITE_FOR_EXEC the pass is registered at: before XLA's clustering passes (phases 3-60)
// and after them. Only the one Python chose acts (kAfterXla unless the step is to be auto-clustered).
constexpr int kBeforeXla = 1;
constexpr int kAfterXla = 100;

std::atomic<Handler> g_handler{nullptr};
std::atomic<int> g_armed{0};
std::atomic<int> g_phase{kAfterXla};
std::atomic<int64_t> g_handled{0};
// The batch size the step's unknown input batch dimension stands for (0: none), set by Python while armed.
std::atomic<int64_t> g_batch_hint{0};

// Inferred output shapes by node name (the `_dymem_output_shapes` values of the serialized graph).
using ShapeAnnotations = std::unordered_map<std::string, tensorflow::AttrValue>;

// State of one handler call, passed to Python as an opaque pointer.
struct PassCall {
  tensorflow::Graph* graph = nullptr;
  std::string serialized;
  ShapeAnnotations shapes;  // of the graph as handed to Python: the rewritten graph reuses them
  std::string error;
  std::string fail_message;
};

// Whether the graph holds a GradientTape's gradient ops (a train step), the only graphs Dymem plans.
bool HasGradientOps(const tensorflow::Graph& graph) {
  for (const tensorflow::Node* n : graph.op_nodes()) {
    if (absl::StrContains(n->name(), "gradient_tape/")) return true;
  }
  return false;
}

// One inferred output shape as a TensorShapeProto (-1 for an unknown dimension).
void ShapeToProto(tensorflow::shape_inference::InferenceContext* c, tensorflow::shape_inference::ShapeHandle h,
                  tensorflow::TensorShapeProto* proto) {
  if (!c->RankKnown(h)) {
    proto->set_unknown_rank(true);
    return;
  }
  for (int d = 0; d < c->Rank(h); ++d) proto->add_dim()->set_size(c->Value(c->Dim(h, d)));
}

// Op types of the step's input ops, whose outputs lead with the batch dimension (Python's
// step_pass.INPUT_OP_TYPES less IteratorGetNextAsOptional, whose output is one optional: a test compares them).
constexpr const char* kStepInputTypes = "IteratorGetNext,IteratorGetNextSync,MultiDeviceIteratorGetNextFromShard";

// Whether `n` is one of the step's input ops (kStepInputTypes).
bool IsStepInput(const tensorflow::Node* n) {
  for (absl::string_view type : absl::StrSplit(kStepInputTypes, ',')) {
    if (n->type_string() == type) return true;
  }
  return false;
}

// Gives the unknown leading dimension of `n`'s outputs the value `batch` in `refiner`, so that shapes computed from
// them (tf.shape -> Reshape, as in attention layers) are inferred too; an output it does not fit keeps TF's shape.
void RefineBatch(tensorflow::ShapeRefiner* refiner, const tensorflow::Node* n, int64_t batch) {
  tensorflow::shape_inference::InferenceContext* c = refiner->GetContext(n);
  for (int i = 0; c != nullptr && i < c->num_outputs(); ++i) {
    tensorflow::shape_inference::ShapeHandle out = c->output(i), refined;
    if (!c->RankKnown(out) || c->Rank(out) == 0 || c->ValueKnown(c->Dim(out, 0))) continue;
    if (!c->ReplaceDim(out, 0, c->MakeDim(batch), &refined).ok()) continue;
    (void)refiner->SetShape(n, i, refined);
  }
}

// Adds `_dymem_output_types` and (where shape inference succeeds) `_dymem_output_shapes` to every node of `def`,
// inferred with the runtime's own op registry (Python's may lack the kernels' dtypes, e.g. bfloat16 fusions). With
// `batch` > 0 the step's input batch dimension is taken to be `batch` (see RefineBatch). The shapes go to `known`.
void AnnotateOutputs(const tensorflow::Graph& graph, tensorflow::GraphDef* def, int64_t batch,
                     ShapeAnnotations* known) {
  std::unordered_map<std::string, tensorflow::NodeDef*> by_name;
  for (tensorflow::NodeDef& nd : *def->mutable_node()) by_name[nd.name()] = &nd;
  tensorflow::ShapeRefiner refiner(graph.versions(), graph.op_registry());
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order);
  for (tensorflow::Node* n : order) {
    auto it = by_name.find(n->name());
    if (!n->IsOp() || it == by_name.end()) continue;
    tensorflow::AttrValue types;
    for (int i = 0; i < n->num_outputs(); ++i) types.mutable_list()->add_type(n->output_type(i));
    (*it->second->mutable_attr())["_dymem_output_types"] = types;
    if (!refiner.AddNode(n).ok()) continue;
    if (batch > 0 && IsStepInput(n)) RefineBatch(&refiner, n, batch);
    tensorflow::shape_inference::InferenceContext* c = refiner.GetContext(n);
    tensorflow::AttrValue shapes;
    for (int i = 0; i < c->num_outputs(); ++i) ShapeToProto(c, c->output(i), shapes.mutable_list()->add_shape());
    (*it->second->mutable_attr())["_dymem_output_shapes"] = shapes;
    (*known)[n->name()] = shapes;
  }
}

// The graph as a serialized GraphDef with inferred output types and shapes (see AnnotateOutputs).
std::string Serialize(const tensorflow::Graph& graph, ShapeAnnotations* known) {
  tensorflow::GraphDef def;
  graph.ToGraphDef(&def, /*include_flib_def=*/false);
  AnnotateOutputs(graph, &def, g_batch_hint.load(), known);
  return def.SerializeAsString();
}

// The output shapes of a node the plan added, from `known`: a swap op's are those of its data input, a copy's
// (named "<op>/dymem_...") those of the op it copies; false when they are not known.
bool AddedShapes(const tensorflow::Node* n, const ShapeAnnotations& known, tensorflow::AttrValue* shapes) {
  if (n->type_string() == "DymemSwapOut" || n->type_string() == "DymemSwapIn") {
    const tensorflow::Edge* in = nullptr;
    if (!n->input_edge(0, &in).ok()) return false;
    auto it = known.find(in->src()->name());
    if (it == known.end() || in->src_output() >= it->second.list().shape_size()) return false;
    *shapes->mutable_list()->add_shape() = it->second.list().shape(in->src_output());
    return true;
  }
  const size_t cut = n->name().rfind("/dymem_");
  auto it = cut == std::string::npos ? known.end() : known.find(n->name().substr(0, cut));
  if (it == known.end() || it->second.list().shape_size() != n->num_outputs()) return false;
  *shapes = it->second;
  return true;
}

// The rewritten graph serialized like Serialize without a second shape inference (the pass's most expensive
// step on a large graph): the original nodes keep the shapes in `known`, added nodes get AddedShapes.
std::string SerializeRewritten(const tensorflow::Graph& graph, ShapeAnnotations* known) {
  tensorflow::GraphDef def;
  graph.ToGraphDef(&def, /*include_flib_def=*/false);
  std::unordered_map<std::string, tensorflow::NodeDef*> by_name;
  for (tensorflow::NodeDef& nd : *def.mutable_node()) by_name[nd.name()] = &nd;
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order);
  for (tensorflow::Node* n : order) {
    auto it = by_name.find(n->name());
    if (!n->IsOp() || it == by_name.end()) continue;
    tensorflow::AttrValue types;
    for (int i = 0; i < n->num_outputs(); ++i) types.mutable_list()->add_type(n->output_type(i));
    (*it->second->mutable_attr())["_dymem_output_types"] = types;
    auto shapes = known->find(n->name());
    tensorflow::AttrValue added;
    if (shapes == known->end() && AddedShapes(n, *known, &added)) shapes = known->emplace(n->name(), added).first;
    if (shapes != known->end()) (*it->second->mutable_attr())["_dymem_output_shapes"] = shapes->second;
  }
  return def.SerializeAsString();
}

// The name of the function being instantiated (empty when TF did not say).
std::string FunctionName(const tensorflow::GraphOptimizationPassOptions& options) {
  return options.function_def != nullptr ? options.function_def->signature().name() : std::string();
}

template <int kPhase>
class DymemStepPass : public tensorflow::GraphOptimizationPass {
 public:
  // Offers the graph to the Python planner when armed for this phase; a planner failure leaves the graph as it was.
  absl::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    Handler handler = g_handler.load();
    if (handler == nullptr || g_armed.load() <= 0 || g_phase.load() != kPhase || options.graph == nullptr ||
        *options.graph == nullptr) {
      return absl::OkStatus();
    }
    tensorflow::Graph* graph = options.graph->get();
    if (!HasGradientOps(*graph)) return absl::OkStatus();
    PassCall call;
    call.graph = graph;
    call.serialized = Serialize(*graph, &call.shapes);
    g_handled.fetch_add(1);
    const std::string name = FunctionName(options);
    if (handler(&call, name.c_str(), call.serialized.data(), call.serialized.size()) == kFail) {
      return absl::CancelledError(absl::StrCat("dymem_tf: ", call.fail_message));
    }
    return absl::OkStatus();
  }
};

using DymemStepPassAfterXla = DymemStepPass<kAfterXla>;
using DymemStepPassBeforeXla = DymemStepPass<kBeforeXla>;

}  // namespace
}  // namespace dymem

// After XLA's clustering passes (phases 3-60 of the same grouping): swap ops never land inside a cluster. The
// default: a step that swaps runs without XLA.
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, dymem::kAfterXla,
                      dymem::DymemStepPassAfterXla);
// Before them, for a step auto-clustered around its swap ops (DymemCallback(xla="auto")): the swap ops have no XLA
// kernel, so MarkForCompilationPass leaves them out, and a cluster cannot hold both ends of a swap (that would
// close a cycle through the swap ops): clusters form between them and every swapped tensor is a cluster output.
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, dymem::kBeforeXla,
                      dymem::DymemStepPassBeforeXla);

extern "C" {

// Installs the Python handler (null removes it).
__attribute__((visibility("default"))) void dymem_pass_set_handler(dymem::Handler handler) {
  dymem::g_handler.store(handler);
}

// Arms (+1) or disarms (-1) the pass; it offers graphs to the handler while the count is positive.
__attribute__((visibility("default"))) int dymem_pass_arm(int delta) { return dymem::g_armed.fetch_add(delta) + delta; }

// Makes the pass act before XLA's clustering passes (1) or after them (0, the default); returns the previous choice.
__attribute__((visibility("default"))) int dymem_pass_set_before_xla(int before) {
  return dymem::g_phase.exchange(before ? dymem::kBeforeXla : dymem::kAfterXla) == dymem::kBeforeXla ? 1 : 0;
}

// Sets the batch size the step's unknown input batch dimension stands for in the shapes offered (0: none); returns
// the previous one.
__attribute__((visibility("default"))) int64_t dymem_pass_set_batch_hint(int64_t batch) {
  return dymem::g_batch_hint.exchange(batch > 0 ? batch : 0);
}

// The op types whose outputs' unknown batch dimension the batch hint fills, comma-separated.
__attribute__((visibility("default"))) const char* dymem_pass_step_input_types(void) {
  return dymem::kStepInputTypes;
}

// How many graphs were offered to the handler since the library was loaded.
__attribute__((visibility("default"))) int64_t dymem_pass_handled(void) { return dymem::g_handled.load(); }

// Applies a plan (step_plan.h text form) to the graph of `call`: 0 on success, -1 with dymem_pass_error set and
// the graph unchanged otherwise. On success the call's serialized graph is the rewritten one.
__attribute__((visibility("default"))) int dymem_pass_apply(void* call, const char* text) {
  auto* c = static_cast<dymem::PassCall*>(call);
  dymem::StepPlan plan;
  if (text == nullptr || !dymem::ParseStepPlan(text, &plan, &c->error) ||
      !dymem::ApplyStepPlan(plan, c->graph, &c->error)) {
    if (text == nullptr) c->error = "null plan";
    return -1;
  }
  c->serialized = dymem::SerializeRewritten(*c->graph, &c->shapes);
  return 0;
}

// The last error of `call` ("" when none).
__attribute__((visibility("default"))) const char* dymem_pass_error(void* call) {
  return static_cast<dymem::PassCall*>(call)->error.c_str();
}

// The call's graph as a serialized GraphDef (after dymem_pass_apply: the rewritten graph); returns its size.
__attribute__((visibility("default"))) int64_t dymem_pass_graph_def(void* call, const char** data) {
  auto* c = static_cast<dymem::PassCall*>(call);
  *data = c->serialized.data();
  return static_cast<int64_t>(c->serialized.size());
}

// Makes the handler's kFail fail the instantiation with this message.
__attribute__((visibility("default"))) void dymem_pass_fail(void* call, const char* message) {
  static_cast<dymem::PassCall*>(call)->fail_message = message != nullptr ? message : "";
}

}  // extern "C"
