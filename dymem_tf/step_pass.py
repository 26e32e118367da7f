"""The Dymem pass over a traced train step: analyse ▶ plan ▶ rewrite, run while Keras traces ``train_step``.

:func:`attach` wraps a model's ``train_step`` so that, after the original step has built its forward and gradient
ops in the current ``FuncGraph``, the pass captures those ops (:mod:`dymem_tf.graph_capture`), plans the swaps
(:mod:`dymem_tf.planner`), inserts the swap ops (:mod:`dymem_tf.rewrite`) and installs the tensors' mobility in
the GTBM allocator. Each trace (first call, retrace on a new input shape, each replica of a distribution strategy)
gets its own plan.

Under a distribution strategy with several local replicas (``MirroredStrategy``), Keras calls the wrapped step once
per replica, each in its own thread, all building into the same FuncGraph; the threads take turns at every
``merge_call`` (the gradient all-reduce), so the ops created during one replica's call interleave with the other
replicas' ops. The pass keeps a replica's own ops only: those placed on its device (ops without a device: those
under its ``replica_<k>/`` name scope, or under none for replica 0). Each replica gets its own plan, and its swap ops
sit on its device.

Constructs the pass cannot plan leave the trace unmodified, with one warning per construct
(:class:`SkippedTrace`): control flow or nested function calls in the forward or backward pass (their ops live in
another FuncGraph), forward tensors needed by the backward pass whose size is unknown, a step without gradient ops.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import warnings
import weakref
from collections import Counter

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph as func_graph_module

from dymem_tf import graph_capture, planner, rewrite, update_deferral

logger = logging.getLogger("dymem_tf")

# model -> (original train_step, whether it was an instance attribute); kept outside the model so that Keras'
# attribute tracking never sees it.
_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class PassConfig:
    """Settings of the pass, validated by :class:`dymem_tf.DymemCallback`."""

    policy: str = "dymem"
    budget_bytes: int | None = None
    device: str = "cpu"
    swapin_ahead: int = 1
    min_swap_bytes: int = 1 << 16
    defer_updates: bool = True  # see dymem_tf.update_deferral and DymemCallback(defer_updates=...)
    headroom: float = planner.DEFAULT_HEADROOM  # share of the budget the planner leaves free
    verbose: int = 1


@dataclasses.dataclass
class TraceRecord:
    """One application of the pass to one traced step (``graph`` is the rewritten FuncGraph)."""

    graph: tf.Graph
    batch_size: int | None
    step_graph: object
    plan: object
    report: rewrite.RewriteReport
    replica: int | None = None


@dataclasses.dataclass
class SkippedTrace:
    """A trace the pass left unmodified: ``kind`` is ``"unsupported-graph"`` (no ops, a cycle), ``"control-flow"``,
    ``"unknown-shape"`` or ``"no-gradients"``; ``subject`` names the op or tensor; ``reason`` is the warning's text."""

    graph: tf.Graph
    kind: str
    subject: str
    reason: str
    replica: int | None = None


#: Loops: their bodies live in other FuncGraphs and keep per-iteration feature maps for the backward pass in
#: TensorList accumulators (variant tensors of unknown size), which the planner can neither size nor swap.
LOOP_OP_TYPES = frozenset({"While", "StatelessWhile"})
#: Conditionals and nested function calls: their bodies live in other FuncGraphs too, but every tensor the backward
#: pass needs from them crosses the boundary as an output of the op, so they are planned as opaque ops.
OPAQUE_OP_TYPES = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                             "StatefulPartitionedCall"})
_REPLICA_SCOPE = re.compile(r"(?:^|/)replica_(\d+)/")


