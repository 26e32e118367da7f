"""What ``DymemCallback`` tells the user when memory runs out or a budget cannot be met: the refusals of the first
step under a budget, the hint added to an out-of-memory error, and the warning about oneDNN's crash. Each takes the
first-step session (``session``, :class:`~dymem_tf.keras.session.FitSession`) for the budget and the plan of the
call it reports on."""
from __future__ import annotations

import os

from dymem_tf import compat, units
from dymem_tf.memory import allocator, devices
from dymem_tf.planning import first_step, planner


def weights_over_budget(budget: int, resident: int, offload: bool, weights_too: bool) -> planner.BudgetTooSmallError:
    """The refusal before training of a budget that cannot hold the variables that must stay on the device."""
    what = ("the model's weights that must stay on the device (its largest weight and those smaller than "
            "min_swap_bytes)" if offload and weights_too
            else "the model's weights alone" if offload else "the model's weights and optimizer state")
    return planner.BudgetTooSmallError(f"memory_budget {fmt(budget)} is smaller than {what} ({fmt(resident)}); raise "
                                       "the budget or use a smaller model.", budget_bytes=budget)


def state_does_not_fit(capacity: int, weights: int) -> planner.BudgetTooSmallError:
    """The refusal before training when the optimizer's state ran out of the device while it was built (its
    estimate said it would fit): nothing trained, the optimizer left unbuilt."""
    return planner.BudgetTooSmallError(
        f"the optimizer's state ran out of the device's {fmt(capacity)} while it was built (the weights take "
        f"{fmt(weights)}); pass a memory_budget (for example DymemCallback(memory_budget={fmt(capacity)!r})) so "
        "that the state is made in host memory and offloaded, or use a larger device.", budget_bytes=capacity)


def below_block_floor(budget: int, floor: int, resident: int, block: int) -> planner.BudgetTooSmallError:
    """The refusal before training of a budget under the least GTBM's groups can hold: the variables' blocks and
    one block each for the step's other two groups."""
    return planner.BudgetTooSmallError(
        f"memory_budget {fmt(budget)} is smaller than the least GTBM can train in: {fmt(floor)}, the blocks of the "
        f"variables that stay on the device ({fmt(resident)}) and one {fmt(block)} block each for the step's "
        "short-lived and swapped tensors; raise the budget to at least that.", budget_bytes=budget)


def too_close(session, measured: int) -> planner.BudgetTooSmallError:
    """The refusal after the least-memory plan fitted with less than its step slack of the budget to spare (the
    plan of the session's latest call: the probe's)."""
    plan = session.last_result.plan
    batch = plan.batch_size if plan is not None else None
    slack = first_step.step_slack(session.budget_bytes)
    suggested = planner.suggested_batch(batch, session.budget_bytes, measured, session.request.persistent_bytes,
                                        margin=2 * slack)
    hint = batch_hint(batch, suggested)
    needed = first_step.least_budget(measured)
    return planner.BudgetTooSmallError(
        f"memory_budget {fmt(session.budget_bytes)} is too small to train reliably: with every tensor that can leave "
        f"the device swapped out, the first step used {fmt(measured)}, and later steps can use "
        f"{slack:.0%} more. The variables were restored. Raise the budget to at least "
        f"{units.at_least(needed, session.budget_bytes)} or {hint}.",
        min_peak_bytes=measured, budget_bytes=session.budget_bytes, suggested_batch=suggested)


def measured_too_small(session, err, fallen_back: bool = False) -> planner.BudgetTooSmallError:
    """The refusal after the least-memory plan ran out of memory in its first step (variables restored): the plan
    of the session's latest call, the probe's (None when the pass left that call's step unmodified);
    ``fallen_back``: in the step it trained again after a budgeted plan failed."""
    plan = session.last_result.plan
    predicted = int(plan.predicted.peak_bytes or 0) if plan is not None else 0
    persistent = session.request.persistent_bytes
    batch = plan.batch_size if plan is not None else None
    # the simulator underestimated this plan by an unknown amount: scale from the prediction with a margin,
    # and by at least one sample
    suggested = planner.suggested_batch(batch, session.budget_bytes, max(predicted, session.budget_bytes + 1),
                                        persistent, margin=first_step.CALIBRATION_MARGIN)
    if suggested is not None:
        suggested = max(min(suggested, batch - 1), 0)
    hint = batch_hint(batch, suggested)
    when = ("training fell back to the least-memory plan after a budgeted plan failed, and that step ran out of "
            "memory" if fallen_back else "the first step ran out of memory")
    if plan is None:  # the pass left the step unmodified: nothing could be swapped
        reasons = "; ".join(sorted({s.kind for s in session.skipped})) or "no plan"
        return planner.BudgetTooSmallError(
            f"memory_budget {fmt(session.budget_bytes)} is too small: {when}, and Dymem "
            f"left it unmodified ({reasons}), so no swapping could help. No variable was changed. Raise the "
            "budget or reduce the batch size.", budget_bytes=session.budget_bytes)
    error = planner.BudgetTooSmallError(
        f"memory_budget {fmt(session.budget_bytes)} is too small: {when} even with every "
        f"tensor that can leave the device swapped out (predicted peak {fmt(predicted)}, of which "
        f"{fmt(plan.persistent_bytes)} weights and optimizer state that stay on the device; "
        f"{err.message.splitlines()[0] if err.message else ''}). No variable was changed. Raise the budget or "
        f"{hint}.",
        min_peak_bytes=predicted or None, budget_bytes=session.budget_bytes, suggested_batch=suggested)
    return error


