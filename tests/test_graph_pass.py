"""The graph pass after Grappler (cc/pass/graph_pass.cc, cc/pass/step_plan.cc) through its Python bridge: what it
offers, and that a plan is applied all or nothing."""
import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import dymem_tf  # noqa: F401  (loads the libraries)
from dymem_tf.passes import graph_def_view, graph_pass, plan_message


def _step_function():
    """A tf.function with a gradient tape (the pass only offers graphs holding gradient ops)."""
    w = tf.Variable(np.ones((8, 8), np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(x, w))
            loss = tf.reduce_sum(tf.matmul(h, w))
        return loss, tape.gradient(loss, w)

    return step


X = np.arange(32, dtype=np.float32).reshape(4, 8) / 32


def _offered(listener):
    step = _step_function()
    with graph_pass.armed(listener):
        out = step(tf.constant(X))
    return [t.numpy() for t in out]


def test_graphs_without_gradients_are_not_offered_and_unarmed_graphs_run_untouched():
    calls = []

    @tf.function
    def plain(x):
        return tf.nn.relu(x) * 2.0

    with graph_pass.armed(calls.append):
        plain(tf.constant(X))
    _step_function()(tf.constant(X))  # not armed
    assert calls == []


def test_the_offered_graph_carries_types_and_shapes_from_the_runtime():
    seen = []
    _offered(lambda call: seen.append((call.function_name, call.graph())))
    assert len(seen) == 1
    name, view = seen[0]
    assert name.startswith("__inference_step")
    relu = [op for op in view.get_operations() if op.type == "Relu"][0]
    assert relu.outputs[0].dtype == tf.float32 and relu.outputs[0].shape.as_list() == [4, 8]
    grads = [op for op in view.get_operations() if "gradient_tape/" in op.name]
    assert grads and all(op.device for op in grads)


def _dynamic_reshape_shapes(batch_size):
    """The shape the pass is offered for a Relu behind a ``tf.shape``-computed Reshape of an input whose batch
    dimension is unknown (a dataset batched without ``drop_remainder``), armed with ``batch_size``."""
    w = tf.Variable(np.ones((8, 8), np.float32))
    dataset = tf.data.Dataset.from_tensor_slices(np.ones((10, 4, 8), np.float32)).batch(3)
    iterator = iter(dataset)

    @tf.function
    def step(it):
        x = next(it)
        with tf.GradientTape() as tape:
            flat = tf.reshape(x, tf.stack([tf.shape(x)[0] * 4, 8]))
            h = tf.nn.relu(tf.matmul(flat, w))
            loss = tf.reduce_sum(h)
        return loss, tape.gradient(loss, w)

    seen = []
    with graph_pass.armed(lambda call: seen.append(call.graph()),
                          batch_size=batch_size):
        out = step(iterator)
    relu = [op for op in seen[0].get_operations() if op.type == "Relu"][0]
    return relu.outputs[0].shape.as_list(), float(out[0])


def test_the_batch_size_hint_gives_shapes_computed_from_the_input_batch_and_changes_no_value():
    """A budget needs every size: with the batch hint the Reshape's dynamic target is inferred ([3 * 4, 8]), without
    it the dimension stays unknown; the step computes the same either way, and the hint ends with the block."""
    unknown, loss = _dynamic_reshape_shapes(None)
    known, loss_hinted = _dynamic_reshape_shapes(3)
    assert unknown == [None, 8] and known == [12, 8]
    assert loss == loss_hinted == 12 * 8 * 8
    assert _dynamic_reshape_shapes(None)[0] == [None, 8]  # not left set after the armed block


def _versioned(records: str) -> str:
    """``records`` (record lines, each ending in a newline) as a plan message: after its header line."""
    return plan_message.message([]) + records


def _records(kind, *fields: dict) -> str:
    """Records of ``kind`` with the given fields (by name), each line ending in a newline."""
    return "".join(plan_message.record(kind, **f) + "\n" for f in fields)


def _seq(names, bands=None) -> str:
    """``seq`` records of chain 0 for ``names``, each in a band of its own unless ``bands`` are given."""
    bands = range(len(names)) if bands is None else bands
    return _records("seq", *[{"chain": 0, "node": n, "band": b} for n, b in zip(names, bands)])


_SEQADDED = _records("seqadded", {"chain": 0})


def _relu_swap_plan(view, consumers=None, trigger="", keep_rows=0):
    relu = [op for op in view.get_operations() if op.type == "Relu"][0]
    readers = consumers or [op.name for op in relu.outputs[0].consumers() if "gradient_tape/" in op.name]
    name = relu.name
    out = f"{name}/dymem_swap_out_0"
    return (_records("out", {"producer": name, "port": 0, "swap_out": out, "keep_rows": keep_rows})
            + _records("in", {"swap_out": out, "swap_in": f"{name}/dymem_swap_in_0_0", "trigger": trigger,
                              "consumers": ",".join(readers)}))


def test_a_plan_inserts_swap_ops_and_the_step_computes_the_same_values():
    base = _offered(lambda call: None)
    rewritten = []

    def apply(call):
        view = call.graph()
        rewritten.append(call.apply(_versioned(_relu_swap_plan(view))).view())

    out = _offered(apply)
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)
    types = [op.type for op in rewritten[0].get_operations()]
    assert types.count("DymemSwapOut") == 1 and types.count("DymemSwapIn") == 1
    swap_in = [op for op in rewritten[0].get_operations() if op.type == "DymemSwapIn"][0]
    assert swap_in.outputs[0].consumers() and swap_in.device


