"""The `tierpipe` command: run node-agent stages, inspect a job, run the demo."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from tierpipe.bus.client import Bus
from tierpipe.bus.connect import translate
from tierpipe.cli.render import (
    EVENT_KINDS,
    JobRow,
    JobView,
    event_json_line,
    event_line,
    jobs_table,
    lag_note,
    rank_details,
    rank_json,
    rank_table,
    step_json,
    step_table,
)
from tierpipe.control.confirm import confirmed_list, confirmed_steps
from tierpipe.control.folded import folded_head, newest_seq
from tierpipe.control.kvstate import JobStore, digests_key
from tierpipe.errors import BusUnavailableError, ConfigError, NoCheckpointError, TierpipeError
from tierpipe.log import configure_logging
from tierpipe.names import (
    batch_subject,
    consumer_name,
    filter_subject,
    flush_control_subject,
    job_subjects,
    node_name,
    plan_subject,
    shard_relpath,
    shard_subject,
    state_subjects,
    stream_name,
    subject_job,
    validate_token,
)
from tierpipe.progress import bar
from tierpipe.recovery.kvplan import KvPlan, plan_now
from tierpipe.schemas import FlushAction, FlushControl, StageFailed
from tierpipe.schemas.jobstate import (
    RANKS_PER_CHUNK,
    Budget,
    JobHead,
    RankDigests,
    Shares,
    StepRecord,
)
from tierpipe.settings import Settings, load_settings

__all__ = ("main", "parse_rate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierpipe", description=__doc__)
    parser.add_argument("--config", help="settings TOML file (default $TIERPIPE_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    from tierpipe.stages import AGENT_STAGES

    worker = sub.add_parser("worker", help="run node-agent stages until SIGTERM/SIGINT")
    worker.add_argument(
        "stages",
        nargs="+",
        choices=[*AGENT_STAGES, "all"],
        help="stages to run in this process ('all': every stage of this node)",
    )

    status = sub.add_parser(
        "status",
        help="a job's kept steps from its state in KV (per rank: --step N)",
        description="One line per step the job keeps: world size, ranks with a good copy on "
        "NVMe and in object storage, and on which tier the step is complete; above them the "
        "newest complete steps, the retention floors and policy, and the coordinator's lease. "
        "--step N lists that step's ranks instead (digest, size, NVMe path, object).",
    )
    status.add_argument("--job", required=True)
    status.add_argument("--step", type=int, help="per-rank detail of this step")
    status.add_argument("--rank", type=int, help="with --step: only this rank")
    status.add_argument(
        "--json", action="store_true", help="one JSON object per step (per rank with --step)"
    )

    plan = sub.add_parser(
        "plan",
        help="which step a restore would pick now, from the job state in KV",
        description="The newest candidate step a restart considers on which every rank has a "
        "copy on some tier, and how many ranks would read NVMe and object storage, assuming "
        "every rank's node still holds the NVMe copy the job state records (a restart also "
        "checks each file on its disk). --json prints one object: job, step, world_size, "
        "from_nvme, from_s3 (rank counts), s3_ranks (the ranks reading object storage), "
        "candidates (newest first), rejected (step -> why), unconfirmed (step -> why the "
        "job state does not back what its head says of it: no record, or no rank digests; "
        "never planned), assumes (nvme_kept, nvme_lost or nodes_lost), lost_nodes (those given "
        "with --lost-node), folded_seq and stream_seq (the job "
        "state lags the stream when the first is lower). Exits non-zero when no candidate is "
        "confirmed and restorable.",
    )
    plan.add_argument("--job", required=True)
    plan.add_argument("--step", type=int, help="plan this step rather than the newest")
    plan.add_argument(
        "--nvme-lost",
        action="store_true",
        help="plan as if every NVMe copy were lost (every rank reads object storage)",
    )
    plan.add_argument(
        "--lost-node",
        action="append",
        metavar="NODE",
        help="plan as if NODE were lost with its NVMe (replaced by an empty node): the ranks "
        "it saved (its `verified` events say which) read object storage; repeatable",
    )
    # Gone: the job state does not record which node holds a rank's NVMe copy.
    plan.add_argument("--alive", help=argparse.SUPPRESS)
    plan.add_argument("--json", action="store_true", help="one JSON object (see above)")

    reindex = sub.add_parser(
        "reindex", help="rebuild a job's events from this node's shard files and the objects"
    )
    reindex.add_argument("--job", required=True)
    reindex.add_argument(
        "--no-verify",
        action="store_true",
        help="trust NVMe files without re-reading them (the agent verifies)",
    )
    reindex.add_argument("--no-s3", action="store_true", help="this node's NVMe only")

    flush = sub.add_parser("flush", help="change the upload rate to object storage at run time")
    flush.add_argument("action", choices=get_args(FlushAction))
    flush.add_argument(
        "rate",
        nargs="?",
        default=None,
        help="for `rate`: bytes/s, e.g. 50MiB, 200MB, 0 for unlimited",
    )
    flush.add_argument("--node", help="only this node (default: every node)")
    flush.add_argument(
        "--job",
        help="`rate` for this job as a whole: its coordinator divides it among the job's "
        "active nodes (each node keeps its own rate too: the lower applies)",
    )
    flush.add_argument(
        "--force",
        action="store_true",
        help="send to --node even if it has no flush worker and no events yet",
    )

    budget = sub.add_parser(
        "budget",
        help="show or set a job's object-storage budgets (for the whole job: its coordinator "
        "divides them among the job's active nodes)",
    )
    budget.add_argument("--job", required=True)
    budget.add_argument(
        "--flush", help="upload bytes/s of the whole job, e.g. 800MiB (0: no job-wide cap)"
    )
    budget.add_argument(
        "--restore-gets",
        type=int,
        help="concurrent object GETs of the whole job during a restore (0: no job-wide cap)",
    )
    budget.add_argument("--json", action="store_true", help="one JSON object")

    events = sub.add_parser(
        "events",
        help="a job's events as its stream stores them (subject, sequence, time, body)",
        description="What `nats stream view` / `nats sub` would show of one job, without the "
        "NATS CLI: every stored event (or one kind, or those of the last --since), oldest "
        "first; --follow then prints each new one until Ctrl-C.",
    )
    events.add_argument("--job", required=True)
    events.add_argument("--kind", choices=EVENT_KINDS, help="only this kind")
    events.add_argument(
        "--since", help="only those stored in the last 90s, 15m, 2h, 1d, ... or since an ISO "
        "8601 time (2026-12-01T03:00:00Z)",
    )  # fmt: skip
    events.add_argument("--follow", "-f", action="store_true", help="then print new ones")
    events.add_argument(
        "--json", action="store_true", help="one JSON object a line: seq, time, subject, event"
    )

    export = sub.add_parser(
        "export",
        help="write a step of a job in a format other tools load (torch, safetensors, dcp)",
        description="Reads every rank's shard of the step (this node's NVMe copy, else object "
        "storage; every digest checked) and writes it per rank into DIR: rank-R-of-W.pt "
        "(torch.load(..., weights_only=True)), rank-R-of-W.safetensors (tensors by dotted key "
        "path, other values in its metadata) or rank-R-of-W/ (torch.distributed.checkpoint).",
    )
    export.add_argument("--job", required=True)
    export.add_argument("--step", type=int, help="default: the newest complete step")
    export.add_argument("--to", required=True, choices=("torch", "safetensors", "dcp"))
    export.add_argument("dir", help="where to write (made if missing)")

    prefetch = sub.add_parser(
        "prefetch",
        help="pull a node's shards of the newest step in object storage onto this node's NVMe",
        description="For a standby node: fetches the ranks of --node (default: this node) of "
        "the newest step complete in object storage (or --step), checks every digest, writes "
        "them to this node's NVMe and reports them written and verified here, so a restore on "
        "this node reads NVMe instead of object storage.",
    )
    prefetch.add_argument("--job", required=True)
    prefetch.add_argument("--node", help="whose ranks (default: this node's)")
    prefetch.add_argument("--step", type=int, help="default: the newest complete in object storage")

    gc = sub.add_parser(
        "gc",
        help="list (--apply: remove) a job's objects and this node's files no kept step owns",
        description="Judges the job's objects (shards, COMMITs) and this node's NVMe files by "
        "their step against the job state in KV: those of steps it keeps on no tier (below the "
        "floors, or with no record) are listed with why; --apply removes them. Never a step the "
        "floors keep, a step newer than any the job state knows, or anything younger than "
        "--min-age-s. Refuses a job with no state in KV (`tierpipe reindex` rebuilds it).",
    )
    gc.add_argument("--job", required=True)
    gc.add_argument("--apply", action="store_true", help="remove them (default: a dry run)")
    gc.add_argument("--min-age-s", type=float, default=600.0, help="leave younger ones (600)")
    gc.add_argument("--json", action="store_true", help="one JSON object per object or file")
    rm = sub.add_parser(
        "rm",
        help="delete a job: stream, job-state keys, objects, this node's files (dry run first)",
        description="Counts what of the job would go; --apply deletes it. Refuses a job in use "
        "(a live coordinator lease, or an event younger than --idle-s) unless --force. Each "
        "node's NVMe and staging files are its own: run it on every node that held copies.",
    )
    rm.add_argument("--job", required=True)
    rm.add_argument("--apply", action="store_true", help="delete it (default: a dry run)")
    rm.add_argument("--force", action="store_true", help="delete it even while in use")
    rm.add_argument("--idle-s", type=float, default=600.0, help="in use if an event is younger")
    rm.add_argument("--json", action="store_true", help="one JSON object")

    ls = sub.add_parser(
        "ls",
        help="every job: newest complete step per tier, fold lag, coordinator, last error",
    )
    ls.add_argument("--json", action="store_true", help="one JSON object per job")

    up = sub.add_parser(
        "up",
        help="run this machine's NATS, S3 store and node agent under one supervisor",
        description="Starts an embedded nats-server and S3 store (SeaweedFS) on loopback and "
        "this node's agent, restarts whichever exits (with backoff), writes the environment a "
        "trainer needs to <data>/env (source it, then run your trainer), and on Ctrl-C drains "
        "the agent and stops the servers.",
    )
    up.add_argument("--data", default=".tierpipe", help="directory for everything (./.tierpipe)")
    up.add_argument(
        "--nats-port", type=int, default=4222, help="the embedded nats-server's port (4222)"
    )
    up.add_argument("--nats-url", help="use this running NATS server instead of an embedded one")
    up.add_argument("--s3-endpoint", help="use this S3 endpoint instead of an embedded store")
    up.add_argument(
        "--no-s3", action="store_true", help="no object storage: NVMe only (retention may then "
        "remove copies that were never flushed)",
    )  # fmt: skip

    demo = sub.add_parser(
        "demo", help="the whole story on this machine: train, lose a node, resume (about 1 min)"
    )
    demo.add_argument("--ranks", type=int, default=2, help="ranks, spread over two nodes (2)")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--every", type=int, default=5, help="a save every this many steps (5)")
    demo.add_argument(
        "--data", default="tierpipe-data/demo", help="directory for NVMe, NATS, S3 data and logs"
    )
    demo.add_argument(
        "--plot", nargs="?", const="tierpipe-demo.png", metavar="PNG",
        help="render the timeline of events per tier (default file tierpipe-demo.png; needs "
        "matplotlib: pip install 'tierpipe[plot]')",
    )  # fmt: skip
    demo.add_argument(
        "--rank",
        type=int,
        help="run only this trainer rank, against the agent and servers the settings name "
        "(what the demo starts per rank, and compose.yaml's trainer); prints JSON lines",
    )

    args = parser.parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
    except BrokenPipeError:
        if args.command == "worker":
            raise  # a socket's error, not a closed stdout
        return _reader_gone()
    except TierpipeError as e:
        print(f"tierpipe: error: {e}", file=sys.stderr)
        return 2
    return code


def _run(args: argparse.Namespace) -> int:
    from tierpipe.stages import AGENT_STAGES

    settings = load_settings(args.config)
    configure_logging(settings.log_level, settings.log_format)
    match args.command:
        case "worker":
            names = list(AGENT_STAGES) if "all" in args.stages else list(dict.fromkeys(args.stages))
            return _run_worker(settings, names)
        case "status":
            job = validate_token("job", args.job)
            return _status(settings, job, step=args.step, rank=args.rank, as_json=args.json)
        case "flush":
            return _flush(
                settings, args.action, args.rate, args.node, force=args.force, job=args.job
            )
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
            return _plan(
                settings, job, args.step, nvme_lost=args.nvme_lost, lost_nodes=lost,
                as_json=args.json,
            )  # fmt: skip
        case "reindex":
            return _reindex(settings, validate_token("job", args.job), args)
        case "budget":
            if args.restore_gets is not None and args.restore_gets < 0:
                raise ConfigError("--restore-gets must be >= 0")
            flush = parse_rate(args.flush) if args.flush is not None else None
            return _budget(
                settings, validate_token("job", args.job), flush=flush,
                gets=args.restore_gets, as_json=args.json,
            )  # fmt: skip
        case "events":
            job = validate_token("job", args.job)
            since = parse_since(args.since) if args.since is not None else None
            return _events(
                settings, job, kind=args.kind, since=since, follow=args.follow,
                as_json=args.json,
            )  # fmt: skip
        case "ls":
            return _ls(settings, as_json=args.json)
        case "gc":
            from tierpipe.retention.gc import gc

            job = validate_token("job", args.job)
            found = anyio.run(lambda: gc(settings, job, apply=args.apply, min_age_s=args.min_age_s))
            print("\n".join(found.json_lines() if args.json else found.lines()))
            return 0
        case "rm":
            from tierpipe.retention.rm import rm

            job = validate_token("job", args.job)
            gone = anyio.run(
                lambda: rm(settings, job, apply=args.apply, force=args.force, idle_s=args.idle_s)
            )
            print("\n".join(gone.json_lines() if args.json else gone.lines()))
            return 0
        case "prefetch":
            from tierpipe.recovery.prefetch import prefetch

            job = validate_token("job", args.job)
            node = validate_token("node", args.node) if args.node else None
            with bar(f"prefetching {job}") as shown:
                done = anyio.run(
                    lambda: prefetch(settings, job, of_node=node, step=args.step, progress=shown)
                )
            print(f"step {done.step} of {job}: fetched ranks {done.fetched or 'none'} onto this "
                  f"node's NVMe ({len(done.present)} already there)")  # fmt: skip
            return 0
        case "export":
            job = validate_token("job", args.job)
            return _export(settings, job, args.step, args.to, Path(args.dir))
        case "up":
            from tierpipe.dev.up import run_up

            return run_up(
                settings, data=args.data, nats_url=args.nats_url, nats_port=args.nats_port,
                s3_endpoint=args.s3_endpoint, no_s3=args.no_s3,
            )  # fmt: skip
        case "demo" if args.rank is not None:
            from tierpipe.dev.trainer import run_rank

            if not 0 <= args.rank < args.ranks:
                raise ConfigError(f"--rank must be in 0..{args.ranks - 1} (--ranks {args.ranks})")
            return run_rank(args.rank, args.ranks, args.steps, args.every)
        case "demo":
            from tierpipe.dev.demo import run_demo

            return run_demo(
                settings, ranks=args.ranks, steps=args.steps, every=args.every, data=args.data,
                plot=args.plot,
            )  # fmt: skip
    return 0


def _reader_gone() -> int:
    """The reader of our output closed it (`tierpipe plan --json | head -c 10`): stop quietly,
    as Unix filters do. Python flushes stdout again at exit and would report the same broken
    pipe, so stdout is pointed at /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _reindex(settings: Settings, job: str, args: argparse.Namespace) -> int:
    from tierpipe.recovery.reindex import reindex

    with bar(f"reindexing {job}") as shown:
        done = anyio.run(
            lambda: reindex(
                settings, job, verify=not args.no_verify, s3=not args.no_s3, progress=shown
            )
        )
    if not (done.nvme or done.s3 or done.skipped) and not anyio.run(_job_has_events, settings, job):
        where = f"no shard files under {settings.nvme_root}/{job}"
        if not args.no_s3:
            prefix = "/".join(p for p in (settings.s3_prefix.strip("/"), "<hh>", job) if p)
            where += f", no objects under s3://{settings.s3_bucket}/{prefix}/"
        stream = stream_name(settings.stream, job)
        raise ConfigError(f"unknown job {job!r}: no events on stream {stream}, {where}")
    print(f"republished {done.nvme} NVMe shards and {done.s3} objects of {job}")
    for line in done.skipped:
        print(f"  skipped {line}")
    return 0


