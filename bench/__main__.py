"""`python -m bench <name> [--size-gib N] [--reps N]`: run one benchmark; `python -m bench all
--quick [--only a,b]`: every bench small enough for a before/after comparison in a few minutes.

Dispatches to `bench.<name>.run(size_gib, reps)` (`control`: `bench.control.run(nodes,
ranks_per_node, steps)`, with its own options; `rpo`: `bench.rpo.run(trials, quick, seed,
state_mib)`; `reshard`, `overhead` and `flush`: `bench.<name>.run(size_gib, reps,
quick=...)`); progress goes to stderr, and stdout gets exactly one JSON line: the benchmark's
figures, or `{"error": ...}` if it failed (exit 1).

`all --quick` runs the benches of `QUICK` one after another, each in its own process
(`python -m bench <name> <its quick options>`), and prints one JSON line per bench on stdout as
it ends: `{"bench": <name>, <its figures>}` (or `{"bench": <name>, "error": ...}`); exit 1 if
any failed. `reshard --quick`, `rpo --quick` and `control` are left out (minutes each here);
`flush --quick` skips its throttle checks (~13 s of uploading per rate per rep).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import subprocess
import sys
import traceback
from typing import Any

from bench.common import emit, log, sigterm_as_interrupt

BENCHMARKS = {
    "stall": "blocking time of Checkpointer.save() vs memcpy, torch.save, DCP async_save",
    "nvme": "staged->written->verified through the agent vs dd O_DIRECT write/read",
    "flush": "verified->flushed to S3 (SeaweedFS) through the agent vs boto3, raw aioboto3;"
    " throttle accuracy",
    "restore": "NVMe and S3 restore into preallocated tensors vs dd, torch.load, safetensors, DCP,"
    " raw GET",
    "plan": "recovery plan at 1024 ranks x 20 steps, 100k-event replay (synthetic events)",
    "overhead": "a small real model trained on the CPU with and without a save every 50 steps"
    " (blocking and overlapped, the agent running): overhead_pct",
    "control": "the control plane at scale: real nats-server, coordinator and KV, simulated"
    " agents and ranks (--nodes, --ranks-per-node, --steps)",
    "rpo": "what a node loss costs with object storage slower than the saves, peer replicas off"
    " and on: steps lost, restore seconds, NVMe high-water, stall (--reps: trials per mode,"
    " --size-gib: the state, default 4 MiB; --quick, --seed)",
    "reshard": "a sharded (DTensor) state saved at world 4, restored at 4, 2 and 8 vs DCP; the"
    " save stall vs memcpy; a DDP state's bytes in object storage (--size-gib, default 1;"
    " --quick)",
}
#: `all --quick`: each bench's options, in the order they run (small sizes, few reps; the
#: paired ratios still get an interval: at least 5 pairs).
QUICK: dict[str, tuple[str, ...]] = {
    "stall": ("--size-gib", "0.25", "--reps", "7"),
    "overhead": ("--quick", "--reps", "3"),
    "nvme": ("--size-gib", "0.25", "--reps", "5"),
    "restore": ("--size-gib", "0.25", "--reps", "5"),
    "flush": ("--quick", "--size-gib", "0.25", "--reps", "5"),
    "plan": (),
}
#: Benches with a `--quick` of their own.
HAS_QUICK = ("rpo", "reshard", "overhead", "flush")
#: `control`'s own options (the others take --size-gib and --reps).
CONTROL_DEFAULTS = {"nodes": 100, "ranks_per_node": 8, "steps": 5}


def module_run(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`bench.<name>.run(*args, **kwargs)`."""
    result: dict[str, Any] = importlib.import_module(f"bench.{name}").run(*args, **kwargs)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    described = [f"{k}: {v}" for k, v in BENCHMARKS.items()] + ["all: every quick one (--quick)"]
    parser.add_argument("name", choices=[*sorted(BENCHMARKS), "all"], help="; ".join(described))
    parser.add_argument(
        "--size-gib", type=float, default=None, help="state size (default 2; overhead: 0.05)"
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="stall: cProfile one extra save; control: cProfile the coordinator (stderr)",
    )
    rpo = parser.add_argument_group("rpo only (--quick: rpo, reshard, overhead, flush, all)")
    rpo.add_argument("--quick", action="store_true", help="a small run (the test's)")
    rpo.add_argument(
        "--only", default=None, help=f"all: a comma-separated subset of {','.join(QUICK)}"
    )
    rpo.add_argument(
        "--seed", type=int, default=None, help="the kill moments' RNG (default: drawn, printed)"
    )
    control = parser.add_argument_group("control only")
    for name, default in CONTROL_DEFAULTS.items():
        control.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {default}"
        )
    args = parser.parse_args(argv)
    if args.name == "all":
        return _all(parser, args)
    if args.only is not None:
        parser.error("--only applies to all only")
    if args.name != "rpo" and args.seed is not None:
        parser.error("--seed applies to rpo only")
    if args.name not in HAS_QUICK and args.quick:
        parser.error(f"--quick applies to {', '.join(HAS_QUICK)} and all only")
    given = [k for k in CONTROL_DEFAULTS if getattr(args, k) is not None]
    if args.name != "control" and given:
        parser.error(f"--{given[0].replace('_', '-')} applies to control only")
    if args.name == "rpo":
        state_mib = None if args.size_gib is None else args.size_gib * 1024
        if args.reps < 1 or (state_mib is not None and state_mib <= 0):
            parser.error("--size-gib must be > 0 and --reps >= 1")
        call = functools.partial(
            module_run, "rpo", args.reps, quick=args.quick, seed=args.seed, state_mib=state_mib
        )
        return _call(call)
    if args.size_gib is None:
        args.size_gib = {"overhead": 0.05, "reshard": 1.0}.get(args.name, 2.0)
    if args.size_gib <= 0 or args.reps < 1:
        parser.error("--size-gib must be > 0 and --reps >= 1")
    if args.name == "control":
        sizes = {k: d if getattr(args, k) is None else getattr(args, k)
                 for k, d in CONTROL_DEFAULTS.items()}  # fmt: skip
        if min(sizes.values()) < 1:
            parser.error("--nodes, --ranks-per-node and --steps must be >= 1")
        call = functools.partial(module_run, args.name, profile=args.profile, **sizes)
    else:
        if args.reps < 3:
            log(f"WARNING: {args.reps} reps; medians of fewer than 3 reps are not meaningful here")
        kwargs: dict[str, Any] = {"profile": True} if args.profile and args.name == "stall" else {}
        if args.name in ("reshard", "overhead", "flush"):
            kwargs = {"quick": args.quick}
        call = functools.partial(module_run, args.name, args.size_gib, args.reps, **kwargs)
    return _call(call)