def test_a_partial_swap_keeps_its_rows_on_the_device_and_the_step_computes_the_same_values():
    """A plan that keeps rows of a swapped tensor (``keep_rows``) inserts DymemSwapOutPartial, whose kept rows and
    host part both feed DymemSwapInPartial; the step's values are those of the step as compiled."""
    base = _offered(lambda call: None)
    rewritten = []

    def apply(call):
        rewritten.append(call.apply(_versioned(_relu_swap_plan(call.graph(), keep_rows=3))).view())

    out = _offered(apply)
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)
    ops = rewritten[0].get_operations()
    (swap_out,) = [op for op in ops if op.type == "DymemSwapOutPartial"]
    (swap_in,) = [op for op in ops if op.type == "DymemSwapInPartial"]
    assert swap_out.get_attr("keep_rows") == 3 and not any(op.type in ("DymemSwapOut", "DymemSwapIn") for op in ops)
    assert [t.op.name for t in swap_in.inputs] == [swap_out.name, swap_out.name]
    assert [t.value_index for t in swap_in.inputs] == [0, 1]
    assert swap_in.outputs[0].consumers() and swap_in.device


@pytest.mark.parametrize("plan, fragment", [
    ("bogus line\n", "unknown record kind 'bogus line'"),
    ("out\tno_such_node\t0\tx/dymem_swap_out_0\t0\n", "no_such_node"),
    ("out\tx\t0\tx/dymem_swap_out_0\t-1\n", "malformed"),
    ("in\tmissing_out\tx/in\t\tconsumer\n", "unknown swap-out"),
    ("seq\t0\tno_such_node\t0\n", "no_such_node"),
    ("seq\tnot_a_chain\tx\t0\n", "malformed"),
    ("seq\t-1\tx\t0\n", "malformed"),
    ("seq\t0\tx\t-1\n", "malformed"),
    ("seq\t0\tx\t1\nseq\t0\ty\t0\n", "malformed"),
    ("seq\t0\tx\t\n", "malformed"),
    ("seqadded\n", "a 'seqadded' record has 1 fields (chain), not 0"),
    ("out\tx\t0\n", "a 'out' record has 4 fields (producer, port, swap_out, keep_rows), not 2"),
])
def test_a_plan_that_does_not_fit_is_refused_and_the_graph_is_unchanged(plan, fragment):
    base = _offered(lambda call: None)
    errors, sizes = [], []

    def apply(call):
        try:
            call.apply(_versioned(plan))
        except graph_pass.PlanApplyError as err:
            errors.append(str(err))
        sizes.append(len(call.graph().get_operations()))

    out = _offered(apply)
    assert len(errors) == 1 and fragment in errors[0]
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


def test_a_plan_that_would_close_a_cycle_is_undone_completely():
    rewritten, errors, cycle_nodes = [], [], set()

    def apply(call):
        view = call.graph()
        relu = [op for op in view.get_operations() if op.type == "Relu"][0]
        # trigger the swap-in by an op that depends on the swap-in's own consumer: a cycle
        consumer = [op for op in relu.outputs[0].consumers() if "gradient_tape/" in op.name][0]
        late = [op.name for op in view.get_operations() if consumer in
                [t.op for t in op.inputs]][0]
        plan = _relu_swap_plan(view, [consumer.name], trigger=late)
        cycle_nodes.add(late)
        try:
            call.apply(_versioned(plan))
        except graph_pass.PlanApplyError as err:
            errors.append(str(err))
        # nothing of the plan stays: applying a good plan afterwards still works
        rewritten.append(call.apply(_versioned(_relu_swap_plan(view))))

    base = _offered(lambda call: None)
    out = _offered(apply)
    assert errors and "cyclic" in errors[0] and f"{cycle_nodes.pop()} -> " in errors[0]  # names it
    types = [op.type for op in rewritten[0].view().get_operations()]
    assert types.count("DymemSwapOut") == 1 and types.count("DymemSwapIn") == 1
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


def _dag(view) -> nx.DiGraph:
    """The offered graph's nodes and edges (data and control)."""
    g = nx.DiGraph()
    for op in view.get_operations():
        g.add_node(op.name)
        g.add_edges_from((t.op.name, op.name) for t in op.inputs)
        g.add_edges_from((c.name, op.name) for c in op.control_inputs)
    return g


def _control_inputs(view, name) -> set[str]:
    return {c.name for c in view.get_operation_by_name(name).control_inputs}


def test_a_second_plan_on_one_call_returns_the_graph_with_both_plans():
    """Each apply returns the graph as it now is: a second plan's view still holds the first plan's swap ops and
    their rerouted consumers (the pass hands back only what changed, so it must hand back every change)."""
    base = _offered(lambda call: None)
    seen = {}

    def apply(call):
        view = call.graph()
        first = call.apply(_versioned(_relu_swap_plan(view))).view()
        g = _dag(view)
        a, b = [n for n in nx.topological_sort(g) if g.in_degree(n) > 0][-2:]
        second = call.apply(_versioned(_records("ctrl", {"src": a, "dst": b}))).view()
        seen["types"] = [sorted(op.type for op in v.get_operations() if op.type.startswith("DymemSwap"))
                         for v in (first, second)]
        seen["readers"] = [sorted(c.name for op in v.get_operations() if op.type == "DymemSwapIn"
                                  for c in op.outputs[0].consumers()) for v in (first, second)]
        seen["ctrl"] = (a, b, _control_inputs(second, b))

    out = _offered(apply)
    assert seen["types"][0] == ["DymemSwapIn", "DymemSwapOut"] and seen["types"][1] == seen["types"][0]
    assert seen["readers"][0] and seen["readers"][1] == seen["readers"][0]
    a, b, controls = seen["ctrl"]
    assert a in controls
    for x, y in zip(out, base):
        np.testing.assert_array_equal(x, y)


