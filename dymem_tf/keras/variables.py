"""Where the model's and the optimizer's variables live during a ``fit`` with Dymem: built early, offloaded to host
memory before the first step (the plan brings back what it keeps), packed again on the device, and brought back
after ``fit``; what they are (the optimizers' variables, their bytes) and their host copies across a failed step
(:class:`VariableSnapshot`)."""
from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from dymem_tf import compat
from dymem_tf.memory import allocator, placement


def other_optimizers(model) -> list:
    """Keras optimizers held as attributes of ``model`` besides ``model.optimizer`` (a GAN's generator and
    discriminator optimizers, made in its ``compile``): their state lives across steps too, but Keras tracks it
    nowhere on the model, and plans never offload it. Known by what their class has (``apply_gradients``,
    ``iterations``, ``variables``), so any optimizer-like object counts, whatever its base class."""
    main = getattr(model, "optimizer", None)
    return [value for value in vars(model).values() if value is not main
            and all(hasattr(type(value), name) for name in ("apply_gradients", "iterations", "variables"))]


def optimizer_variables(model, main: bool = True) -> list:
    """The variables of ``model``'s optimizers: ``model.optimizer``'s (with ``main``) and :func:`other_optimizers`'."""
    optimizers = ([getattr(model, "optimizer", None)] if main else []) + other_optimizers(model)
    return [var for optimizer in optimizers if optimizer is not None for var in getattr(optimizer, "variables", [])]


def variable_bytes(var) -> int:
    """Bytes of one variable's value (unknown dimensions count as 0)."""
    shape = [d if d is not None else 0 for d in var.shape]
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(var.dtype).size


def persistent_bytes(model, optimizer: bool = True) -> int:
    """Bytes of the model's variables, of its :func:`other_optimizers`' and (``optimizer``) of
    ``model.optimizer``'s, each variable once: what lives across steps."""
    seen, total = set(), 0
    for var in list(model.variables) + optimizer_variables(model, main=optimizer):
        if id(var) not in seen:
            seen.add(id(var))
            total += variable_bytes(var)
    return total


class VariableSnapshot:
    """Host copies of a model's, its optimizers' and its metrics' variables, to put back after a failed step (the
    metrics too: the loss a failed step added to the running mean must not count; and the optimizers a custom
    ``train_step`` keeps as attributes, whose updates a failed step may have made)."""

    def __init__(self, model):
        variables = list(model.variables) + list(getattr(model, "metrics_variables", [])) + optimizer_variables(model)
        seen, self._saved = set(), []
        for var in variables:
            if id(var) not in seen:
                seen.add(id(var))
                self._saved.append((var, np.array(var.numpy(), copy=True)))

    def restore(self, changed_only: bool = False) -> int:
        """Assign every saved value back (``changed_only``: only those that differ); returns how many variables
        changed (a failed step may have updated some before it ran out of memory)."""
        changed = 0
        for var, value in self._saved:
            differs = not np.array_equal(var.numpy(), value)
            changed += differs
            if differs or not changed_only:
                var.assign(value)
        return changed

    def __len__(self) -> int:
        return len(self._saved)


def offload_variables(variables, min_bytes: int) -> int:
    """Move each of ``variables`` that has one handle, is not a scalar or a string and holds at least ``min_bytes``
    to host memory before the first step; returns how many moved. Each plan brings back before their users those
    it keeps (``PlannedStep.resident``; updates bring back optimizer state it does not offload), so a first step
    measures what the plan needs and not the variables that were on the device before it."""
    from dymem_tf.ops import swap_ops

    moved = 0
    for var in variables:
        if (swap_ops.variable_handle(var) is not None and len(var.shape) > 0 and var.dtype != tf.string
                and variable_bytes(var) >= min_bytes):
            swap_ops.offload_variable(var)
            moved += 1
    return moved


