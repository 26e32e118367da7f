"""The bridge to Dymem's graph pass after Grappler (``cc/pass/graph_pass.cc``): offer, plan, apply.

TensorFlow runs the pass once per function instantiation, on the graph it will execute (after Grappler, and after
oneDNN's layout rewrite where that is on: :func:`default_stage`). While :func:`armed` blocks are active, the pass
hands every instantiated graph that holds gradient ops to the *listener* of one of them, as a :class:`PassCall`. The
listener may

* :meth:`PassCall.apply` a plan (:class:`~dymem_tf.planning.plan.Plan` records encoded by :func:`encode_plan`): the swap ops
  are inserted by node name, all or nothing;
* :meth:`PassCall.fail` the instantiation (the dry run captures a graph this way without running the step);
* do nothing: the graph runs as Grappler left it.

Which block's listener (:func:`_select_block`): blocks are kept per arming thread. A graph instantiated on a thread
that armed the pass goes to that thread's innermost block; one instantiated on another thread (TensorFlow may
instantiate a function on a thread of its own) to the innermost block of the only arming thread; with several
arming threads, such a graph runs unmodified, with a warning (once per process). The listener runs on the thread that
instantiates the function, usually the one calling it.

No exception crosses into TensorFlow. An ``Exception`` in a listener leaves the graph unmodified: a warning names
it, its traceback goes to the ``"dymem_tf"`` logger, and the block's :attr:`ArmedBlock.errors` keeps it. A
``KeyboardInterrupt`` or ``SystemExit`` fails the instantiation instead (the step does not run) and is raised again
when its block exits, so Ctrl-C stops training.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import warnings
from typing import Callable

from dymem_tf.passes.plan_message import message, record

logger = logging.getLogger("dymem_tf")

_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)
_CONTINUE, _FAIL = 0, 1

_lock = threading.RLock()
_active: list = []  # every thread's active ArmedBlocks, in the order armed
_state: dict = {}


# The buffers of a call (cc/pass/graph_pass.cc, dymem_pass_buffer).
_GRAPH, _OUTPUTS, _CHANGED, _CHANGED_OUTPUTS = 0, 1, 2, 3


class PassCall:
    """One offer of an instantiated graph to a listener (valid only while the listener runs).

    ``graph_def_bytes`` is the graph as Grappler (and, at ``stage`` ``"after_partitioning"``, oneDNN) left it,
    serialized; ``outputs_bytes`` its nodes' output types and inferred shapes (decoded by
    :class:`~dymem_tf.passes.graph_def_view.GraphView`)."""

    def __init__(self, lib, handle, function_name: str, graph_def_bytes: bytes):
        self._lib, self._handle = lib, handle
        self.function_name = function_name
        #: where the pass offered the graph (:data:`STAGES`), as the pass that offered it says
        self.stage = _STAGE_NAMES[lib.dymem_pass_call_stage(handle)]
        self.graph_def_bytes = graph_def_bytes
        self.outputs_bytes = self._buffer(_OUTPUTS)
        self.failed_with: str | None = None

    def graph_def(self):
        """The offered graph as a ``GraphDef`` (as Grappler left it)."""
        from tensorflow.core.framework import graph_pb2

        return graph_pb2.GraphDef.FromString(self.graph_def_bytes)

    def graph(self):
        """The offered graph as a :class:`~dymem_tf.passes.graph_def_view.GraphView`."""
        from dymem_tf.passes import graph_def_view

        return graph_def_view.GraphView(self.graph_def_bytes, self.outputs_bytes)

    def apply(self, plan_text: str):
        """Insert the plan (see :func:`encode_plan`); returns the graph as it now is, as a
        :class:`~dymem_tf.passes.graph_def_view.RewrittenGraph` (what this call's plans changed, merged into the
        offered graph when first read). Raises :class:`PlanApplyError` (graph unchanged) when the plan does not
        fit."""
        from dymem_tf.passes import graph_def_view

        if self._lib.dymem_pass_apply(self._handle, plan_text.encode()) != 0:
            raise PlanApplyError(self._lib.dymem_pass_error(self._handle).decode(errors="replace"))
        return graph_def_view.RewrittenGraph(self.graph_def_bytes, self.outputs_bytes, self._buffer(_CHANGED),
                                             self._buffer(_CHANGED_OUTPUTS))

    def fail(self, message: str) -> None:
        """Fail this instantiation with ``message`` (the step does not run; variables stay untouched)."""
        self.failed_with = message
        self._lib.dymem_pass_fail(self._handle, message.encode())

    def _buffer(self, which: int) -> bytes:
        data = ctypes.c_char_p()
        size = self._lib.dymem_pass_buffer(self._handle, which, ctypes.byref(data))
        return ctypes.string_at(data, size) if size > 0 else b""


class PlanApplyError(RuntimeError):
    """The pass could not apply a plan to the graph; the graph was left as it was."""


def _library():
    """The ops library as a ctypes handle with the pass's C functions typed."""
    if "lib" not in _state:
        from dymem_tf.memory import native

        lib = native.ops_cdll()
        lib.dymem_pass_set_handler.argtypes = [_HANDLER_TYPE]
        lib.dymem_pass_arm.argtypes = [ctypes.c_int]
        lib.dymem_pass_arm.restype = ctypes.c_int
        lib.dymem_pass_handled.restype = ctypes.c_int64
        lib.dymem_pass_apply.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.dymem_pass_apply.restype = ctypes.c_int
        lib.dymem_pass_error.argtypes = [ctypes.c_void_p]
        lib.dymem_pass_error.restype = ctypes.c_char_p
        lib.dymem_pass_buffer.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.dymem_pass_buffer.restype = ctypes.c_int64
        lib.dymem_pass_fail.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.dymem_pass_call_stage.argtypes = [ctypes.c_void_p]
        lib.dymem_pass_call_stage.restype = ctypes.c_int
        lib.dymem_pass_set_stage.argtypes = [ctypes.c_int]
        lib.dymem_pass_set_stage.restype = ctypes.c_int
        lib.dymem_pass_set_batch_hint.argtypes = [ctypes.c_int64]
        lib.dymem_pass_set_batch_hint.restype = ctypes.c_int64
        lib.dymem_pass_step_input_types.restype = ctypes.c_char_p
        lib.dymem_pass_infer_outputs.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64,
                                                 ctypes.POINTER(ctypes.c_char_p)]
        lib.dymem_pass_infer_outputs.restype = ctypes.c_int64
        lib.dymem_pass_parse_plan.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        lib.dymem_pass_parse_plan.restype = ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]


