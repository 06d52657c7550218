"""`python -m bench <name> [--size-gib N] [--reps N]`: run one benchmark.

Dispatches to `bench.<name>.run(size_gib, reps)`; progress goes to stderr, and stdout gets
exactly one JSON line: the benchmark's medians, or `{"error": ...}` if it failed (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from bench.common import emit, log, sigterm_as_interrupt

BENCHMARKS = {
    "stall": "blocking time of Checkpointer.save() vs memcpy, torch.save, DCP async_save",
    "nvme": "staged->written->verified through the agent vs dd O_DIRECT write/read",
    "flush": "verified->flushed to S3 (SeaweedFS) through the agent vs boto3, raw aioboto3;"
    " throttle accuracy",
    "restore": "NVMe and S3 restore into preallocated tensors vs dd, torch.load, safetensors, DCP,"
    " raw GET",
    "plan": "recovery plan at 1024 ranks x 20 steps, 100k-event replay (synthetic events)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="; ".join(
        f"{k}: {v}" for k, v in BENCHMARKS.items()))  # fmt: skip
    parser.add_argument("--size-gib", type=float, default=2.0, help="state size (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument(
        "--profile", action="store_true", help="stall only: cProfile one extra save (stderr)"
    )
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.reps < 1:
        parser.error("--size-gib must be > 0 and --reps >= 1")
    if args.reps < 3:
        log(f"WARNING: {args.reps} reps; medians of fewer than 3 reps are not meaningful here")
    sigterm_as_interrupt()
    module = importlib.import_module(f"bench.{args.name}")
    kwargs = {"profile": True} if args.profile and args.name == "stall" else {}
    try:
        result = module.run(args.size_gib, args.reps, **kwargs)
    except BaseException as e:
        traceback.print_exc()
        emit({"error": f"{type(e).__name__}: {e}"})
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