def _run_worker(settings: Settings, names: list[str]) -> int:
    from tierpipe.runner import run_agent
    from tierpipe.stages import agent_stage

    node = node_name(settings.node)
    try:
        anyio.run(
            lambda: run_agent(settings, [agent_stage(n) for n in names], node=node),
            backend_options={"use_uvloop": importlib.util.find_spec("uvloop") is not None},
        )
    except BaseExceptionGroup as group:
        # A stage that refused to start (e.g. AgentLockedError) arrives wrapped by the task
        # groups: surface it as the one-line error it is, not a traceback.
        errors = _leaves(group)
        if len(errors) == 1 and isinstance(errors[0], TierpipeError):
            raise errors[0] from None
        raise
    return 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def parse_rate(text: str) -> int:
    """`50MiB`, `200MB`, `1.5GiB`, `1048576`, `0` -> bytes/s."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
    }
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*?)(?:/s)?\s*", text)
    if m is None or m.group(2).lower() not in units:
        raise ConfigError(f"cannot read a rate from {text!r} (try 50MiB or 200MB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def parse_since(text: str, *, now: float | None = None) -> float:
    """`90s`, `15m`, `2h`, `1d`, `30` (seconds) ago, or an ISO 8601 time
    (`2026-12-01T03:00:00Z`; without a zone: UTC) -> a Unix time."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", text)
    if m is not None:
        ago = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return (time.time() if now is None else now) - ago
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"cannot read a time from {text!r} (try 90s, 15m, 2h, 1d or 2026-12-01T03:00:00Z)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _events(
    settings: Settings, job: str, *, kind: str | None, since: float | None, follow: bool,
    as_json: bool,
) -> int:  # fmt: skip
    if kind is None:
        subject = job_subjects(job)
    elif kind == "plan":
        subject = plan_subject(job)
    elif kind == "batch":
        subject = batch_subject(job, "*", "*")
    else:
        subject = shard_subject(job, kind, "*", "*")
    show = event_json_line if as_json else event_line

    async def main() -> None:
        async with Bus(settings, name="tierpipe-cli") as bus:
            made = await bus.stream_made(job)
            if made is None:
                raise ConfigError(
                    f"job {job!r} has no stream ({stream_name(settings.stream, job)}): check "
                    "the name (`tierpipe ls` lists the jobs)"
                )
            found = await bus.stored(subject, since=since)
            for raw in found:
                print(show(raw), flush=follow)
            if follow:
                async with bus.tail(subject, after=found[-1].seq if found else made[1]) as new:
                    while True:
                        print(show(await new.get()), flush=True)

    try:
        anyio.run(main)
    except KeyboardInterrupt:
        return 0
    return 0


