"""Trace a model's train step without running it, and plan it under every policy (``python -m dymem_tf plan``)."""
from __future__ import annotations

import dataclasses
import inspect

import keras
import numpy as np
import tensorflow as tf

from dymem_tf.passes import graph_def_view, graph_pass, step_pass
from dymem_tf.planning import pipeline, planner


@dataclasses.dataclass
class TracedStep:
    """The analysed train step of a model at one batch size, ready to be planned."""

    step_graph: object  # None when the ops could not be captured (then ``unsupported`` says why)
    persistent_bytes: int
    batch_size: int
    num_ops: int
    #: why the callback would leave this step unmodified (:func:`dymem_tf.passes.step_pass.unsupported_construct`), or None
    unsupported: str | None = None


class StepLeftUnmodifiedError(ValueError):
    """The callback would leave this train step as it is (a construct the pass cannot plan): no swap plan."""


def application_names() -> list[str]:
    """Names of the ``keras.applications`` model builders, lower-cased (``resnet50``, ``densenet121``, ...)."""
    names = []
    for name, obj in inspect.getmembers(keras.applications):
        if inspect.isfunction(obj) and name[0].isupper():
            names.append(name.lower())
    return sorted(names)


def build_model(model: str, image_size: int, classes: int = 10) -> keras.Model:
    """A compiled ``keras.applications`` model by name (random weights: no download), or a saved ``.keras`` file."""
    if model.endswith(".keras") or model.endswith(".h5"):
        loaded = keras.models.load_model(model, compile=False)
        loaded.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return loaded
    builders = {name.lower(): obj for name, obj in inspect.getmembers(keras.applications) if inspect.isfunction(obj)}
    key = model.lower().replace("_", "").replace("-", "")
    if key not in builders:
        raise ValueError(f"unknown model {model!r}: use a saved .keras file or one of "
                         f"{', '.join(application_names())}")
    net = builders[key](weights=None, input_shape=(image_size, image_size, 3), classes=classes)
    net.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    return net


def trace_train_step(model: keras.Model, batch_size: int) -> TracedStep:
    """The analysed train step of ``model`` at ``batch_size``, as the callback would plan it, without running it.

    The step is instantiated by a ``fit`` on one batch of zeros; the graph pass captures the graph TensorFlow would
    run (after Grappler, exactly what the callback plans) and cancels the instantiation, so the step never runs and
    no variable changes. Differences from a run: the batch is one of zeros, and a step that the callback would see
    with an unknown batch dimension (a partial last batch) is captured here with a full one.
    """
    x = np.zeros((batch_size,) + tuple(model.input_shape[1:]), np.float32)
    out_shape = model.output_shape
    y = np.zeros((batch_size,), np.int64) if len(out_shape) == 2 else np.zeros(
        (batch_size,) + tuple(out_shape[1:]), np.float32)
    captured = {}

    def capture(call):
        graph = call.graph()
        _, ops = step_pass.replica_ops(graph)[0]
        captured["graph"], captured["problem"] = step_pass.capture(ops, batch_size)  # as the callback does
        captured["num_ops"] = len(ops)
        call.fail("dry run: the step's graph was captured and is not run")

    try:
        with graph_pass.armed(capture):
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
    except tf.errors.CancelledError:
        if "graph" not in captured:
            raise
    finally:
        model.train_function = None  # the next fit instantiates the step afresh
    if "graph" not in captured:
        captured["graph"], captured["num_ops"] = None, 0
        captured["problem"] = step_pass.Unsupported(step_pass.SkipKind.NO_GRADIENTS, "", step_pass.NO_GRADIENTS)
    problem = captured["problem"]
    unsupported = f"{problem.kind}: {problem.detail}" if problem else None
    return TracedStep(captured["graph"], step_pass.persistent_bytes(model), batch_size, captured["num_ops"],
                      unsupported)


def plan_all(traced: TracedStep, policies, budget_bytes, device, headroom: float = planner.DEFAULT_HEADROOM,
             **kwargs) -> dict:
    """A plan (or the error that stopped it) per policy for one traced step; a step the callback would not rewrite
    (``traced.unsupported``) gets :class:`StepLeftUnmodifiedError` for every swapping policy.

    ``headroom`` is the share of the budget kept free: the callback's default when it has measured nothing (it
    calibrates its own on the first step under a budget, which a dry run cannot); 0 compares policies at exactly
    the same modelled budget."""
    results = {}
    for policy in policies:
        if traced.unsupported and (policy != "none" or traced.step_graph is None):
            results[policy] = StepLeftUnmodifiedError(f"the callback would leave this step unmodified "
                                                      f"({traced.unsupported})")
            continue
        settings = pipeline.PlanSettings(policy=policy, budget_bytes=budget_bytes, headroom=headroom,
                                         persistent_bytes=traced.persistent_bytes, profile=device,
                                         batch_size=traced.batch_size, **kwargs)
        try:  # the same pipeline as the callback's pass; "none" leaves the step as Keras built it (no deferral)
            results[policy] = pipeline.plan_step(traced.step_graph, settings, copy=True).plan
        except ValueError as err:
            results[policy] = err
    return results
