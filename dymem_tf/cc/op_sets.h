// Op-type sets and op-name marks that the native code and the Python planner both use, defined once. C++ includes
// this file as X-macros (define DYMEM_OP_SET first: DYMEM_OP_SET(name, "entry", ...)); dymem_tf/op_sets.py reads
// its DYMEM_OP_SET lines as data. No include guard: it is included once per table built from it.

// The step's input ops, whose outputs lead with the batch dimension (the graph pass fills an unknown one with the
// batch hint; the planner reads the batch size from them).
DYMEM_OP_SET(kStepInputTypes, "IteratorGetNext", "IteratorGetNextSync", "MultiDeviceIteratorGetNextFromShard")

// Name scopes of a GradientTape's gradient ops: a graph with one is a train step, and they start its backward pass.
DYMEM_OP_SET(kGradientScopes, "gradient_tape/")

// Prefixes of the op types (and so of the default node names) that write a resource variable in place: optimizer
// updates and assignments.
DYMEM_OP_SET(kVariableUpdatePrefixes, "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
             "ResourceApply", "ResourceSparseApply", "ResourceScatter")