def test_seq_records_chain_independent_ops_in_the_listed_order_and_bend_to_the_graphs_edges():
    """Two ops with no path between them get an edge in the listed order; the whole graph listed backwards is
    chained in a topological order (no cycle: the listed order gives way to the edges), and the step computes the
    same."""
    base = _offered(lambda call: None)
    seen = {}

    def apply(call):
        view = call.graph()
        g = _dag(view)
        ops = [n for n in nx.topological_sort(g) if g.in_degree(n) > 0]
        a, b = next((a, b) for i, a in enumerate(ops) for b in ops[i + 1:]
                    if not nx.has_path(g, a, b) and not nx.has_path(g, b, a))
        text = _seq(ops[::-1])
        rewritten = call.apply(_versioned(_seq([b, a]))).view()
        seen["pair"] = (a, b, _control_inputs(rewritten, a))
        seen["backwards"] = _dag(call.apply(_versioned(text)).view())

    out = _offered(apply)
    a, b, controls = seen["pair"]
    assert b in controls
    assert nx.is_directed_acyclic_graph(seen["backwards"])
    for x, y in zip(out, base):
        np.testing.assert_array_equal(x, y)


def test_bands_leave_their_ops_unordered_and_wait_for_the_whole_band_before():
    """Two bands of several ops: no edge inside a band, one NoOp that every op of the first precedes and that
    precedes every op of the second, no other edge; the step computes the same."""
    base = _offered(lambda call: None)
    seen = {}

    def apply(call):
        view = call.graph()
        g = _dag(view)
        ops = [n for n in nx.topological_sort(g) if g.in_degree(n) > 0 and not n.startswith("Identity")
               and view.get_operation_by_name(n).type != "_Retval"]
        half = len(ops) // 2
        seen["bands"] = (ops[:half], ops[half:])
        seen["before"] = set(g.edges)
        seen["after"] = _dag(call.apply(_versioned(_seq(ops, [0] * half + [1] * (len(ops) - half)))).view())

    out = _offered(apply)
    first, second = seen["bands"]
    assert len(first) > 1 and len(second) > 1
    barrier = f"{second[0]}/dymem_band_start"
    g = seen["after"]
    assert set(g.predecessors(barrier)) == set(first) and set(g.successors(barrier)) == set(second)
    assert set(g.edges) - seen["before"] == {(a, barrier) for a in first} | {(barrier, b) for b in second}
    for x, y in zip(out, base):
        np.testing.assert_array_equal(x, y)


def test_a_chain_numbering_more_bands_than_nodes_is_refused():
    errors = []

    def apply(call):
        ops = [n for n in nx.topological_sort(_dag(call.graph())) if n.startswith("MatMul")]
        try:
            call.apply(_versioned(_seq(ops, [0, 7])))
        except graph_pass.PlanApplyError as err:
            errors.append(str(err))

    _offered(apply)
    assert len(errors) == 1 and "numbers its bands up to 7 for 2 nodes" in errors[0]


def test_a_seqadded_record_chains_the_plans_own_ops_as_soon_as_they_are_ready():
    seen = {}

    def apply_with(added):
        def apply(call):
            view = call.graph()
            g = _dag(view)
            chain = _seq([n for n in nx.topological_sort(g) if g.in_degree(n) > 0])
            text = _relu_swap_plan(view, trigger="MatMul_1") + chain + (_SEQADDED if added else "")
            rewritten = _dag(call.apply(_versioned(text)).view())
            swaps = [n for n in rewritten if "/dymem_swap_" in n]
            seen[added] = {(a, b) for a in swaps for b in rewritten.successors(a)}
        return apply

    _offered(apply_with(False))
    _offered(apply_with(True))
    # the swap-out right after its producer (already its input), then the forward op that triggers the swap-in (a
    # new edge), the swap-in (after its trigger already) and its consumer (already its output's)
    assert seen[False] < seen[True] and len(seen[True] - seen[False]) == 1


