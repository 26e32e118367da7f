// A swap plan as the graph pass receives it from the Python planner: plain data, one parser, one applier.
//
// Text form (plan_schema.h is the one definition of the version and of each record's fields, for this parser and
// for the Python writer, dymem_tf/passes/plan_message.py): a header line, `dymem-plan <version>` followed by one
// `<kind>:<field>,<field>,...` per record kind, then one record per line, its kind and its fields in the columns
// the header declares for that kind, all separated by tabs (node names never contain tabs or newlines). The parser
// reads every field by name; the records, their fields by name (in plan_schema.h's order):
//   out   producer (node), port (its output), swap_out (the new node's name)
//   in    swap_out (node name), swap_in (the new node's name), trigger (node or empty), consumers (nodes, a
//         comma-separated list, may be empty)
//   ctrl  src (node), dst (node)
//   var   resource (node), port (its output), evict, swap_in, swap_out (new node names), trigger (node or empty),
//         consumers (nodes, comma-separated)
// `out` copies a tensor to host memory; `in` brings it back for the listed consumers (their data inputs from the
// tensor are rerouted to the swap-in; none when it feeds only `clone`s of alias ops), after the trigger node ran;
// `ctrl` adds a control edge from src to dst (no numeric change);
// `var` offloads a resource variable between its uses: an evict (DymemVariableSwapOut, a no-op once the variable is
// in host memory) at the step's start, a swap-in (DymemVariableSwapIn) after the evict and the trigger and before
// every listed consumer, and a swap-out (DymemVariableSwapOut) after every consumer. The consumers must be all the
// ops that read the resource (control edges only: no data input changes).
//
// Weights offloaded between their uses are written with smaller records, applied in the order given (each may name
// nodes that an earlier record of the plan adds):
//   vin     resource, port, name, keep_host (0|1)      a DymemVariableSwapIn
//   vkeep   resource, port, name, keep_host (0|1)      a vin whose variable then stays on the device (resident)
//   vout    resource, port, name, discard (0|1)        a DymemVariableSwapOut
//   vread   resource, port, name, like (a read node)   a DymemVariableRead of the read node's dtype
//   clone   node, name, inputs (<k>:<input node>[,...], may be empty)
//                                                      a copy of the node (attributes, device, data inputs) whose
//                                                      input k reads `input node`:0
// (A recomputation copies a chain of ops with `clone`, after a trigger by `ctrl`, and reroutes its consumers.)
//   reroute consumer, source, port, target             the consumer's data inputs that read source:port now read
//                                                      target:0
//
// The order the planner simulated, applied last, after every other record:
//   seq   chain, node, band   one record per node, in the simulated order; chains numbered from 0 (one per
//                             replica): each chain's nodes are linked with control edges in the topological order of
//                             the rewritten graph that follows its records as far as the graph's edges allow (other
//                             nodes run as soon as they are ready), so a chain closes no cycle. Bands (numbers from
//                             0, non-decreasing along a chain) relax the chain: the nodes of a run of one band along
//                             that order are not linked to each other, each waits for every node of the run before
//                             it (through one NoOp where both runs have several)
//   seqadded chain            chain `chain` also takes the nodes the plan adds on its device (its first node's),
//                             each as soon as it is ready: for synchronous copies (the CPU kernels), which the
//                             executor could otherwise leave waiting behind the chain
#ifndef DYMEM_TF_CC_PASS_STEP_PLAN_H_
#define DYMEM_TF_CC_PASS_STEP_PLAN_H_

#include <string>
#include <vector>

#include "tensorflow/core/graph/graph.h"

namespace dymem {

struct SwapOutRecord {
  std::string producer;
  int port = 0;
  std::string name;
  int64_t keep_rows = 0;  // above 0: a partial swap (DymemSwapOutPartial) that keeps this many first rows
};

struct SwapInRecord {
  std::string swap_out;
  std::string name;
  std::string trigger;  // empty: no trigger, the swap-in may start as soon as its swap-out is done
  std::vector<std::string> consumers;
};

struct ControlEdgeRecord {
  std::string from;
  std::string to;
};

struct VariableRecord {
  std::string resource;
  int port = 0;
  std::string evict;
  std::string swap_in;
  std::string swap_out;
  std::string trigger;  // empty: the swap-in may start as soon as the evict is done
  std::vector<std::string> consumers;
};

// One `vin`, `vout` or `vread` record.
struct VariableOpRecord {
  std::string kind;  // "vin", "vkeep" (a vin whose variable then stays: resident), "vout" or "vread"
  std::string resource;
  int port = 0;
  std::string name;
  bool flag = false;  // keep_host (vin) or discard (vout)
  std::string like;   // vread: the ReadVariableOp whose dtype the read takes
};

struct CloneRecord {
  std::string node;
  std::string name;
  std::vector<std::pair<int, std::string>> inputs;  // input index -> node whose output 0 it reads instead
};

struct RerouteRecord {
  std::string consumer;
  std::string source;
  int port = 0;
  std::string target;
};

// A `vin`, `vout`, `vread`, `clone` or `reroute` record (`kind` says which), in plan order.
struct NodeEditRecord {
  std::string kind;
  VariableOpRecord variable_op;
  CloneRecord clone;
  RerouteRecord reroute;
};

struct StepPlan {
  std::vector<SwapOutRecord> swap_outs;
  std::vector<SwapInRecord> swap_ins;
  std::vector<ControlEdgeRecord> control_edges;
  std::vector<VariableRecord> variables;
  std::vector<NodeEditRecord> edits;
  std::vector<std::vector<std::string>> sequences;  // `seq` records: the nodes of each chain, in order
  std::vector<std::vector<int>> bands;               // their bands, parallel to `sequences`
  std::vector<int> chains_with_added;                // `seqadded` records
};

// Parses the text form above into `plan`; false with `error` set (naming the kind, field or line) on another
// version, a header declaring a kind or field plan_schema.h lacks or leaving out one of a kind's fields, a record
// of a kind unknown or undeclared, one with another number of fields than declared, or a malformed field.
bool ParseStepPlan(const std::string& text, StepPlan* plan, std::string* error);

// `plan` as text: one line per record, in the order ApplyStepPlan adds them (out, in, var, the edits, ctrl, seq,
// seqadded), each its kind and tab-separated `field=value`s named as in plan_schema.h. What the parser read: two
// messages that mean the same plan, whatever their columns' order, read the same.
std::string DescribeStepPlan(const StepPlan& plan);

// Inserts the plan's swap ops into `graph`, reroutes consumers and adds control edges. All or nothing: on a plan
// that does not match the graph it returns false with `error` set and leaves the graph as it was. On success
// `changed` (when given) lists the nodes the plan added, in the order added, then those whose inputs it changed.
bool ApplyStepPlan(const StepPlan& plan, tensorflow::Graph* graph, std::string* error,
                   std::vector<tensorflow::Node*>* changed = nullptr);

}  // namespace dymem

#endif  // DYMEM_TF_CC_PASS_STEP_PLAN_H_
