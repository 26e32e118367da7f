"""Plan a model's train step without running it: :func:`dry_run` for any compiled model, and the policies side by side
for ``dymem plan``."""
from __future__ import annotations

import dataclasses
import inspect

import keras
import numpy as np
import tensorflow as tf

from dymem_tf import compat
from dymem_tf.keras import variables, xla
from dymem_tf.keras.config import DymemConfig
from dymem_tf.memory import devices
from dymem_tf.passes import graph_pass, step_pass
from dymem_tf.planning import pipeline


@dataclasses.dataclass
class TracedStep:
    """The analysed train step of a model at one batch size, ready to be planned."""

    step_graph: object  # None when the ops could not be captured (then ``unsupported`` says why)
    persistent_bytes: int
    batch_size: int
    num_ops: int
    #: why the callback would leave this step unmodified (:func:`~dymem_tf.passes.step_pass.unsupported_construct`;
    #: for some budgets only: ``problem``), or None
    unsupported: str | None = None
    ops: list = dataclasses.field(default_factory=list)  # the step's ops, as the pass was offered them
    function_name: str = ""
    #: oneDNN's layout pass rewrites the graph after the pass (``PlanSettings.onednn_later``), as in the callback
    onednn_later: bool = False
    #: the construct behind ``unsupported`` (a :class:`~dymem_tf.passes.step_pass.Unsupported`): tensors of unknown
    #: size leave the step unmodified under a budget only (:meth:`~dymem_tf.passes.step_pass.Unsupported.blocks`)
    problem: object = None


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


def sample_batch(model: keras.Model, batch_size: int):
    """A batch of zeros ``(x, y)`` for ``model``: ``x`` in the structure of its inputs (a dict for dict inputs), ``y``
    in that of its outputs, as integer class labels where the output's loss is a sparse one; ValueError for a model
    without symbolic inputs (a subclassed model never called on ``keras.Input``: pass ``x`` and ``y``)."""
    inputs, outputs = _symbolic(model, "input"), _symbolic(model, "output")

    def zeros(tensor, sparse: bool = False):
        shape = (batch_size,) + tuple(int(d or 1) for d in tensor.shape[1:])
        if sparse:
            return np.zeros(shape[:-1], np.int64)
        return np.zeros(shape, np.dtype(tensor.dtype) if tensor.dtype != "string" else np.float32)

    x = keras.tree.map_structure(zeros, inputs)
    loss = getattr(model, "loss", None)
    if isinstance(outputs, dict):
        y = {name: zeros(out, _sparse(loss.get(name) if isinstance(loss, dict) else loss))
             for name, out in outputs.items()}
    elif isinstance(outputs, (list, tuple)):
        losses = loss if isinstance(loss, (list, tuple)) else [loss] * len(outputs)
        y = [zeros(out, _sparse(l)) for out, l in zip(outputs, losses)]
    else:
        y = zeros(outputs, _sparse(loss))
    return x, y