class StepPass:
    """Callable run inside the trace of ``train_step``; keeps the plans it made."""

    def __init__(self, config: PassConfig, print_fn=print):
        self.config = config
        self.records: list[TraceRecord] = []
        self.skipped: list[SkippedTrace] = []
        #: batch size to plan with when a trace's batch dimension is unknown (set by the callback from ``fit``)
        self.default_batch_size: int | None = None
        self._print = print_fn
        self._warned: set[str] = set()
        self._mobility: dict = {}

    @property
    def last_plan(self):
        return self.records[-1].plan if self.records else None

    def run(self, graph: tf.Graph, new_ops: list, batch_size: int | None, persistent_bytes: int,
            replica: int | None = None) -> TraceRecord | None:
        """Analyse, plan and rewrite the ops ``new_ops`` that the step created in ``graph``.

        Returns the record, or None when the trace is left unmodified (then :attr:`skipped` says why).
        """
        step_graph, problem = capture(new_ops, batch_size)
        if problem is not None:
            self.skip(graph, *problem, replica)
            return None
        deferrals = []
        if self.config.defer_updates and self.config.policy != "none":
            deferrals = update_deferral.find_deferrals(step_graph)
            update_deferral.defer(step_graph, deferrals)
        plan = planner.make_plan(
            step_graph,
            policy=self.config.policy,
            budget_bytes=self.config.budget_bytes,
            persistent_bytes=persistent_bytes,
            profile=self.config.device,
            batch_size=batch_size,
            min_swap_bytes=self.config.min_swap_bytes,
            swapin_ahead=self.config.swapin_ahead,
            headroom=self.config.headroom,
        )
        op_index = {op.name: i for i, op in enumerate(graph.get_operations())}
        if deferrals:
            update_deferral.apply_deferrals(graph, deferrals)
            plan.notes.append(f"{len(deferrals)} gradient-independent optimizer ops deferred to their gradients")
        report = rewrite.apply_plan(graph, plan, layers=step_graph.layers, op_index=op_index)
        for name in report.swap_in_ops:
            plan.mobility[name] = "mobile"
        # Every trace of this fit stays callable (a partial last batch, each replica): keep all their entries.
        self._mobility.update(plan.mobility)
        _install_mobility(self._mobility)
        opaque = [op.name for op in step_graph.ops.values() if op.type in OPAQUE_OP_TYPES and op.phase != "update"]
        if opaque:
            plan.notes.append(f"{len(opaque)} conditionals or nested function calls (e.g. {opaque[0]!r}) planned as "
                              "opaque ops: their inner ops and working memory are not modelled")
        record = TraceRecord(graph, batch_size, step_graph, plan, report, replica)
        self.records.append(record)
        if self.config.verbose:
            where = f" (replica {replica})" if replica is not None else ""
            self._print(plan.summary())
            self._print(f"dymem_tf: rewrite{where}: {report.summary()}")
        return record

    def skip(self, graph, kind: str, subject: str, detail: str, replica: int | None) -> None:
        """Record that the trace of ``graph`` is left unmodified, and warn once per construct."""
        reason = f"dymem_tf left this train step unmodified (no swapping): {detail}"
        self.skipped.append(SkippedTrace(graph, kind, subject, reason, replica))
        # one warning per construct: the same op in another replica or a retrace is the same construct
        self._warn_once(f"{kind}:{_REPLICA_SCOPE.sub(_keep_slash, subject)}", reason)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _keep_slash(match) -> str:
    return "/" if match.group(0).startswith("/") else ""


def _model_scope(ops) -> str | None:
    """The model's name scope, inferred with replica scopes (``replica_1/``) set aside and put back."""
    names = [op.name for op in ops]
    stripped = [_REPLICA_SCOPE.sub(_keep_slash, n) for n in names]
    scope = graph_capture.infer_model_scope(stripped)
    if scope is None or stripped == names:
        return scope
    prefixed = Counter()
    for n in names:
        rest = n[n.find("gradient_tape/") + len("gradient_tape/"):] if "gradient_tape/" in n else n
        m = re.match(r"^((?:[^/]+/)*?replica_\d+/)" + re.escape(scope) + "/", rest)
        if m:
            prefixed[m.group(1) + scope] += 1
    return prefixed.most_common(1)[0][0] if prefixed else scope


def _ancestors(g, seeds: list[str]) -> set[str]:
    seen, frontier = set(seeds), list(seeds)
    while frontier:
        for m in g.predecessors(frontier.pop()):
            if m not in seen:
                seen.add(m)
                frontier.append(m)
    return seen