def _export(settings: Settings, job: str, step: int | None, fmt: str, out: Path) -> int:
    from tierpipe.recovery.export import export_step

    async def run() -> tuple[int, list[Path]]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore(bus.js, settings).open()
            chosen = step
            if chosen is None:
                head, _ = await folded_head(bus, store, job)
                complete = await confirmed_list(store, job, head)  # (a forged head: not believed)
                if not complete:
                    raise NoCheckpointError(f"job {job!r} has no complete step to export")
                chosen = complete[-1]
            return chosen, await export_step(settings, store, job, chosen, fmt, out)

    chosen, paths = anyio.run(run)
    print(f"exported step {chosen} of {job} ({len(paths)} ranks) as {fmt} into {out}")
    return 0


def _ls(settings: Settings, *, as_json: bool) -> int:
    async def read() -> list[JobRow]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore(bus.js, settings).open()
            heads = await store.heads()
            rows = []
            for job in sorted(set(heads) | set(await bus.jobs())):
                newest = max([await newest_seq(bus, s) for s in state_subjects(job)])
                failed = await bus.last_event(shard_subject(job, "failed", "*", "*"))
                head = heads.get(job)
                doubts = (
                    {} if head is None else (await confirmed_steps(store, job, head)).unconfirmed
                )
                rows.append(
                    JobRow(
                        job, head, newest, await store.lease(job),
                        failed if isinstance(failed, StageFailed) else None, doubts,
                    )
                )  # fmt: skip
            return rows

    rows = anyio.run(read)
    if as_json:
        for row in rows:
            print(json.dumps(row.as_json()))
    else:
        print(jobs_table(rows))
    return 0


