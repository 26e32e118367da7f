// Parser and applier of a swap plan (step_plan.h). The parser reads each record's fields by name: its parsers name
// them as plan_schema.h does (checked at compile time), and a message's header says which column holds each (checked
// against plan_schema.h when read). The applier follows Grappler's memory_optimizer.cc: check everything first,
// change the graph only when the whole plan fits it, and undo every change on a late failure.

#include "step_plan.h"

#include <algorithm>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_def.pb.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/graph/node_builder.h"

namespace dymem {
namespace {

using tensorflow::Edge;
using tensorflow::Graph;
using tensorflow::Node;

using NodeIndex = std::unordered_map<std::string, Node*>;

// One rerouted data input: `consumer`'s input `index` read `src:port` before the plan.
struct Reroute {
  Node* consumer;
  int index;
  Node* src;
  int port;
};

// What ApplyStepPlan changed, so that a late failure can put the graph back.
struct UndoLog {
  std::vector<Node*> added_nodes;
  std::vector<const Edge*> added_control_edges;
  std::vector<Reroute> reroutes;
};

std::vector<int> InputsReading(const Node* consumer, const Node* src, int port);

// ---------------------------------------------------------------------------------------------------- the message
// plan_schema.h as a constexpr table, each record kind's fields looked up by name: in the parsers at compile time
// (Field), in a message's header at run time (Columns).

#define DYMEM_PLAN_RECORD(kind, ...)
#define DYMEM_PLAN_VERSION(v) constexpr int kPlanVersion = v;
#include "plan_schema.h"
#undef DYMEM_PLAN_VERSION
#undef DYMEM_PLAN_RECORD

constexpr const char* kHeader = "dymem-plan";
constexpr int kMaxFields = 8;

// One record kind of plan_schema.h: its name and its fields' names in the order listed there (the rest empty).
struct KindSchema {
  std::string_view kind;
  std::string_view fields[kMaxFields];
};

constexpr KindSchema kSchema[] = {
#define DYMEM_PLAN_VERSION(v)
#define DYMEM_PLAN_RECORD(kind, ...) {#kind, {__VA_ARGS__}},
#include "plan_schema.h"
#undef DYMEM_PLAN_RECORD
#undef DYMEM_PLAN_VERSION
};
constexpr int kNumKinds = static_cast<int>(std::size(kSchema));

// How many fields kind `kind` has.
constexpr int NumFields(int kind) {
  int n = 0;
  while (n < kMaxFields && !kSchema[kind].fields[n].empty()) ++n;
  return n;
}

// The position of record kind `name` in kSchema, or -1.
constexpr int KindIndex(std::string_view name) {
  for (int k = 0; k < kNumKinds; ++k) {
    if (kSchema[k].kind == name) return k;
  }
  return -1;
}

// The position of field `name` among kind `kind`'s fields, or -1.
constexpr int FieldIndex(int kind, std::string_view name) {
  for (int i = 0; i < NumFields(kind); ++i) {
    if (kSchema[kind].fields[i] == name) return i;
  }
  return -1;
}

// Whether every kind has fields, and no kind or field of a kind is listed twice (a name must say one column).
constexpr bool SchemaIsUnambiguous() {
  for (int k = 0; k < kNumKinds; ++k) {
    if (NumFields(k) == 0 || KindIndex(kSchema[k].kind) != k) return false;
    for (int i = 0; i < NumFields(k); ++i) {
      if (FieldIndex(k, kSchema[k].fields[i]) != i) return false;
    }
  }
  return true;
}
static_assert(SchemaIsUnambiguous(), "plan_schema.h lists a kind without fields, or a kind or a field twice");

// A field of one record kind, by name, resolved to its kind's position and its own in plan_schema.h. Define it
// constexpr: a kind or field plan_schema.h lacks then does not compile (the throw is no constant expression).
struct Field {
  constexpr Field(std::string_view kind_name, std::string_view name)
      : kind(KindIndex(kind_name)), index(kind < 0 ? -1 : FieldIndex(kind, name)) {
    if (index < 0) throw std::invalid_argument("plan_schema.h has no such record kind or field");
  }
  int kind;
  int index;
};

// Where a message's records hold each kind's fields, from its header: columns[kind][field] is the record column
// (after the kind) of that kind's field `field`; empty for a kind the header does not declare.
using Columns = std::vector<std::vector<int>>;

// One record line as its message's header lays it out.
class Record {
 public:
  Record(int kind, const std::vector<std::string>& line, const std::vector<int>& columns)
      : kind_(kind), line_(line), columns_(columns) {}

  // The record's kind.
  std::string_view kind() const { return kSchema[kind_].kind; }
  // The value of field `f` (a field of another kind reads as empty, which no parser accepts where it matters).
  const std::string& operator[](Field f) const {
    static const std::string* const kNone = new std::string();
    return f.kind == kind_ ? line_[columns_[f.index] + 1] : *kNone;
  }