def capture(new_ops: list, batch_size: int | None):
    """``(step_graph, None)`` for the ops a train step created, or ``(step_graph or None, (kind, subject,
    explanation))`` when the pass would leave the step unmodified (see :func:`unsupported_construct`)."""
    try:
        step_graph = graph_capture.capture_step_graph(new_ops, batch_size=batch_size,
                                                      model_scope=_model_scope(new_ops))
    except graph_capture.UnsupportedGraphError as err:
        return None, ("unsupported-graph", "", f"{err}")
    return step_graph, unsupported_construct(step_graph, batch_size)


def unsupported_construct(sg, batch_size: int | None = None) -> tuple[str, str, str] | None:
    """``(kind, subject, explanation)`` of the first construct in the step that the pass cannot plan, or None.

    * a loop (``While``: ``tf.while_loop``, a Keras RNN on the TensorFlow backend) in the backward pass, or in the
      forward pass upstream of it: its body lives in another FuncGraph and keeps the feature maps of every iteration
      in TensorList accumulators, which the analysis cannot size or swap, so the step's memory cannot be planned
      (a loop elsewhere -- the optimizer update -- holds no feature map and is fine; ``If``/``Case`` and nested
      function calls are planned as opaque ops: what the backward pass needs from them leaves them as outputs);
    * a forward tensor that the backward pass reads whose static shape is unknown beyond the batch dimension: its
      size, and so the step's peak, cannot be modelled;
    * no gradient ops: nothing is kept for a backward pass, so there is nothing to swap.
    """
    ops = sg.ops
    if not any(op.phase == "backward" for op in ops.values()):
        return ("no-gradients", "",
                "the step has no gradient ops (no GradientTape.gradient in train_step, or no trainable weights), "
                "so no feature map is kept for a backward pass and there is nothing to swap.")
    loops = [op for op in ops.values() if op.type in LOOP_OP_TYPES and op.phase != "update"]
    if loops:
        feeds_backward = _ancestors(sg.graph, [n for n, op in ops.items() if op.phase == "backward"])
        loops = [op for op in loops if op.phase == "backward" or op.name in feeds_backward]
    if loops:
        first = loops[0]
        more = f" and {len(loops) - 1} more" if len(loops) > 1 else ""
        return ("control-flow", first.name,
                f"its {first.phase} pass contains a loop ({first.type} op {first.name!r}{more}); the ops of a loop "
                "body live in another FuncGraph and keep each iteration's feature maps in TensorList accumulators, "
                "which the pass can neither size nor swap, so the step's memory cannot be planned.")
    unknown = []
    for t in sg.tensors.values():
        if t.shape_known or t.persistent or t.alias_of is not None or t.dtype in ("resource", "variant", "string"):
            continue
        prod = ops[t.producer]
        if prod.is_backward:
            continue
        if any(ops[c].is_backward and sg.is_data_consumer(c) for c in t.consumers):
            unknown.append(t)
    if unknown:
        first = unknown[0]
        shape = "[" + ", ".join("?" if d is None else str(d) for d in (first.shape or ())) + "]" \
            if first.shape else "unknown rank"
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        batch_note = ("" if batch_size is not None else
                      "; the batch size is unknown too (batch the dataset with drop_remainder=True)")
        return ("unknown-shape", first.name,
                f"tensor {first.name!r}{more}, kept for the backward pass, has an unknown static shape ({shape}), "
                f"so its size cannot be planned{batch_note}.")
    return None


def _install_mobility(mobility: dict) -> None:
    from dymem_tf import allocator

    if allocator.is_active():
        allocator.set_mobility_map(mobility)


def persistent_bytes(model) -> int:
    """Bytes of the model's variables and its optimizer's slots (the tensors that live across steps)."""
    seen, total = set(), 0
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(getattr(optimizer, "variables", []))
    for var in variables:
        key = id(var)
        if key in seen:
            continue
        seen.add(key)
        shape = [d if d is not None else 0 for d in var.shape]
        total += int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(var.dtype).size
    return total


def batch_size_of(data) -> int | None:
    """The static batch dimension of the first tensor in a step's ``data`` (None when unknown)."""
    for item in tf.nest.flatten(data):
        shape = getattr(item, "shape", None)
        if shape is not None and shape.rank:
            return shape[0]
    return None