def _flush(
    settings: Settings,
    action: FlushAction,
    rate: str | None,
    node: str | None,
    *,
    force: bool = False,
    job: str | None = None,
) -> int:
    if (action == "rate") != (rate is not None):
        raise ConfigError("`flush rate` takes a rate (e.g. 50MiB); pause/resume take none")
    if job is not None:
        if action != "rate" or node:
            raise ConfigError("--job sets a job's rate only (not with pause/resume or --node)")
        return _budget(settings, validate_token("job", job), flush=parse_rate(rate or "0"))
    control = FlushControl(
        action=action, rate_bytes_per_s=parse_rate(rate) if rate else 0, ts=time.time()
    )
    subject = flush_control_subject(validate_token("node", node) if node else None)

    async def send() -> int:
        async with Bus(settings, name="tierpipe-cli") as bus:
            await bus.ensure_stream(subject_job(subject), update=False)
            # A typo would be obeyed by nobody, silently: name only a node the streams know.
            if node and not force and not await _node_known(bus, node):
                raise ConfigError(
                    f"unknown node {node!r}: it has no flush worker "
                    f"({consumer_name('flush', node)}) and no events on any job's stream "
                    f"({settings.stream}_<job>); check the name, or pass --force to send anyway"
                )
            return await bus.publish_raw(subject, msgspec.json.encode(control))

    seq = anyio.run(send)
    print(f"{action} sent on {subject} (stream seq {seq})")
    return 0