def _symbolic(model: keras.Model, which: str):
    """The model's symbolic ``which`` ("input" or "output") in its structure: a functional model's as built (a
    dict, a list or one tensor), a ``Sequential``'s one tensor."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        pass
    tensors = getattr(model, which + "s", None)  # Sequential: inputs and outputs, but no input before a call
    if not tensors:
        raise ValueError(f"this model has no symbolic {which}s to make a batch from (a subclassed model never "
                         "called on keras.Input?): pass a batch as x=... and y=...")
    return tensors[0] if len(tensors) == 1 else list(tensors)


def _sparse(loss) -> bool:
    """Whether ``loss`` (a name, a function or a ``Loss``) takes integer class labels."""
    name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", "")
    return "sparse" in str(name).lower() or "sparse" in type(loss).__name__.lower()


def trace_train_step(model: keras.Model, batch_size: int, x=None, y=None, *, also=None) -> TracedStep:
    """The analysed train step of ``model`` at ``batch_size``, as the callback would plan it, without running it.

    The step is instantiated by a ``fit`` on one batch (``x`` and ``y``, or zeros shaped like the model's inputs and
    outputs: :func:`sample_batch`); the graph pass captures the graph TensorFlow would run (after Grappler, exactly
    what the callback plans) and cancels the instantiation, so the step never runs and no variable changes.
    Differences from a run: the batch is this one, and a step that the callback would see with an unknown batch
    dimension (a partial last batch) is captured here with a full one.

    The optimizer's slots are built first, as the callback builds them (:func:`~dymem_tf.keras.variables.
    build_optimizer`): an optimizer that builds inside the trace creates variables there, and TensorFlow then traces
    the whole step a second time. ``also``: a graph-pass listener offered the instantiated graph before it is
    captured (``bench/zoo_coverage.py`` times the callback's pass on it); it must neither fail the call nor raise.
    """
    if x is None:
        x, sample_y = sample_batch(model, batch_size)
        y = sample_y if y is None else y
    captured = {}

    def capture(call):
        if also is not None:
            also(call)
        with step_pass.collector_paused():  # as in the pass: its objects would make each collection walk the heap
            graph = call.graph()
            _, ops = step_pass.replica_ops(graph)[0]
            captured["graph"], captured["problem"] = step_pass.capture(ops, batch_size)  # as the callback does
        captured.update(num_ops=len(ops), ops=ops, function_name=call.function_name,
                        onednn_later=call.stage != "after_partitioning" and bool(compat.onednn_enabled()))
        call.fail("dry run: the step's graph was captured and is not run")

    variables.build_optimizer(model)  # as the callback does before the step is traced: one trace, not two
    history, train_function, gradients = getattr(model, "history", None), model.train_function, []
    try:
        # the step the callback plans runs without XLA (dymem_tf.keras.xla), which would swallow its gradient ops
        xla.make_train_function_without_xla(model)  # fit takes the train function made here
        with graph_pass.armed(capture), compat.new_gradients(gradients):
            model.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    except tf.errors.CancelledError:
        if "graph" not in captured:
            raise
    finally:
        model.train_function = train_function  # the model's own, as it was (the dry run's is let go)
        compat.drop_gradients(gradients)  # what its trace registered for good with TensorFlow
        if history is not None:
            model.history = history
    if "graph" not in captured:
        captured["graph"], captured["num_ops"] = None, 0
        captured["problem"] = step_pass.Unsupported(step_pass.SkipKind.NO_GRADIENTS, "", step_pass.NO_GRADIENTS)
    problem = captured["problem"]
    unsupported = f"{problem.kind}: {problem.detail}" if problem else None
    return TracedStep(captured["graph"], variables.persistent_bytes(model), batch_size, captured["num_ops"],
                      unsupported, captured.get("ops", []), captured.get("function_name", ""),
                      captured.get("onednn_later", False), problem)


def plan_all(traced: TracedStep, policies, budget_bytes, device, headroom: float | None = None, **kwargs) -> dict:
    """A plan (or the error that stopped it) per policy for one traced step, each made as the callback's pass makes
    it (:meth:`~dymem_tf.passes.step_pass.StepPass.plan_captured`); a step the callback would not rewrite for
    ``budget_bytes`` (``traced.unsupported``) gets :class:`StepLeftUnmodifiedError` for every swapping policy.

    ``headroom`` is the share of the budget kept free (None: the callback's default when it has measured nothing;
    it calibrates its own on the first step under a budget, which a dry run cannot); 0 compares policies at
    exactly the same modelled budget. ``kwargs`` are :class:`~dymem_tf.planning.pipeline.PlanSettings` fields."""
    request = step_pass.PlanRequest(budget_bytes=budget_bytes, headroom=headroom,
                                    persistent_bytes=traced.persistent_bytes, default_batch_size=traced.batch_size)
    return plan_each(traced, {policy: pipeline.PlanSettings(policy=policy, profile=device, **kwargs)
                              for policy in policies}, request)


def plan_each(traced: TracedStep, settings: dict, request: step_pass.PlanRequest) -> dict:
    """:func:`plan_traced` for each ``{name: PlanSettings}`` of ``settings``: its plan, or the ValueError that
    stopped it (a refusal, a step left unmodified)."""
    results = {}
    for name, each in settings.items():
        try:
            results[name] = plan_traced(traced, each, request)
        except ValueError as err:
            results[name] = err
    return results


def plan_traced(traced: TracedStep, settings: pipeline.PlanSettings, request: step_pass.PlanRequest,
                copy: bool = True):
    """The plan the callback's pass makes for ``traced`` with ``settings`` for ``request``; raises
    :class:`StepLeftUnmodifiedError` for a step it would leave unmodified for ``request`` (``"none"`` plans it as
    Keras built it; tensors of unknown size block a budget only, and are noted in a plan without one) and
    :class:`~dymem_tf.planning.planner.BudgetTooSmallError` when no plan fits. ``copy=False`` lets the plan add its
    ordering edges to ``traced.step_graph`` in place (for a step planned only once)."""
    blocks = traced.problem is None or traced.problem.blocks(request)
    if traced.unsupported and ((settings.policy != "none" and blocks) or traced.step_graph is None):
        raise StepLeftUnmodifiedError(f"the callback would leave this step unmodified ({traced.unsupported})")
    pass_ = step_pass.StepPass(settings, verbose=0)
    where = (None, traced.batch_size, None)
    with step_pass.collector_paused():
        plan = pass_.plan_captured(traced.step_graph, traced.ops, where, traced.onednn_later, request,
                                   copy=copy).plan
    if traced.problem is not None and not blocks:  # tensors of unknown size, planned around without a budget
        plan.notes.append(traced.problem.note())
    return plan


def resolve_budget(config: DymemConfig) -> tuple[int | None, bool]:
    """The budget a dry run of ``config`` plans for, as the callback would on this machine (``"auto"``: this
    machine's device), and whether the device has no limit (``"auto"`` then swaps nothing)."""
    if not config.auto:
        return config.budget_bytes, False
    capacity = devices.device_memory_capacity()
    return capacity, capacity is None


def dry_run(model: keras.Model, batch_size: int, memory_budget="auto", *, profile=None, policy: str = "dymem",
            x=None, y=None, offload_optimizer_state: bool | None = None, offload_weights: bool | None = None,
            min_swap_bytes=1 << 16, execution_order: str = "planned"):
    """The :class:`~dymem_tf.planning.plan.Plan` ``DymemCallback`` would make for ``model``'s train step at
    ``batch_size``, without training: nothing runs and no variable changes (``plan.summary()`` prints it).

    ``model`` is compiled (optimizer and loss; with any ``jit_compile``: the callback plans the step without XLA);
    its batch is ``x`` and ``y`` when given, else zeros shaped like its inputs and outputs (any structure: dicts
    of inputs too). The arguments mean what they mean for ``DymemCallback`` (one :class:`DymemConfig` is made of
    them): ``memory_budget="auto"`` plans for this machine's device (a step that fits it swaps nothing). What a
    dry run cannot do is measure: budgets are planned with the fixed headroom, as ``DymemCallback(calibrate=False)``
    does. Raises :class:`~dymem_tf.planning.planner.BudgetTooSmallError` when no plan fits the budget, and
    :class:`StepLeftUnmodifiedError` for a step the callback would leave as it is.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError("compile the model first (model.compile(optimizer=..., loss=...)): the train step "
                         "includes the optimizer's update")
    config = DymemConfig.from_arguments(memory_budget, profile=profile, policy=policy, verbose=0, calibrate=False,
                                        offload_optimizer_state=offload_optimizer_state,
                                        offload_weights=offload_weights, min_swap_bytes=min_swap_bytes,
                                        execution_order=execution_order)
    budget, unlimited = resolve_budget(config)
    if unlimited:  # a device without a limit: every step fits, nothing is swapped
        config = dataclasses.replace(config, policy="none")
    traced = trace_train_step(model, batch_size, x, y)
    request = step_pass.PlanRequest(budget_bytes=budget, persistent_bytes=traced.persistent_bytes,
                                    default_batch_size=batch_size)
    return plan_traced(traced, config.plan_settings(), request, copy=False)  # planned once: no copy
