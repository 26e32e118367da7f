"""The Dymem pass over a traced train step: analyse ▶ plan ▶ rewrite, run while Keras traces ``train_step``.

:func:`attach` wraps a model's ``train_step`` so that, after the original step has built its forward and gradient
ops in the current ``FuncGraph``, the pass captures those ops (:mod:`dymem_tf.graph_capture`), plans the swaps
(:mod:`dymem_tf.planner`), inserts the swap ops (:mod:`dymem_tf.rewrite`) and installs the tensors' mobility in
the GTBM allocator. Each trace (first call, retrace on a new input shape, each replica of a distribution strategy)
gets its own plan.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph as func_graph_module

from dymem_tf import graph_capture, planner, rewrite

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
    verbose: int = 1


@dataclasses.dataclass
class TraceRecord:
    """One application of the pass to one traced step (``graph`` is the rewritten FuncGraph)."""

    graph: tf.Graph
    batch_size: int | None
    step_graph: object
    plan: object
    report: rewrite.RewriteReport


class StepPass:
    """Callable run inside the trace of ``train_step``; keeps the plans it made."""

    def __init__(self, config: PassConfig, print_fn=print):
        self.config = config
        self.records: list[TraceRecord] = []
        self._print = print_fn
        self._warned: set[str] = set()

    @property
    def last_plan(self):
        return self.records[-1].plan if self.records else None

    def run(self, graph: tf.Graph, new_ops: list, batch_size: int | None, persistent_bytes: int) -> TraceRecord | None:
        """Analyse, plan and rewrite the ops ``new_ops`` that the step created in ``graph``."""
        try:
            step_graph = graph_capture.capture_step_graph(new_ops, batch_size=batch_size)
        except graph_capture.UnsupportedGraphError as err:
            self._warn_once(str(err), f"dymem_tf left this train step unmodified: {err}")
            return None
        plan = planner.make_plan(
            step_graph,
            policy=self.config.policy,
            budget_bytes=self.config.budget_bytes,
            persistent_bytes=persistent_bytes,
            profile=self.config.device,
            batch_size=batch_size,
            min_swap_bytes=self.config.min_swap_bytes,
            swapin_ahead=self.config.swapin_ahead,
        )
        op_index = {op.name: i for i, op in enumerate(graph.get_operations())}
        report = rewrite.apply_plan(graph, plan, layers=step_graph.layers, op_index=op_index)
        for name in report.swap_in_ops:
            plan.mobility[name] = "mobile"
        _install_mobility(plan.mobility)
        record = TraceRecord(graph, batch_size, step_graph, plan, report)
        self.records.append(record)
        if self.config.verbose:
            self._print(plan.summary())
            self._print(f"dymem_tf: rewrite: {report.summary()}")
        return record

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=2)


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
        start = len(graph.get_operations())
        outputs = original(data)
        new_ops = graph.get_operations()[start:]
        batch = batch_size_of(data)
        if batch is None:
            batch = last_batch.get("value")  # relaxed retrace: plan with the last known batch size
        else:
            last_batch["value"] = batch
        step_pass.run(graph, new_ops, batch, persistent_bytes(model))
        return outputs

    _ATTACHED[model] = (original, had_instance_attr)
    model.train_step = train_step


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
