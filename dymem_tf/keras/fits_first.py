"""``memory_budget="auto"``: the train step runs as the user compiled it while it fits the device.

Its first call runs guarded, on a copy of the first batch: the variables are saved to host memory first, and the
batch is taken off ``fit``'s iterator and served from a one-element iterator of the same type, so that a step that
runs out of memory can be planned for the device and run again on the same batch (no batch is lost). A step that
fits with the slack later steps need (:func:`dymem_tf.planning.first_step.step_slack`) keeps the user's train
function, untouched: no pass, no swap op, XLA as compiled.
"""
from __future__ import annotations

import gc

import tensorflow as tf

from dymem_tf import compat
from dymem_tf.keras import errors, variables
from dymem_tf.memory import allocator, devices
from dymem_tf.planning import first_step


def begin(session) -> None:
    """Set up a ``fit`` for ``session`` (a :class:`~dymem_tf.keras.session.FitSession` with
    ``memory_budget="auto"``): the step trains as the user compiled it (XLA included, no pass, nothing swapped)
    while it fits the device, its first call guarded (:func:`first_call_function`). A device without a limit, or
    ``policy="none"``, needs not even that; a step that did not fit in an earlier ``fit`` of the same callback, and
    a model whose weights and optimizer state do not fit the device, plan the step for the device at once."""
    model = session.model
    stats = devices.device_memory_stats()
    held = variables.persistent_bytes(model)  # the variables there are before the optimizer builds its state
    session.others_bytes = devices.others_bytes(stats, held)
    capacity = devices.device_memory_capacity()
    if capacity is None or session.config.policy == "none":
        session.control.plain_fits()
        session.say("dymem_tf: the train step runs as compiled: "
                    + ("the device has no memory limit." if capacity is None else 'policy="none".'))
        return
    capacity = max(capacity - session.others_bytes, 1)  # other models of the process keep their memory
    if session.plain_known_to_fit:  # the same train function fitted in the callback's last fit, at this batch size
        session.control.plain_fits()
        return
    if session.device_too_small:
        session.plan_for_device()
        return
    state = variables.optimizer_state_bytes(model)
    # a plain step whose first step leaves less than its slack free is planned for the device anyway
    # (first_call_function), and its variables alone take that much: plan it now, before the state is packed onto
    # the device only to be offloaded again (DenseNet-121 32px + SGD on a 56 MiB device: 53.5 MiB of variables;
    # the packing ran out midway and left 1 MiB more of the persistent group's pageblocks reserved)
    room = capacity - first_step.slack_bytes(capacity)
    if state is not None and held + state > room:
        fit = "do not fit" if held + state > capacity else "leave less than the step's slack free of"
        session.say(f"dymem_tf: the model's weights and optimizer state ({errors.fmt(state)} of it) {fit} "
                    f"the device's {errors.fmt(capacity)}; the step is planned for the device.")
        session.plan_for_device()
        return
    if variables.pageblock_floor(stats, held + (state or 0)) > room:
        session.say(f"dymem_tf: the model's weights and optimizer state need more of GTBM's pageblocks than the "
                    f"device's {errors.fmt(capacity)} hold with the step's slack free; the step is planned for the "
                    "device.")
        session.plan_for_device()  # refused there if even the variables that must stay do not fit
        return
    errors.warn_onednn_out_of_memory_crash()
    placed = _build_optimizer(model)
    if placed is None:
        raise errors.state_does_not_fit(capacity, variables.persistent_bytes(model))
    model.train_function = first_call_function(session, model.train_function, capacity, place_state=not placed)


def _build_optimizer(model) -> bool | None:
    """Build the optimizer's state, as Keras would at the first step: True when it is on the device (or left to
    the first step), False when it was made in the host arena and is still to be placed on the device
    (:func:`_place_state`), None when it does not fit.

    Where plans may offload it (the CPU device with GTBM), the state is made in the host arena: each variable's
    handle stays where the variable was made, and a handle made on the device, next to its slot, would keep that
    slot's pageblock reserved after a plan offloads the state."""
    if devices.training_gpus() or not allocator.is_active():
        return True if variables.build_optimizer(model, in_host_memory=False) else None
    optimizer = getattr(model, "optimizer", None)
    unbuilt = optimizer is not None and not getattr(optimizer, "built", True)
    if not variables.build_optimizer(model, in_host_memory=True):
        return None
    return not (unbuilt and optimizer.built)  # False: this build made the state (not one left to the first step)


def _place_state(model) -> bool:
    """Move the state made in the host arena onto the device, packed with the weights
    (:func:`~dymem_tf.keras.variables.compact_weights`); False when packing ran out of the device. Done at the
    first call, once ``fit``'s iterator has made its long-lived small tensors: made after the state, they would sit
    in the pageblocks above it and keep them reserved after a plan offloads the state (U-Net under 53 MiB: one
    pageblock more at the probe's peak).

    The estimate that let the state be placed counts bytes, not the pageblocks the other groups already hold:
    DenseNet-121 32px + SGD on a 56 MiB device packed 53.5 MiB of variables and ran out. Then the weights the
    packing left in host memory come back (they fitted before it) and the state stays where it is, in host memory
    or on the device, for the plan for the device to offload (:meth:`FitSession.plan_for_device`); a weight that
    does not come back stays in host memory, where reads see its value."""
    try:
        variables.compact_weights(model)
        return True
    except tf.errors.ResourceExhaustedError:
        pass
    from dymem_tf.ops import swap_ops

    try:
        with allocator.mobility("persistent"):
            swap_ops.bring_back_variables(model.variables)
    except tf.errors.ResourceExhaustedError:
        pass
    return False


