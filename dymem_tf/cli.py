"""Command line, run as ``python -m dymem_tf`` (``plan ...`` or ``selfcheck``).

``plan`` (e.g. ``plan --model resnet50 --batch 64 --budget 5GiB``) is a dry run: it traces the model's train step
(random weights, nothing is trained or downloaded), plans it under every policy and prints the plan summary and,
per policy, the predicted device peak and step time. ``selfcheck`` checks dymem_tf on this machine's devices
(:mod:`dymem_tf.keras.selfcheck`) and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import sys

from tabulate import tabulate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dymem_tf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="dry-run the planner on a model's train step")
    plan.add_argument("--model", required=True, help="keras.applications name (resnet50, ...) or a .keras file")
    plan.add_argument("--batch", type=int, default=32)
    plan.add_argument("--image-size", type=int, default=224)
    plan.add_argument("--classes", type=int, default=10)
    plan.add_argument("--budget", default=None, help="device budget, e.g. 8GiB (default: none)")
    plan.add_argument("--device", default="h200", help="cost-model profile (cpu, v100, a100, h100, h200, ...)")
    plan.add_argument("--policy", default="all", help="dymem, vdnn, tflms, none or all (default)")
    plan.add_argument("--save", default=None, help="write the dymem plan as JSON to this path")
    plan.add_argument("--offload-state", action="store_true",
                      help="with --budget, let dymem keep optimizer state in host memory between its uses, as the "
                           "callback does under a budget on the CPU device")
    plan.add_argument("--offload-weights", action="store_true",
                      help="with --budget, let dymem also keep weights in host memory between their forward and "
                           "backward uses, as the callback does under a budget on the CPU device")
    check = sub.add_parser("selfcheck", help="check dymem_tf on this machine's devices (GTBM, swap ops, copies, "
                                             "training); exit 1 on a failure")
    check.add_argument("--no-training", action="store_true", help="skip the tiny training run (the slowest check)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import dymem_tf  # noqa: F401  (loads the allocator before TF allocates)

    if args.command == "selfcheck":
        from dymem_tf.keras import selfcheck

        return selfcheck.main(training=not args.no_training)
    from dymem_tf import units
    from dymem_tf.keras import dry_run
    from dymem_tf.planning import device_profiles, planner

    if args.batch <= 0 or args.image_size <= 0:
        print("error: --batch and --image-size must be positive", file=sys.stderr)
        return 2
    try:
        budget = units.parse_bytes(args.budget) if args.budget else None
        profile = device_profiles.get_profile(args.device)
        policies = planner.POLICIES if args.policy == "all" else (args.policy,)
        for policy in policies:
            if policy not in planner.POLICIES:
                raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(planner.POLICIES)}")
        model = dry_run.build_model(args.model, args.image_size, args.classes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    traced = dry_run.trace_train_step(model, args.batch)
    print(f"{args.model}: batch {args.batch}, {args.image_size}x{args.image_size}, {traced.num_ops} ops in the "
          f"train step, {len(traced.step_graph.layers) if traced.step_graph is not None else '?'} dependency layers, "
          f"persistent "
          f"{units.format_bytes(traced.persistent_bytes)}, device profile {profile.name}")
    for flag, asked in (("--offload-state", args.offload_state), ("--offload-weights", args.offload_weights)):
        if asked and budget is None:
            print(f"error: {flag} needs a --budget (it offloads only where a budget needs it)", file=sys.stderr)
            return 2
    plans = dry_run.plan_all(traced, policies, budget, profile, offload_variables=args.offload_state,
                             offload_weights=args.offload_weights)
    rows = []
    for policy, plan in plans.items():
        if isinstance(plan, Exception):
            rows.append((policy, "-", "-", "-", "-", "-", "-", "-", f"error: {plan}"))
            continue
        pred = plan.predicted
        rows.append((policy, str(len(plan.feature_maps)), str(len(plan.offloaded_variables)),
                     str(len(plan.offloaded_weights)), str(len(plan.recomputed)),
                     units.format_bytes(pred["peak_bytes"]),
                     f"{pred['step_time_s'] * 1e3:.1f}", f"{pred['stall_s'] * 1e3:.1f}", ""))
    if "dymem" in plans and not isinstance(plans["dymem"], Exception):
        print(plans["dymem"].summary())
        if args.save:
            plans["dymem"].save(args.save)
            print(f"plan saved to {args.save}")
    print(tabulate(rows, headers=("policy", "swaps", "state", "weights", "recompute", "pred. peak", "step ms",
                                  "stall ms", ""),
                   tablefmt="plain",
                   disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