def _budget(
    settings: Settings,
    job: str,
    *,
    flush: int | None = None,
    gets: int | None = None,
    as_json: bool = False,
) -> int:
    """Set what is given of `job`'s budgets (the rest stays), then show them and each active
    node's part. A job the KV does not know is refused: a budget for a mistyped name would
    cap nobody, silently."""

    async def store() -> tuple[Budget, Shares]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            jobs = await JobStore(bus.js, settings).open()
            if await jobs.keep(job) is None and await jobs.head(job) is None:
                raise ConfigError(
                    f"unknown job {job!r}: no job state in KV bucket {settings.kv_bucket} "
                    "(a job's trainer registers it when it starts)"
                )
            budget = await jobs.budget(job)
            if flush is not None or gets is not None:
                budget = Budget(
                    flush_bytes_per_s=budget.flush_bytes_per_s if flush is None else flush,
                    restore_gets=budget.restore_gets if gets is None else gets,
                )
                await jobs.set_budget(job, budget)
            return budget, await jobs.shares(job)

    budget, shares = anyio.run(store)
    if as_json:
        print(json.dumps({"job": job, "budget": msgspec.to_builtins(budget),
                          "shares": msgspec.to_builtins(shares)}))  # fmt: skip
        return 0
    verb = "set" if flush is not None or gets is not None else "is"
    rate = f"{budget.flush_bytes_per_s} bytes/s" if budget.flush_bytes_per_s else "no cap"
    reads = f"{budget.restore_gets} GETs" if budget.restore_gets else "no cap"
    print(f"budget of job {job} {verb}: flush {rate}, restore {reads} (whole job)")
    if shares.nodes:
        print(
            f"  divided among {shares.nodes} active nodes (coordinator term {shares.term}): "
            f"{shares.flush_bytes_per_s_per_node or 'no cap'} bytes/s and "
            f"{shares.restore_gets_per_node or 'no cap'} GETs per node"
        )
    else:
        print("  not divided yet: the job's coordinator does so within seconds of its next save")
    return 0