class ArmedBlock:
    """One :func:`armed` block, as it yields it: its ``listener``, the ``thread`` (ident) that armed it, its
    ``stage`` and ``batch_size``, the exceptions the listener raised during the block (:attr:`errors`; each left its
    graph unmodified), and the ``KeyboardInterrupt`` or ``SystemExit`` that failed an instantiation
    (:attr:`interrupt`; raised again when the block exits)."""

    def __init__(self, listener: Callable[[PassCall], None], thread: int, stage: str = "after_xla",
                 batch_size: int = 0):
        self.listener, self.thread, self.stage, self.batch_size = listener, thread, stage, batch_size
        self.errors: list[Exception] = []
        self.interrupt: BaseException | None = None


def _select_block(active: list, thread: int) -> tuple[ArmedBlock | None, bool]:
    """The block that receives a graph offered on ``thread``, from the ``active`` blocks (in the order armed), and
    whether none does because that is ambiguous: ``thread``'s innermost block if it armed the pass, else the
    innermost block of the only arming thread, else none (ambiguous when several threads armed it)."""
    own = [block for block in active if block.thread == thread]
    if own:
        return own[-1], False
    threads = {block.thread for block in active}
    if len(threads) == 1:
        return active[-1], False
    return None, len(threads) > 1


def _on_graph(handle, function_name, data, size) -> int:
    """The C handler: give the graph to the listener of the block :func:`_select_block` picks; never raise into
    TensorFlow (see the module's docstring for what an exception in the listener does)."""
    block = None
    try:
        with _lock:
            block, ambiguous = _select_block(_active, threading.get_ident())
        if block is None:
            if ambiguous:
                _warn_ambiguous()
            return _CONTINUE
        call = PassCall(_library(), handle, (function_name or b"").decode(errors="replace"),
                        ctypes.string_at(data, size))
        block.listener(call)
        return _FAIL if call.failed_with is not None else _CONTINUE
    except Exception as err:  # pylint: disable=broad-except  (an exception must not cross into TF's C++)
        return _listener_failed(block, err)
    except BaseException as err:  # KeyboardInterrupt, SystemExit: stop the step, raise again in the arming thread
        return _interrupted(block, handle, err)


