"""Binary search of the largest batch that trains under a device budget, per swap policy.

    python examples/find_max_batch.py --model resnet50 --image-size 64 --budget 512MiB --policies none,dymem

Each trial trains ``--steps`` steps in a fresh process (the budget caps the GTBM pool, so a batch that does not
fit fails with ResourceExhaustedError exactly as on a full GPU). The search doubles the batch until a trial fails,
then bisects.
"""
import argparse
import sys
import types

import common


def fits(model: str, batch: int, args) -> bool:
    """Whether ``batch`` trains under the budget with the policy in ``args``."""
    run_args = types.SimpleNamespace(batch=batch, image_size=args.image_size, steps=args.steps, classes=10, seed=0,
                                     budget=args.budget, profile=args.profile, deterministic=False)
    summary = common.run_in_subprocess(model, run_args, args.policy)
    ok = summary.get("status") == "ok"
    print(f"  {args.policy:6s} batch {batch:5d}: {'fits' if ok else summary.get('status')}", flush=True)
    return ok


def max_batch(model: str, args, start: int = 1, limit: int = 4096) -> int:
    """Largest batch in [0, limit] that fits (0 when even ``start`` does not)."""
    lo, hi = 0, None
    batch = start
    while batch <= limit:
        if fits(model, batch, args):
            lo = batch
            batch *= 2
        else:
            hi = batch
            break
    if hi is None:
        return lo
    while hi - lo > max(1, lo // 16):  # resolve to ~6% of the answer: each trial costs a training run
        mid = (lo + hi) // 2
        if fits(model, mid, args):
            lo = mid
        else:
            hi = mid
    return lo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=["vgg16", "resnet50", "densenet121", "inception_v3"])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--budget", default="512MiB")
    parser.add_argument("--policies", default="none,dymem", help="comma-separated: none, dymem, vdnn, tflms")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--start", type=int, default=4, help="first batch tried")
    parser.add_argument("--limit", type=int, default=2048, help="largest batch tried")
    parser.add_argument("--profile", "--device", dest="profile", default=None, help="cost-model profile")
    args = parser.parse_args(argv)
    results = {}
    for policy in args.policies.split(","):
        args.policy = policy.strip()
        print(f"{args.model} {args.image_size}x{args.image_size}, budget {args.budget}, policy {args.policy}:")
        results[args.policy] = max_batch(args.model, args, args.start, args.limit)
    print()
    print(f"largest batch under {args.budget} ({args.model}, {args.image_size}x{args.image_size}):")
    base = results.get("none")
    for policy, batch in results.items():
        ratio = f"  ({batch / base:.2f}x none)" if base and policy != "none" else ""
        print(f"  {policy:6s} {batch}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
