"""The operations of `tierpipe`: run the node agent (`worker`), change the flush rate and a job's
budgets, rebuild a job's events (`reindex`), export, import, prefetch, collect garbage, delete a
job (`rm`), and run this machine's servers (`up`) or the demo."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import anyio
import msgspec

from tierpipe.bus.client import Bus
from tierpipe.cli.parser import parse_rate
from tierpipe.cli.views import require_job
from tierpipe.control.confirm import confirmed_list
from tierpipe.control.folded import folded_head
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    BusUnavailableError,
    ConfigError,
    JobStateMissingError,
    NoCheckpointError,
    TierpipeError,
    leaves,
)
from tierpipe.names import (
    consumer_name,
    filter_subject,
    flush_control_subject,
    job_subjects,
    node_name,
    stream_name,
    subject_job,
    validate_token,
)
from tierpipe.progress import bar
from tierpipe.schemas import FlushAction, FlushControl
from tierpipe.schemas.jobstate import Budget, Shares
from tierpipe.settings import Settings

__all__ = (
    "budget", "demo", "demo_rank", "export", "flush", "gc", "import_dcp", "prefetch", "reindex",
    "rm", "up", "worker",
)  # fmt: skip


def worker(settings: Settings, names: list[str]) -> int:
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
        errors = leaves(group)
        if len(errors) == 1 and isinstance(errors[0], TierpipeError):
            raise errors[0] from None
        raise
    return 0


def flush(
    settings: Settings,
    action: FlushAction,
    rate: str | None,
    node: str | None,
    *,
    force: bool = False,
    job: str | None = None,
    as_json: bool = False,
) -> int:
    if (action == "rate") != (rate is not None):
        raise ConfigError("`flush rate` takes a rate (e.g. 50MiB); pause/resume take none")
    if job is not None:
        if action != "rate" or node:
            raise ConfigError("--job sets a job's rate only (not with pause/resume or --node)")
        return budget(
            settings, validate_token("job", job), flush=parse_rate(rate or "0"), as_json=as_json
        )
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
    if as_json:
        print(json.dumps({"action": action, "rate_bytes_per_s": control.rate_bytes_per_s,
                          "subject": subject, "seq": seq}))  # fmt: skip
    else:
        print(f"{action} sent on {subject} (stream seq {seq})")
    return 0


def budget(
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
                raise JobStateMissingError(
                    job, f"unknown job {job!r}: no job state in KV bucket {settings.kv_bucket} "
                    "(a job's trainer registers it when it starts; `tierpipe ls` lists the jobs)",
                )  # fmt: skip
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
            if await bus.has_consumer(job, consumer_name("flush", node)):
                return True
            if await bus.newest_seq(filter_subject("*", node=node, job=job)):
                return True
        return False
    except BusUnavailableError as e:
        raise BusUnavailableError(f"looking up node {node!r}: {e}") from e


async def _require_job(settings: Settings, job: str) -> None:
    async with Bus(settings, name="tierpipe-cli") as bus:
        await require_job(bus, await JobStore.opened(bus), job)


async def _job_has_events(settings: Settings, job: str) -> bool:
    async with Bus(settings, name="tierpipe-cli") as bus:
        try:
            return await bus.newest_seq(job_subjects(job)) > 0
        except BusUnavailableError as e:
            raise BusUnavailableError(f"looking up job {job!r}: {e}") from e


def reindex(settings: Settings, job: str, *, verify: bool, s3: bool, as_json: bool = False) -> int:
    from tierpipe.recovery.reindex import reindex as republish

    with bar(f"reindexing {job}") as shown:
        done = anyio.run(lambda: republish(settings, job, verify=verify, s3=s3, progress=shown))
    if not (done.nvme or done.s3 or done.skipped) and not anyio.run(_job_has_events, settings, job):
        where = f"no shard files under {settings.nvme_root}/{job}"
        if s3:
            prefix = "/".join(p for p in (settings.s3_prefix.strip("/"), "<hh>", job) if p)
            where += f", no objects under s3://{settings.s3_bucket}/{prefix}/"
        stream = stream_name(settings.stream, job)
        raise JobStateMissingError(
            job, f"unknown job {job!r}: no events on stream {stream}, {where}"
        )
    if as_json:
        print(json.dumps({"job": job, "nvme": done.nvme, "s3": done.s3,
                          "skipped": list(done.skipped)}))  # fmt: skip
        return 0
    print(f"republished {done.nvme} NVMe shards and {done.s3} objects of {job}")
    for line in done.skipped:
        print(f"  skipped {line}")
    return 0


def export(
    settings: Settings, job: str, step: int | None, fmt: str, out: Path, *, merged: bool = False,
    max_file_bytes: int = 5 * 10**9, as_json: bool = False,
) -> int:  # fmt: skip
    from tierpipe.recovery.export import Exported, export_step

    if max_file_bytes <= 0:
        raise ConfigError(f"--max-file-size must be above 0 (got {max_file_bytes} bytes)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: not a directory")

    async def run() -> tuple[int, Exported]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore.opened(bus)
            await require_job(bus, store, job)
            chosen = step
            if chosen is None:
                head, _ = await folded_head(bus, store, job)
                complete = await confirmed_list(store, job, head)  # (a forged head: not believed)
                if not complete:
                    raise NoCheckpointError(f"job {job!r} has no complete step to export")
                chosen = complete[-1]
            done = await export_step(settings, store, job, chosen, fmt, out, merged=merged,
                                     max_file_bytes=max_file_bytes)  # fmt: skip
            return chosen, done

    chosen, done = anyio.run(run)
    if as_json:
        print(json.dumps({"job": job, "step": chosen, "format": fmt, "merged": merged,
                          "world_size": done.world_size, "dir": str(out)}))  # fmt: skip
        return 0
    how = f"{fmt} (merged)" if merged else fmt
    print(f"exported step {chosen} of {job} ({done.world_size} ranks) as {how} into {out}")
    return 0


def import_dcp(
    settings: Settings, folder: Path, job: str, *, step: int | None, world_size: int,
    timeout_s: float, as_json: bool = False,
) -> int:  # fmt: skip
    from tierpipe.interop.importer import import_dcp as bring_in

    done = bring_in(settings, folder, job, step=step, world_size=world_size, timeout_s=timeout_s)
    if as_json:
        print(json.dumps({"job": done.job, "step": done.step, "world_size": done.world_size,
                          "tensors": done.tensors, "nbytes": done.nbytes,
                          "seconds": done.seconds, "dir": str(folder)}))  # fmt: skip
        return 0
    print(f"imported {folder} as step {done.step} of {done.job} ({done.world_size} ranks, "
          f"{done.tensors} tensors, {done.nbytes} bytes), verified on NVMe in "
          f"{done.seconds:.1f} s; the agent flushes it to object storage")  # fmt: skip
    return 0


def gc(settings: Settings, job: str, *, apply: bool, min_age_s: float, as_json: bool) -> int:
    from tierpipe.retention.gc import gc as collect

    found = anyio.run(lambda: collect(settings, job, apply=apply, min_age_s=min_age_s))
    for line in found.json_lines() if as_json else found.lines():
        print(line)
    return 0


def rm(
    settings: Settings, job: str, *, apply: bool, force: bool, idle_s: float, as_json: bool
) -> int:
    from tierpipe.retention.rm import rm as remove

    gone = anyio.run(lambda: remove(settings, job, apply=apply, force=force, idle_s=idle_s))
    anything = gone.kv_keys or gone.objects or gone.nvme[0] or gone.staging[0]
    if gone.stream is None and not anything:
        raise JobStateMissingError(
            job, f"unknown job {job!r}: nothing of it anywhere (no stream, no job-state keys, "
            "no objects, no files on this node; `tierpipe ls` lists the jobs)",
        )  # fmt: skip
    for line in gone.json_lines() if as_json else gone.lines():
        print(line)
    return 0


def prefetch(
    settings: Settings, job: str, *, node: str | None, step: int | None, as_json: bool = False
) -> int:
    from tierpipe.recovery.prefetch import prefetch as fetch

    anyio.run(_require_job, settings, job)
    with bar(f"prefetching {job}") as shown:
        done = anyio.run(lambda: fetch(settings, job, of_node=node, step=step, progress=shown))
    if as_json:
        print(json.dumps({"job": job, "step": done.step, "fetched": list(done.fetched),
                          "present": list(done.present)}))  # fmt: skip
        return 0
    print(f"step {done.step} of {job}: fetched ranks {done.fetched or 'none'} onto this "
          f"node's NVMe ({len(done.present)} already there)")  # fmt: skip
    return 0


def up(
    settings: Settings, *, data: str, nats_url: str | None, nats_port: int,
    s3_endpoint: str | None, no_s3: bool,
) -> int:  # fmt: skip
    from tierpipe.dev.up import run_up

    return run_up(
        settings, data=data, nats_url=nats_url, nats_port=nats_port,
        s3_endpoint=s3_endpoint, no_s3=no_s3,
    )  # fmt: skip


def demo_rank(rank: int, ranks: int, steps: int, every: int) -> int:
    from tierpipe.dev.trainer import run_rank

    if not 0 <= rank < ranks:
        raise ConfigError(f"--rank must be in 0..{ranks - 1} (--ranks {ranks})")
    return run_rank(rank, ranks, steps, every)


def demo(
    settings: Settings, *, ranks: int, steps: int, every: int, data: str, plot: str | None,
    seed: int | None = None,
) -> int:  # fmt: skip
    from tierpipe.dev.demo import run_demo

    return run_demo(
        settings, ranks=ranks, steps=steps, every=every, data=data, plot=plot, seed=seed,
    )  # fmt: skip
