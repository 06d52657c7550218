"""The read-only views of `tierpipe`: `status`, `plan`, `ls` and `events`, read through the bus
and the job store (`tierpipe.cli.render` and `tierpipe.cli.events` render them), and the check
every command that reads a job makes first (`require_job`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio

from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import backlogs
from tierpipe.bus.history import Raw
from tierpipe.cli.events import Filter, Seen, event_json, event_line, shown
from tierpipe.cli.render import (
    JobRow,
    JobView,
    jobs_table,
    lag_note,
    rank_details,
    rank_json,
    rank_table,
    step_json,
    step_table,
)
from tierpipe.control.confirm import confirmed_steps
from tierpipe.control.folded import folded_head
from tierpipe.control.kvstate import JobStore
from tierpipe.control.risk import read_risk
from tierpipe.errors import ConfigError, JobStateMissingError, NoCheckpointError
from tierpipe.names import (
    shard_relpath,
    shard_subject,
    state_subjects,
    stream_name,
)
from tierpipe.recovery.kvplan import KvPlan, confirmed_plan, plan_now
from tierpipe.schemas import StageFailed
from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, JobHead, RankDigests, StepRecord
from tierpipe.settings import Settings

__all__ = ("events", "ls", "plan", "require_job", "status")


async def require_job(bus: Bus, store: JobStore, job: str) -> None:
    """Make sure `job` is a job: it has state in KV (its trainer registered it) or a stream.

    Raises:
        JobStateMissingError: it has neither (a mistyped name, or a job deleted).
    """
    if await store.keep(job) is not None or await store.head(job) is not None:
        return
    if await bus.stream_made(job) is None:
        s = bus.settings
        raise JobStateMissingError(
            job, f"unknown job {job!r}: no state in KV bucket {s.kv_bucket} and no stream "
            f"{stream_name(s.stream, job)}; `tierpipe ls` lists the jobs (if its state and "
            f"events were lost, `tierpipe reindex --job {job}` rebuilds them from shard files "
            "and objects)",
        )  # fmt: skip


def status(
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
            store = await JobStore.opened(bus)
            await require_job(bus, store, job)
            head, _ = await folded_head(bus, store, job)
            rec = await store.record(job, step)
            if rec is None:
                kept = ", ".join(map(str, head.steps)) or "none"
                raise NoCheckpointError(
                    f"step {step} of job {job!r} has no record in its job state (the steps it "
                    f"keeps: {kept})"
                )
            if rank is not None and not 0 <= rank < rec.world_size:
                raise ConfigError(
                    f"rank {rank} is not a rank of step {step} (world size {rec.world_size})"
                )
            last = -(-rec.world_size // RANKS_PER_CHUNK)
            chunks = range(last) if rank is None else [rank // RANKS_PER_CHUNK]
            return rec, {c: d for c in chunks if (d := await store.digests(job, step, c))}

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
        store = await JobStore.opened(bus)
        await require_job(bus, store, job)
        head, stream_seq = await folded_head(bus, store, job)
        records = await store.records(job, sorted({*head.steps, *head.candidates()}))
        try:  # what a restart would restore: the planner `tierpipe plan` and a restart use
            restore = (await confirmed_plan(store, job, head, records)).summary()
        except NoCheckpointError as e:
            restore = f"none ({e})"
        return JobView(
            job=job,
            head=head,
            records=records,
            floors=await store.floors(job),
            keep=await store.keep(job),
            lease=await store.lease(job),
            stream_seq=stream_seq,
            unconfirmed=(await confirmed_steps(store, job, head)).unconfirmed,
            restore=restore,
            backlog=await backlogs(bus, job),
        )


def plan(
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
            store = await JobStore.opened(bus)
            await require_job(bus, store, job)
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


def ls(settings: Settings, *, as_json: bool) -> int:
    async def read() -> list[JobRow]:
        async with Bus(settings, name="tierpipe-cli") as bus:
            store = await JobStore.opened(bus)
            heads = await store.heads()
            rows = []
            for job in sorted(set(heads) | set(await bus.jobs())):
                newest = max([await bus.newest_seq(s) for s in state_subjects(job)])
                failed = await bus.last_event(shard_subject(job, "failed", "*", "*"))
                head = heads.get(job)
                doubts = (
                    {} if head is None else (await confirmed_steps(store, job, head)).unconfirmed
                )
                risk = None if head is None else await read_risk(bus, store, job, head=head)
                rows.append(
                    JobRow(
                        job, head, newest, await store.lease(job),
                        failed if isinstance(failed, StageFailed) else None, doubts, risk,
                        await backlogs(bus, job),
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


def events(
    settings: Settings, job: str, keep: Filter, *, since: float | None, follow: bool,
    as_json: bool,
) -> int:  # fmt: skip
    """Print `job`'s stored events that `keep` keeps (one line each, or JSON), then with
    `follow` each new one until Ctrl-C; a job with no stream yet is waited for when following.

    Raises:
        JobStateMissingError: `job` has no stream and no state (not following).
    """
    subject = keep.subject(job)
    seen = Seen()
    render = event_json if as_json else event_line

    def show(raw: Raw) -> None:
        for one in shown(raw, batches=keep.kinds is not None and "batch" in keep.kinds):
            if keep.keeps(one) and (one.event is None or seen.first(one.event)):
                print(render(one), flush=follow)

    async def main() -> None:
        async with Bus(settings, name="tierpipe-cli") as bus:
            made = await bus.stream_made(job)
            if made is None and not follow:
                await require_job(bus, await JobStore.opened(bus), job)
                return  # (a job whose stream went: no events)
            if made is None:
                made = await _stream_made(bus, job)
            found = await bus.stored(subject, since=since)
            for raw in found:
                show(raw)
            if follow:
                async with bus.tail(subject, after=found[-1].seq if found else made[1]) as new:
                    while True:
                        show(await new.receive())

    try:
        anyio.run(main)
    except KeyboardInterrupt:
        return 0
    return 0


async def _stream_made(bus: Bus, job: str) -> tuple[str, int]:
    """Wait until `job` has a stream (`Bus.stream_made`): woken by the server's advisory that
    it made the stream (a core subscription on the job's own subjects would delay the first
    publish: the server then waits for a stream to answer), and looked for again every few
    seconds besides."""
    name = stream_name(bus.settings.stream, job)
    print(f"waiting for job {job!r} (no stream {name} yet)", file=sys.stderr, flush=True)
    wake = [anyio.Event()]

    async def woken(_: object) -> None:
        wake[0].set()

    sub = await bus.subscribe(f"$JS.EVENT.ADVISORY.STREAM.CREATED.{name}", woken)
    try:
        while True:
            wake[0] = anyio.Event()  # (before looking: a stream made meanwhile wakes the wait)
            if (made := await bus.stream_made(job)) is not None:
                return made
            with anyio.move_on_after(5.0):
                await wake[0].wait()
    finally:
        await sub.unsubscribe()
