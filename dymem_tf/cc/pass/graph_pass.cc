// Dymem's graph pass: runs on the graph TensorFlow will execute, after Grappler, once per function instantiation:
// at POST_REWRITE_FOR_EXEC, or after oneDNN's layout rewrite at POST_PARTITIONING (Python chooses, see Stage). It
// hands the graph to the Python planner through a C function pointer set with ctypes and applies the plan the
// planner returns (step_plan.h). Nothing happens unless Python installed a handler and
// armed the pass (DymemCallback arms it while its train function runs), and only for graphs with gradient ops.
//
// Why after Grappler: the plan is then made for the graph that runs (fused ops, removed identities, rewritten
// AddNs), and the inserted swap ops cannot change what Grappler does, so training stays bit-identical.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "step_plan.h"
#include "tensorflow/core/common_runtime/graph_constructor.h"
#include "tensorflow/core/common_runtime/optimization_registry.h"
#include "tensorflow/core/common_runtime/shape_refiner.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/graph/algorithm.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/graph/graph.h"

namespace dymem {

// The op sets shared with the Python planner (op_sets.h).
#define DYMEM_OP_SET(name, ...) [[maybe_unused]] constexpr absl::string_view name[] = {__VA_ARGS__};
#include "../op_sets.h"
#undef DYMEM_OP_SET

namespace {

// The Python side: called with the call's state, the function's name and its serialized GraphDef; returns
// kContinue (run the graph as it now is) or kFail (fail the instantiation with the message set by
// dymem_pass_fail, used by the dry run to capture a graph without running it).
using Handler = int (*)(void* call, const char* function_name, const char* graph_def, size_t size);
constexpr int kContinue = 0;
constexpr int kFail = 1;

// Where the pass acts; Python chooses one (dymem_pass_set_stage), the others let the graph through.
//  - kAfterXla: POST_REWRITE_FOR_EXEC after XLA's clustering passes (phases 3-60), the default;
//  - kBeforeXla: before them, for a step to be auto-clustered around its swap ops;
//  - kAfterPartitioning: POST_PARTITIONING after oneDNN's layout rewrite (phases 0-2), on each partition that
//    holds gradient ops: with oneDNN on, the graph that runs is the one rewritten there.
enum Stage : int { kAfterXla = 0, kBeforeXla = 1, kAfterPartitioning = 2 };
constexpr int kBeforeXlaPhase = 1;
constexpr int kAfterXlaPhase = 100;
constexpr int kAfterPartitioningPhase = 10;

std::atomic<Handler> g_handler{nullptr};
std::atomic<int> g_armed{0};
std::atomic<int> g_stage{kAfterXla};
std::atomic<int64_t> g_handled{0};
// The batch size the step's unknown input batch dimension stands for (0: none), set by Python while armed.
std::atomic<int64_t> g_batch_hint{0};

// Output types and inferred shapes of one node, flattened: its number of outputs, then per output its dtype, its
// rank (-1 when unknown or not inferred) and that many sizes (-1 for an unknown dimension). The pass hands these
// records to Python beside the GraphDef, one per node in the GraphDef's order (graph_def_view.py decodes them).
using OutputRecord = std::vector<int64_t>;
// Output records by node name, of the graph as handed to Python: the rewritten graph's nodes reuse them.
using ShapeAnnotations = std::unordered_map<std::string, OutputRecord>;

// The buffers a PassCall hands to Python (dymem_pass_buffer).
enum Buffer { kGraph = 0, kOutputs = 1, kChanged = 2, kChangedOutputs = 3, kNumBuffers = 4 };

// State of one handler call, passed to Python as an opaque pointer.
struct PassCall {
  tensorflow::Graph* graph = nullptr;
  // The stage whose pass offered the graph.
  int stage = 0;
  // kGraph: the offered GraphDef; kOutputs: its output records; after dymem_pass_apply, kChanged: a GraphDef of
  // the nodes the plan added and, by name and inputs only, those whose inputs it changed; kChangedOutputs: the
  // output records of the added nodes, in that GraphDef's order.
  std::string buffers[kNumBuffers];
  ShapeAnnotations shapes;
  // Node ids below this were in the offered graph (TF never reuses an id); the nodes every successful
  // dymem_pass_apply of this call added or rewired, each once, in that order.
  int offered_ids = 0;
  std::vector<const tensorflow::Node*> changed;
  std::unordered_set<const tensorflow::Node*> changed_set;
  std::string error;
  std::string fail_message;
};

// Whether the graph holds a GradientTape's gradient ops (a train step), the only graphs Dymem plans.
bool HasGradientOps(const tensorflow::Graph& graph) {
  for (const tensorflow::Node* n : graph.op_nodes()) {
    for (absl::string_view scope : kGradientScopes) {
      if (absl::StrContains(n->name(), scope)) return true;
    }
  }
  return false;
}

// The output record of `n` (see OutputRecord), its shapes from `c` (null: none inferred).
OutputRecord RecordOf(const tensorflow::Node* n, tensorflow::shape_inference::InferenceContext* c) {
  OutputRecord record{n->num_outputs()};
  for (int i = 0; i < n->num_outputs(); ++i) {
    record.push_back(n->output_type(i));
    if (c == nullptr || i >= c->num_outputs() || !c->RankKnown(c->output(i))) {
      record.push_back(-1);
      continue;
    }
    record.push_back(c->Rank(c->output(i)));
    for (int d = 0; d < c->Rank(c->output(i)); ++d) record.push_back(c->Value(c->Dim(c->output(i), d)));
  }
  return record;
}

// Appends `record` to `buffer` as native 64-bit integers.
void AppendRecord(const OutputRecord& record, std::string* buffer) {
  buffer->append(reinterpret_cast<const char*>(record.data()), record.size() * sizeof(int64_t));
}

// Whether `n` is one of the step's input ops (kStepInputTypes).
bool IsStepInput(const tensorflow::Node* n) {
  for (absl::string_view type : kStepInputTypes) {
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

// Whether `e` is not a while loop's back edge (out of a NextIteration, as TF lowers a While). Without those edges
// the graph is acyclic, so its reverse post-order infers every node after all its forward inputs. With them, the
// order inside a loop depends on which consumer a depth-first search takes first, and a node with many consumers
// keeps them in a set hashed by address: a node inside the loop could be inferred before one of its inputs, its
// shape and those computed from it left unknown, in some processes only.
bool IsForwardEdge(const tensorflow::Edge& e) { return !e.src()->IsNextIteration(); }

// The output record of every op node of `graph`, by name, with shapes inferred by the runtime's own op registry
// (Python's may lack the kernels' dtypes, e.g. bfloat16 fusions). With `batch` > 0 the step's input batch dimension
// is taken to be `batch` (see RefineBatch). A Merge sees its back edge's input as unknown, as TF's ShapeRefiner does.
// A call TF did not inline (a jit_compile function on the CPU) gets its outputs' shapes from its body in `library`
// (null: the graph's own).
ShapeAnnotations InferOutputs(const tensorflow::Graph& graph, int64_t batch,
                              const tensorflow::FunctionLibraryDefinition* library = nullptr) {
  ShapeAnnotations records;
  tensorflow::ShapeRefiner refiner(graph.versions(), graph.op_registry());
  refiner.set_function_library_for_shape_inference(library != nullptr ? library : &graph.flib_def());
  std::vector<tensorflow::Node*> order;
  tensorflow::GetReversePostOrder(graph, &order, /*stable_comparator=*/{}, IsForwardEdge);
  for (tensorflow::Node* n : order) {
    if (!n->IsOp()) continue;
    if (!refiner.AddNode(n).ok()) {
      records[n->name()] = RecordOf(n, nullptr);
      continue;
    }
    if (batch > 0 && IsStepInput(n)) RefineBatch(&refiner, n, batch);
    records[n->name()] = RecordOf(n, refiner.GetContext(n));
  }
  return records;
}

// Appends the record of each node of `def`, in its order, to `outputs` (a node `shapes` lacks: no outputs).
void AppendRecords(const tensorflow::GraphDef& def, const ShapeAnnotations& shapes, std::string* outputs) {
  for (const tensorflow::NodeDef& nd : def.node()) {
    auto it = shapes.find(nd.name());
    AppendRecord(it != shapes.end() ? it->second : OutputRecord{0}, outputs);
  }
}

// Serializes `graph` into the call's kGraph buffer and its output records (InferOutputs with `library`) into kOutputs.
void Serialize(const tensorflow::Graph& graph, const tensorflow::FunctionLibraryDefinition* library, PassCall* call) {
  tensorflow::GraphDef def;
  graph.ToGraphDef(&def, /*include_flib_def=*/false);
  call->shapes = InferOutputs(graph, g_batch_hint.load(), library);
  call->offered_ids = graph.num_node_ids();
  AppendRecords(def, call->shapes, &call->buffers[kOutputs]);
  call->buffers[kGraph] = def.SerializeAsString();
}

// The output records the pass would offer for the serialized GraphDef of `size` bytes at `bytes` (InferOutputs
// with `batch`), into `outputs`; false with `error` set when it is not a valid graph.
bool InferGraphDefOutputs(const char* bytes, size_t size, int64_t batch, std::string* outputs, std::string* error) {
  tensorflow::GraphDef def;
  const bool fits = size <= static_cast<size_t>(std::numeric_limits<int>::max());  // protobuf's size is an int
  if (!fits || !def.ParseFromArray(bytes, static_cast<int>(size))) {
    *error = "not a serialized GraphDef";
    return false;
  }
  tensorflow::Graph graph(tensorflow::OpRegistry::Global());
  absl::Status status = tensorflow::ConvertGraphDefToGraph(tensorflow::GraphConstructorOptions(), def, &graph);
  if (!status.ok()) {
    *error = std::string(status.message());
    return false;
  }
  AppendRecords(def, InferOutputs(graph, batch), outputs);
  return true;
}

// Output `port` of `record` as a one-output record (false when the record has no such output).
bool OutputOf(const OutputRecord& record, int port, OutputRecord* out) {
  size_t at = 1;
  for (int i = 0; i < record[0] && at + 1 < record.size(); ++i) {
    const size_t size = 2 + static_cast<size_t>(std::max<int64_t>(record[at + 1], 0));
    if (i == port) {
      out->assign({1});
      out->insert(out->end(), record.begin() + at, record.begin() + at + size);
      return true;
    }
    at += size;
  }
  return false;
}

// The output record of a node the plan added: a swap op's output is shaped like its data input, a copy's (named
// "<op>/dymem_...") like the op it copies; other nodes (a partial swap's, whose outputs hold some of the rows)
// get their types with unknown shapes.
OutputRecord AddedRecord(const tensorflow::Node* n, const ShapeAnnotations& known) {
  OutputRecord record;
  const tensorflow::Edge* in = nullptr;
  if ((n->type_string() == "DymemSwapOut" || n->type_string() == "DymemSwapIn") && n->input_edge(0, &in).ok()) {
    auto it = known.find(in->src()->name());
    if (it != known.end() && OutputOf(it->second, in->src_output(), &record)) return record;
  }
  const size_t cut = n->name().rfind("/dymem_");
  auto it = cut == std::string::npos ? known.end() : known.find(n->name().substr(0, cut));
  if (it != known.end() && it->second[0] == n->num_outputs()) return it->second;
  return RecordOf(n, nullptr);
}

// Sets `def`'s inputs to `n`'s as Graph::ToGraphDef writes them: data inputs in order, then control inputs by name.
void SetInputs(const tensorflow::Node* n, tensorflow::NodeDef* def) {
  std::vector<const tensorflow::Edge*> data(n->num_inputs(), nullptr);
  std::vector<std::string> control;
  for (const tensorflow::Edge* e : n->in_edges()) {
    if (!e->IsControlEdge()) {
      data[e->dst_input()] = e;
    } else if (!e->src()->IsSource()) {
      control.push_back(absl::StrCat("^", e->src()->name()));
    }
  }
  def->clear_input();
  for (const tensorflow::Edge* e : data) {
    if (e == nullptr) continue;
    def->add_input(e->src_output() == 0 ? e->src()->name() : absl::StrCat(e->src()->name(), ":", e->src_output()));
  }
  std::sort(control.begin(), control.end());
  for (std::string& c : control) def->add_input(std::move(c));
}

// What the call's plans changed so far (`changed` adds the last one's nodes), into the call's kChanged and
// kChangedOutputs buffers (see PassCall): a fraction of the whole graph's serialization, which the pass would
// otherwise pay on every instantiation.
void SerializeChanged(const std::vector<tensorflow::Node*>& changed, PassCall* call) {
  for (const tensorflow::Node* n : changed) {
    if (call->changed_set.insert(n).second) call->changed.push_back(n);
  }
  tensorflow::GraphDef def;
  std::string& outputs = call->buffers[kChangedOutputs];
  outputs.clear();
  for (const tensorflow::Node* n : call->changed) {
    tensorflow::NodeDef* nd = def.add_node();
    if (n->id() < call->offered_ids) {
      nd->set_name(n->name());
    } else {
      *nd = n->def();
      if (!n->assigned_device_name().empty()) nd->set_device(n->assigned_device_name());
      auto it = call->shapes.find(n->name());
      if (it == call->shapes.end()) it = call->shapes.emplace(n->name(), AddedRecord(n, call->shapes)).first;
      AppendRecord(it->second, &outputs);
    }
    SetInputs(n, nd);
  }
  call->buffers[kChanged] = def.SerializeAsString();
}

// Offers `graph` of function `name`, at `stage`, to the Python planner; a planner failure leaves the graph as it was, a kFail
// fails the instantiation.
absl::Status Offer(Handler handler, Stage stage, const std::string& name, tensorflow::Graph* graph,
                   const tensorflow::FunctionLibraryDefinition* library) {
  if (!HasGradientOps(*graph)) return absl::OkStatus();
  PassCall call;
  call.graph = graph;
  call.stage = stage;
  Serialize(*graph, library, &call);
  g_handled.fetch_add(1);
  const std::string& def = call.buffers[kGraph];
  if (handler(&call, name.c_str(), def.data(), def.size()) == kFail) {
    return absl::CancelledError(absl::StrCat("dymem_tf: ", call.fail_message));
  }
  return absl::OkStatus();
}

// The handler when the pass is armed for `stage`, else null.
Handler ArmedFor(Stage stage) {
  if (g_armed.load() <= 0 || g_stage.load() != stage) return nullptr;
  return g_handler.load();
}

// The pass at POST_REWRITE_FOR_EXEC: the whole function graph, named by its FunctionDef.
template <Stage kStage>
class DymemStepPass : public tensorflow::GraphOptimizationPass {
 public:
  absl::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    Handler handler = ArmedFor(kStage);
    if (handler == nullptr || options.graph == nullptr || *options.graph == nullptr) return absl::OkStatus();
    const std::string name = options.function_def != nullptr ? options.function_def->signature().name() : "";
    return Offer(handler, kStage, name, options.graph->get(), options.flib_def);
  }
};

// The pass at POST_PARTITIONING: each device's partition, named by the function (TF passes it as the debug prefix).
class DymemPartitionPass : public tensorflow::GraphOptimizationPass {
 public:
  absl::Status Run(const tensorflow::GraphOptimizationPassOptions& options) override {
    Handler handler = ArmedFor(kAfterPartitioning);
    if (handler == nullptr || options.partition_graphs == nullptr) return absl::OkStatus();
    for (auto& partition : *options.partition_graphs) {
      if (partition.second == nullptr) continue;
      const std::string& name = options.debug_filename_prefix;
      absl::Status status = Offer(handler, kAfterPartitioning, name, partition.second.get(), options.flib_def);
      if (!status.ok()) return status;
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
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, dymem::kAfterXlaPhase,
                      dymem::DymemStepPassAfterXla);
// Before them, for a step auto-clustered around its swap ops (DymemCallback(xla="auto")): the swap ops have no XLA
// kernel, so MarkForCompilationPass leaves them out, and a cluster cannot hold both ends of a swap (that would
// close a cycle through the swap ops): clusters form between them and every swapped tensor is a cluster output.
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_REWRITE_FOR_EXEC, dymem::kBeforeXlaPhase,
                      dymem::DymemStepPassBeforeXla);
// After oneDNN's MklLayoutRewritePass (phase 1) and MklToTfConversionPass (phase 2): with oneDNN on, the swap ops
// are inserted into the graph as oneDNN left it, so they cannot keep it from fusing a pair the plain step fuses.
REGISTER_OPTIMIZATION(tensorflow::OptimizationPassRegistry::POST_PARTITIONING, dymem::kAfterPartitioningPhase,
                      dymem::DymemPartitionPass);

extern "C" {

// Installs the Python handler (null removes it).
__attribute__((visibility("default"))) void dymem_pass_set_handler(dymem::Handler handler) {
  dymem::g_handler.store(handler);
}

// Arms (+1) or disarms (-1) the pass; it offers graphs to the handler while the count is positive.
__attribute__((visibility("default"))) int dymem_pass_arm(int delta) { return dymem::g_armed.fetch_add(delta) + delta; }

// Makes the pass act at `stage` (dymem::Stage: 0 after XLA's clustering passes, the default; 1 before them; 2 after
// partitioning); returns the previous stage, or -1 (nothing changed) for an unknown one.
__attribute__((visibility("default"))) int dymem_pass_set_stage(int stage) {
  if (stage < dymem::kAfterXla || stage > dymem::kAfterPartitioning) return -1;
  return dymem::g_stage.exchange(stage);
}

// Sets the batch size the step's unknown input batch dimension stands for in the shapes offered (0: none); returns
// the previous one.
__attribute__((visibility("default"))) int64_t dymem_pass_set_batch_hint(int64_t batch) {
  return dymem::g_batch_hint.exchange(batch > 0 ? batch : 0);
}

// The op types whose outputs' unknown batch dimension the batch hint fills, comma-separated.
__attribute__((visibility("default"))) const char* dymem_pass_step_input_types(void) {
  static const std::string* joined = new std::string(absl::StrJoin(dymem::kStepInputTypes, ","));
  return joined->c_str();
}

// The output records (as in the kOutputs buffer) of the serialized GraphDef `def` of `size` bytes, with `batch`
// as the batch hint (0: none): returns their size with `*data` pointing at them, or -1 with `*data` pointing at
// the error. Valid until this thread's next call. For inspecting and testing the shapes the pass offers.
__attribute__((visibility("default"))) int64_t dymem_pass_infer_outputs(const char* def, size_t size, int64_t batch,
                                                                        const char** data) {
  thread_local std::string result;
  result.clear();
  std::string error;
  if (!dymem::InferGraphDefOutputs(def, size, batch, &result, &error)) {
    result = error;
    *data = result.c_str();
    return -1;
  }
  *data = result.data();
  return static_cast<int64_t>(result.size());
}

// Parses the plan message `text` (step_plan.h) without applying it: returns 0 with `*data` pointing at what the
// parser read (DescribeStepPlan), or -1 with `*data` pointing at its error. Valid until this thread's next call.
// For inspecting and testing the parser.
__attribute__((visibility("default"))) int dymem_pass_parse_plan(const char* text, const char** data) {
  thread_local std::string result;
  dymem::StepPlan plan;
  result.clear();
  if (text == nullptr) {
    result = "null plan";
  } else if (dymem::ParseStepPlan(text, &plan, &result)) {
    result = dymem::DescribeStepPlan(plan);
    *data = result.c_str();
    return 0;
  }
  *data = result.c_str();
  return -1;
}

// How many graphs were offered to the handler since the library was loaded.
__attribute__((visibility("default"))) int64_t dymem_pass_handled(void) { return dymem::g_handled.load(); }

// Applies a plan (step_plan.h text form) to the graph of `call`: 0 on success, -1 with dymem_pass_error set and
// the graph unchanged otherwise. On success the call's kChanged buffers hold what the plan changed.
__attribute__((visibility("default"))) int dymem_pass_apply(void* call, const char* text) {
  auto* c = static_cast<dymem::PassCall*>(call);
  dymem::StepPlan plan;
  std::vector<tensorflow::Node*> changed;
  if (text == nullptr || !dymem::ParseStepPlan(text, &plan, &c->error) ||
      !dymem::ApplyStepPlan(plan, c->graph, &c->error, &changed)) {
    if (text == nullptr) c->error = "null plan";
    return -1;
  }
  dymem::SerializeChanged(changed, c);
  return 0;
}

// The stage (dymem::Stage) whose pass offered `call`'s graph.
__attribute__((visibility("default"))) int dymem_pass_call_stage(void* call) {
  return static_cast<dymem::PassCall*>(call)->stage;
}

// The last error of `call` ("" when none).
__attribute__((visibility("default"))) const char* dymem_pass_error(void* call) {
  return static_cast<dymem::PassCall*>(call)->error.c_str();
}

// One of the call's buffers (PassCall: 0 the offered GraphDef, 1 its output records, 2 and 3 what the last
// dymem_pass_apply changed); returns its size, or -1 for an unknown buffer.
__attribute__((visibility("default"))) int64_t dymem_pass_buffer(void* call, int which, const char** data) {
  if (which < 0 || which >= dymem::kNumBuffers) return -1;
  const std::string& buffer = static_cast<dymem::PassCall*>(call)->buffers[which];
  *data = buffer.data();
  return static_cast<int64_t>(buffer.size());
}

// Makes the handler's kFail fail the instantiation with this message.
__attribute__((visibility("default"))) void dymem_pass_fail(void* call, const char* message) {
  static_cast<dymem::PassCall*>(call)->fail_message = message != nullptr ? message : "";
}

}  // extern "C"