def _listener_failed(block: ArmedBlock | None, err: Exception) -> int:
    """Report ``err`` (a warning naming it, its traceback to the log, ``block.errors``); the graph runs unmodified."""
    try:
        if block is not None:
            with _lock:
                block.errors.append(err)
        logger.exception("dymem_tf: the graph pass's listener raised %s; the step runs unmodified",
                         type(err).__name__, exc_info=err)
        warnings.warn(f"dymem_tf: the graph pass failed ({type(err).__name__}: {err}); the step runs unmodified "
                      "(traceback in the 'dymem_tf' log)", RuntimeWarning, stacklevel=1)
    except BaseException:  # pylint: disable=broad-except  (warnings as errors, or an interrupt while reporting)
        pass
    return _CONTINUE


def _interrupted(block: ArmedBlock | None, handle, err: BaseException) -> int:
    """Fail the instantiation for ``err`` (a KeyboardInterrupt or SystemExit), kept in ``block`` to be raised again
    when it exits."""
    try:
        if block is not None:
            with _lock:
                if block.interrupt is None:
                    block.interrupt = err
        _library().dymem_pass_fail(handle, f"interrupted ({type(err).__name__}) while planning the step".encode())
    except BaseException:  # pylint: disable=broad-except  (nothing may cross into TF's C++)
        pass
    return _FAIL


def _warn_ambiguous() -> None:
    """Warn, once per process, that a graph offered on a thread that did not arm the pass while several did ran
    unmodified."""
    with _lock:
        if _state.get("warned_ambiguous"):
            return
        _state["warned_ambiguous"] = True
    warnings.warn("dymem_tf: a train step was instantiated on a thread that did not arm the graph pass while "
                  "several threads have it armed, so it is nobody's to plan and runs unmodified: call each step on "
                  "the thread that arms the pass for it", RuntimeWarning, stacklevel=1)


def _install() -> None:
    """Install the C handler once per process (the ctypes function object is kept alive here)."""
    with _lock:
        if "handler" not in _state:
            _state["handler"] = _HANDLER_TYPE(_on_graph)
            _library().dymem_pass_set_handler(_state["handler"])


#: Where the pass acts (``cc/pass/graph_pass.cc``, ``Stage``): after XLA's auto-clustering passes, before them, or
#: after TensorFlow partitioned the graph by device and oneDNN rewrote its CPU partition.
STAGES = {"after_xla": 0, "before_xla": 1, "after_partitioning": 2}
_STAGE_NAMES = {number: name for name, number in STAGES.items()}


def default_stage() -> str:
    """The stage whose graph is the one that runs: after partitioning where oneDNN's layout pass rewrites CPU ops
    (it runs after TF's other passes, so swap ops inserted before it could keep a pair of ops from fusing as they
    do in the plain step), otherwise after XLA's clustering passes."""
    from dymem_tf import compat

    return "after_partitioning" if compat.onednn_enabled() else "after_xla"


