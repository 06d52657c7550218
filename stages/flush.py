"""Flush stage: `verified` -> upload to object storage, throttled -> `flushed`.

The shard goes up as a checksummed multipart upload streamed from the NVMe file
(`S3Store.write`; the runner heartbeats long uploads). A store outage is retried in place for as
long as it lasts; refused credentials are permanent. On start, multipart uploads a killed worker
of this node left behind are aborted, and this node's verified shards never flushed are looked at
again: uploaded if the job wants their step, remembered if it may yet.

Only the steps the job wants in object storage go up (`retention.kept.upload_wanted`, from the
job state in KV): the upload target its coordinator names (`Floors.upload`: the same step on
every node) and the steps `Keep.s3_keep_period` keeps. A shard verified for the target is uploaded
at once; one of another step is remembered (in memory, acked) and uploaded, its `flushed`
published here, if the floors (watched) name its step (a newer one, or a lower one after a
rewind: then found again from this node's events); those below a new target are forgotten (evict
removes them as superseded). An upload of a step the job no longer wants is cancelled (its
multipart upload aborted, its copy maybe gone), and an object completed just as the floors passed
its step is removed again, unreported. A job state that cannot be read defers the upload.

The upload rate is `flush_max_bytes_per_s`, changed at run time by `FlushControl` messages on
`tp.ctl.flush` (every node) or `tp.ctl.flush.<node>`; the newest of those is applied at start too,
so a restarted worker keeps the rate the job asked for. A command of an unknown schema version is
refused, never guessed at. A job with a job-wide budget (`tierpipe flush rate --job`) has its
uploads paced by this node's share of it too (`<job>.shares` in KV, watched): the lower of the
node's rate and the share applies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import text
from tierpipe.control.kvstate import JobStore, default_keep
from tierpipe.control.location import bind_location
from tierpipe.control.upload import Later
from tierpipe.errors import RetryableError, ShardFormatError, TierpipeError, UnavailableError
from tierpipe.log import bind_io, unit_of_work
from tierpipe.metrics import METRICS
from tierpipe.names import flush_control_subject, job_dirs, node_name, shard_subject, subject_job
from tierpipe.retention.kept import kept_in_s3, upload_wanted
from tierpipe.schemas import (
    SCHEMA_VERSION,
    FlushControl,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    StageFailed,
)
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3.store import S3Store, Uploaded
from tierpipe.storage.store import SealedFile
from tierpipe.throttle import JobThrottles, Throttle, also_paced_by
from tierpipe.worker import OUTAGE_REPORT_EVERY_S

__all__ = ("KINDS", "STAGE", "Flush", "apply_control", "handle", "open")

STAGE = "flush"
KINDS = ("verified",)
log = structlog.get_logger(__name__)
_control_decoder = msgspec.json.Decoder(FlushControl)
#: How often an upload in progress looks at its job's floors again (direct KV gets).
KEPT_RECHECK_S = 5.0


@dataclass(frozen=True, slots=True)
class Flush:
    settings: Settings
    bus: Bus
    node: str
    nvme: NvmeStore
    s3: S3Store
    #: The job states in KV (what object storage keeps: `kept_in_s3`).
    state: JobStore
    #: One upload per key at a time (a re-drive and a redelivery may meet; each aborts others).
    uploads: _KeyLocks = field(default_factory=lambda: _KeyLocks())
    #: This node's share of each job's flush budget.
    jobs: JobThrottles = field(default_factory=JobThrottles)
    #: Jobs whose objects were found bound to this agent's store (`bind_location`).
    bound: set[str] = field(default_factory=set)
    #: This node's `verified` of steps not named yet (`_follow_floors` uploads them).
    later: Later = field(default_factory=Later)


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[Flush]:
    """Hold the node's flush lock, connect to the store, follow the rate commands; in the
    background, abort this node's orphaned uploads and re-drive its unflushed shards."""
    node = node_name(settings.node)
    throttle = Throttle(settings.flush_max_bytes_per_s or None)
    METRICS.watch_throttle(throttle)
    with NvmeStore.from_settings(settings) as nvme:
        async with (
            nvme.lock(STAGE, timeout_s=settings.agent_lock_timeout_s),  # one agent per node
            S3Store(settings, throttle=throttle) as s3,
            anyio.create_task_group() as tg,
        ):
            ctx = Flush(settings, bus, node, nvme, s3, JobStore(bus.js, settings).bind())
            tg.start_soon(_abort_orphans, ctx)
            tg.start_soon(_follow_shares, settings, bus, ctx.jobs)
            tg.start_soon(_follow_floors, ctx, tg)
            await _follow_controls(bus, throttle, node)
            tg.start_soon(_redrive, ctx)
            yield ctx


