// The plan message between the Python planner and the graph pass: its version and one definition of each record,
// read by both sides. step_plan.cc includes this file as X-macros (define DYMEM_PLAN_VERSION and DYMEM_PLAN_RECORD
// first); dymem_tf/passes/plan_message.py reads its DYMEM_PLAN_ lines as data. No include guard: it is included
// once per table built from it.
//
// A message is lines of tab-separated fields (node names never contain tabs or newlines). Its first line is
// `dymem-plan <version>`; a reader refuses another version. Each record after it is its kind followed by exactly
// the fields listed here (a list field is comma-separated and may be empty). What each record does is in
// step_plan.h.
//
// DYMEM_PLAN_RECORD(kind, field names...)

DYMEM_PLAN_VERSION(3)

DYMEM_PLAN_RECORD(out, "producer", "port", "swap_out")
DYMEM_PLAN_RECORD(in, "swap_out", "swap_in", "trigger", "consumers")
DYMEM_PLAN_RECORD(ctrl, "from", "to")
DYMEM_PLAN_RECORD(var, "resource", "port", "evict", "swap_in", "swap_out", "trigger", "consumers")
DYMEM_PLAN_RECORD(vin, "resource", "port", "name", "keep_host")
DYMEM_PLAN_RECORD(vkeep, "resource", "port", "name", "keep_host")
DYMEM_PLAN_RECORD(vout, "resource", "port", "name", "discard")
DYMEM_PLAN_RECORD(vread, "resource", "port", "name", "like")
DYMEM_PLAN_RECORD(clone, "node", "name", "inputs")
DYMEM_PLAN_RECORD(reroute, "consumer", "source", "port", "target")
DYMEM_PLAN_RECORD(seq, "chain", "node", "band")
DYMEM_PLAN_RECORD(seqadded, "chain")