def offload_optimizer_state(model, min_bytes: int) -> int:
    """:func:`offload_variables` of the optimizer's variables (a distributed one, without a single handle, stays)."""
    return offload_variables(getattr(getattr(model, "optimizer", None), "variables", []), min_bytes)


def offload_weights(model, min_bytes: int) -> int:
    """:func:`offload_variables` of the model's trainable variables (each replica's of a distributed one)."""
    from dymem_tf.ops import swap_ops

    return offload_variables(swap_ops.variable_components(model.trainable_variables), min_bytes)


def compact_weights(model) -> int:
    """Place what stays on the device (the model's variables, its optimizers' small ones and the state of those a
    custom ``train_step`` keeps as attributes) next to each other again after the optimizer state left it; returns
    how many variables moved.

    Keras creates each weight's slots right after it, so weights and state share GTBM's persistent pageblocks, and
    a pageblock stays reserved while any buffer in it lives: with the state offloaded, a 12-block GPT's persistent
    group kept 96 MiB reserved for 43 MiB of weights. Every such variable goes to host memory and back
    (``DymemVariableSwapOut`` / ``In``: copies, the values do not change), so the pageblocks empty and leave the
    pool before the variables are placed again, packed, in the persistent group."""
    from dymem_tf.ops import swap_ops

    candidates = list(model.variables) + optimizer_variables(model)  # attribute optimizers' too
    seen, variables = set(), []
    for var in swap_ops.variable_components(candidates):
        if id(var) not in seen and var.dtype != tf.string and not swap_ops.variable_is_offloaded(var):
            seen.add(id(var))
            variables.append(var)
    if not variables or not allocator.is_active():
        return 0
    for var in variables:
        swap_ops.offload_variable(var)
    with allocator.mobility("persistent"):
        return swap_ops.bring_back_variables(variables)


def device_resident_bytes(model) -> int:
    """Bytes of the model's and its optimizers' variables that are in device memory now (not offloaded; CPU
    device, where the offloading kernels run)."""
    from dymem_tf.ops import swap_ops

    variables = list(model.variables) + optimizer_variables(model)
    seen, total = set(), 0
    for var in swap_ops.variable_components(variables):
        if id(var) not in seen and var.dtype != tf.string:
            seen.add(id(var))
            total += 0 if swap_ops.variable_is_offloaded(var) else variable_bytes(var)
    return total


def pageblock_floor(stats: dict | None, resident: int) -> int:
    """The least device memory GTBM can train in with ``resident`` bytes of variables on the device (0 without
    GTBM's pageblocks): each mobility group holds whole pageblocks, the persistent one enough for the variables and
    the transient and mobile ones at least one each. Below it nothing runs, not even the input pipeline's first
    tensor (an LSTM under a 3 MiB device: TF's "Cannot parse tensor from proto" from its iterator)."""
    block = int((stats or {}).get("block_size") or 0)
    if block <= 0:
        return 0
    return placement.PersistentGroup(0, 0, block).reserved_with(max(int(resident), 1)) + 2 * block


def resident_weight_bytes(model, min_bytes: int) -> int:
    """Bytes of the model's variables that stay on the device while weights may be offloaded: those smaller than
    ``min_bytes`` (never moved), and the largest other one (its stays put it on the device once at least)."""
    sizes = [variable_bytes(v) for v in model.variables]
    movable = [b for b in sizes if b >= min_bytes]
    return sum(b for b in sizes if b < min_bytes) + max(movable, default=0)