 private:
  int kind_;
  const std::vector<std::string>& line_;
  const std::vector<int>& columns_;
};

// Splits one line into tab-separated fields (empty fields kept).
std::vector<std::string> Fields(const std::string& line) { return absl::StrSplit(line, '\t'); }

// `text` as a port or index (a non-negative integer) into `value`; false otherwise.
bool ParseIndex(const std::string& text, int* value) { return absl::SimpleAtoi(text, value) && *value >= 0; }

// `text`, a comma-separated list, as its non-empty items.
std::vector<std::string> List(const std::string& text) { return absl::StrSplit(text, ',', absl::SkipEmpty()); }

// Parses one `out` record; false on a malformed one.
bool ParseOut(const Record& r, StepPlan* plan) {
  constexpr Field kProducer("out", "producer"), kPort("out", "port"), kSwapOut("out", "swap_out"),
      kKeepRows("out", "keep_rows");
  int port = 0;
  int64_t keep_rows = 0;
  if (r[kProducer].empty() || r[kSwapOut].empty() || !ParseIndex(r[kPort], &port)) return false;
  if (!absl::SimpleAtoi(r[kKeepRows], &keep_rows) || keep_rows < 0) return false;
  plan->swap_outs.push_back({r[kProducer], port, r[kSwapOut], keep_rows});
  return true;
}

// Parses one `in` record (no direct consumers: it feeds only copies of alias ops); false on a malformed one.
bool ParseIn(const Record& r, StepPlan* plan) {
  constexpr Field kSwapOut("in", "swap_out"), kSwapIn("in", "swap_in"), kTrigger("in", "trigger"),
      kConsumers("in", "consumers");
  if (r[kSwapOut].empty() || r[kSwapIn].empty()) return false;
  plan->swap_ins.push_back({r[kSwapOut], r[kSwapIn], r[kTrigger], List(r[kConsumers])});
  return true;
}

// Parses one `ctrl` record; false on a malformed one.
bool ParseCtrl(const Record& r, StepPlan* plan) {
  constexpr Field kSrc("ctrl", "src"), kDst("ctrl", "dst");
  if (r[kSrc].empty() || r[kDst].empty()) return false;
  plan->control_edges.push_back({r[kSrc], r[kDst]});
  return true;
}

// Parses one `seq` record; false on a malformed one.
bool ParseSeq(const Record& r, StepPlan* plan) {
  constexpr Field kChain("seq", "chain"), kNode("seq", "node"), kBand("seq", "band");
  constexpr int kMaxChains = 1 << 16;
  int chain = 0, band = 0;
  if (r[kNode].empty() || !ParseIndex(r[kChain], &chain) || chain >= kMaxChains || !ParseIndex(r[kBand], &band)) {
    return false;
  }
  if (plan->sequences.size() <= static_cast<size_t>(chain)) {
    plan->sequences.resize(chain + 1);
    plan->bands.resize(chain + 1);
  }
  if (!plan->bands[chain].empty() && band < plan->bands[chain].back()) return false;  // bands never go back
  plan->sequences[chain].push_back(r[kNode]);
  plan->bands[chain].push_back(band);
  return true;
}

// Parses one `seqadded` record; false on a malformed one.
bool ParseSeqAdded(const Record& r, StepPlan* plan) {
  constexpr Field kChain("seqadded", "chain");
  int chain = 0;
  if (!ParseIndex(r[kChain], &chain)) return false;
  plan->chains_with_added.push_back(chain);
  return true;
}

// Parses one `var` record; false on a malformed one.
bool ParseVar(const Record& r, StepPlan* plan) {
  constexpr Field kResource("var", "resource"), kPort("var", "port"), kEvict("var", "evict"),
      kSwapIn("var", "swap_in"), kSwapOut("var", "swap_out"), kTrigger("var", "trigger"),
      kConsumers("var", "consumers");
  int port = 0;
  if (r[kResource].empty() || r[kEvict].empty() || r[kSwapIn].empty() || r[kSwapOut].empty() ||
      r[kConsumers].empty() || !ParseIndex(r[kPort], &port)) {
    return false;
  }
  plan->variables.push_back(
      {r[kResource], port, r[kEvict], r[kSwapIn], r[kSwapOut], r[kTrigger], List(r[kConsumers])});
  return true;
}

// The fields of a `vin`, `vkeep`, `vout` or `vread` record; `last` is keep_host, keep_host, discard or like.
struct VariableOpFields {
  Field resource, port, name, last;
};

// The fields of variable op record kind `kind`, whose own last field is called `last`.
constexpr VariableOpFields VariableOpFieldsOf(std::string_view kind, std::string_view last) {
  return {Field(kind, "resource"), Field(kind, "port"), Field(kind, "name"), Field(kind, last)};
}

// Parses one `vin`, `vkeep`, `vout` or `vread` record with fields `f`; false on a malformed one.
bool ParseVariableOp(const Record& r, const VariableOpFields& f, StepPlan* plan) {
  NodeEditRecord edit;
  VariableOpRecord& v = edit.variable_op;
  if (r[f.resource].empty() || r[f.name].empty() || r[f.last].empty() || !ParseIndex(r[f.port], &v.port)) {
    return false;
  }
  edit.kind = v.kind = std::string(r.kind());
  v.resource = r[f.resource];
  v.name = r[f.name];
  if (v.kind == "vread") {
    v.like = r[f.last];
  } else if (r[f.last] == "0" || r[f.last] == "1") {
    v.flag = r[f.last] == "1";
  } else {
    return false;
  }
  plan->edits.push_back(std::move(edit));
  return true;
}

// Parses one `vin` record; false on a malformed one.
bool ParseVin(const Record& r, StepPlan* plan) {
  static constexpr VariableOpFields kFields = VariableOpFieldsOf("vin", "keep_host");
  return ParseVariableOp(r, kFields, plan);
}

// Parses one `vkeep` record; false on a malformed one.
bool ParseVkeep(const Record& r, StepPlan* plan) {
  static constexpr VariableOpFields kFields = VariableOpFieldsOf("vkeep", "keep_host");
  return ParseVariableOp(r, kFields, plan);
}

// Parses one `vout` record; false on a malformed one.
bool ParseVout(const Record& r, StepPlan* plan) {
  static constexpr VariableOpFields kFields = VariableOpFieldsOf("vout", "discard");
  return ParseVariableOp(r, kFields, plan);
}

// Parses one `vread` record; false on a malformed one.
bool ParseVread(const Record& r, StepPlan* plan) {
  static constexpr VariableOpFields kFields = VariableOpFieldsOf("vread", "like");
  return ParseVariableOp(r, kFields, plan);
}

// Parses one `clone` record; false on a malformed one.
bool ParseClone(const Record& r, StepPlan* plan) {
  constexpr Field kNode("clone", "node"), kName("clone", "name"), kInputs("clone", "inputs");
  if (r[kNode].empty() || r[kName].empty()) return false;
  NodeEditRecord edit;
  edit.kind = "clone";
  edit.clone.node = r[kNode];
  edit.clone.name = r[kName];
  for (const std::string& pair : List(r[kInputs])) {
    const size_t colon = pair.find(':');
    int k = 0;
    if (colon == std::string::npos || colon + 1 == pair.size() || !ParseIndex(pair.substr(0, colon), &k)) {
      return false;
    }
    edit.clone.inputs.emplace_back(k, pair.substr(colon + 1));
  }
  plan->edits.push_back(std::move(edit));
  return true;
}

// Parses one `reroute` record; false on a malformed one.
bool ParseReroute(const Record& r, StepPlan* plan) {
  constexpr Field kConsumer("reroute", "consumer"), kSource("reroute", "source"), kPort("reroute", "port"),
      kTarget("reroute", "target");
  NodeEditRecord edit;
  RerouteRecord& e = edit.reroute;
  if (r[kConsumer].empty() || r[kSource].empty() || r[kTarget].empty() || !ParseIndex(r[kPort], &e.port)) {
    return false;
  }
  edit.kind = "reroute";
  e.consumer = r[kConsumer];
  e.source = r[kSource];
  e.target = r[kTarget];
  plan->edits.push_back(std::move(edit));
  return true;
}

// The parser of each record kind.
using Parser = bool (*)(const Record&, StepPlan*);
struct KindParser {
  std::string_view kind;
  Parser parse;
};
constexpr KindParser kParsers[] = {
    {"out", ParseOut},     {"in", ParseIn},     {"ctrl", ParseCtrl},   {"var", ParseVar},
    {"vin", ParseVin},     {"vkeep", ParseVkeep}, {"vout", ParseVout}, {"vread", ParseVread},
    {"clone", ParseClone}, {"reroute", ParseReroute}, {"seq", ParseSeq}, {"seqadded", ParseSeqAdded},
};

// The parser of kind `kind` (a position in kSchema), or null.
constexpr Parser ParserOf(int kind) {
  for (const KindParser& p : kParsers) {
    if (p.kind == kSchema[kind].kind) return p.parse;
  }
  return nullptr;
}

// Whether every kind of plan_schema.h has a parser, and every parser a kind.
constexpr bool ParsesEveryKind() {
  for (int k = 0; k < kNumKinds; ++k) {
    if (ParserOf(k) == nullptr) return false;
  }
  return std::size(kParsers) == static_cast<size_t>(kNumKinds);
}
static_assert(ParsesEveryKind(), "every record kind of plan_schema.h needs its parser in kParsers, and no other");

// What to do about a message that does not fit this library's schema.
constexpr const char* kOtherBuild = "the Python package and its native library come from different builds";

// Kind `kind`'s fields, comma-separated, in plan_schema.h's order.
std::string FieldList(int kind) {
  return absl::StrJoin(kSchema[kind].fields, kSchema[kind].fields + NumFields(kind), ", ");
}

// Whether `f` is a header line of the version this library reads; false with `error` saying what it is otherwise.
bool CheckVersion(const std::vector<std::string>& f, std::string* error) {
  int version = 0;
  if (f.size() < 2 || f[0] != kHeader || !absl::SimpleAtoi(f[1], &version)) {
    *error = absl::StrCat("the plan message does not start with its version line (", kHeader, " ", kPlanVersion,
                          ")");
    return false;
  }
  if (version == kPlanVersion) return true;
  *error = absl::StrCat("the plan message is version ", version, " and this graph pass reads version ",
                        kPlanVersion, ": ", kOtherBuild);
  return false;
}

// The column of each of kind `kind`'s fields among `names` (its declaration in a header) into `columns`; false
// with `error` naming the kind and the field when a name is not one of its fields, is repeated, or is missing.
bool MapColumns(int kind, const std::vector<std::string>& names, std::vector<int>* columns, std::string* error) {
  const std::string_view kind_name = kSchema[kind].kind;
  const std::string reads = absl::StrCat(" (this graph pass reads ", FieldList(kind), "): ", kOtherBuild);
  std::vector<int> column(NumFields(kind), -1);
  for (size_t c = 0; c < names.size(); ++c) {
    const int field = FieldIndex(kind, names[c]);
    if (field < 0) {
      *error = absl::StrCat("the plan message's '", kind_name, "' records have the unknown field '", names[c], "'",
                            reads);
      return false;
    }
    if (column[field] >= 0) {
      *error = absl::StrCat("the plan message's header declares the field '", names[c], "' of '", kind_name,
                            "' records twice");
      return false;
    }
    column[field] = static_cast<int>(c);
  }
  for (int field = 0; field < NumFields(kind); ++field) {
    if (column[field] >= 0) continue;
    *error = absl::StrCat("the plan message's '", kind_name, "' records lack the field '",
                          kSchema[kind].fields[field], "'", reads);
    return false;
  }
  *columns = std::move(column);
  return true;
}

// The header's column declarations (`kind:field,...` after the version) into `columns`; false with `error`
// naming the kind (and field) when one is malformed, repeated, of a kind or with fields plan_schema.h lacks.
bool ReadColumns(const std::vector<std::string>& header, Columns* columns, std::string* error) {
  columns->assign(kNumKinds, {});
  for (size_t i = 2; i < header.size(); ++i) {
    const size_t colon = header[i].find(':');
    const int kind = KindIndex(std::string_view(header[i]).substr(0, colon));
    if (colon == std::string::npos || kind < 0 || !(*columns)[kind].empty()) {
      const std::string_view what = colon == std::string::npos ? "the malformed column declaration '"
                                    : kind < 0                 ? "the unknown record kind '"
                                                               : "twice the columns of '";
      *error = absl::StrCat("the plan message's header declares ", what, header[i].substr(0, colon),
                            "' (this graph pass reads ",
                            absl::StrJoin(kSchema, kSchema + kNumKinds, ", ",
                                          [](std::string* out, const KindSchema& s) { out->append(s.kind); }),
                            "): ", kOtherBuild);
      return false;
    }
    const std::vector<std::string> names = absl::StrSplit(header[i].substr(colon + 1), ',');
    if (!MapColumns(kind, names, &(*columns)[kind], error)) return false;
  }
  return true;
}

// The kind of record `f` (a line after the header), a kind `columns` declares with as many fields as `f` has;
// -1 with `error` naming the line and the kind otherwise.
int CheckRecord(const std::vector<std::string>& f, const Columns& columns, int lineno, std::string* error) {
  const int kind = KindIndex(f[0]);
  if (kind < 0) {
    *error = absl::StrCat("plan line ", lineno, " has the unknown record kind '", f[0], "'");
    return -1;
  }
  const std::vector<int>& column = columns[kind];
  if (column.empty()) {
    *error = absl::StrCat("plan line ", lineno, " is a '", f[0], "' record, a kind the message's header does not ",
                          "declare the columns of");
    return -1;
  }
  if (f.size() == column.size() + 1) return kind;
  std::vector<std::string_view> declared(column.size());
  for (size_t field = 0; field < column.size(); ++field) declared[column[field]] = kSchema[kind].fields[field];
  *error = absl::StrCat("plan line ", lineno, ": a '", f[0], "' record has ", column.size(), " fields (",
                        absl::StrJoin(declared, ", "), "), not ", f.size() - 1);
  return -1;
}

// The node called `name`, or null (with `error` set).
Node* Find(const NodeIndex& index, const std::string& name, std::string* error) {
  auto it = index.find(name);
  if (it != index.end()) return it->second;
  *error = absl::StrCat("the plan names node '", name, "', which is not in the graph");
  return nullptr;
}

// The types DymemSwapOut is registered for (its attribute T's allowed values); empty when it is not registered.
const std::unordered_set<int>& SwapOutTypes() {
  static const std::unordered_set<int>* types = [] {
    auto* found = new std::unordered_set<int>;
    const tensorflow::OpDef* def = nullptr;
    if (!tensorflow::OpRegistry::Global()->LookUpOpDef("DymemSwapOut", &def).ok()) return found;
    for (const auto& attr : def->attr()) {
      if (attr.name() == "T") found->insert(attr.allowed_values().list().type().begin(),
                                            attr.allowed_values().list().type().end());
    }
    return found;
  }();
  return *types;
}

// Whether a tensor of this type can be swapped: not a reference, and a type the swap ops take.
bool Swappable(tensorflow::DataType dtype) {
  return !tensorflow::IsRefType(dtype) && SwapOutTypes().count(dtype) > 0;
}

// Checks one `var` record: a resource output, consumers that read it, untaken new names (added to `taken`).
bool ValidateVariable(const VariableRecord& r, const NodeIndex& index, std::unordered_set<std::string>* taken,
                      std::string* error) {
  Node* resource = Find(index, r.resource, error);
  if (resource == nullptr) return false;
  if (r.port >= resource->num_outputs() || resource->output_type(r.port) != tensorflow::DT_RESOURCE) {
    *error = absl::StrCat("output ", r.port, " of '", r.resource, "' is not a resource");
    return false;
  }
  for (const std::string* name : {&r.evict, &r.swap_in, &r.swap_out}) {
    if (index.count(*name) || !taken->insert(*name).second) {
      *error = absl::StrCat("variable swap name '", *name, "' is already taken");
      return false;
    }
  }
  if (!r.trigger.empty() && Find(index, r.trigger, error) == nullptr) return false;
  for (const std::string& c : r.consumers) {
    Node* consumer = Find(index, c, error);
    if (consumer == nullptr) return false;
    if (InputsReading(consumer, resource, r.port).empty()) {
      *error = absl::StrCat("'", c, "' does not read ", r.resource, ":", r.port);
      return false;
    }
  }
  return true;
}

// Whether output `port` of `node` is a resource; false with `error` otherwise.
bool IsResourceOutput(const Node* node, int port, std::string* error) {
  if (port < node->num_outputs() && node->output_type(port) == tensorflow::DT_RESOURCE) return true;
  *error = absl::StrCat("output ", port, " of '", node->name(), "' is not a resource");
  return false;
}

// Checks one `vin`/`vkeep`/`vout`/`vread` record against the graph; false with `error` otherwise.
bool ValidateVariableOp(const VariableOpRecord& r, const NodeIndex& index, std::string* error) {
  Node* resource = Find(index, r.resource, error);
  if (resource == nullptr || !IsResourceOutput(resource, r.port, error)) return false;
  if (r.kind != "vread") return true;
  Node* like = Find(index, r.like, error);
  tensorflow::DataType dtype;
  if (like == nullptr) return false;
  if (!tensorflow::GetNodeAttr(like->attrs(), "dtype", &dtype).ok() || !Swappable(dtype) ||
      !tensorflow::DataTypeCanUseMemcpy(dtype)) {
    *error = absl::StrCat("'", r.like, "' gives no dtype a variable read can take");
    return false;
  }
  return true;
}

// Checks one edit record; `names` holds the graph's and the plan's earlier node names (new names are added).
bool ValidateEdit(const NodeEditRecord& edit, const NodeIndex& index, std::unordered_set<std::string>* names,
                  std::string* error) {
  auto known = [&](const std::string& name) {
    if (names->count(name)) return true;
    *error = absl::StrCat("the plan names node '", name, "', which is neither in the graph nor added before");
    return false;
  };
  auto fresh = [&](const std::string& name) {
    if (names->insert(name).second) return true;
    *error = absl::StrCat("node name '", name, "' is already taken");
    return false;
  };
  if (edit.kind == "clone") {
    Node* node = Find(index, edit.clone.node, error);
    if (node == nullptr) return false;
    for (const auto& input : edit.clone.inputs) {
      if (input.first >= node->num_inputs()) {
        *error = absl::StrCat("'", edit.clone.node, "' has no input ", input.first);
        return false;
      }
      if (!known(input.second)) return false;
    }
    return fresh(edit.clone.name);
  }
  if (edit.kind == "reroute") {
    const RerouteRecord& r = edit.reroute;
    Node* consumer = Find(index, r.consumer, error);
    Node* source = consumer ? Find(index, r.source, error) : nullptr;
    if (source == nullptr || !known(r.target)) return false;
    if (InputsReading(consumer, source, r.port).empty()) {
      *error = absl::StrCat("'", r.consumer, "' does not read ", r.source, ":", r.port);
      return false;
    }
    return true;
  }
  return ValidateVariableOp(edit.variable_op, index, error) && fresh(edit.variable_op.name);
}

// Checks that every name the plan uses exists (and every new name does not); false with `error` otherwise.
bool Validate(const StepPlan& plan, const NodeIndex& index, std::string* error) {
  std::unordered_set<std::string> outs;
  for (const SwapOutRecord& r : plan.swap_outs) {
    Node* producer = Find(index, r.producer, error);
    if (producer == nullptr) return false;
    if (r.port >= producer->num_outputs() || !Swappable(producer->output_type(r.port))) {
      *error = absl::StrCat("output ", r.port, " of '", r.producer, "' does not exist or cannot be swapped");
      return false;
    }
    if (r.keep_rows > 0 && producer->output_type(r.port) == tensorflow::DT_VARIANT) {
      *error = absl::StrCat("output ", r.port, " of '", r.producer, "' is a variant: it cannot be swapped in part");
      return false;
    }
    if (index.count(r.name) || !outs.insert(r.name).second) {
      *error = absl::StrCat("swap-out name '", r.name, "' is already taken");
      return false;
    }
  }
  std::unordered_set<std::string> ins;
  for (const SwapInRecord& r : plan.swap_ins) {
    if (!outs.count(r.swap_out) || index.count(r.name) || outs.count(r.name) || !ins.insert(r.name).second) {
      *error = absl::StrCat("swap-in '", r.name, "' has an unknown swap-out or a taken name");
      return false;
    }
    if (!r.trigger.empty() && Find(index, r.trigger, error) == nullptr) return false;
    for (const std::string& c : r.consumers) {
      if (Find(index, c, error) == nullptr) return false;
    }
  }
  std::unordered_set<std::string> taken(outs);
  taken.insert(ins.begin(), ins.end());
  for (const VariableRecord& r : plan.variables) {
    if (!ValidateVariable(r, index, &taken, error)) return false;
  }
  std::unordered_set<std::string> names(taken);
  for (const auto& entry : index) names.insert(entry.first);
  for (const NodeEditRecord& edit : plan.edits) {
    if (!ValidateEdit(edit, index, &names, error)) return false;
  }
  for (const ControlEdgeRecord& r : plan.control_edges) {
    for (const std::string* name : {&r.from, &r.to}) {
      if (!names.count(*name)) {
        *error = absl::StrCat("the plan names node '", *name, "', which is not in the graph");
        return false;
      }
    }
  }
  for (size_t k = 0; k < plan.sequences.size(); ++k) {
    for (const std::string& name : plan.sequences[k]) {
      if (!index.count(name)) {
        *error = absl::StrCat("the plan's order names node '", name, "', which is not in the graph");
        return false;
      }
    }
    if (!plan.bands[k].empty() && plan.bands[k].back() >= static_cast<int>(plan.bands[k].size())) {
      *error = absl::StrCat("chain ", k, " of the plan's order numbers its bands up to ", plan.bands[k].back(),
                            " for ", plan.bands[k].size(), " nodes: a chain has at most one band per node");
      return false;
    }
  }
  return true;
}

// Finishes `builder`'s swap node named `name` of `type` with type `dtype` on `like`'s device; null with `error`.
Node* FinishSwapNode(tensorflow::NodeBuilder* builder, Graph* graph, const std::string& name, const char* type,
                     Node* like, tensorflow::DataType dtype, std::string* error) {
  Node* node = nullptr;
  absl::Status s = builder->Attr("T", dtype).Device(like->assigned_device_name()).Finalize(graph, &node, true);
  if (!s.ok()) {
    *error = absl::StrCat("could not add ", type, " '", name, "': ", s.message());
    return nullptr;
  }
  node->set_assigned_device_name(like->assigned_device_name());
  return node;
}

// Adds one swap op named `name` of `type` reading `src:port`, placed like `like`; null with `error` on failure.
Node* AddSwapNode(Graph* graph, const std::string& name, const char* type, Node* src, int port, Node* like,
                  tensorflow::DataType dtype, std::string* error) {
  tensorflow::NodeBuilder builder(name, type);
  builder.Input(tensorflow::NodeBuilder::NodeOut(src, port));
  return FinishSwapNode(&builder, graph, name, type, like, dtype, error);
}

// Adds the swap-out of `record` (DymemSwapOutPartial where it keeps rows) reading `producer`; null with `error`.
Node* AddSwapOut(Graph* graph, const SwapOutRecord& record, Node* producer, std::string* error) {
  const tensorflow::DataType dtype = producer->output_type(record.port);
  if (record.keep_rows == 0) {
    return AddSwapNode(graph, record.name, "DymemSwapOut", producer, record.port, producer, dtype, error);
  }
  tensorflow::NodeBuilder builder(record.name, "DymemSwapOutPartial");
  builder.Input(tensorflow::NodeBuilder::NodeOut(producer, record.port)).Attr("keep_rows", record.keep_rows);
  return FinishSwapNode(&builder, graph, record.name, "DymemSwapOutPartial", producer, dtype, error);
}

// Adds a swap-in named `name` of the swap-out `out` of `record` (DymemSwapInPartial, reading its host and its kept
// rows, where it keeps rows); null with `error` on failure.
Node* AddSwapIn(Graph* graph, const std::string& name, const SwapOutRecord& record, Node* out, Node* producer,
                std::string* error) {
  const tensorflow::DataType dtype = producer->output_type(record.port);
  if (record.keep_rows == 0) return AddSwapNode(graph, name, "DymemSwapIn", out, 0, producer, dtype, error);
  tensorflow::NodeBuilder builder(name, "DymemSwapInPartial");
  builder.Input(tensorflow::NodeBuilder::NodeOut(out, 0)).Input(tensorflow::NodeBuilder::NodeOut(out, 1));
  return FinishSwapNode(&builder, graph, name, "DymemSwapInPartial", producer, dtype, error);
}

// Data inputs of `consumer` that read `src:port`, as input indices.
std::vector<int> InputsReading(const Node* consumer, const Node* src, int port) {
  std::vector<int> found;
  for (const Edge* e : consumer->in_edges()) {
    if (!e->IsControlEdge() && e->src() == src && e->src_output() == port) found.push_back(e->dst_input());
  }
  return found;
}

// Moves `consumer`'s inputs that read `src:port` to `dst:0`, logging each move; false if it read none.
bool RerouteConsumer(Graph* graph, Node* consumer, Node* src, int port, Node* dst, UndoLog* log) {
  std::vector<int> inputs = InputsReading(consumer, src, port);
  for (int i : inputs) {
    if (!graph->UpdateEdge(dst, 0, consumer, i).ok()) return false;
    log->reroutes.push_back({consumer, i, src, port});
  }
  return !inputs.empty();
}

// Whether `e` is a lowered loop's back edge (NextIteration -> Merge), which TF's executor expects to close a cycle.
bool IsBackEdge(const Edge* e) { return e->src()->IsNextIteration(); }

// Ids of the nodes Kahn's algorithm cannot reach (data and control edges, loop back edges aside): those on a cycle
// and downstream of one; empty when the graph is acyclic.
std::vector<bool> Unordered(const Graph& graph, bool* any) {
  std::vector<int> pending(graph.num_node_ids(), 0);
  std::deque<const Node*> ready;
  for (const Node* n : graph.nodes()) {
    for (const Edge* e : n->in_edges()) pending[n->id()] += !IsBackEdge(e);
    if (pending[n->id()] == 0) ready.push_back(n);
  }
  for (; !ready.empty(); ready.pop_front()) {
    for (const Edge* e : ready.front()->out_edges()) {
      if (!IsBackEdge(e) && --pending[e->dst()->id()] == 0) ready.push_back(e->dst());
    }
  }
  std::vector<bool> left(graph.num_node_ids(), false);
  *any = false;
  for (const Node* n : graph.nodes()) *any |= left[n->id()] = pending[n->id()] > 0;
  return left;
}

// "a -> b -> a" for one cycle of the graph, or "" when it has none (walks back through unordered predecessors).
std::string FindCycle(const Graph& graph) {
  bool any = false;
  std::vector<bool> left = Unordered(graph, &any);
  if (!any) return "";
  const Node* n = nullptr;
  for (const Node* m : graph.nodes()) {
    if (left[m->id()]) n = m;
  }
  std::vector<const Node*> path;
  std::unordered_map<int, size_t> seen;
  while (n != nullptr && !seen.count(n->id())) {
    seen[n->id()] = path.size();
    path.push_back(n);
    const Node* back = nullptr;
    for (const Edge* e : n->in_edges()) {
      if (!IsBackEdge(e) && left[e->src()->id()]) back = e->src();
    }
    n = back;
  }
  if (n == nullptr) return "(a cycle)";
  std::string text = n->name();
  for (size_t i = path.size(); i-- > seen[n->id()];) absl::StrAppend(&text, " -> ", path[i]->name());
  return text;
}
// Undoes everything in `log`, newest first.
void Undo(Graph* graph, const UndoLog& log) {
  for (auto it = log.reroutes.rbegin(); it != log.reroutes.rend(); ++it) {
    graph->UpdateEdge(it->src, it->port, it->consumer, it->index).IgnoreError();
  }
  for (const Edge* e : log.added_control_edges) graph->RemoveControlEdge(e);
  for (auto it = log.added_nodes.rbegin(); it != log.added_nodes.rend(); ++it) graph->RemoveNode(*it);
}

// Adds the swap-out nodes; false with `error` on failure.
bool AddSwapOuts(const StepPlan& plan, const NodeIndex& index, Graph* graph, NodeIndex* added, UndoLog* log,
                 std::string* error) {
  for (const SwapOutRecord& r : plan.swap_outs) {
    Node* out = AddSwapOut(graph, r, index.at(r.producer), error);
    if (out == nullptr) return false;
    log->added_nodes.push_back(out);
    (*added)[r.name] = out;
  }
  return true;
}

// Adds the swap-in nodes with their triggers and reroutes their consumers; false with `error` on failure.
bool AddSwapIns(const StepPlan& plan, const NodeIndex& index, Graph* graph, NodeIndex* added, UndoLog* log,
                std::string* error) {
  std::unordered_map<std::string, const SwapOutRecord*> outs;
  for (const SwapOutRecord& r : plan.swap_outs) outs[r.name] = &r;
  for (const SwapInRecord& r : plan.swap_ins) {
    const SwapOutRecord& src = *outs.at(r.swap_out);
    Node* producer = index.at(src.producer);
    Node* in = AddSwapIn(graph, r.name, src, added->at(r.swap_out), producer, error);
    if (in == nullptr) return false;
    log->added_nodes.push_back(in);
    (*added)[r.name] = in;  // `clone` records may read it (copies of alias ops)
    if (!r.trigger.empty()) log->added_control_edges.push_back(graph->AddControlEdge(index.at(r.trigger), in));
    for (const std::string& c : r.consumers) {
      if (!RerouteConsumer(graph, index.at(c), producer, src.port, in, log)) {
        *error = absl::StrCat("'", c, "' does not read ", src.producer, ":", src.port);
        return false;
      }
    }
  }
  return true;
}

// Adds one variable op named `name` of `type` reading `resource:port` (no outputs); null with `error` on failure.
Node* AddVariableNode(Graph* graph, const std::string& name, const char* type, Node* resource, int port,
                      std::string* error) {
  Node* node = nullptr;
  absl::Status s = tensorflow::NodeBuilder(name, type)
                       .Input(tensorflow::NodeBuilder::NodeOut(resource, port))
                       .Device(resource->assigned_device_name())
                       .Finalize(graph, &node, /*consume=*/true);
  if (!s.ok()) {
    *error = absl::StrCat("could not add ", type, " '", name, "': ", s.message());
    return nullptr;
  }
  node->set_assigned_device_name(resource->assigned_device_name());
  return node;
}

// Adds a control edge `from` -> `to`, logged for undo.
void AddLoggedControlEdge(Graph* graph, Node* from, Node* to, UndoLog* log) {
  const Edge* e = graph->AddControlEdge(from, to);
  if (e != nullptr) log->added_control_edges.push_back(e);
}

// Adds each variable's evict, swap-in and swap-out with their control edges, and names them in `added` (validation
// lets later records name them); false with `error` on failure.
bool AddVariableSwaps(const StepPlan& plan, const NodeIndex& index, Graph* graph, NodeIndex* added, UndoLog* log,
                      std::string* error) {
  for (const VariableRecord& r : plan.variables) {
    Node* resource = index.at(r.resource);
    Node* evict = AddVariableNode(graph, r.evict, "DymemVariableSwapOut", resource, r.port, error);
    if (evict != nullptr) log->added_nodes.push_back(evict);
    Node* in = evict ? AddVariableNode(graph, r.swap_in, "DymemVariableSwapIn", resource, r.port, error) : nullptr;
    if (in != nullptr) log->added_nodes.push_back(in);
    Node* out = in ? AddVariableNode(graph, r.swap_out, "DymemVariableSwapOut", resource, r.port, error) : nullptr;
    if (out == nullptr) return false;
    log->added_nodes.push_back(out);
    for (Node* n : {evict, in, out}) (*added)[n->name()] = n;
    AddLoggedControlEdge(graph, evict, in, log);
    if (!r.trigger.empty()) AddLoggedControlEdge(graph, index.at(r.trigger), in, log);
    for (const std::string& c : r.consumers) {
      AddLoggedControlEdge(graph, in, index.at(c), log);
      AddLoggedControlEdge(graph, index.at(c), out, log);
    }
  }
  return true;
}

// The node `name` of the graph or of the plan's added nodes.
Node* Lookup(const NodeIndex& index, const NodeIndex& added, const std::string& name) {
  auto it = added.find(name);
  return it != added.end() ? it->second : index.at(name);
}

// Adds one `vin`/`vkeep`/`vout`/`vread` node; null with `error` on failure.
Node* AddVariableOp(const VariableOpRecord& r, const NodeIndex& index, Graph* graph, std::string* error) {
  Node* resource = index.at(r.resource);
  const bool swap_in = r.kind == "vin" || r.kind == "vkeep";
  tensorflow::NodeBuilder builder(r.name, swap_in ? "DymemVariableSwapIn"
                                          : r.kind == "vout" ? "DymemVariableSwapOut" : "DymemVariableRead");
  builder.Input(tensorflow::NodeBuilder::NodeOut(resource, r.port)).Device(resource->assigned_device_name());
  if (swap_in) builder.Attr("keep_host", r.flag);
  if (r.kind == "vkeep") builder.Attr("resident", true);
  if (r.kind == "vout") builder.Attr("discard", r.flag);
  absl::Status s;
  if (r.kind == "vread") {
    tensorflow::DataType dtype = tensorflow::DT_INVALID;
    s = tensorflow::GetNodeAttr(index.at(r.like)->attrs(), "dtype", &dtype);
    builder.Attr("dtype", dtype);
  }
  Node* node = nullptr;
  if (s.ok()) s = builder.Finalize(graph, &node, /*consume=*/true);
  if (!s.ok()) {
    *error = absl::StrCat("could not add '", r.name, "': ", s.message());
    return nullptr;
  }
  node->set_assigned_device_name(resource->assigned_device_name());
  return node;
}

// Adds a copy of `like` named `name` (attributes, device and data inputs) whose inputs listed in `replaced` read
// the given nodes' output 0; null with `error` on failure.
Node* AddClone(const Node* like, const std::string& name, const std::vector<std::pair<int, Node*>>& replaced,
               Graph* graph, std::string* error) {
  std::vector<tensorflow::NodeBuilder::NodeOut> inputs(like->num_inputs());
  for (const Edge* e : like->in_edges()) {
    if (!e->IsControlEdge()) inputs[e->dst_input()] = tensorflow::NodeBuilder::NodeOut(e->src(), e->src_output());
  }
  for (const auto& r : replaced) inputs[r.first] = tensorflow::NodeBuilder::NodeOut(r.second, 0);
  tensorflow::NodeBuilder builder(name, like->type_string());
  for (const tensorflow::NodeBuilder::NodeOut& input : inputs) builder.Input(input);
  for (const auto& attr : like->attrs()) builder.Attr(attr.first, attr.second);
  Node* node = nullptr;
  absl::Status s = builder.Device(like->assigned_device_name()).Finalize(graph, &node, /*consume=*/true);
  if (!s.ok()) {
    *error = absl::StrCat("could not clone '", like->name(), "' as '", name, "': ", s.message());
    return nullptr;
  }
  node->set_assigned_device_name(like->assigned_device_name());
  return node;
}

// Applies the edit records in order; false with `error` on failure.
bool ApplyEdits(const StepPlan& plan, const NodeIndex& index, Graph* graph, NodeIndex* added, UndoLog* log,
                std::string* error) {
  for (const NodeEditRecord& edit : plan.edits) {
    if (edit.kind == "reroute") {
      const RerouteRecord& r = edit.reroute;
      if (!RerouteConsumer(graph, index.at(r.consumer), index.at(r.source), r.port, Lookup(index, *added, r.target),
                           log)) {
        *error = absl::StrCat("'", r.consumer, "' does not read ", r.source, ":", r.port);
        return false;
      }
      continue;
    }
    Node* node = nullptr;
    if (edit.kind == "clone") {
      std::vector<std::pair<int, Node*>> replaced;
      for (const auto& input : edit.clone.inputs) replaced.emplace_back(input.first, Lookup(index, *added, input.second));
      node = AddClone(index.at(edit.clone.node), edit.clone.name, replaced, graph, error);
    } else {
      node = AddVariableOp(edit.variable_op, index, graph, error);
    }
    if (node == nullptr) return false;
    log->added_nodes.push_back(node);
    (*added)[node->name()] = node;
  }
  return true;
}

// Whether `n` may take and give a chain's control edges: not a function's argument or result (TF accepts no control
// edge out of a result), not the graph's source or sink.
bool Chainable(const Node* n) { return n->IsOp() && !n->IsArg() && !n->IsRetval(); }

// The sequence's nodes and `extra` in the topological order of `graph` that takes the listed nodes in their listed
// order as far as the edges allow (Kahn's algorithm, a min-heap keyed by list position; other nodes, `extra` among
// them, first as they become ready).
std::vector<Node*> OrderSequence(const std::vector<std::string>& sequence, const std::vector<Node*>& extra,
                                 const NodeIndex& index, const Graph& graph) {
  constexpr int kUnchained = -2, kExtra = -1;  // keys: both run as soon as ready, before listed nodes
  std::vector<int> key(graph.num_node_ids(), kUnchained), pending(graph.num_node_ids(), 0);
  for (size_t i = 0; i < sequence.size(); ++i) key[index.at(sequence[i])->id()] = static_cast<int>(i);
  for (const Node* n : extra) key[n->id()] = kExtra;
  for (const Node* n : graph.nodes()) {
    if (!Chainable(n)) key[n->id()] = kUnchained;
  }
  using Entry = std::pair<int, int>;  // (key, node id)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> ready;
  std::vector<Node*> by_id(graph.num_node_ids(), nullptr), order;
  for (Node* n : graph.nodes()) {
    by_id[n->id()] = n;
    for (const Edge* e : n->in_edges()) pending[n->id()] += !IsBackEdge(e);
    if (pending[n->id()] == 0) ready.push({key[n->id()], n->id()});
  }
  while (!ready.empty()) {
    Node* n = by_id[ready.top().second];
    ready.pop();
    if (key[n->id()] != kUnchained) order.push_back(n);
    for (const Edge* e : n->out_edges()) {
      if (!IsBackEdge(e) && --pending[e->dst()->id()] == 0) {
        ready.push({key[e->dst()->id()], e->dst()->id()});
      }
    }
  }
  return order;
}

// Whether each node (by id) may be dead: reached from a Switch's output by data or control edges without passing a
// Merge. A dead node makes every node after it dead, so it must not join a chain.
std::vector<bool> MayBeDead(const Graph& graph) {
  std::vector<bool> dead(graph.num_node_ids(), false);
  std::vector<const Node*> stack;
  for (const Node* n : graph.op_nodes()) {
    if (n->IsSwitch()) stack.push_back(n);
  }
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    for (const Edge* e : n->out_edges()) {
      const Node* dst = e->dst();
      if (dst->IsMerge() || !dst->IsOp() || dead[dst->id()]) continue;
      dead[dst->id()] = true;
      stack.push_back(dst);
    }
  }
  return dead;
}

// `order` cut into runs of one band. A listed node's band is its record's (`sequence[i]` is in band `bands[i]`),
// another node's the band of the listed node before it in `order`; in a band of one listed node, and before any
// listed node, every node is a run of its own (the strict chain).
std::vector<std::vector<Node*>> BandRuns(const std::vector<Node*>& order, const std::vector<std::string>& sequence,
                                         const std::vector<int>& bands, const NodeIndex& index, int num_node_ids) {
  std::vector<int> band_of(num_node_ids, -1), members(bands.back() + 1, 0);
  for (size_t i = 0; i < sequence.size(); ++i) {
    band_of[index.at(sequence[i])->id()] = bands[i];
    ++members[bands[i]];
  }
  std::vector<std::vector<Node*>> runs;
  int band = -1, previous = 0, solo = -1;  // run keys: a wide band's number, or a negative one per solo node
  for (Node* n : order) {
    if (band_of[n->id()] >= 0) band = band_of[n->id()];
    const int key = band >= 0 && members[band] > 1 ? band : solo--;
    if (runs.empty() || key != previous) runs.emplace_back();
    runs.back().push_back(n);
    previous = key;
  }
  return runs;
}

// A NoOp on the device of `after`'s first node that every node of `before` precedes and that precedes every node of
// `after`; false with `error` if it cannot be added.
bool AddBarrier(const std::vector<Node*>& before, const std::vector<Node*>& after, Graph* graph, UndoLog* log,
                std::string* error) {
  Node* barrier = nullptr;
  const std::string name = absl::StrCat(after.front()->name(), "/dymem_band_start");
  absl::Status s = tensorflow::NodeBuilder(name, "NoOp")
                       .Device(after.front()->assigned_device_name())
                       .Finalize(graph, &barrier, /*consume=*/true);
  if (!s.ok()) {
    *error = absl::StrCat("could not add NoOp '", name, "': ", s.message());
    return false;
  }
  barrier->set_assigned_device_name(after.front()->assigned_device_name());
  log->added_nodes.push_back(barrier);
  for (Node* n : before) AddLoggedControlEdge(graph, n, barrier, log);
  for (Node* n : after) AddLoggedControlEdge(graph, barrier, n, log);
  return true;
}

// Makes every node of `after` wait for every node of `before` (runs of a chain, `before` first in a topological
// order): direct edges where either run is one node (none where the graph has one), else through a barrier.
bool LinkRuns(const std::vector<Node*>& before, const std::vector<Node*>& after, Graph* graph, UndoLog* log,
              std::string* error) {
  if (before.size() > 1 && after.size() > 1) return AddBarrier(before, after, graph, log, error);
  for (Node* a : before) {
    for (Node* b : after) {
      bool linked = false;
      for (const Edge* e : b->in_edges()) linked |= e->src() == a;
      if (!linked) AddLoggedControlEdge(graph, a, b, log);
    }
  }
  return true;
}

// Chains each of the plan's sequences with control edges (see `seq` in step_plan.h), skipping edges the graph has.
// The plan's own nodes join a `seqadded` chain only where they cannot be dead (MayBeDead). False with `error` if
// a band's barrier cannot be added.
bool AddSequences(const StepPlan& plan, const NodeIndex& index, Graph* graph, UndoLog* log, std::string* error) {
  const std::vector<Node*> added = log->added_nodes;  // copied: the chain's edges are logged too
  // MayBeDead, found once: chains link only nodes that cannot be dead, so they make no node dead.
  std::vector<bool> dead;
  for (size_t k = 0; k < plan.sequences.size(); ++k) {
    const std::vector<std::string>& sequence = plan.sequences[k];
    if (sequence.size() < 2) continue;
    std::vector<Node*> extra;
    if (std::count(plan.chains_with_added.begin(), plan.chains_with_added.end(), static_cast<int>(k))) {
      const std::string& device = index.at(sequence[0])->assigned_device_name();
      if (dead.empty()) dead = MayBeDead(*graph);
      for (Node* n : added) {
        if (n->assigned_device_name() == device && !dead[n->id()]) extra.push_back(n);
      }
    }
    std::vector<Node*> order = OrderSequence(sequence, extra, index, *graph);
    const std::vector<std::vector<Node*>> runs = BandRuns(order, sequence, plan.bands[k], index, graph->num_node_ids());
    for (size_t r = 1; r < runs.size(); ++r) {
      if (!LinkRuns(runs[r - 1], runs[r], graph, log, error)) return false;
    }
  }
  return true;
}

// Adds the plan's control edges.
void AddControlEdges(const StepPlan& plan, const NodeIndex& index, const NodeIndex& added, Graph* graph,
                     UndoLog* log) {
  for (const ControlEdgeRecord& r : plan.control_edges) {
    AddLoggedControlEdge(graph, Lookup(index, added, r.from), Lookup(index, added, r.to), log);
  }
}

// The nodes `log` added, then the nodes whose inputs it changed (rerouted or given a control edge), each once.
std::vector<Node*> ChangedNodes(const UndoLog& log) {
  std::vector<Node*> changed = log.added_nodes;
  std::unordered_set<const Node*> seen(changed.begin(), changed.end());
  auto add = [&](Node* n) {
    if (seen.insert(n).second) changed.push_back(n);
  };
  for (const Reroute& r : log.reroutes) add(r.consumer);
  for (const Edge* e : log.added_control_edges) add(e->dst());
  return changed;
}

// ApplyStepPlan's work; `log` holds what it changed.
bool ApplyValidated(const StepPlan& plan, Graph* graph, UndoLog* log, std::string* error) {
  NodeIndex index;
  for (Node* n : graph->nodes()) index[n->name()] = n;
  if (!Validate(plan, index, error)) return false;
  NodeIndex added;
  bool ok = AddSwapOuts(plan, index, graph, &added, log, error) &&
            AddSwapIns(plan, index, graph, &added, log, error) &&
            AddVariableSwaps(plan, index, graph, &added, log, error) &&
            ApplyEdits(plan, index, graph, &added, log, error);
  if (ok) AddControlEdges(plan, index, added, graph, log);
  if (ok) ok = AddSequences(plan, index, graph, log, error);
  if (ok) {
    std::string cycle = FindCycle(*graph);
    if (!cycle.empty()) {
      *error = absl::StrCat("the plan would make the graph cyclic: ", cycle);
      ok = false;
    }
  }
  if (!ok) Undo(graph, *log);
  return ok;
}

// A `vin`, `vkeep`, `vout`, `vread`, `clone` or `reroute` record as DescribeStepPlan writes it.
std::string DescribeEdit(const NodeEditRecord& e) {
  if (e.kind == "clone") {
    std::vector<std::string> inputs;
    for (const auto& input : e.clone.inputs) inputs.push_back(absl::StrCat(input.first, ":", input.second));
    return absl::StrCat("clone\tnode=", e.clone.node, "\tname=", e.clone.name, "\tinputs=", absl::StrJoin(inputs, ","));
  }
  if (e.kind == "reroute") {
    const RerouteRecord& r = e.reroute;
    return absl::StrCat("reroute\tconsumer=", r.consumer, "\tsource=", r.source, "\tport=", r.port, "\ttarget=",
                        r.target);
  }
  const VariableOpRecord& v = e.variable_op;
  const std::string last = v.kind == "vread" ? absl::StrCat("like=", v.like)
                                             : absl::StrCat(v.kind == "vout" ? "discard=" : "keep_host=", v.flag);
  return absl::StrCat(v.kind, "\tresource=", v.resource, "\tport=", v.port, "\tname=", v.name, "\t", last);
}

}  // namespace