async def handle(ctx: Flush, event: ShardVerified, attempt: int) -> ShardFlushed | None:
    """Upload one verified shard of a step the job wants in object storage (or find it
    uploaded already) and say where it is; remember it for later if the job may yet want it;
    nothing for a step object storage does not keep (any more).

    Raises:
        BusUnavailableError: the job state cannot be read (the upload waits for it).
        StoreMismatchError: the job's objects are bound to another object store.
    """
    shard = (event.job, event.step, event.rank, event.world_size)
    path = Path(ctx.nvme.locate(*shard))
    if Path(event.path) != path:
        raise ShardFormatError(event.path, f"not this node's shard path {path}")
    if not await _kept(ctx, event, "upload_skipped"):
        return None
    if event.job not in ctx.bound:  # (a job bound to another team's bucket: refused for good)
        await bind_location(ctx.state, event.job)
        ctx.bound.add(event.job)
    if not await _wanted(ctx, event):
        # Held: uploaded if the floors name its step (a newer one; a lower one after a rewind).
        ctx.later.hold(event)
        # The floors may have named the step meanwhile (the watch saw it before this note).
        if not await _wanted(ctx, event) or not ctx.later.take(event):
            return None  # (or `_follow_floors` took it: it uploads it)
    return await _upload(ctx, event, path)


async def _upload(ctx: Flush, event: ShardVerified, path: Path) -> ShardFlushed | None:
    """Upload the shard at `path` (`handle`, after the checks)."""
    if not await anyio.Path(path).exists():  # (retention took it: fine if no longer kept)
        if await _kept(ctx, event, "upload_skipped"):
            raise ShardFormatError(event.path, "no longer on NVMe (evicted unflushed?)")
        return None
    location = ctx.s3.locate(event.job, event.step, event.rank, event.world_size)
    source = SealedFile(path, event.header_digest, event.epoch, event.step)
    try:
        async with ctx.uploads.hold(location):
            with also_paced_by(ctx.jobs.of(event.job)):  # (the job's share, if it has a budget)
                done = await _upload_while_kept(ctx, event, source, location)
    except (OSError, TierpipeError) as e:
        # Retention removed the copy mid-upload, the step no longer kept: nothing to report.
        if isinstance(e, UnavailableError) or await _kept(ctx, event, "upload_abandoned"):
            raise
        return None
    if done is None:
        return None
    if not await _kept(ctx, event, "upload_withdrawn"):
        # Completed as the floors passed the step: the coordinator may have removed its
        # objects already, and would never remove this one.
        await ctx.s3.delete(location, header_digest=event.header_digest)
        return None
    bind_io(done.nbytes, done.seconds, key=done.key, existed=done.existed)
    return event.follow(ShardFlushed, node=ctx.node, header_digest=event.header_digest,
                        layout=event.layout, **done.fields())  # fmt: skip


async def _kept(ctx: Flush, event: ShardVerified, otherwise: str) -> bool:
    """Whether object storage keeps the event's step; if not, logs `otherwise` (the event)."""
    if await kept_in_s3(ctx.state, event.job, event.step):
        return True
    log.info(otherwise, job=event.job, step=event.step, rank=event.rank,
             reason="object storage no longer keeps the step")  # fmt: skip
    return False


async def _wanted(ctx: Flush, event: ShardVerified) -> bool:
    """Whether the job wants the event's step in object storage now (`upload_wanted`)."""
    floors = await ctx.state.floors(event.job)
    keep = await ctx.state.keep(event.job) or default_keep(ctx.settings)
    return upload_wanted(event.step, floors, keep)


async def _follow_floors(ctx: Flush, tg: TaskGroup) -> None:
    """At each new upload target of a job, upload this node's remembered shards of its step
    (in the background) and forget those the target passes; through an outage, watch again
    once it is over."""
    settings = ctx.settings
    delay = settings.retry_base_s
    while True:
        try:
            store = await JobStore(ctx.bus.js, settings).open()
            async for job, floors in store.watch_floors():
                delay = settings.retry_base_s
                last = ctx.later.named(job)
                if due := ctx.later.due(job, floors):
                    log.info("upload_due", job=job, step=floors.upload, shards=len(due))
                    tg.start_soon(_upload_all, ctx, due)
                if last is not None and 0 <= floors.upload < last:
                    # A lower target (a rewind made the last one never to complete): its
                    # shards were let go when a newer target passed them; found again from
                    # this node's events, as at start.
                    tg.start_soon(_redrive, ctx, job, floors.upload)
        except TierpipeError as e:
            log.warning("flush_floors_unwatched", error=str(e), retry_s=delay)
        await anyio.sleep(delay)
        delay = min(delay * 2, settings.retry_max_s)