def bring_back_offloaded(model, weights: bool = False) -> int:
    """Swap every variable of the model's optimizers (and with ``weights`` every model variable) that a plan, or
    :func:`compact_weights` cut short, left in host memory back onto the device; returns how many."""
    variables = optimizer_variables(model)
    if weights:
        variables += [v for v in model.variables if all(v is not u for u in variables)]
    if not variables:
        return 0
    from dymem_tf.ops import swap_ops

    try:
        return swap_ops.bring_back_variables(variables)
    except tf.errors.ResourceExhaustedError:
        # a model trained with its weights and state offloaded need not fit the device whole: what does not fit
        # stays in host memory, where reads see its value and the next fit's plan finds it
        left = sum(swap_ops.variable_is_offloaded(v) for v in swap_ops.variable_components(variables))
        compat.warn_user(f"dymem_tf: {left} of the model's and optimizer's variables stay in host memory after fit: "
                         "the device cannot hold all of them at once. Their values are intact and readable "
                         "(get_weights, checkpoints); the next fit with DymemCallback moves them as its plan needs.")
        return 0


def build_optimizer(model, in_host_memory: bool = False) -> bool:
    """Create the optimizer's slot variables now, as its first ``apply`` would (zeros, under the model's strategy),
    so that the persistent bytes the planner works with include them: Keras builds Adam's ``m`` and ``v`` lazily,
    and without them a ResNet-50 step was planned with a third of its persistent memory.

    Only when every layer of the model is built, as Keras's own symbolic build requires: an optimizer is built for
    a fixed set of variables, and a subclassed model whose layers create theirs at its first call (a ``Dense`` in
    ``call``) would otherwise get an optimizer that rejects them (Keras's ``test_callbacks_can_update_state_at_
    batch_boundary``: weights made in ``__init__`` plus such a layer).

    ``in_host_memory``: make them in GTBM's host arena (not the device), for a fit that offloads optimizer state:
    the state moves to the host pool next, and what stays on the device comes back to it packed
    (:func:`compact_weights`).

    Returns False when the device ran out of memory while building (its weights and state do not fit): the
    optimizer is left unbuilt, the slots it made untracked (TensorFlow's own tracking of the optimizer still
    references them, so their device memory is not given back: callers refuse the fit then, see
    :func:`dymem_tf.keras.fits_first.begin`). A build that fails otherwise is undone the same way, and the optimizer
    builds at its first step."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", True) or not model.trainable_variables:
        return True
    if not compat.all_layers_built(model):
        return True
    before = {id(v) for v in optimizer.variables}
    try:
        with model.distribute_strategy.scope(), (allocator.host_memory() if in_host_memory
                                                  else contextlib.nullcontext()):
            optimizer.build(model.trainable_variables)
    except tf.errors.ResourceExhaustedError:
        _unbuild(optimizer, before)
        return False
    except Exception:  # pylint: disable=broad-except  (an optimizer that cannot build early builds at its step)
        _unbuild(optimizer, before)
    return True


def optimizer_state_bytes(model) -> int | None:
    """Bytes the optimizer's state will take once built (0 when it is built already: its variables count among
    the model's), estimated by building a copy of it on one-element stand-ins of the trainable variables: each
    slot it makes per variable is taken as large as the variable. None when no copy can be built."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "built", True) or not model.trainable_variables:
        return 0
    try:
        copy = type(optimizer).from_config(optimizer.get_config())
        stand_ins = [keras.Variable(np.zeros((1,), v.dtype), trainable=True) for v in model.trainable_variables]
        base = len(copy.variables)
        copy.build(stand_ins)
        slots = (len(copy.variables) - base) / len(stand_ins)
    except Exception:  # pylint: disable=broad-except  (an optimizer that cannot be copied: no estimate)
        return None
    return int(round(slots * sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                                 for v in model.trainable_variables)))


def _unbuild(optimizer, before: set[int]) -> None:
    """Put ``optimizer`` back as it was before a ``build`` that failed midway (Keras marks it built before it makes
    the slots, so it would use slots it never made): unbuilt, the variables the build made untracked (``before``:
    the ids of those it had)."""
    for v in optimizer.variables:
        if id(v) not in before:
            optimizer._untrack_variable(v)  # pylint: disable=protected-access
    optimizer._trainable_variables = []  # pylint: disable=protected-access
    optimizer._trainable_variables_indices = {}  # pylint: disable=protected-access
    optimizer.built = False