def _gated_step_function():
    """A train step with a ``tf.cond`` whose "then" branch (a Relu read by a Mul) is never taken: after lowering, the
    branch's ops are dead in every run."""
    w = tf.Variable(np.ones((8, 8), np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = tf.matmul(x, w)
            h = tf.cond(tf.reduce_sum(h) < -1e9, lambda: tf.nn.relu(h * 2.0) * 3.0, lambda: h * 0.5)
            loss = tf.reduce_sum(tf.matmul(h, w))
        return loss, tape.gradient(loss, w)

    return step


def test_seqadded_leaves_swap_ops_on_an_untaken_branch_out_of_the_chain():
    """Regression: every op the plan added joined the chain, and a dead one (on the branch not taken) made every op
    chained after it dead, so the step had no results. A branch's swap ops must not be chained."""
    step = _gated_step_function()
    base = [t.numpy() for t in step(tf.constant(X))]
    seen = {}

    def apply(call):
        view = call.graph()
        relu = next(op for op in view.get_operations() if op.type == "Relu")
        consumer = relu.outputs[0].consumers()[0].name
        g = _dag(view)
        types = {op.name: op.type for op in view.get_operations()}
        # the ops of both branches: reached from a Switch before a Merge (what Python's capture marks conditional)
        beyond = g.subgraph(n for n in g if types[n] != "Merge")
        branch = set().union(*(nx.descendants(beyond, n) for n in g if types[n] == "Switch"))
        chain = [n for n in nx.topological_sort(g) if g.in_degree(n) > 0 and n not in branch
                 and types[n] not in ("_Retval", "Switch", "Merge")]
        text = _relu_swap_plan(view, consumers=[consumer]) + _seq(chain) + _SEQADDED
        seen["graph"] = _dag(call.apply(_versioned(text)).view())
        seen["swaps"] = {n for n in seen["graph"] if "/dymem_swap_" in n}
        seen["consumer"] = consumer

    step = _gated_step_function()
    with graph_pass.armed(apply):
        out = [t.numpy() for t in step(tf.constant(X))]
    g, swaps = seen["graph"], seen["swaps"]
    assert len(swaps) == 2
    # inserted, and linked only to each other and the consumer: no chain edge leaves them
    assert all(set(g.successors(n)) <= swaps | {seen["consumer"]} for n in swaps)
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


def test_a_listener_that_raises_leaves_the_step_unmodified_with_a_warning():
    base = _offered(lambda call: None)

    def broken(call):
        raise RuntimeError("planner bug")

    with pytest.warns(RuntimeWarning, match="planner bug"):
        out = _offered(broken)
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


def test_fail_cancels_the_instantiation_before_the_step_runs():
    step = _step_function()
    with graph_pass.armed(lambda call: call.fail("captured")):
        with pytest.raises(tf.errors.CancelledError, match="dymem_tf: captured"):
            step(tf.constant(X))


def test_encode_plan_names_the_swap_ops():
    from dymem_tf.planning.plan import SwapDecision, SwapIn

    decision = SwapDecision("a/Relu:1", "a/Relu", 64, 1, [], ["g"], [SwapIn("t", 3, ["g"], 4)])
    text = graph_pass.encode_plan([decision], [("x", "y")])
    assert text.splitlines() == [plan_message.header(), "out\ta/Relu\t1\ta/Relu/dymem_swap_out_1\t0",
                                 "in\ta/Relu/dymem_swap_out_1\ta/Relu/dymem_swap_in_1_0\tt\tg", "ctrl\tx\ty"]


def test_tensors_a_gpu_keeps_in_host_memory_are_never_swapped():
    """int32 tensors live in host memory on a GPU: planned on a GPU placement of the step, none takes device memory
    and none is swapped, while on the CPU they are device tensors like any other."""
    import keras

    from dymem_tf.passes import graph_capture
    from dymem_tf.planning import planner

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = []
    with graph_pass.armed(lambda call: seen.append((call.graph_def_bytes, call.outputs_bytes))):
        model.fit(np.zeros((8, 8, 8, 3), np.float32), np.zeros((8,), np.int32), batch_size=8, verbose=0)
    on_gpu = (seen[0][0].replace(b"device:CPU:0", b"device:GPU:0"), seen[0][1])

    def capture(data):
        view = graph_def_view.GraphView(*data)
        sg = graph_capture.capture_step_graph(view.get_operations(), batch_size=8)
        return sg, planner.make_plan(sg, min_swap_bytes=0)

    def int32(sg):
        return [t for t in sg.tensors.values() if t.dtype == "int32" and t.alias_of is None]

    cpu, _ = capture(seen[0])
    gpu, gpu_plan = capture(on_gpu)
    assert any(t.bytes > 0 and not t.persistent for t in int32(cpu))  # device memory on the CPU
    assert int32(gpu) and all(t.bytes == 0 and t.persistent for t in int32(gpu))  # host memory on a GPU
    assert gpu_plan.swaps and not [s for s in gpu_plan.swaps if gpu.tensors[s.tensor].dtype == "int32"]


def _momentum_step():
    """A tf.function whose update reads and writes ``m`` after the gradient (optimizer state), and the variables."""
    w = tf.Variable(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8))
    m = tf.Variable(np.full((8, 8), 0.5, np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.relu(tf.matmul(x, w)))
        g = tape.gradient(loss, w)
        m.assign(0.9 * m + g)
        w.assign_sub(0.1 * m)
        return loss

    return step, w, m


def _state_arg(view):
    """The resource argument of ``m``: the one whose readers and writers all run after the gradient."""
    args = [op for op in view.get_operations() if op.type == "_Arg" and op.outputs[0].dtype == tf.resource]
    for arg in args:
        users = arg.outputs[0].consumers()
        if any(u.type == "AssignVariableOp" for u in users) and not any(u.type == "AssignSubVariableOp"
                                                                         for u in users):
            return arg, [u.name for u in users]
    raise AssertionError("no state argument")


def _run_momentum(listener, steps=3):
    from dymem_tf.ops import swap_ops

    step, w, m = _momentum_step()
    losses, offloaded = [], []
    for _ in range(steps):
        with graph_pass.armed(listener):
            losses.append(float(step(tf.constant(X))))
        offloaded.append(swap_ops.variable_is_offloaded(m))
    return losses, w.numpy(), m.numpy(), offloaded


def test_a_var_record_keeps_the_state_in_host_memory_between_its_uses():
    base = _run_momentum(lambda call: None)
    rewritten = []

    def apply(call):
        view = call.graph()
        arg, users = _state_arg(view)
        n = arg.name
        plan = _records("var", {"resource": n, "port": 0, "evict": f"{n}/dymem_var_evict_0",
                                "swap_in": f"{n}/dymem_var_swap_in_0", "swap_out": f"{n}/dymem_var_swap_out_0",
                                "trigger": "", "consumers": ",".join(users)})
        rewritten.append(call.apply(_versioned(plan)).view())

    losses, w, m, offloaded = _run_momentum(apply)
    assert losses == base[0]
    np.testing.assert_array_equal(w, base[1])
    np.testing.assert_array_equal(m, base[2])  # read while offloaded: the host copy
    assert offloaded == [True, True, True] and base[3] == [False, False, False]
    types = [op.type for op in rewritten[0].get_operations()]
    assert types.count("DymemVariableSwapOut") == 2 and types.count("DymemVariableSwapIn") == 1


def test_records_may_name_the_nodes_a_var_record_adds():
    """Validation accepts a control edge (or a clone input) that names a node a ``var`` record adds; the applier
    must find it too (it looked up only the graph's nodes and the other records' ones: std::out_of_range inside
    TensorFlow ended the process)."""
    base = _run_momentum(lambda call: None, steps=2)
    rewritten = []

    def apply(call):
        view = call.graph()
        arg, users = _state_arg(view)
        n = arg.name
        plan = (_records("var", {"resource": n, "port": 0, "evict": f"{n}/e", "swap_in": f"{n}/i",
                                 "swap_out": f"{n}/o", "trigger": "", "consumers": ",".join(users)})
                + _records("ctrl", {"src": f"{n}/e", "dst": users[0]}))
        rewritten.append((call.apply(_versioned(plan)).view(), f"{n}/e", users[0]))

    losses, w, m, offloaded = _run_momentum(apply, steps=2)
    assert losses == base[0] and offloaded == [True, True]
    np.testing.assert_array_equal(w, base[1])
    view, evict, user = rewritten[0]
    assert evict in [c.name for c in view.op(user).control_inputs]


@pytest.mark.parametrize("record, fragment", [
    ("var\t{x}\t0\ta\tb\tc\t\t{users}\n", "is not a resource"),
    ("var\t{arg}\t0\ta\tb\tc\t\t{x}\n", "does not read"),
    ("var\t{arg}\t0\ta\ta\tc\t\t{users}\n", "already taken"),
    ("var\t{arg}\t0\ta\tb\tc\n", "a 'var' record has 7 fields"),
])
def test_a_var_record_that_does_not_fit_is_refused(record, fragment):
    errors = []

    def apply(call):
        view = call.graph()
        arg, users = _state_arg(view)
        x = [op.name for op in view.get_operations() if op.type == "MatMul"][0]
        try:
            call.apply(_versioned(record.format(arg=arg.name, users=",".join(users), x=x)))
        except graph_pass.PlanApplyError as err:
            errors.append(str(err))

    losses, *_ = _run_momentum(apply, steps=1)
    assert len(errors) == 1 and fragment in errors[0]
    assert losses == _run_momentum(lambda call: None, steps=1)[0]


@pytest.mark.parametrize("record, fragment", [
    ("vin\t{x}\t0\tw_in\t1\n", "is not a resource"),
    ("vin\t{arg}\t0\tw_in\t2\n", "malformed"),
    ("vread\t{arg}\t0\tw_read\t{x}\n", "gives no dtype"),
    ("clone\tno_such_node\tcopy\t0:{x}\n", "no_such_node"),
    ("clone\t{x}\tcopy\t7:{x}\n", "has no input 7"),
    ("clone\t{x}\tcopy\t0:not_added_yet\n", "neither in the graph nor added before"),
    ("clone\t{x}\tcopy\t0x\n", "malformed"),
    ("reroute\t{x}\t{arg}\t0\t{x}\n", "does not read"),
    ("vin\t{arg}\t0\tw_in\t0\nvin\t{arg}\t0\tw_in\t0\n", "already taken"),
    ("vkeep\t{x}\t0\tw_keep\t0\n", "is not a resource"),
    ("vkeep\t{arg}\t0\tw_keep\n", "a 'vkeep' record has 4 fields"),
])
def test_a_weight_or_recompute_record_that_does_not_fit_is_refused(record, fragment):
    """The records that offload weights and recompute tensors (vin, vout, vread, clone, reroute) are checked like
    the others: a plan naming what is not there is refused whole and the step trains as without a plan."""
    errors = []

    def apply(call):
        view = call.graph()
        arg, _ = _state_arg(view)
        x = [op.name for op in view.get_operations() if op.type == "MatMul"][0]
        try:
            call.apply(_versioned(record.format(arg=arg.name, x=x)))
        except graph_pass.PlanApplyError as err:
            errors.append(str(err))

    losses, *_ = _run_momentum(apply, steps=1)
    assert len(errors) == 1 and fragment in errors[0], errors
    assert losses == _run_momentum(lambda call: None, steps=1)[0]


def _every_kind_message(view) -> str:
    """A message with a record of each kind plan_schema.h defines, for the momentum step's graph ``view``: swap a
    ReLU (out, in), offload the state (var), move the weight out and back (vout, vin), keep it (vkeep), read it
    (vread), compute the ReLU's forward reader from a copy (clone, reroute), order ops (ctrl, seq, seqadded)."""
    from dymem_tf.passes.plan_message import record

    m, m_users = _state_arg(view)
    w = [op for op in view.get_operations() if op.type == "_Arg" and op.outputs[0].dtype == tf.resource
         and op is not m][0]
    w_users = [u.name for u in w.outputs[0].consumers()]
    w_read = [u for u in w_users if view.op(u).type == "ReadVariableOp"][0]
    relu = [op for op in view.get_operations() if op.type == "Relu"][0]
    matmul = relu.inputs[0].op.name
    reader = [c.name for c in relu.outputs[0].consumers() if "gradient_tape/" not in c.name][0]
    grads = [op.name for op in relu.outputs[0].consumers() if "gradient_tape/" in op.name]
    out, swap_in = f"{relu.name}/dymem_swap_out_0", f"{relu.name}/dymem_swap_in_0_0"

    def weight(kind, name, **last):
        return record(kind, resource=w.name, port=0, name=name, **last)

    return plan_message.message([
        record("out", producer=relu.name, port=0, swap_out=out, keep_rows=0),
        record("in", swap_out=out, swap_in=swap_in, trigger="", consumers=",".join(grads)),
        record("var", resource=m.name, port=0, evict="m/e", swap_in="m/i", swap_out="m/o", trigger="",
               consumers=",".join(m_users)),
        weight("vout", "w/out", discard=0), weight("vin", "w/in", keep_host=0), weight("vkeep", "w/keep", keep_host=0),
        weight("vread", "w/read", like=w_read),
        record("ctrl", src="w/out", dst="w/in"), record("ctrl", src="w/in", dst="w/keep"),
        record("ctrl", src="w/in", dst="w/read"), *[record("ctrl", src="w/keep", dst=u) for u in w_users],
        record("clone", node=relu.name, name="relu/copy", inputs=""),
        record("reroute", consumer=reader, source=relu.name, port=0, target="relu/copy"),
        record("seq", chain=0, node=matmul, band=0), record("seq", chain=0, node=relu.name, band=1),
        record("seqadded", chain=0)])


def _rotated_columns(text: str) -> str:
    """``text`` (a plan message) with each record kind's columns rotated by one, in its header and its records:
    every field of a kind with several moves to another column."""
    head, *lines = text.splitlines()
    fields = head.split("\t")
    declared = [kind_names.partition(":") for kind_names in fields[2:]]
    rotated = [f"{kind}:{','.join(names.split(',')[1:] + names.split(',')[:1])}" for kind, _, names in declared]
    records = [line.split("\t") for line in lines]
    return "\n".join(["\t".join(fields[:2] + rotated)] + ["\t".join([f[0], *f[2:], f[1]]) for f in records]) + "\n"


def _structure(view) -> list:
    """Each op of ``view`` with its type, data inputs and control inputs, sorted: what a plan changes."""
    return sorted((op.name, op.type, [t.name for t in op.inputs], sorted(c.name for c in op.control_inputs))
                  for op in view.get_operations())


def test_a_plan_of_every_record_kind_applies_and_trains_the_same_in_any_column_order():
    """The every-kind message adds every op and computes the plain step's values; the same message with each kind's
    columns in another order (header and records alike) is read by name and rewrites the graph identically."""
    from dymem_tf.passes.plan_message import schema

    rewritten, kinds = {}, set()

    def apply(order):
        def listener(call):
            text = _every_kind_message(call.graph())
            kinds.update(fields[0] for fields in plan_message.records_of(text))
            rewritten.setdefault(order, call.apply(text if order == "schema" else _rotated_columns(text)).view())
        return listener

    base = _run_momentum(lambda call: None, steps=2)
    for order in ("schema", "rotated"):
        losses, w, m, offloaded = _run_momentum(apply(order), steps=2)
        assert losses == base[0] and offloaded == [True, True], order
        np.testing.assert_array_equal(w, base[1])
        np.testing.assert_array_equal(m, base[2])
    assert kinds == set(schema().records)  # a new record kind needs a place here
    types = [op.type for op in rewritten["schema"].get_operations()]
    assert {"DymemSwapOut", "DymemSwapIn", "DymemVariableSwapOut", "DymemVariableSwapIn",
            "DymemVariableRead"} <= set(types)
    assert "relu/copy" in [op.name for op in rewritten["schema"].get_operations()]
    assert _structure(rewritten["rotated"]) == _structure(rewritten["schema"])


def _every_kind_text() -> str:
    """A message with a record of each kind, of made-up node names (for the parser alone)."""
    from dymem_tf.passes.plan_message import record

    return plan_message.message([
        record("out", producer="a", port=1, swap_out="a/o", keep_rows=0),
        record("in", swap_out="a/o", swap_in="a/i", trigger="t", consumers="g1,g2"),
        record("ctrl", src="x", dst="y"),
        record("var", resource="m", port=0, evict="m/e", swap_in="m/i", swap_out="m/o", trigger="", consumers="u"),
        record("vin", resource="w", port=2, name="w/in", keep_host=1),
        record("vkeep", resource="w", port=2, name="w/keep", keep_host=0),
        record("vout", resource="w", port=2, name="w/out", discard=1),
        record("vread", resource="w", port=2, name="w/read", like="r"),
        record("clone", node="c", name="c/copy", inputs="0:a/i,2:w/read"),
        record("reroute", consumer="g3", source="c", port=3, target="c/copy"),
        record("seq", chain=0, node="x", band=0), record("seq", chain=0, node="y", band=2),
        record("seqadded", chain=0)])


def test_the_parser_reads_every_field_by_its_name_whatever_its_column():
    """describe_plan (the native parser's reading, dymem_pass_parse_plan) names each value's field: every value
    lands in its field, and rotating every kind's columns changes nothing."""
    text = _every_kind_text()
    read = graph_pass.describe_plan(text)
    assert read.splitlines() == [
        "out\tproducer=a\tport=1\tswap_out=a/o\tkeep_rows=0",
        "in\tswap_out=a/o\tswap_in=a/i\ttrigger=t\tconsumers=g1,g2",
        "var\tresource=m\tport=0\tevict=m/e\tswap_in=m/i\tswap_out=m/o\ttrigger=\tconsumers=u",
        "vin\tresource=w\tport=2\tname=w/in\tkeep_host=1",
        "vkeep\tresource=w\tport=2\tname=w/keep\tkeep_host=0",
        "vout\tresource=w\tport=2\tname=w/out\tdiscard=1",
        "vread\tresource=w\tport=2\tname=w/read\tlike=r",
        "clone\tnode=c\tname=c/copy\tinputs=0:a/i,2:w/read",
        "reroute\tconsumer=g3\tsource=c\tport=3\ttarget=c/copy",
        "ctrl\tsrc=x\tdst=y",
        "seq\tchain=0\tnode=x\tband=0", "seq\tchain=0\tnode=y\tband=2",
        "seqadded\tchain=0"]
    assert _rotated_columns(text) != text
    assert graph_pass.describe_plan(_rotated_columns(text)) == read


def _declaring(records: str, version=None, **declarations) -> str:
    """A message of ``records`` (lines) whose header declares each kind's columns as plan_schema.h does but for
    ``declarations`` (kind -> field names; None leaves the kind out), of ``version`` (None: the schema's)."""
    schema = plan_message.schema()
    columns = {**schema.records, **declarations}
    head = [plan_message.HEADER, str(schema.version if version is None else version)]
    head += [f"{kind}:{','.join(names)}" for kind, names in columns.items() if names is not None]
    return "\t".join(head) + "\n" + records


_SWAP_OUT = "out\t{r}\t0\t{r}/o\t0\n"


@pytest.mark.parametrize("text, fragment", [
    (_declaring(_SWAP_OUT, out=("source", "port", "swap_out", "keep_rows")),  # a renamed field
     ("the plan message's 'out' records have the unknown field 'source' (this graph pass reads producer, port, "
      "swap_out, keep_rows): the Python package and its native library come from different builds")),
    (_declaring("out\t{r}\t0\t{r}/o\t0\tx\n", out=("producer", "port", "swap_out", "keep_rows", "extra")),
     "'out' records have the unknown field 'extra'"),
    (_declaring("out\t{r}\t{r}/o\t0\n", out=("producer", "swap_out", "keep_rows")),
     "'out' records lack the field 'port'"),
    (_declaring(_SWAP_OUT, out=("producer", "port", "port", "keep_rows")),
     "declares the field 'port' of 'out' records twice"),
    (_declaring(_SWAP_OUT, bogus=("a", "b")),
     "header declares the unknown record kind 'bogus' (this graph pass reads out, in, ctrl,"),
    (_declaring(_SWAP_OUT, out=None), "plan line 2 is a 'out' record, a kind the message's header does not declare"),
    (_declaring("bogus\t{r}\n"), "plan line 2 has the unknown record kind 'bogus'"),
    (_declaring("out\t{r}\t0\n"),
     "plan line 2: a 'out' record has 4 fields (producer, port, swap_out, keep_rows), not 2"),
    (_declaring("out\t0\n", out=("port", "swap_out", "producer", "keep_rows")),
     "a 'out' record has 4 fields (port, swap_out, producer, keep_rows), not 1"),
    (_declaring(_SWAP_OUT, version=3), "the plan message is version 3 and this graph pass reads version 4"),
    ("dymem-plan\t3\n" + _SWAP_OUT, "the plan message is version 3 and this graph pass reads version 4"),
    (_SWAP_OUT, "does not start with its version line (dymem-plan 4)"),
    ("", "needs at least its version line"),
])
def test_a_message_not_of_this_schema_is_refused_naming_what_and_the_graph_is_unchanged(text, fragment):
    """A message from another build (another version; a kind or field this library's plan_schema.h lacks, or one of
    its fields left out) is refused with an error that names it, before any change: the graph stays as offered (the
    swap-out the message names can be added after it, and is all that is added) and the step computes the plain
    step's values."""
    errors, unchanged = [], []

    def apply(call):
        relu = next(op for op in call.graph().get_operations() if op.type == "Relu")
        message = text.format(r=relu.name)
        with pytest.raises(ValueError) as parsed:
            graph_pass.describe_plan(message)
        try:
            call.apply(message)
        except graph_pass.PlanApplyError as err:
            errors.append((str(err), str(parsed.value)))
        after = call.apply(_declaring(_SWAP_OUT.format(r=relu.name))).view()
        offered = {op.name for op in call.graph().get_operations()}
        unchanged.append({op.name for op in after.get_operations()} - offered == {f"{relu.name}/o"})

    assert plan_message.schema().version == 4
    base = _offered(lambda call: None)
    out = _offered(apply)
    assert len(errors) == 1 and fragment in errors[0][0] and errors[0][0] == errors[0][1], errors
    assert unchanged == [True]
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


def test_host_memory_outputs_of_other_dtypes_are_never_swapped_on_a_gpu():
    """An int64 ``Shape`` output read late in the backward pass: on the CPU a device tensor the plan swaps; on a
    GPU placement of the same step host memory (the GPU kernel registers ``HostMemory("output")``), never swapped."""
    from dymem_tf import compat
    from dymem_tf.passes import graph_capture
    from dymem_tf.planning import planner

    if "GPU" not in compat.registered_kernel_devices("Shape"):
        pytest.skip("this TensorFlow registers no GPU kernels")
    w = tf.Variable(np.ones((8, 8), np.float32) / 8)
    v = tf.Variable(np.ones((8,), np.float32))

    @tf.custom_gradient
    def scaled(h, shape):
        def grad(dy):  # reads the forward's int64 shape after the whole backward pass above it
            return dy + tf.broadcast_to(tf.reduce_mean(dy, axis=0), shape), None
        return h * 1.5, grad

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def step(x):
        with tf.GradientTape() as tape:
            h = scaled(x * v, tf.shape(x, out_type=tf.int64))
            for _ in range(4):
                h = tf.nn.relu(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
        return loss, tape.gradient(loss, [w, v])

    seen = []
    with graph_pass.armed(lambda call: seen.append((call.graph_def_bytes, call.outputs_bytes))):
        step(tf.ones((4, 8)))

    def planned(data):
        view = graph_def_view.GraphView(*data)
        sg = graph_capture.capture_step_graph(view.get_operations(), batch_size=4)
        shapes = [t for t in sg.tensors.values() if sg.ops[t.producer].type == "Shape" and t.dtype == "int64"]
        return sg, shapes, {s.tensor for s in planner.make_plan(sg, min_swap_bytes=0).swaps}

    cpu, cpu_shapes, cpu_swapped = planned(seen[0])
    gpu, gpu_shapes, gpu_swapped = planned((seen[0][0].replace(b"device:CPU:0", b"device:GPU:0"), seen[0][1]))
    assert [t.name for t in cpu_shapes] == [t.name for t in gpu_shapes] and len(cpu_shapes) == 1
    shape = cpu_shapes[0].name
    assert cpu.tensors[shape].bytes == 16 and not cpu.tensors[shape].persistent and shape in cpu_swapped
    assert gpu.tensors[shape].bytes == 0 and gpu.tensors[shape].persistent and shape not in gpu_swapped
    assert gpu_swapped == cpu_swapped - {shape}  # the float feature maps are swapped as before


def test_the_pass_and_the_planner_agree_on_the_steps_input_ops():
    """The C++ pass fills the unknown batch dimension of the outputs of the step's input ops
    (dymem_pass_step_input_types); the planner reads the batch from the same ops (step_pass.INPUT_OP_TYPES), plus
    IteratorGetNextAsOptional, whose one output is an optional with no batch dimension to fill."""
    from dymem_tf.passes import step_pass

    native = set(graph_pass._library().dymem_pass_step_input_types().decode().split(","))
    assert native == set(step_pass.INPUT_OP_TYPES) - {"IteratorGetNextAsOptional"}


def test_the_pass_offers_and_rewrites_the_partitioned_graph_after_onednn():
    """At "after_partitioning" (the default with oneDNN on) the pass offers the device's partition, named by the
    function, and a plan applied there computes the same values; an unknown stage is refused."""
    base = _offered(lambda call: None)
    seen = []

    def apply(call):
        seen.append((call.stage, call.function_name))
        call.apply(_versioned(_relu_swap_plan(call.graph())))

    step = _step_function()
    with graph_pass.armed(apply, stage="after_partitioning"):
        out = [t.numpy() for t in step(tf.constant(X))]
    assert [s for s, _ in seen] == ["after_partitioning"] and seen[0][1].startswith("__inference_step")
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="after_partitioning"):
        with graph_pass.armed(apply, stage="after_grappler"):
            pass


def test_the_default_stage_follows_onednn(monkeypatch):
    from dymem_tf import compat

    monkeypatch.setattr(compat, "onednn_enabled", lambda: True)
    assert graph_pass.default_stage() == "after_partitioning"
    monkeypatch.setattr(compat, "onednn_enabled", lambda: False)
    assert graph_pass.default_stage() == "after_xla"


@pytest.mark.parametrize("onednn_type, standard", [
    ("_MklNativeConv2D", "Conv2D"), ("_MklNativeFusedConv2D", "_FusedConv2D"), ("_MklMatMul", "MatMul"),
    ("_MklNativeFusedBatchNormV3", "FusedBatchNormV3"),
    ("_MklNativeConv2DBackpropFilterWithBias", "Conv2DBackpropFilter"), ("_MklNativePadWithConv2D", "Conv2D"),
    ("_MklLayerNorm", "_MklLayerNorm"), ("Relu", "Relu"), ("_FusedConv2D", "_FusedConv2D"),
])
def test_onednn_ops_read_as_the_standard_op_they_replace(onednn_type, standard):
    assert graph_def_view.standard_op_type(onednn_type) == standard


def test_a_onednn_max_pools_workspace_is_sized_from_its_output():
    from tensorflow.core.framework import node_def_pb2

    node = node_def_pb2.NodeDef(name="pool", op="_MklNativeMaxPool")
    outputs = [(tf.float32, (None, 4, 4, 8)), (tf.uint8, None)]
    assert graph_def_view._with_workspace(node, outputs)[1] == (tf.uint8, (None, 128))
    node.op = "MaxPool"
    assert graph_def_view._with_workspace(node, outputs) == outputs
