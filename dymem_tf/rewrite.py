"""Rewrite stage: insert the plan's swap ops into a train step's FuncGraph and reroute backward consumers.

For every :class:`~dymem_tf.plan.SwapDecision` the rewrite adds, in the graph that is being traced::

    x ──▶ forward consumers (unchanged)
    └──▶ DymemSwapOut ──▶ host ──▶ DymemSwapIn (control input: trigger op) ──▶ backward consumers

so that the device copy of ``x`` dies once its forward consumers and the swap-out have run, and comes back just
before the backward pass needs it. The rewrite runs inside the tracing of the step, before TensorFlow's automatic
control dependencies are added; the swap ops are declared order-insensitive there (they move bytes and touch no
resource), so they are not serialised with the step's other stateful ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from dymem_tf.ops import swap_ops

logger = logging.getLogger("dymem_tf")

SWAP_OP_TYPES = ("DymemSwapOut", "DymemSwapIn")


def _declare_swap_ops_order_insensitive() -> None:
    """Let tf.function run swap ops in parallel with the step's other stateful ops (see module docstring)."""
    current = getattr(auto_control_deps, "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS", None)
    if current is None:
        logger.warning("this TensorFlow has no MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS: swap ops will be chained")
        return
    if not set(SWAP_OP_TYPES) <= set(current):
        auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = frozenset(set(current) | set(SWAP_OP_TYPES))


_declare_swap_ops_order_insensitive()


class RewriteError(RuntimeError):
    """The plan does not match the graph (a tensor or op it names is missing)."""


@dataclasses.dataclass
class RewriteReport:
    """What :func:`apply_plan` changed."""

    swapped_tensors: int = 0
    swap_out_ops: list = dataclasses.field(default_factory=list)
    swap_in_ops: list = dataclasses.field(default_factory=list)
    rerouted_inputs: int = 0
    retargeted_triggers: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # (tensor, reason)

    def summary(self) -> str:
        text = (f"{self.swapped_tensors} tensors swapped: {len(self.swap_out_ops)} swap-outs, "
                f"{len(self.swap_in_ops)} swap-ins, {self.rerouted_inputs} consumer inputs rerouted")
        if self.skipped:
            text += f", {len(self.skipped)} skipped"
        return text


def apply_plan(graph: tf.Graph, plan, layers: list[list[str]] | None = None,
               op_index: dict[str, int] | None = None) -> RewriteReport:
    """Insert the swap ops of ``plan`` into ``graph`` (the FuncGraph being traced) and reroute consumers.

    ``op_index`` maps op names to their creation order; a trigger must have been created before the consumers it
    guards, otherwise the control edge could close a cycle with edges TensorFlow adds later in creation order. Such
    a trigger is replaced by the latest-created safe op of the same or an earlier dependency layer (``layers``, from
    the analysis), or the swap-in is left without trigger (it then starts as soon as its swap-out is done).
    """
    if op_index is None:
        op_index = {op.name: i for i, op in enumerate(graph.get_operations())}
    report = RewriteReport()
    ops_by_name = {op.name: op for op in graph.get_operations()}
    with graph.as_default(), tf.control_dependencies(None):
        for decision in plan.swaps:
            try:
                tensor = graph.get_tensor_by_name(decision.tensor)
            except (KeyError, ValueError) as err:
                raise RewriteError(f"plan names tensor {decision.tensor!r}, which is not in the graph") from err
            reason = _unsupported_reason(tensor)
            if reason:
                report.skipped.append((decision.tensor, reason))
                continue
            with _device_of(tensor), graph.name_scope(None):
                host = swap_ops.swap_out(tensor, name=f"{tensor.op.name}/dymem_swap_out_{tensor.value_index}")
            report.swap_out_ops.append(host.op.name)
            report.swapped_tensors += 1
            for k, swap_in in enumerate(decision.swap_ins):
                consumers = [ops_by_name[c] for c in swap_in.consumers if c in ops_by_name]
                if not consumers:
                    continue
                trigger = _safe_trigger(swap_in, consumers, ops_by_name, op_index, layers)
                if trigger is None or trigger.name != swap_in.trigger_op:
                    report.retargeted_triggers += 1
                deps = [trigger] if trigger is not None else []
                with _device_of(tensor), graph.name_scope(None), tf.control_dependencies(deps):
                    restored = swap_ops.swap_in(
                        host, name=f"{tensor.op.name}/dymem_swap_in_{tensor.value_index}_{k}")
                restored.set_shape(tensor.shape)
                report.swap_in_ops.append(restored.op.name)
                for consumer in consumers:
                    for idx, inp in enumerate(consumer.inputs):
                        if inp is tensor:
                            consumer._update_input(idx, restored)  # pylint: disable=protected-access
                            report.rerouted_inputs += 1
    return report


def _device_of(tensor: tf.Tensor):
    """The swap ops' device scope: the tensor's device; without one, the current scope (a distribution strategy's
    replica device while its step is traced) -- ``tf.device(None)`` would clear it."""
    return tf.device(tensor.op.device) if tensor.op.device else contextlib.nullcontext()


def _unsupported_reason(tensor: tf.Tensor) -> str | None:
    if tensor.dtype in (tf.string, tf.variant, tf.resource):
        return f"dtype {tensor.dtype.name} cannot be swapped"
    if tensor.op.type in SWAP_OP_TYPES:
        return "already a swap op"
    return None


def _safe_trigger(swap_in, consumers, ops_by_name, op_index, layers):
    """The plan's trigger if it was created before every consumer, else the best earlier-created substitute."""
    first_consumer = min(op_index.get(c.name, 1 << 62) for c in consumers)
    trigger = ops_by_name.get(swap_in.trigger_op)
    if trigger is not None and op_index.get(trigger.name, 1 << 62) < first_consumer:
        return trigger
    if layers:
        for layer in range(min(swap_in.trigger_layer, len(layers) - 1), -1, -1):
            safe = [n for n in layers[layer] if n in ops_by_name and op_index.get(n, 1 << 62) < first_consumer]
            if safe:
                return ops_by_name[max(safe, key=lambda n: op_index[n])]
    return None
