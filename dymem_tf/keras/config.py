"""One frozen configuration, the only place each of Dymem's knobs lives.

``DymemCallback(...)`` and ``dry_run(...)`` make a :class:`DymemConfig` from their arguments with
:meth:`DymemConfig.from_arguments` (validated once: :mod:`dymem_tf.keras.arguments`); everything downstream reads
it. What changes from one instantiation of the train step to the next -- the budget for this device, the batch
size, the probe's calibration and measured memory -- is not configuration: it is a
:class:`~dymem_tf.passes.step_pass.PlanRequest`, made by the first-step session
(:mod:`dymem_tf.keras.session`) from this configuration and what it measured.

The data that flows (docs/how-it-works.md): configuration ▶ session ▶ request ▶ plan ▶ message ▶ result.
"""
from __future__ import annotations

import dataclasses

from dymem_tf.keras import arguments
from dymem_tf.planning import device_profiles, pipeline


@dataclasses.dataclass(frozen=True)
class DymemConfig:
    """Dymem's knobs, validated (docs/configuration.md says what each does; ``DymemCallback``'s docstring too).

    ``memory_budget`` is kept as given (``"auto"``, None, a number of bytes or a size string); ``budget_bytes`` is
    its value in bytes when it names one (None for ``"auto"`` and for None)."""

    memory_budget: object = "auto"
    budget_bytes: int | None = None
    profile: device_profiles.DeviceProfile = dataclasses.field(default_factory=lambda: device_profiles.get_profile(
        "cpu"))
    policy: str = "dymem"
    execution_order: str = "planned"
    xla: str | None = None
    log_dir: str | None = None
    trace_allocations: bool = False
    verbose: int = 1
    offload_optimizer_state: bool | None = None
    offload_weights: bool | None = None
    calibrate: bool = True
    defer_updates: bool = True
    min_swap_bytes: int = 1 << 16
    swapin_ahead: int = 1

    @classmethod
    def from_arguments(cls, memory_budget="auto", *, profile=None, policy: str = "dymem",
                       execution_order: str = "planned", xla: str | None = None, log_dir=None,
                       trace_allocations: bool = False, verbose: int = 1, offload_optimizer_state: bool | None = None,
                       offload_weights: bool | None = None, calibrate: bool = True, defer_updates: bool = True,
                       min_swap_bytes=1 << 16, swapin_ahead: int = 1, device=None) -> "DymemConfig":
        """The configuration of ``DymemCallback(...)``'s arguments (a ValueError or TypeError naming a bad one);
        ``device`` is the former name of ``profile``."""
        profile = arguments.profile_argument(profile, device)
        min_swap_bytes, log_dir, verbose = arguments.validate(
            policy=policy, swapin_ahead=swapin_ahead, min_swap_bytes=min_swap_bytes, log_dir=log_dir,
            defer_updates=defer_updates, trace_allocations=trace_allocations,
            offload_optimizer_state=offload_optimizer_state, offload_weights=offload_weights, calibrate=calibrate,
            xla=xla, execution_order=execution_order, verbose=verbose, device=profile)
        budget = None if arguments.is_auto(memory_budget) else arguments.resolve_budget(memory_budget)
        return cls(memory_budget=memory_budget, budget_bytes=budget,
                   profile=device_profiles.get_profile(profile or arguments.default_device_profile()),
                   policy=policy, execution_order=execution_order, xla=xla, log_dir=log_dir,
                   trace_allocations=trace_allocations, verbose=verbose,
                   offload_optimizer_state=offload_optimizer_state, offload_weights=offload_weights,
                   calibrate=calibrate, defer_updates=defer_updates, min_swap_bytes=min_swap_bytes,
                   swapin_ahead=swapin_ahead)

    @property
    def auto(self) -> bool:
        """``memory_budget="auto"``: the step trains as compiled while it fits the device."""
        return arguments.is_auto(self.memory_budget)

    def offloading(self, budget_bytes: int | None) -> tuple[bool, bool]:
        """Whether plans under ``budget_bytes`` may keep optimizer state, and weights, in host memory between their
        uses (:func:`dymem_tf.keras.arguments.offloading`); never without ``defer_updates``, which the planner
        needs to offload anything (:func:`dymem_tf.planning.pipeline.offloadable_for`)."""
        if not self.defer_updates:
            return False, False
        return arguments.offloading(budget_bytes, self.policy, self.offload_optimizer_state, self.offload_weights)

    def guards_first_step(self, budget_bytes: int | None) -> bool:
        """Whether the first step under ``budget_bytes`` is the guarded, measured probe
        (:mod:`dymem_tf.planning.first_step`)."""
        return budget_bytes is not None and self.policy != "none" and self.calibrate

    def plan_settings(self) -> pipeline.PlanSettings:
        """What every plan is made with; each instantiation's request fills in its budget and measurements
        (:func:`dymem_tf.passes.step_pass.instantiation_settings`)."""
        return pipeline.PlanSettings(
            policy=self.policy, profile=self.profile, swapin_ahead=self.swapin_ahead,
            min_swap_bytes=self.min_swap_bytes, defer_updates=self.defer_updates,
            execution_order=self.execution_order, offload_variables=self.offload_optimizer_state is not False,
            offload_weights=self.offload_weights is not False)