async def _node_known(bus: Bus, node: str) -> bool:
    """Whether `node` has a flush consumer on a job's stream or has published any event: one
    or two JetStream API requests per job, however long the streams."""
    try:
        for job in await bus.jobs():
            try:
                await bus.js.consumer_info(
                    stream_name(bus.settings.stream, job), consumer_name("flush", node)
                )
                return True
            except nats.js.errors.NotFoundError:
                pass
            if await _stream_has(bus, filter_subject("*", node=node, job=job)):
                return True
        return False
    except (nats.errors.Error, TimeoutError) as e:
        raise BusUnavailableError(f"looking up node {node!r}: {e or type(e).__name__}") from e


async def _stream_has(bus: Bus, subject: str) -> bool:
    """Whether the job's stream holds any message on `subject` (wildcards allowed, but for
    the job)."""
    try:
        await bus.js.get_msg(bus.stream(subject), subject=subject)  # the newest one, by index
    except nats.js.errors.NotFoundError:  # no such message, or no stream at all
        return False
    return True


async def _job_has_events(settings: Settings, job: str) -> bool:
    async with Bus(settings, name="tierpipe-cli") as bus:
        try:
            return await _stream_has(bus, job_subjects(job))
        except (nats.errors.Error, TimeoutError) as e:
            raise BusUnavailableError(f"looking up job {job!r}: {e or type(e).__name__}") from e


