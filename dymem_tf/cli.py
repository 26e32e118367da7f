"""The ``dymem`` command (also ``python -m dymem_tf``): ``plan``, ``selfcheck``, ``replay`` and ``--version``."""
from __future__ import annotations

import argparse
import sys

from tabulate import tabulate

DESCRIPTION = "dymem_tf: plan and check GPU memory swapping for Keras training."
EPILOG = """examples:
  dymem plan --model resnet50 --batch 64 --image-size 224 --budget 5GiB --profile h200
  dymem plan --model my_model.keras --batch 32 --budget none --policy dymem --save plan.json
  dymem selfcheck
  dymem replay trace.csv --policy gtbm

'plan' is a dry run: it traces the model's train step (random weights; nothing is trained or downloaded), plans
it as DymemCallback would with the same defaults, and prints the plan and each policy's predicted peak and step
time. In Python, dymem_tf.dry_run(model, batch_size, ...) does the same for any compiled model."""


def _parser() -> argparse.ArgumentParser:
    from dymem_tf import __version__

    parser = argparse.ArgumentParser(prog="dymem", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dymem_tf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,selfcheck,replay}")
    plan = sub.add_parser("plan", help="dry-run the planner on a model's train step",
                          description="Plan a model's train step as DymemCallback would, without training.")
    plan.add_argument("--model", required=True, help="keras.applications name (resnet50, ...) or a .keras file")
    plan.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    plan.add_argument("--image-size", type=int, default=224, help="square input size of an application (224)")
    plan.add_argument("--classes", type=int, default=10, help="classes of an application's head (10)")
    plan.add_argument("--budget", default="auto",
                      help="device budget: auto (default: this machine's device, as the callback), none (no "
                           "budget: swap every tensor worth swapping), or a size such as 8GiB")
    plan.add_argument("--profile", default=None,
                      help="cost-model profile: cpu, v100, a100, h100, h200, ... (default: this machine's)")
    plan.add_argument("--device", default=None, help=argparse.SUPPRESS)  # the former name of --profile
    plan.add_argument("--policy", default="all", help="dymem, vdnn, tflms, none or all (default)")
    plan.add_argument("--save", default=None, help="write the dymem plan as JSON to this path")
    plan.add_argument("--no-offload-state", action="store_true",
                      help="keep optimizer state on the device (by default, under a budget on the CPU device, the "
                           "plan may keep it in host memory between its uses, as the callback does)")
    plan.add_argument("--no-offload-weights", action="store_true",
                      help="keep the weights on the device (by default they may leave it as the state does)")
    check = sub.add_parser("selfcheck", help="check dymem_tf on this machine's devices; exit 1 on a failure",
                           description="Check GTBM, the swap ops, copies and a tiny training on this machine.")
    check.add_argument("--no-training", action="store_true", help="skip the tiny training run (the slowest check)")
    sub.add_parser("replay", help="replay allocation traces through GTBM and baseline placers",
                   description="Replay allocation traces; 'dymem replay --help' lists its options.", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["replay"]:  # its own parser (dymem_tf.memory.replay, also the dymem-replay command)
        from dymem_tf.memory import replay

        return replay.main(argv[1:], prog="dymem replay")
    args = _parser().parse_args(argv)
    import dymem_tf  # noqa: F401  (loads the allocator before TF allocates)

    if args.command == "selfcheck":
        from dymem_tf.keras import selfcheck

        return selfcheck.main(training=not args.no_training)
    return _plan(args)


def _plan(args) -> int:
    """``dymem plan``: trace the model's step once, plan it under each policy, print the plans side by side."""
    import dataclasses

    from dymem_tf import units
    from dymem_tf.keras import dry_run
    from dymem_tf.keras.config import DymemConfig
    from dymem_tf.passes import step_pass
    from dymem_tf.planning import planner

    if args.batch <= 0 or args.image_size <= 0:
        return _error("--batch and --image-size must be positive")
    if args.device is not None and args.profile is not None:
        return _error("--device is the former name of --profile: give one of them")
    try:
        budget = None if args.budget.strip().lower() == "none" else args.budget
        config = DymemConfig.from_arguments(budget, profile=args.profile or args.device, verbose=0, calibrate=False,
                                            offload_optimizer_state=False if args.no_offload_state else None,
                                            offload_weights=False if args.no_offload_weights else None)
        policies = planner.POLICIES if args.policy == "all" else (args.policy,)
        for policy in policies:
            if policy not in planner.POLICIES:
                raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(planner.POLICIES)}")
        model = dry_run.build_model(args.model, args.image_size, args.classes)
    except ValueError as err:
        return _error(str(err))
    budget_bytes, unlimited = dry_run.resolve_budget(config)
    if unlimited:
        print("the device has no memory limit: DymemCallback() would swap nothing; --budget none shows the "
              "least-memory plans")
        policies = ("none",)
    traced = dry_run.trace_train_step(model, args.batch)
    layers = len(traced.step_graph.layers) if traced.step_graph is not None else "?"
    budget_text = units.format_bytes(budget_bytes) if budget_bytes is not None else "none"
    print(f"{args.model}: batch {args.batch}, {args.image_size}x{args.image_size}, {traced.num_ops} ops in the "
          f"train step, {layers} dependency layers, persistent {units.format_bytes(traced.persistent_bytes)}, "
          f"budget {budget_text}, profile {config.profile.name}")
    request = step_pass.PlanRequest(budget_bytes=budget_bytes, persistent_bytes=traced.persistent_bytes,
                                    default_batch_size=traced.batch_size)
    plans = dry_run.plan_each(traced, {policy: dataclasses.replace(config, policy=policy).plan_settings()
                                       for policy in policies}, request)
    if "dymem" in plans and not isinstance(plans["dymem"], Exception):
        print(plans["dymem"].summary())
        if args.save:
            plans["dymem"].save(args.save)
            print(f"plan saved to {args.save}")
    print(tabulate([_row(policy, plan) for policy, plan in plans.items()],
                   headers=("policy", "swaps", "state", "weights", "recompute", "pred. peak", "step ms", "stall ms",
                            ""), tablefmt="plain", disable_numparse=True))
    return 0


def _row(policy: str, plan) -> tuple:
    from dymem_tf import units

    if isinstance(plan, Exception):
        return (policy, "-", "-", "-", "-", "-", "-", "-", f"error: {plan}")
    pred = plan.predicted
    return (policy, str(len(plan.feature_maps)), str(len(plan.offloaded_variables)), str(len(plan.offloaded_weights)),
            str(len(plan.recomputed)), units.format_bytes(pred.peak_bytes), f"{pred.step_time_s * 1e3:.1f}",
            f"{pred.stall_s * 1e3:.1f}", "")


def _error(text: str) -> int:
    print(f"error: {text}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