@contextlib.contextmanager
def armed(listener: Callable[[PassCall], None], stage: str | None = None, batch_size: int | None = None):
    """Offer graphs instantiated inside this block to ``listener`` (the calling thread's innermost block wins; see
    the module's docstring for graphs instantiated on other threads). Yields the :class:`ArmedBlock`, whose
    ``errors`` list what the listener raised; a ``KeyboardInterrupt`` or ``SystemExit`` in the listener fails the
    instantiation and is raised again when the block exits.

    ``stage``: one of :data:`STAGES`, where the pass offers the graph (``None``: :func:`default_stage`);
    ``"before_xla"`` is for a step that is to be auto-clustered around its swap ops. The graph is Grappler's
    either way; ``"after_partitioning"`` offers each device's partition on its own. ``batch_size``: the batch an
    unknown batch dimension of the step's input stands for in the offered shapes, so that shapes computed from it
    (a ``Reshape`` to ``tf.shape(x)``-derived dimensions) are known too; the graph itself is not changed. Both are
    settings of the whole process's pass: the active block armed last (on any thread) sets them."""
    stage = default_stage() if stage is None else stage
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {sorted(STAGES)}, not {stage!r}")
    _install()
    lib = _library()
    block = ArmedBlock(listener, threading.get_ident(), stage, int(batch_size or 0))
    with _lock:
        unarmed = _apply_settings(block)
        if not _active:
            _state["unarmed_settings"] = unarmed
        _active.append(block)
        lib.dymem_pass_arm(1)
    try:
        yield block
    except BaseException:
        if block.interrupt is not None:  # the step's error (the failed instantiation) becomes its context
            raise block.interrupt  # pylint: disable=raise-missing-from
        raise
    finally:
        with _lock:
            _active.remove(block)
            if _active:
                _apply_settings(_active[-1])
            else:  # as before the first block
                stage_number, batch = _state.pop("unarmed_settings")
                lib.dymem_pass_set_stage(stage_number)
                lib.dymem_pass_set_batch_hint(batch)
            lib.dymem_pass_arm(-1)
    if block.interrupt is not None:
        raise block.interrupt


def _apply_settings(block: ArmedBlock) -> tuple[int, int]:
    """Set the native pass's stage and batch hint to ``block``'s; returns the previous ones."""
    lib = _library()
    return lib.dymem_pass_set_stage(STAGES[block.stage]), lib.dymem_pass_set_batch_hint(block.batch_size)


def infer_outputs(graph_def_bytes: bytes, batch_size: int | None = None) -> bytes:
    """The output records the pass offers beside ``graph_def_bytes`` (a serialized ``GraphDef``), inferred as it
    infers them (``batch_size`` as in :func:`armed`): with the GraphDef, what
    :class:`~dymem_tf.passes.graph_def_view.GraphView` reads. Raises ``ValueError`` for a GraphDef TensorFlow
    cannot build a graph from."""
    data = ctypes.c_char_p()
    size = _library().dymem_pass_infer_outputs(graph_def_bytes, len(graph_def_bytes), int(batch_size or 0),
                                                ctypes.byref(data))
    if size < 0:
        raise ValueError(f"TensorFlow cannot build a graph from this GraphDef: {data.value.decode(errors='replace')}")
    return ctypes.string_at(data, size) if size > 0 else b""


def describe_plan(plan_text: str) -> str:
    """What the native parser reads from a plan message, without applying it (``DescribeStepPlan`` in
    ``cc/pass/step_plan.h``): a line per record, in the order the pass applies them, its kind and tab-separated
    ``field=value``s named as in the schema. Raises ``ValueError`` with the parser's message for a message it
    refuses."""
    data = ctypes.c_char_p()
    if _library().dymem_pass_parse_plan(plan_text.encode(), ctypes.byref(data)) != 0:
        raise ValueError(data.value.decode(errors="replace"))
    return data.value.decode()