bool ParseStepPlan(const std::string& text, StepPlan* plan, std::string* error) {
  std::istringstream lines(text);
  std::string line;
  Columns columns;
  bool versioned = false;
  for (int lineno = 1; std::getline(lines, line); ++lineno) {
    if (line.empty()) continue;
    const std::vector<std::string> f = Fields(line);
    if (!versioned) {
      if (!CheckVersion(f, error) || !ReadColumns(f, &columns, error)) return false;
      versioned = true;
      continue;
    }
    const int kind = CheckRecord(f, columns, lineno, error);
    if (kind < 0) return false;
    if (!ParserOf(kind)(Record(kind, f, columns[kind]), plan)) {
      *error = absl::StrCat("plan line ", lineno, " is malformed: '", line, "'");
      return false;
    }
  }
  if (!versioned) *error = absl::StrCat("the plan message is empty: it needs at least its version line (", kHeader,
                                        " ", kPlanVersion, ")");
  return versioned;
}

std::string DescribeStepPlan(const StepPlan& plan) {
  std::string out;
  for (const SwapOutRecord& r : plan.swap_outs) {
    absl::StrAppend(&out, "out\tproducer=", r.producer, "\tport=", r.port, "\tswap_out=", r.name,
                    "\tkeep_rows=", r.keep_rows, "\n");
  }
  for (const SwapInRecord& r : plan.swap_ins) {
    absl::StrAppend(&out, "in\tswap_out=", r.swap_out, "\tswap_in=", r.name, "\ttrigger=", r.trigger,
                    "\tconsumers=", absl::StrJoin(r.consumers, ","), "\n");
  }
  for (const VariableRecord& r : plan.variables) {
    absl::StrAppend(&out, "var\tresource=", r.resource, "\tport=", r.port, "\tevict=", r.evict, "\tswap_in=",
                    r.swap_in, "\tswap_out=", r.swap_out, "\ttrigger=", r.trigger, "\tconsumers=",
                    absl::StrJoin(r.consumers, ","), "\n");
  }
  for (const NodeEditRecord& e : plan.edits) absl::StrAppend(&out, DescribeEdit(e), "\n");
  for (const ControlEdgeRecord& r : plan.control_edges) {
    absl::StrAppend(&out, "ctrl\tsrc=", r.from, "\tdst=", r.to, "\n");
  }
  for (size_t k = 0; k < plan.sequences.size(); ++k) {
    for (size_t i = 0; i < plan.sequences[k].size(); ++i) {
      absl::StrAppend(&out, "seq\tchain=", k, "\tnode=", plan.sequences[k][i], "\tband=", plan.bands[k][i], "\n");
    }
  }
  for (int chain : plan.chains_with_added) absl::StrAppend(&out, "seqadded\tchain=", chain, "\n");
  return out;
}

bool ApplyStepPlan(const StepPlan& plan, Graph* graph, std::string* error, std::vector<Node*>* changed) {
  // Validation is meant to make every look-up below succeed; should one still throw, the plan is refused and the
  // graph put back instead of the exception ending the process inside TensorFlow.
  UndoLog log;
  try {
    if (!ApplyValidated(plan, graph, &log, error)) return false;
    if (changed != nullptr) *changed = ChangedNodes(log);
    return true;
  } catch (const std::exception& e) {
    Undo(graph, log);
    *error = absl::StrCat("the plan could not be applied: ", e.what());
    return false;
  }
}

}  // namespace dymem
