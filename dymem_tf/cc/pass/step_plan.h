// A swap plan as the graph pass receives it from the Python planner: plain data, one parser, one applier.
//
// Text form, one record per line, fields separated by tabs (node names never contain tabs or newlines):
//   out   <producer node> <output port> <swap-out node name>
//   in    <swap-out node name> <swap-in node name> <trigger node or empty> <consumer>[,<consumer>...]
//   ctrl  <from node> <to node>
// `out` copies a tensor to host memory; `in` brings it back for the listed consumers (their data inputs from the
// tensor are rerouted to the swap-in), after the trigger node ran; `ctrl` adds a control edge (no numeric change).
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

struct StepPlan {
  std::vector<SwapOutRecord> swap_outs;
  std::vector<SwapInRecord> swap_ins;
  std::vector<ControlEdgeRecord> control_edges;
};

// Parses the text form above into `plan`; false with `error` set on a malformed line.
bool ParseStepPlan(const std::string& text, StepPlan* plan, std::string* error);

// Inserts the plan's swap ops into `graph`, reroutes consumers and adds control edges. All or nothing: on a plan
// that does not match the graph it returns false with `error` set and leaves the graph as it was.
bool ApplyStepPlan(const StepPlan& plan, tensorflow::Graph* graph, std::string* error);

}  // namespace dymem

#endif  // DYMEM_TF_CC_PASS_STEP_PLAN_H_