def graphs_offered() -> int:
    """How many instantiated graphs the pass has offered to Python in this process."""
    return int(_library().dymem_pass_handled())


def encode_plan(swaps, control_edges=(), resident=(), sequences=(), streamed_lists=()) -> str:
    """The pass's text form of a plan: ``swaps`` are :class:`~dymem_tf.planning.plan.SwapDecision`-like records
    (``tensor``, ``swap_ins`` with ``consumers`` and ``trigger_op``), ``control_edges`` ``(from, to)`` op pairs.

    Swap-out ``x:k`` is named ``x/dymem_swap_out_k``, its i-th swap-in ``x/dymem_swap_in_k_i``. A decision with
    ``kind == "variable"`` (optimizer state offloaded between its uses) becomes one ``var`` record, its ops named by
    :func:`variable_op_names`; one with ``kind == "weight"`` the records of :func:`_weight_records`. ``resident``:
    ``(resource, users)`` of variables the plan keeps, each brought back before its users by a ``vkeep`` (a
    ``vin`` whose buffer GTBM places in its persistent group: the variable stays on the device from then on).
    ``sequences``: ``(names, with_added, bands)`` triples, each list chained in its order as far as the graph
    allows (``seq`` records), with the nodes the plan adds on its device when ``with_added`` (``seqadded``), in
    ``bands`` (each name's band, non-decreasing; empty: each name its own). ``streamed_lists``: the loops' lists
    kept in host memory (:class:`~dymem_tf.planning.plan.StreamedList`, :func:`_streamed_list_records`).
    """
    lines = []
    for decision in swaps:
        producer, port = split_tensor_name(decision.tensor)
        if getattr(decision, "kind", "tensor") == "weight":
            lines += _weight_records(decision)
            continue
        if getattr(decision, "kind", "tensor") == "recompute":
            lines += _recompute_records(decision)
            continue
        if getattr(decision, "kind", "tensor") == "variable":
            swap_in = decision.swap_ins[0]
            evict, in_name, out_name = variable_op_names(decision.tensor)
            lines.append(record("var", resource=producer, port=port, evict=evict, swap_in=in_name, swap_out=out_name,
                                trigger=swap_in.trigger_op or "", consumers=",".join(swap_in.consumers)))
            continue
        out = swap_out_name(decision.tensor)
        lines.append(record("out", producer=producer, port=port, swap_out=out,
                            keep_rows=getattr(decision, "keep_rows", 0)))
        wrap = getattr(decision, "optional_wrap", "")
        if wrap:  # a conditional's optional keeps the host copy for the gradient's branch
            lines.append(record("reroute", consumer=wrap, source=producer, port=port, target=out))
        via = dict(getattr(decision, "alias_reads", None) or ())
        for i, swap_in in enumerate(decision.swap_ins):
            if swap_in.consumers:
                name = swap_in_name(decision.tensor, i)
                lines.append(record("in", swap_out=out, swap_in=name, trigger=swap_in.trigger_op or "",
                                    consumers=",".join(c for c in swap_in.consumers if c not in via)))
                reads = [(c, via[c]) for c in swap_in.consumers if c in via]
                if wrap:  # they read the optional's value: now the swap-in
                    lines += [record("reroute", consumer=c, source=unwrap, port=0, target=name) for c, unwrap in reads]
                else:
                    lines += _alias_copy_records(name, reads)
    for streamed in streamed_lists:
        lines += _streamed_list_records(streamed)
    for resource, users in resident:  # kept variables: back on the device before their users, if they were not
        producer, port = split_tensor_name(resource)
        name = resident_op_name(resource)
        # a vin into GTBM's persistent group
        lines.append(record("vkeep", resource=producer, port=port, name=name, keep_host=0))
        lines += [record("ctrl", src=name, dst=user) for user in users]
    lines += [record("ctrl", src=a, dst=b) for a, b in control_edges]
    for k, (sequence, with_added, bands) in enumerate(sequences):
        bands = bands or range(len(sequence))
        lines += [record("seq", chain=k, node=name, band=band) for name, band in zip(sequence, bands)]
        lines += [record("seqadded", chain=k)] if with_added else []
    return message(lines)