def quick_runs(only: str | None = None) -> list[tuple[str, list[str]]]:
    """The benches `all --quick` runs (all of `QUICK`, or the comma-separated `only`, in
    `QUICK`'s order), each with its command line.

    Raises:
        ValueError: `only` names a bench that is not a quick one.
    """
    names = list(QUICK)
    if only is not None:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        if not wanted or any(n not in QUICK for n in wanted):
            raise ValueError(f"--only takes quick benches among {','.join(QUICK)} (got {only!r})")
        names = [n for n in names if n in wanted]
    return [(n, [sys.executable, "-m", "bench", n, *QUICK[n]]) for n in names]


def _all(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`all --quick`: each quick bench in its own process, one JSON line each."""
    if not args.quick:
        parser.error("all runs the quick benches only: python -m bench all --quick")
    given = [k for k in ("size_gib", "seed", "profile", *CONTROL_DEFAULTS)
             if getattr(args, k) not in (None, False)]  # fmt: skip
    if given or args.reps != 5:
        parser.error("all takes --quick and --only only (each bench's options are in QUICK)")
    try:
        runs = quick_runs(args.only)
    except ValueError as e:
        parser.error(str(e))
    sigterm_as_interrupt()
    failed = 0
    for name, cmd in runs:
        log(f"all: {' '.join(cmd[1:])}")
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        lines = out.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {"error": "no JSON line"}
        except ValueError as e:
            result = {"error": f"unreadable JSON line ({e}): {lines[-1][:200]!r}"}
        if out.returncode != 0 and "error" not in result:
            result["error"] = f"exit status {out.returncode}"
        failed += "error" in result
        emit({"bench": name, **result})
    return 1 if failed else 0


def _call(call: functools.partial[dict[str, Any]]) -> int:
    """Run a benchmark; emit its JSON line (or the error's); the exit status."""
    sigterm_as_interrupt()
    try:
        result = call()
    except BaseException as e:
        traceback.print_exc()
        emit({"error": f"{type(e).__name__}: {e}"})
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