def attach(model, step_pass: StepPass) -> None:
    """Wrap ``model.train_step`` so that every trace of it runs ``step_pass``; undo with :func:`detach`."""
    if model in _ATTACHED:
        detach(model)
    had_instance_attr = "train_step" in model.__dict__
    original = model.train_step
    last_batch = {}

    def train_step(data):
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not isinstance(graph, func_graph_module.FuncGraph):
            return original(data)  # run_eagerly=True: nothing to rewrite
        replica = _current_replica()
        if getattr(graph, "is_control_flow_graph", False):
            # traced inside a tf.while_loop / tf.cond body (a custom loop of steps): the step's ops would share the
            # body with the loop's own ops, and swaps could not outlive an iteration; Keras' steps_per_execution
            # calls the step as a nested tf.function instead, which has its own FuncGraph
            outputs = original(data)
            step_pass.skip(graph, "control-flow", graph.name,
                           f"the step is traced inside a control-flow body ({type(graph).__name__} {graph.name!r}, "
                           "e.g. the body of a tf.while_loop of steps), which the pass does not rewrite; wrap the "
                           "step in its own tf.function (as Keras' steps_per_execution does) to have it planned.",
                           replica[0] if replica is not None else None)
            return outputs
        outputs, new_ops = graph_capture.ops_created_by(original, data)
        if replica is not None:
            new_ops = [op for op in new_ops if _belongs_to_replica(op, *replica)]
        batch = batch_size_of(data)
        if batch is None:
            # relaxed retrace or a dataset without drop_remainder: plan for the largest batch, fit's batch size
            # (per replica), else the last static batch size seen
            batch = _per_replica(step_pass.default_batch_size) or last_batch.get("value")
        else:
            last_batch["value"] = batch
        step_pass.run(graph, new_ops, batch, persistent_bytes(model),
                      replica=replica[0] if replica is not None else None)
        return outputs

    _ATTACHED[model] = (original, had_instance_attr)
    model.train_step = train_step


def _current_replica() -> tuple[int, object] | None:
    """``(replica id, device spec)`` inside one of several local replicas of a strategy, else None."""
    strategy = tf.distribute.get_strategy()
    try:
        local_devices = tuple(strategy.extended.worker_devices)
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if len(local_devices) < 2 or tf.distribute.in_cross_replica_context():
        return None
    ctx = tf.distribute.get_replica_context()
    replica = getattr(ctx, "_replica_id_in_sync_group", None)
    if not isinstance(replica, int):
        replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    from tensorflow.python.distribute import device_util

    try:
        device = tf.DeviceSpec.from_string(device_util.current() or "")
    except (ValueError, TypeError):
        device = tf.DeviceSpec()
    return (int(replica) if replica is not None else 0), device


def _belongs_to_replica(op, replica: int, device) -> bool:
    """Whether ``op`` (created while ``replica``'s step was being traced) is that replica's op.

    Ops with a device belong to the replica placed on it; ops without one (variable reads colocated with their
    variable) by name scope: ``replica_<k>/`` for replica k > 0, no replica scope for replica 0.
    """
    if op.device and device.device_type is not None:
        spec = tf.DeviceSpec.from_string(op.device)
        if spec.device_type is not None:
            same = (spec.device_type.upper() == device.device_type.upper()
                    and (spec.device_index or 0) == (device.device_index or 0))
            for field in ("job", "task", "replica"):
                a, b = getattr(spec, field), getattr(device, field)
                same = same and (a is None or b is None or a == b)
            return same
    scopes = {int(k) for k in _REPLICA_SCOPE.findall(op.name)}
    return replica in scopes if replica else not scopes


def _per_replica(batch: int | None) -> int | None:
    if not batch:
        return None
    try:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
    except (AttributeError, RuntimeError):
        replicas = 1
    return -(-int(batch) // max(1, int(replicas)))


def detach(model) -> None:
    """Restore the ``train_step`` that :func:`attach` wrapped."""
    saved = _ATTACHED.pop(model, None)
    if saved is None:
        return
    original, had_instance_attr = saved
    if had_instance_attr:
        model.train_step = original
    else:
        del model.train_step