def _alias_copy_records(swap_in: str, reads: list[tuple[str, str]]) -> list[str]:
    """The records serving consumers that read a swapped tensor through a forward alias op (``reads``: consumer,
    alias op): a copy of each alias op reading ``swap_in``, the consumers rerouted to it."""
    lines, copies = [], {}
    for consumer, alias in reads:
        if alias not in copies:
            copies[alias] = f"{alias}/dymem_alias_of_{swap_in.rpartition('/')[2]}"
            lines.append(record("clone", node=alias, name=copies[alias], inputs=f"0:{swap_in}"))
        lines.append(record("reroute", consumer=consumer, source=alias, port=0, target=copies[alias]))
    return lines


def resident_op_name(resource: str) -> str:
    """Node name of the swap-in that brings a variable the plan keeps back before its users (a no-op when it is on
    the device)."""
    op, port = split_tensor_name(resource)
    return f"{op}/dymem_resident_{port}"


def _streamed_list_records(streamed) -> list[str]:
    """The records that keep a loop's list in host memory: each pushed element swapped out (``out``) and the push
    rerouted to the host copy; each popped element, a host tensor, swapped in for its readers (an ``out`` of the
    pop's element, a copy in host memory the ``in`` record needs as its source, then the ``in``). All of them run
    inside the loops."""
    lines = []
    for element, push in streamed.pushes:
        producer, port = split_tensor_name(element)
        out = swap_out_name(element)
        lines.append(record("out", producer=producer, port=port, swap_out=out, keep_rows=0))
        lines.append(record("reroute", consumer=push, source=producer, port=port, target=out))
    for pop, *readers in streamed.pops:
        element = f"{pop}:1"
        out = swap_out_name(element)
        lines.append(record("out", producer=pop, port=1, swap_out=out, keep_rows=0))
        lines.append(record("in", swap_out=out, swap_in=swap_in_name(element, 0), trigger="",
                            consumers=",".join(readers)))
    return lines


def _weight_records(decision) -> list[str]:
    """The records keeping a weight in host memory but for its two stays on the device (``cc/pass/step_plan.h``).

    Evict at the step's start; first stay: a swap-in keeping the host copy, after its trigger, before the forward
    reads, and a swap-out that drops the device copy after the reads' forward users; second stay: after that
    swap-out and its trigger a swap-in, a ``DymemVariableRead`` (with copies of the alias ops) that the backward
    users are rerouted to, the update's reads and writes after the swap-in, the writes after the backward users, and
    a swap-out copying the value back after all of them."""
    producer, port = split_tensor_name(decision.tensor)
    route, (first, second) = decision.route, decision.swap_ins
    names = weight_op_names(decision.tensor)
    evict, in_f, out_f, in_b, read_b, out_b = (names[k] for k in ("evict", "in_fwd", "out_fwd", "in_bwd", "read_bwd",
                                                                   "out_bwd"))
    def variable_op(kind, name, **last):
        return record(kind, resource=producer, port=port, name=name, **last)

    lines = [variable_op("vout", evict, discard=0), variable_op("vin", in_f, keep_host=1),
             variable_op("vout", out_f, discard=1), variable_op("vin", in_b, keep_host=0)]
    if route.reroutes:  # backward users read the weight again
        lines.append(variable_op("vread", read_b, like=route.reads[0]))
    copy_of = {read: read_b for read in route.reads}
    for alias, source in route.clones:
        copy_of[alias] = f"{alias}/dymem_weight_copy"
        lines.append(record("clone", node=alias, name=copy_of[alias], inputs=f"0:{copy_of[source]}"))
    rerouted = []
    for consumer, source in route.reroutes:
        lines.append(record("reroute", consumer=consumer, source=source, port=0, target=copy_of[source]))
        rerouted.append(consumer)
    lines.append(variable_op("vout", out_b, discard=0))
    edges = [(evict, in_f)] + ([(first.trigger_op, in_f)] if first.trigger_op else [])
    edges += [(in_f, read) for read in route.reads]
    edges += [(user, out_f) for user in list(route.reads) + list(first.consumers)]
    edges += [(out_f, in_b)] + ([(in_b, read_b)] if route.reroutes else [])
    edges += [(second.trigger_op, in_b)] if second.trigger_op else []
    edges += [(in_b, user) for user in second.consumers if user not in rerouted]
    edges += [(user, out_b) for user in second.consumers]
    edges += [(user, write) for user in rerouted for write in route.writes]
    return lines + [record("ctrl", src=a, dst=b) for a, b in dict.fromkeys(edges)]