def one_batch(iterator, steps_per_execution):
    """The next batch of ``iterator`` as a maker of one-element iterators whose type is ``iterator``'s (so the
    train function traced for one serves the other; ``maker(empty=True)`` makes one that has no element); None
    where that cannot be done (not a ``tf.data`` iterator, several steps per call, a batch that is not dense
    tensors), and then nothing is taken off ``iterator``."""
    if steps_per_execution != 1 or type(iterator).__name__ != "OwnedIterator":
        return None
    spec = iterator.element_spec
    if not all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)):
        return None
    optional = iterator.get_next_as_optional()
    if not optional.has_value():
        return None
    element = optional.get_value()

    def relax(*args):  # the batch's static shapes relaxed to the iterator's (e.g. an unknown batch dimension)
        value = args if isinstance(spec, tuple) else args[0]
        return tf.nest.map_structure(lambda t, s: tf.compat.v1.placeholder_with_default(t, s.shape), value, spec)

    dataset = tf.data.Dataset.from_tensors(element).map(relax)
    if dataset.element_spec != spec:
        raise RuntimeError(f"dymem_tf: the first batch cannot be served again as {spec} (got "
                           f"{dataset.element_spec}); please report this.")
    return lambda empty=False: iter(dataset.take(0) if empty else dataset)


def _instantiate(train_function, batch) -> None:
    """Make TensorFlow instantiate ``train_function`` for ``batch``'s iterators without training a step: it runs on
    an iterator with no element and stops at its first read (``OutOfRangeError``, which is expected here)."""
    try:
        train_function(batch(empty=True))
    except (tf.errors.OutOfRangeError, StopIteration):
        pass


def _run_or_none_if_out_of_memory(train_function, iterator, gradient_keys: list):
    """``train_function(iterator)``, or None when it runs out of memory: the error and its traceback are gone when
    this returns, and with them the frames that kept the function and the failed call's state (a Grappler
    ``TemporaryVariable`` of a gradient sum, for one) on the device (docs/benchmarks.md, "Largest batch"). The
    gradient functions its trace registers with TensorFlow are added to ``gradient_keys``."""
    try:
        with compat.new_gradients(gradient_keys):
            return train_function(iterator)
    except tf.errors.ResourceExhaustedError:
        compat.release_step_resources()  # what the failed step left for the next call (a gradient sum's variable)
        return None


def first_call_function(session, train_function, capacity: int, place_state: bool = False):
    """``train_function`` whose first call runs guarded on the first batch and decides: a step that fits
    ``capacity`` with its slack to spare keeps ``train_function`` as the model's train function; one that runs
    out of memory (its variables put back) or comes within the slack is planned for the device by
    ``session.plan_for_device``, and a step that ran out of memory is run again on the same batch.
    ``place_state``: the optimizer's state is in the host arena and moves onto the device first (:func:`_place_state`)."""

    plain = [train_function]  # let go when the step is planned for the device: nothing needs it any more

    def first_call(iterator):
        model = session.model
        batch = one_batch(iterator, getattr(model, "steps_per_execution", 1))
        snapshot = variables.VariableSnapshot(model)
        if place_state:
            if batch is not None:  # what the instantiation keeps for good goes below the state, not above it
                with compat.new_gradients(session.gradient_keys):
                    _instantiate(plain[0], batch)
                snapshot.restore(changed_only=True)  # ops that read no batch may have run (a seed's update)
            if not _place_state(model):
                session.say(f"dymem_tf: the optimizer's state did not fit the device's {errors.fmt(capacity)} "
                            "next to the weights; the step is planned for the device with the state in host "
                            "memory.")
                return _planned_for_device(session, plain, batch() if batch else iterator)
        devices.reset_device_peaks()
        outputs = _run_or_none_if_out_of_memory(plain[0], batch() if batch else iterator, session.gradient_keys)
        if outputs is None:
            snapshot.restore()
            lost = "" if batch else " (the batches of that call were not trained)"
            session.say(f"dymem_tf: the train step ran out of the device's {errors.fmt(capacity)} in its first "
                        f"step; the variables were put back{lost} and the step is planned for the device, "
                        "swapping what does not fit.")
            return _planned_for_device(session, plain, batch() if batch else iterator)
        stats = session.own(devices.device_memory_stats())
        measured = stats["peak_bytes_reserved"] if stats is not None else None
        margin = first_step.plain_step_margin(capacity, stats.get("largest_alloc_size") if stats else None)
        if measured is not None and measured > capacity - margin:
            session.say(f"dymem_tf: the train step measured {errors.fmt(measured)} in its first step, within "
                        f"{errors.fmt(margin)} of the device's {errors.fmt(capacity)} (what a later step may "
                        "hold more: its largest buffer or a share of the device); from its next step on it is "
                        "planned for the device, swapping what later steps could run out of.")
            session.plan_for_device()
        else:
            session.control.plain_fits()
            model.train_function = plain[0]
            took = (f"{errors.fmt(measured)} of the device's {errors.fmt(capacity)}" if measured is not None
                    else f"it did not run out of the device's {errors.fmt(capacity)}")
            session.say(f"dymem_tf: the train step fits the device ({took} in its first step): it trains as "
                        "compiled, nothing swapped.")
        return outputs

    first_call._dymem_wrapped = True  # pylint: disable=protected-access
    return first_call


def _planned_for_device(session, plain: list, iterator):
    """Let the plain train function go (``plain``, with the Keras function that made it, and what a failed call
    left), plan the step for the device and run the planned step on ``iterator``."""
    plain.clear()
    session.keras_function = None  # nothing holds it now: a new one is made when the session ends
    gc.collect()  # the plain step's function and what its failed call left, before the probe is placed
    session.plan_for_device()
    return session.model.train_function(iterator)
