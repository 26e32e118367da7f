// The plan message between the Python planner and the graph pass: its version and one definition of each record
// kind's fields, by name, read by both sides. step_plan.cc includes this file as X-macros (define
// DYMEM_PLAN_VERSION and DYMEM_PLAN_RECORD first) into a constexpr table that its parsers look their fields up in
// by name (a name missing here does not compile); dymem_tf/passes/plan_message.py reads its DYMEM_PLAN_ lines as
// data and writes records by keyword against it. No include guard: it is included once per table built from it.
//
// A message is lines of tab-separated fields (node names never contain tabs or newlines). Its first line is its
// header: `dymem-plan`, the version, then one `<kind>:<field>,<field>,...` column declaration per record kind,
// naming that kind's fields in the order its records hold them (one line, so that every line after the first is a
// record). Each record after the header is its kind followed by the declared fields (a list field is
// comma-separated and may be empty). The parser reads each field by its name through the declaration, so the
// column order is the writer's to choose; it refuses, with a message naming the kind or field, another version, a
// declaration naming a kind or field this file lacks or leaving one of a kind's fields out, and a record of a kind
// the header does not declare. What each record does is in step_plan.h.
//
// A change of a record's meaning bumps the version; adding, renaming or removing a field need not (the header
// carries the names). A field name is unique within its kind and a plain identifier but no Python keyword
// (plan_message.record takes the fields as keyword arguments).
//
// DYMEM_PLAN_RECORD(kind, field names...)

DYMEM_PLAN_VERSION(4)

DYMEM_PLAN_RECORD(out, "producer", "port", "swap_out", "keep_rows")
DYMEM_PLAN_RECORD(in, "swap_out", "swap_in", "trigger", "consumers")
DYMEM_PLAN_RECORD(ctrl, "src", "dst")
DYMEM_PLAN_RECORD(var, "resource", "port", "evict", "swap_in", "swap_out", "trigger", "consumers")
DYMEM_PLAN_RECORD(vin, "resource", "port", "name", "keep_host")
DYMEM_PLAN_RECORD(vkeep, "resource", "port", "name", "keep_host")
DYMEM_PLAN_RECORD(vout, "resource", "port", "name", "discard")
DYMEM_PLAN_RECORD(vread, "resource", "port", "name", "like")
DYMEM_PLAN_RECORD(clone, "node", "name", "inputs")
DYMEM_PLAN_RECORD(reroute, "consumer", "source", "port", "target")
DYMEM_PLAN_RECORD(seq, "chain", "node", "band")
DYMEM_PLAN_RECORD(seqadded, "chain")