def _recompute_records(decision) -> list[str]:
    """The records recomputing a tensor for its backward consumers (``cc/pass/step_plan.h``): a copy of each op of
    the chain (reading the copies of the chain's earlier ops), after the trigger; copies of the alias ops the
    consumers read it through; the consumers rerouted to the copies."""
    route, (swap_in,) = decision.recompute, decision.swap_ins
    copy_of = {op: recompute_op_name(op) for op, _ in route.ops}
    copy_of.update({alias: recompute_op_name(alias) for alias in route.aliases})
    lines = []
    for op, inputs in route.ops:
        remapped = ",".join(f"{k}:{copy_of[source]}" for k, source in inputs)
        lines.append(record("clone", node=op, name=copy_of[op], inputs=remapped))
    last = route.ops[-1][0]
    for alias in route.aliases:
        lines.append(record("clone", node=alias, name=copy_of[alias], inputs=f"0:{copy_of[last]}"))
    _, port = split_tensor_name(decision.tensor)
    for consumer, source in route.reroutes:
        lines.append(record("reroute", consumer=consumer, source=source, port=port if source == last else 0,
                            target=copy_of[source]))
    if swap_in.trigger_op:
        lines += [record("ctrl", src=swap_in.trigger_op, dst=copy_of[op]) for op, _ in route.ops]
    return lines


def recompute_op_name(op: str) -> str:
    """Node name of the copy of ``op`` a recomputation runs."""
    return f"{op}/dymem_recompute"


def weight_op_names(tensor: str) -> dict[str, str]:
    """Node names of the ops that keep the weight whose resource is ``tensor`` off the device: ``evict``,
    ``in_fwd``, ``out_fwd``, ``in_bwd``, ``read_bwd``, ``out_bwd``."""
    op, port = split_tensor_name(tensor)
    return {k: f"{op}/dymem_weight_{port}_{k}" for k in ("evict", "in_fwd", "out_fwd", "in_bwd", "read_bwd",
                                                          "out_bwd")}


def split_tensor_name(tensor: str) -> tuple[str, int]:
    """``("op", k)`` of a tensor name ``"op:k"``."""
    op, _, port = tensor.rpartition(":")
    return op, int(port)


def swap_out_name(tensor: str) -> str:
    """Node name of the swap-out of ``tensor``."""
    op, port = split_tensor_name(tensor)
    return f"{op}/dymem_swap_out_{port}"


def swap_in_name(tensor: str, index: int) -> str:
    """Node name of the ``index``-th swap-in of ``tensor``."""
    op, port = split_tensor_name(tensor)
    return f"{op}/dymem_swap_in_{port}_{index}"


def variable_op_names(tensor: str) -> tuple[str, str, str]:
    """Node names of the evict, the swap-in and the swap-out of the offloaded variable whose resource is
    ``tensor``."""
    op, port = split_tensor_name(tensor)
    return f"{op}/dymem_var_evict_{port}", f"{op}/dymem_var_swap_in_{port}", f"{op}/dymem_var_swap_out_{port}"