def _plan(
    settings: Settings,
    job: str,
    step: int | None,
    *,
    nvme_lost: bool,
    lost_nodes: list[str],
    as_json: bool,
) -> int:
    async def read() -> tuple[JobHead, int, KvPlan]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore(bus.js, settings).open()
            return await plan_now(
                bus, store, job, step=step, nvme_lost=nvme_lost, lost_nodes=lost_nodes
            )

    head, stream_seq, plan = anyio.run(read)
    if as_json:
        print(json.dumps({**plan.to_json(), "folded_seq": head.seq, "stream_seq": stream_seq}))
    else:
        note = lag_note(head.seq, stream_seq)
        print(plan.describe() + (f"\n  {note}" if note else ""))
    return 0


def _status(
    settings: Settings, job: str, *, step: int | None, rank: int | None, as_json: bool
) -> int:
    if rank is not None and step is None:
        raise ConfigError("--rank needs --step (the per-rank detail is of one step)")
    if step is not None:
        return _status_step(settings, job, step, rank, as_json=as_json)
    view = anyio.run(_read_view, settings, job)
    if as_json:
        for s in view.head.steps:
            print(json.dumps(step_json(job, s, view.records.get(s))))
    else:
        print(step_table(view))
    return 0


def _status_step(
    settings: Settings, job: str, step: int, rank: int | None, *, as_json: bool
) -> int:
    from tierpipe.storage.s3.store import S3Store

    async def read() -> tuple[StepRecord, dict[int, RankDigests]]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore(bus.js, settings).open()
            head, _ = await folded_head(bus, store, job)
            rec = await store.record(job, step)
            if rec is None:
                kept = ", ".join(map(str, head.steps)) or "none"
                raise ConfigError(
                    f"step {step} of job {job!r} has no record in its job state (the steps it "
                    f"keeps: {kept})"
                )
            if rank is not None and not 0 <= rank < rec.world_size:
                raise ConfigError(
                    f"rank {rank} is not a rank of step {step} (world size {rec.world_size})"
                )
            last = -(-rec.world_size // RANKS_PER_CHUNK)
            chunks = range(last) if rank is None else [rank // RANKS_PER_CHUNK]
            return rec, {c: d for c in chunks if (d := await _digests(store, job, step, c))}

    rec, chunks = anyio.run(read)
    nvme_root = Path(settings.nvme_root)
    details = rank_details(
        job, rec, chunks, range(rec.world_size) if rank is None else [rank],
        locate_nvme=lambda j, s, r, w: str(nvme_root / shard_relpath(j, s, r, w)),
        locate_object=S3Store(settings).locate,
    )  # fmt: skip
    if as_json:
        for d in details:
            print(json.dumps(rank_json(job, rec, d)))
    else:
        print(rank_table(job, rec, details))
    return 0


async def _read_view(settings: Settings, job: str) -> JobView:
    """The job's state in KV, once folded up to its newest event (see `folded_head`)."""
    async with Bus(settings, name="tierpipe-cli") as bus:
        store = await JobStore(bus.js, settings).open()
        head, stream_seq = await folded_head(bus, store, job)
        return JobView(
            job=job,
            head=head,
            records=await store.records(job, head.steps),
            floors=await store.floors(job),
            keep=await store.keep(job),
            lease=await store.lease(job),
            stream_seq=stream_seq,
            unconfirmed=(await confirmed_steps(store, job, head)).unconfirmed,
        )


async def _digests(store: JobStore, job: str, step: int, chunk: int) -> RankDigests | None:
    """One chunk of a step's header digests (None: not stored)."""
    key = digests_key(job, step, chunk)
    with translate(f"kv {key}", keep=(KeyNotFoundError, KeyDeletedError)):
        try:
            entry = await store.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
    return msgspec.json.decode(entry.value, type=RankDigests) if entry.value else None