async def _upload_all(ctx: Flush, events: list[ShardVerified]) -> None:
    """Upload `events`' shards and publish their `flushed`, in the node's batch too (not
    messages: the runner is not there to), each retried through an outage; a failure is
    reported (`failed`) as the runner would; one shard's problem does not stop the rest."""
    settings = ctx.settings
    for event in events:
        delay, attempt, reported = settings.retry_base_s, 1, -OUTAGE_REPORT_EVERY_S
        while True:
            try:
                with unit_of_work(job=event.job, step=event.step, rank=event.rank):
                    if (flushed := await handle(ctx, event, 0)) is not None:  # (None: skipped)
                        await ctx.bus.publish(flushed)
                        batch = Batcher(ctx.bus)
                        batch.add(flushed)
                        await batch.flush()
                        log.info("flush_redriven")
                break
            except Exception as e:  # an outage is waited out, like the runner does
                retry = isinstance(e, UnavailableError)
                log.warning("flush_redrive_deferred" if retry else "flush_redrive_skipped",
                            step=event.step, rank=event.rank, error_type=type(e).__name__,
                            error=text(e))  # fmt: skip
                # (an outage reported at once, then at most every minute: as the runner does)
                if not retry or time.monotonic() - reported >= OUTAGE_REPORT_EVERY_S:
                    reported = time.monotonic()
                    with contextlib.suppress(Exception):  # (a report is never the failure)
                        await ctx.bus.publish(event.follow(
                            StageFailed, node=ctx.node, stage=STAGE, error=type(e).__name__,
                            message=text(e), retryable=retry, attempt=attempt,
                        ))  # fmt: skip
                if not retry:
                    break
                await anyio.sleep(delay)
                delay, attempt = min(delay * 2, settings.retry_max_s), attempt + 1


async def _upload_while_kept(
    ctx: Flush, event: ShardVerified, source: SealedFile, location: str
) -> Uploaded | None:
    """`S3Store.write`, cancelled (its multipart upload aborted) once the job no longer wants
    the step in object storage (`upload_wanted`, `kept_in_s3`), as its floors say every
    `KEPT_RECHECK_S`; None then. A job state that cannot be read meanwhile lets the upload go
    on (it is looked at again once it is done)."""
    done: Uploaded | None = None
    cancelled = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal cancelled
        while True:
            await anyio.sleep(KEPT_RECHECK_S)
            try:
                wanted = await _wanted(ctx, event)
                kept = wanted and await _kept(ctx, event, "upload_cancelled")
            except TierpipeError:
                continue
            if not wanted:
                log.info("upload_cancelled", job=event.job, step=event.step, rank=event.rank,
                         reason="no longer the job's upload target")  # fmt: skip
            if not kept:
                cancelled = True
                scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            done = await ctx.s3.write(source, location, rewind_to=event.rewind_to)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # (the upload's own error, as if unwatched)
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return None if cancelled else done


def apply_control(throttle: Throttle, control: FlushControl) -> None:
    match control.action:
        case "rate":
            throttle.set_rate(control.rate_bytes_per_s or None)
        case "pause":
            throttle.pause()
        case "resume":
            throttle.resume()
    log.info("flush_control_applied", action=control.action, rate_bytes_per_s=throttle.rate,
             paused=throttle.paused)  # fmt: skip


async def _follow_controls(bus: Bus, throttle: Throttle, node: str) -> None:
    """Apply the newest rate command for this node, then every new one as it comes."""
    subjects = [flush_control_subject(), flush_control_subject(node)]
    await bus.ensure_job_stream(subject_job(subjects[0]))  # (the commands' own stream)
    latest = [c for c in [await bus.last_raw(s) for s in subjects] if c is not None]
    for _, data in sorted(latest):  # the newest command wins
        _apply(throttle, data)

    async def on_control(msg: object) -> None:
        _apply(throttle, msg.data)  # type: ignore[attr-defined]

    for subject in subjects:
        await bus.subscribe(subject, on_control)


async def _follow_shares(settings: Settings, bus: Bus, jobs: JobThrottles) -> None:
    """Keep each job's throttle at this node's share of its flush budget, as the jobs'
    coordinators store them; through an outage, watch again once it is over."""
    delay = settings.retry_base_s
    while True:
        try:
            store = await JobStore(bus.js, settings).open()
            async for job, shares in store.watch_shares():
                delay = settings.retry_base_s
                jobs.set_share(job, shares.flush_bytes_per_s_per_node)
                log.info("flush_share_applied", job=job, nodes=shares.nodes,
                         rate_bytes_per_s=shares.flush_bytes_per_s_per_node)  # fmt: skip
        except TierpipeError as e:
            log.warning("flush_shares_unwatched", error=str(e), retry_s=delay)
        await anyio.sleep(delay)
        delay = min(delay * 2, settings.retry_max_s)