def out_of_memory_hint(session) -> str:
    """What the out-of-memory error of a train step in ``session``'s fit adds: the budget, and what to change."""
    limits = []
    gpus = devices.training_gpus()
    if gpus:  # GTBM's CPU pool (DYMEM_DEVICE_MEMORY_LIMIT) is not the step's memory there
        capacity = devices.device_memory_capacity()
        limits.append(f"memory of {', '.join(gpus)}" + (f" ({fmt(capacity)} for TensorFlow)" if capacity else ""))
        device_limit = capacity
        raise_budget = ("free GPU memory that other processes hold, or use a GPU with more memory")
    else:
        if allocator.is_active():
            env = os.environ.get(allocator.LIMIT_ENV)
            src = f"{allocator.LIMIT_ENV}={env}" if env else "the GTBM default (no DYMEM_DEVICE_MEMORY_LIMIT set)"
            limits.append(f"GTBM device budget {fmt(allocator.get_memory_limit())} ({src})")
        device_limit = allocator.get_memory_limit() if allocator.is_active() else None
        raise_budget = (f"raise the budget ({allocator.LIMIT_ENV} before starting Python, or "
                        "dymem_tf.set_memory_limit)" if device_limit is not None else "use a device with more memory")
    if session.budget_bytes is not None:
        limits.append(f"memory_budget={fmt(session.budget_bytes)}")
    where = "; ".join(limits) if limits else "the device's memory"
    skipped = session.last_skipped
    if skipped is not None:  # no plan runs in this step: swapping (or a plan's budget) cannot change anything
        why = skipped.reason.split(": ", 1)[-1].rstrip(".")
        return (f"dymem_tf: the train step ran out of device memory under the {where}. Dymem left this step "
                f"unmodified ({skipped.kind}: {why}), so no tensor is swapped and swapping cannot help it. To "
                f"fit: lower the batch size; or {raise_budget}.")
    plan = session.plan
    predicted = ""
    if plan is not None and plan.predicted.peak_bytes:
        predicted = f" The plan predicted a peak of {fmt(int(plan.predicted.peak_bytes))}."
    fixes = ["lower the batch size", raise_budget]
    if session.budget_bytes is not None and device_limit is not None and session.budget_bytes > device_limit:
        fixes.append(f"plan for the device's real size: memory_budget=\"{fmt(device_limit)}\" (memory_budget "
                     f"{fmt(session.budget_bytes)} exceeds the device budget)")
    elif session.config.policy != "dymem" or session.budget_bytes is None:
        budget = fmt(session.budget_bytes or device_limit) if (session.budget_bytes or device_limit) \
            else "<device memory>"
        fixes.append(f'let the planner swap enough feature maps to fit: DymemCallback(policy="dymem", '
                     f'memory_budget="{budget}")')
    else:
        fixes.append(f"lower memory_budget below {fmt(session.budget_bytes)} to leave room for what the planner "
                     "does not model (workspace, fragmentation), or min_swap_bytes=0 to swap small tensors too")
    return (f"dymem_tf: the train step ran out of device memory under the {where}.{predicted} To fit: "
            + "; or ".join(fixes) + ".")


_ONEDNN_WARNED = []


def warn_onednn_out_of_memory_crash() -> None:
    """Warn once when running out of a GTBM budget would crash TensorFlow instead of raising an error.

    TensorFlow 2.21's oneDNN kernels (``MklConvOp`` ...) do not stop when their output allocation fails: they touch
    the missing buffer and the process dies with SIGSEGV. TF's own CPU allocator never fails, so only a capped GTBM
    pool reaches that path; with ``TF_ENABLE_ONEDNN_OPTS=0`` TensorFlow uses its Eigen kernels, which raise
    ``ResourceExhaustedError`` as on a GPU.
    """
    if _ONEDNN_WARNED or not allocator.is_active() or not os.environ.get(allocator.LIMIT_ENV, "").strip():
        return
    if compat.onednn_enabled():
        _ONEDNN_WARNED.append(True)
        compat.warn_user(
            f"dymem_tf: {allocator.LIMIT_ENV} caps the device pool while TensorFlow's oneDNN kernels are on; in "
            "TensorFlow 2.21 a oneDNN kernel that runs out of the budget crashes the process (SIGSEGV) instead of "
            "raising ResourceExhaustedError. Set TF_ENABLE_ONEDNN_OPTS=0 before starting Python to get the error.")


def batch_hint(batch: int | None, suggested: int | None) -> str:
    return f"reduce the batch size from {batch} to about {suggested}" if suggested is not None else \
        "reduce the batch size"


def fmt(n: int) -> str:
    return units.format_bytes(n)
