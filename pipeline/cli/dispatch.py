"""`tierpipe`'s entry point (`main`): the command line parsed, the settings loaded, each verb
handed to its view (`tierpipe.cli.views`) or operation (`tierpipe.cli.ops`), and an error
printed as one line on stderr, the exit status its class's (`tierpipe.cli.exits`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tierpipe.cli import ops, views
from tierpipe.cli.events import Filter
from tierpipe.cli.exits import INTERRUPTED, READER_GONE, USAGE, exit_code
from tierpipe.cli.parser import build_parser, parse_rate, parse_since
from tierpipe.errors import ConfigError, TierpipeError, leaves
from tierpipe.log import configure_logging
from tierpipe.names import validate_token
from tierpipe.settings import load_settings

__all__ = ("main",)


def main(argv: list[str] | None = None) -> int:
    """Run `tierpipe` with `argv` (default: the process's arguments); the exit status."""
    # Before anything can log (reading the settings): logs go to stderr, stdout is the
    # command's own (a `--json` reader parses every line of it).
    configure_logging()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # (argparse's usage error, or --help)
        return e.code if isinstance(e.code, int) else USAGE
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except BrokenPipeError:
        if args.command == "worker":
            raise  # a socket's error, not a closed stdout
        return _reader_gone()
    except KeyboardInterrupt:
        return INTERRUPTED
    except (TierpipeError, OSError) as e:
        return _failed(e)
    except BaseExceptionGroup as group:  # (a task group's: one error of ours is that error)
        errors = leaves(group)
        if len(errors) == 1 and isinstance(errors[0], TierpipeError | OSError):
            return _failed(errors[0])
        raise
    return code


def _failed(error: Exception) -> int:
    print(f"tierpipe: error: {error}", file=sys.stderr)
    return exit_code(error)


def _run(args: argparse.Namespace) -> int:
    from tierpipe.stages import AGENT_STAGES

    settings = load_settings(args.config)
    configure_logging(settings.log_level, settings.log_format)
    match args.command:
        case "worker":
            names = list(AGENT_STAGES) if "all" in args.stages else list(dict.fromkeys(args.stages))
            return ops.worker(settings, names)
        case "status":
            job = validate_token("job", args.job)
            return views.status(settings, job, step=args.step, rank=args.rank, as_json=args.json)
        case "flush":
            return ops.flush(
                settings, args.action, args.rate, args.node, force=args.force, job=args.job,
                as_json=args.json,
            )  # fmt: skip
        case "plan":
            if args.alive is not None:
                raise ConfigError(
                    "--alive is gone: the job state does not record which node holds a rank's "
                    "NVMe copy (a restart checks each rank's own disk); --nvme-lost plans as if "
                    "every NVMe copy were lost"
                )
            job = validate_token("job", args.job)
            lost = [validate_token("node", n) for n in args.lost_node or []]
            if lost and args.nvme_lost:
                raise ConfigError("--lost-node and --nvme-lost: give one (--nvme-lost: all nodes)")
            return views.plan(
                settings, job, args.step, nvme_lost=args.nvme_lost, lost_nodes=lost,
                as_json=args.json,
            )  # fmt: skip
        case "reindex":
            job = validate_token("job", args.job)
            return ops.reindex(
                settings, job, verify=not args.no_verify, s3=not args.no_s3, as_json=args.json
            )
        case "budget":
            if args.restore_gets is not None and args.restore_gets < 0:
                raise ConfigError("--restore-gets must be >= 0")
            flush = parse_rate(args.flush) if args.flush is not None else None
            return ops.budget(
                settings, validate_token("job", args.job), flush=flush,
                gets=args.restore_gets, as_json=args.json,
            )  # fmt: skip
        case "events":
            job = validate_token("job", args.job)
            since = parse_since(args.since) if args.since is not None else None
            keep = Filter(
                kinds=frozenset(args.kind) if args.kind else None, step=args.step,
                rank=args.rank, node=validate_token("node", args.node) if args.node else None,
            )  # fmt: skip
            return views.events(
                settings, job, keep, since=since, follow=args.follow, as_json=args.json
            )
        case "ls":
            return views.ls(settings, as_json=args.json)
        case "gc":
            job = validate_token("job", args.job)
            return ops.gc(
                settings, job, apply=args.apply, min_age_s=args.min_age_s, as_json=args.json
            )
        case "rm":
            job = validate_token("job", args.job)
            return ops.rm(
                settings, job, apply=args.apply, force=args.force, idle_s=args.idle_s,
                as_json=args.json,
            )  # fmt: skip
        case "prefetch":
            job = validate_token("job", args.job)
            node = validate_token("node", args.node) if args.node else None
            return ops.prefetch(settings, job, node=node, step=args.step, as_json=args.json)
        case "export":
            job = validate_token("job", args.job)
            if args.merged and args.to == "dcp":
                raise ConfigError("--merged is for torch and safetensors (dcp is always merged)")
            return ops.export(
                settings, job, args.step, args.to, Path(args.dir), merged=args.merged,
                max_file_bytes=parse_rate(args.max_file_size), as_json=args.json,
            )  # fmt: skip
        case "import":
            job = validate_token("job", args.job)
            if args.step is not None and args.step < 0:
                raise ConfigError(f"--step must be >= 0 (got {args.step})")
            return ops.import_dcp(
                settings, Path(args.dir), job, step=args.step, world_size=args.world,
                timeout_s=args.timeout_s, as_json=args.json,
            )  # fmt: skip
        case "up":
            return ops.up(
                settings, data=args.data, nats_url=args.nats_url, nats_port=args.nats_port,
                s3_endpoint=args.s3_endpoint, no_s3=args.no_s3,
            )  # fmt: skip
        case "demo" if args.rank is not None:
            return ops.demo_rank(args.rank, args.ranks, args.steps, args.every)
        case "demo":
            return ops.demo(
                settings, ranks=args.ranks, steps=args.steps, every=args.every, data=args.data,
                plot=args.plot, seed=args.seed,
            )  # fmt: skip
    return 0


def _reader_gone() -> int:
    """The reader of our output closed it (`tierpipe plan --json | head -c 10`): stop quietly,
    as Unix filters do. Python flushes stdout again at exit and would report the same broken
    pipe, so stdout is pointed at /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return READER_GONE