async def _abort_orphans(ctx: Flush) -> None:
    """Abort uploads a killed worker of this node left behind; keep trying through an outage
    (uploads go on meanwhile: each one aborts earlier attempts at its own key anyway)."""
    nvme, s3, settings = ctx.nvme, ctx.s3, ctx.settings
    delay = settings.retry_base_s
    while True:
        try:
            await s3.abort_orphans(
                lambda key: _owned(nvme, s3, key), max_age_s=settings.orphan_upload_max_age_s
            )
            return
        except RetryableError as e:
            log.warning("orphan_sweep_deferred", error=str(e), retry_s=delay)
        except TierpipeError as e:
            log.error("orphan_sweep_failed", error=str(e))
            return
        await anyio.sleep(delay)
        delay = min(delay * 2, settings.retry_max_s)


async def _redrive(ctx: Flush, job: str | None = None, step: int | None = None) -> None:
    """Handle again every verified shard of this node that has no `flushed` event and is still
    on NVMe: an agent that gave up on it (older versions did, after `max_deliver` attempts
    during a long outage) or held it for a later target when it stopped left it unflushed.
    `job`, `step`: only that job's shards (of that step)."""
    settings = ctx.settings
    delay = settings.retry_base_s
    while True:
        try:
            pending = await _unflushed(ctx.bus, ctx.nvme, ctx.node, job)
            pending = [e for e in pending if step is None or e.step == step]
            break
        except UnavailableError as e:
            log.warning("flush_redrive_deferred", error=str(e), retry_s=delay)
        except Exception as e:  # the stage goes on; the next start tries again
            log.error("flush_redrive_failed", error=str(e) or type(e).__name__)
            return
        await anyio.sleep(delay)
        delay = min(delay * 2, settings.retry_max_s)
    if pending:
        log.info("flush_redrive_started", shards=len(pending))
    # (`handle` uploads only what the job wants, and remembers what it may want later)
    await _upload_all(ctx, pending)


async def _unflushed(
    bus: Bus, nvme: NvmeStore, node: str, only: str | None = None
) -> list[ShardVerified]:
    """This node's newest `verified` per shard with no `flushed` of the same content, not
    evicted since, whose file is still there (of job `only`, if given). Only this node's
    subjects are read."""
    verified: dict[tuple[str, int, int], ShardVerified] = {}
    flushed: set[tuple[str, int, int, str]] = set()
    evicted: dict[tuple[str, int, int], float] = {}
    jobs = job_dirs(nvme.root)  # (a job with no copy here has nothing to flush)
    for job in sorted(jobs & {only} if only else jobs):
        for e in await bus.history(shard_subject(job, "verified", node, "*")):
            if isinstance(e, ShardVerified):
                verified[(e.job, e.step, e.rank)] = e
        for e in await bus.history(shard_subject(job, "flushed", node, "*")):
            if isinstance(e, ShardFlushed):
                flushed.add((e.job, e.step, e.rank, e.header_digest))
        for e in await bus.history(shard_subject(job, "evicted", node, "*")):
            if isinstance(e, ShardEvicted) and e.tier == "nvme":
                evicted[(e.job, e.step, e.rank)] = e.ts
    pending = []
    for key, e in verified.items():
        if (*key, e.header_digest) in flushed or evicted.get(key, 0.0) >= e.ts:
            continue
        try:
            path = Path(nvme.locate(e.job, e.step, e.rank, e.world_size))
        except ValueError:
            continue
        if Path(e.path) == path and await anyio.Path(path).exists():
            pending.append(e)
    return pending


def _apply(throttle: Throttle, data: bytes) -> None:
    try:
        control = _control_decoder.decode(data)
        if control.v != SCHEMA_VERSION:
            raise msgspec.ValidationError(
                f"schema version {control.v} is not supported (this build reads {SCHEMA_VERSION})"
            )
        apply_control(throttle, control)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        log.warning("flush_control_rejected", error=str(e), body=data[:200])


def _owned(nvme: NvmeStore, s3: S3Store, key: str) -> bool:
    """An upload is this node's if the shard it uploads lives on this node's NVMe."""
    shard = s3.shard_of(key)
    return shard is not None and Path(nvme.locate(*shard)).exists()


class _KeyLocks:
    """One lock per key, alive while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[anyio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (anyio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
