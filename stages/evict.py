"""Evict stage: this node's side of retention, and the host of the jobs' coordinators.

- The RAM tier: a staging slot is released once the shard's NVMe copy is verified (never
  earlier: verify rewrites a corrupt file from the staging copy), or once nvme-write or verify
  failed for good (nothing will ever need the copy again; the trainer's handle reports the
  failure). These are the only events the stage consumes, and only this node's: slot releases
  never wait behind retention work.
- The NVMe tier: the node watches the jobs' retention floors in KV (`tierpipe.control.kvstate`) and
  applies them to every copy on its disk, with or without events about it
  (`tierpipe.retention.kept`): below the NVMe floor a copy goes once that very copy is in
  object storage, as "not kept" once the job keeps its step on no tier, as "superseded" if it is
  never to be uploaded (not the upload target nor a period step); all at once when the
  job keeps no unflushed copies (`Keep.evict_unflushed`). The steps the floors keep, the upload
  target and pinned steps stay. Below `nvme_min_free_bytes` free, or when nvme-write finds no
  room for a save (it asks: `storage.resources.make_room`), the oldest removable copies go
  first (`relieve_pressure`), before any save waits.
- Object storage: the job's retention coordinator (`tierpipe.control.coordinator`), elected by a
  lease among the agents (each runs one here), removes objects and writes COMMITs through this
  stage's object store. Every removal is published as `evicted`. Holds the node's evict lock.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import anyio
import msgspec
import structlog

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import Msg
from tierpipe.control.coordinator import Coordinator, RestorePins
from tierpipe.control.kvstate import JobStore, default_keep
from tierpipe.errors import ShardFormatError, TierpipeError
from tierpipe.faults import maybe_fail
from tierpipe.names import job_dirs, node_name, plan_subject, shard_relpath, shard_subject
from tierpipe.retention.kept import REASONS, Fate, copy_evidence, nvme_fate
from tierpipe.schemas import (
    Event,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    StageFailed,
    decode_event,
    shard_event,
)
from tierpipe.schemas.commit import CommitManifest
from tierpipe.schemas.jobstate import Floors, Keep, StepRecord
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.resources import room_maker
from tierpipe.storage.s3.commit import put_commit, remove_commit
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.staged_image import release

__all__ = ("KINDS", "STAGE", "Evict", "LocalCopy", "Verdict", "floor_verdict", "handle", "open")

STAGE = "evict"
KINDS = ("verified", "failed")
#: Stages whose permanent failure ends a save on this node: its staging slot is released.
_SAVE_STAGES = ("nvme-write", "verify")
log = structlog.get_logger(__name__)

Verdict = Literal["keep", "if-flushed", "unflushed"]
#: How often copies left below a floor (not in object storage yet) are looked at again.
RECHECK_S = 2.0


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[Evict]:
    """Hold the node's evict lock; follow the floors and coordinate jobs in the background."""
    async with AsyncExitStack() as stack:
        nvme = stack.enter_context(NvmeStore.from_settings(settings))
        await stack.enter_async_context(nvme.lock(STAGE, timeout_s=settings.agent_lock_timeout_s))
        store = await JobStore(bus.js, settings).open()
        evict = Evict(settings, bus, nvme, store, stack)
        stack.enter_context(room_maker(nvme.root, evict.make_room))
        # Restore plans pin their step on this node at once too, whatever the floors say yet.
        # Subscribed before the read: no plan falls between the two. (Only the jobs this
        # node holds copies of: a plan pins nothing else here.)
        for subject in (plan_subject("*"), shard_subject("*", "restore", "*", 0)):
            await bus.subscribe(subject, evict.on_plan)
        await evict.follow_flushed()
        for job in evict._local_jobs():
            for subject in (plan_subject(job), shard_subject(job, "restore", "*", 0)):
                for _, event in await bus.latest(subject):
                    evict.pins.note(event)
        async with anyio.create_task_group() as tg:
            tg.start_soon(evict.follow_floors)
            tg.start_soon(evict.coordinator.run)
            yield evict
            tg.cancel_scope.cancel()


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """One shard file on this node's NVMe."""

    job: str
    step: int
    rank: int
    world_size: int
    epoch: int
    header_digest: str
    nbytes: int
    path: Path


class Evict:
    """The evict worker's state: the floors of every job, and the object store (connected
    on first use)."""

    def __init__(
        self, settings: Settings, bus: Bus, nvme: NvmeStore, store: JobStore, stack: AsyncExitStack
    ) -> None:
        self.settings, self.bus, self.nvme, self.store = settings, bus, nvme, store
        self.node = node_name(settings.node)
        self.floors: dict[str, Floors] = {}
        self._stack = stack
        self._s3: S3Store | None = None
        self._lock = anyio.Lock()
        self._registered: set[str] = set()
        #: Jobs with copies left below a floor to wait; jobs whose floors changed (`_wake`).
        self._waiting: set[str] = set()
        self._changed: set[str] = set()
        self._wake = anyio.Event()
        #: (job, step, rank) -> the header digest this node reported flushed since it started
        #: (evidence that a copy is in object storage before the job state says so).
        self.flushed_here: dict[tuple[str, int, int], str] = {}
        self.pins = RestorePins(settings.restore_timeout_s)
        self.coordinator = Coordinator(
            settings, bus, store, self.node, self.remove_objects, commit=self.commit_step
        )
        #: This node's NVMe removals, reported per node as well.
        self.batcher = Batcher(bus)

    async def handle(self, event: Event, attempt: int) -> None:
        """Release the staging slot `event` frees (this node's `verified`, or a save that
        failed for good), then check the disk's free space."""
        if isinstance(event, StageFailed):
            maybe_fail("evict:on-failed", self.settings.fault_point)
        if isinstance(event, ShardVerified) and event.node == self.node:
            if event.job not in self._registered:  # (a trainer registers its job itself too)
                await self.store.register(event.job)
                self._registered.add(event.job)
            self.coordinator.hosts(event.job, event.rank)
            await self._release_slot(
                event.follow(
                    ShardEvicted, node=self.node, tier="ram", location="",
                    reason="nvme copy verified",
                )
            )  # fmt: skip
            if self.settings.nvme_min_free_bytes:
                await self.relieve_pressure()
        elif (failed := _failed_save(event, self.node)) is not None:
            assert isinstance(event, StageFailed)
            await self._release_slot(failed, generation=event.generation)

    async def on_plan(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            self.pins.note(decode_event(msg.data))

    async def follow_flushed(self) -> None:
        """Note this node's `flushed` events from now on (`flushed_here`)."""
        await self.bus.subscribe(shard_subject("*", "flushed", self.node, "*"), self._on_flushed)

    async def _on_flushed(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            e = decode_event(msg.data)
            if isinstance(e, ShardFlushed) and e.node == self.node:
                self.flushed_here[(e.job, e.step, e.rank)] = e.header_digest

    # --- the RAM tier

    async def _release_slot(self, evicted: ShardEvicted, *, generation: int | None = None) -> None:
        """Release the slot of `evicted`'s step (while it holds that copy: `release`) and
        publish it (location: the slot)."""
        slot = await anyio.to_thread.run_sync(
            functools.partial(
                release, self.settings.staging_root, evicted.job, evicted.rank, evicted.step,
                epoch=evicted.epoch, generation=generation,
            )
        )  # fmt: skip
        if slot is not None:
            await self.bus.publish(msgspec.structs.replace(evicted, location=str(slot)))
            log.info("staging_released", slot=str(slot), reason=evicted.reason)

    # --- the NVMe tier

    async def follow_floors(self) -> None:
        """Apply every job's floors as stored now, then the newest at each change (never a
        backlog of stale ones), and every `RECHECK_S` to copies left waiting (until cancelled)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._apply_changed)
            while True:
                try:
                    async for job, floors in self.store.watch_floors():
                        self.floors[job] = floors
                        self._changed.add(job)
                        self._wake.set()
                except TierpipeError as e:
                    log.warning("floor_watch_interrupted", error=str(e))
                await anyio.sleep(self.settings.retry_max_s / 10)

    async def _apply_changed(self) -> None:
        while True:
            with anyio.move_on_after(RECHECK_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            jobs, self._changed = self._changed | self._waiting, set()
            for job in sorted(jobs):
                try:
                    await self.apply_floors(job)
                except TierpipeError as e:
                    log.warning("floor_recheck_failed", job=job, error=str(e))

    async def apply_floors(self, job: str) -> list[LocalCopy]:
        """Remove this node's copies of `job` that its floors no longer keep; what was
        removed. A copy that cannot be checked now (the job state unreachable) stays for the next
        change; nothing here raises for one copy."""
        floors = self.floors.get(job)
        if floors is None:
            return []
        keep = await self.store.keep(job) or default_keep(self.settings)
        removed = []
        self._waiting.discard(job)
        async with self._lock:
            for copy in await anyio.to_thread.run_sync(self.local_copies, job):
                if floor_verdict(copy.step, floors, keep) == "keep" or self._pinned(copy):
                    continue
                fate = await self._fate(copy, floors, keep)
                if fate in ("keep", "wait"):
                    self._waiting.add(job)  # not in object storage yet: looked at again
                    continue
                if fate == "flushed":
                    # Floors as new as the record: the flush that completed the step in object
                    # storage may have made it the newest there, which keeps it.
                    floors = self.floors[job] = await self.store.floors(job)
                    if floor_verdict(copy.step, floors, keep) == "keep":
                        continue
                if self._pinned(copy):
                    continue  # (a restore began meanwhile)
                if await self._remove(copy, REASONS[fate]):
                    removed.append(copy)
            await self.batcher.flush()
        return removed

    async def make_room(self, nbytes: int) -> int:
        """`relieve_pressure` for a write of `nbytes` (nvme-write asks); the bytes freed."""
        need = max(self.settings.nvme_min_free_bytes, self.nvme.reserve_bytes) + nbytes
        return sum(c.nbytes for c in await self.relieve_pressure(need))

    async def relieve_pressure(self, need: int | None = None) -> list[LocalCopy]:
        """Below `need` free bytes (`nvme_min_free_bytes` unless given): remove the oldest
        removable copies of any job until there is room: below the NVMe floor, those
        `nvme_fate` removes (if retention did not yet); above it, one in object storage. Never
        a step the floors keep, the upload target, the newest complete on NVMe, a pinned step,
        or a job's newest step here (maybe in flight)."""
        need = self.settings.nvme_min_free_bytes if need is None else need
        removed: list[LocalCopy] = []
        async with self._lock:
            free = await anyio.to_thread.run_sync(self.nvme.free_bytes)
            if free >= need:
                return removed
            copies = []
            for job in await anyio.to_thread.run_sync(self._local_jobs):
                copies += await anyio.to_thread.run_sync(self.local_copies, job)
            newest = {c.job: c.step for c in sorted(copies, key=lambda c: c.step)}
            jobs: dict[str, tuple[Keep, int | None]] = {}
            for copy in sorted(copies, key=lambda c: (c.step, c.job, c.rank)):
                if free >= need:
                    break
                floors = self.floors.get(copy.job, Floors())
                kept = (*floors.keep, floors.upload, newest[copy.job])
                if copy.step in kept or self._pinned(copy):
                    continue
                if copy.job not in jobs:
                    jobs[copy.job] = await self._policy(copy.job)
                keep, newest_nvme = jobs[copy.job]
                if copy.step >= floors.nvme:  # (only keep_latest_k keeps it: if in s3)
                    removable = copy.step != newest_nvme and await self._in_s3(copy)
                else:
                    removable = await self._fate(copy, floors, keep) not in ("keep", "wait")
                if removable and await self._remove(copy, "disk pressure"):
                    removed.append(copy)
                    free += copy.nbytes
            await self.batcher.flush()
        if removed:
            log.info("nvme_pressure_relieved", copies=len(removed), free_bytes=free, need=need)
        return removed

    async def _policy(self, job: str) -> tuple[Keep, int | None]:
        """The job's retention policy and its newest step complete on NVMe (the defaults, and
        None, while the job state cannot be read: then no copy counts as that step's)."""
        try:
            head = await self.store.head(job)
            newest = head.nvme_steps[-1] if head is not None and head.nvme_steps else -1
            return await self.store.keep(job) or default_keep(self.settings), newest
        except TierpipeError:
            return default_keep(self.settings), None

    def _local_jobs(self) -> list[str]:
        return sorted(job_dirs(self.nvme.root))

    def local_copies(self, job: str) -> list[LocalCopy]:
        """This node's shard files of `job`, oldest step first (unreadable ones skipped: the
        verify stage deals with those)."""
        out = []
        for path in sorted((self.nvme.root / job).glob("step-*/rank-*.shard")):
            try:  # (a file another process removes meanwhile: gone from the listing)
                head, nbytes = read_head(path), path.stat().st_size
            except (OSError, ShardFormatError, TierpipeError):
                continue
            h = head.header
            if h.job != job or path != self.nvme.path_for(
                shard_relpath(h.job, h.step, h.rank, h.world_size)
            ):
                continue  # not at its own path: never this node's copy of that shard
            out.append(
                LocalCopy(
                    h.job, h.step, h.rank, h.world_size, h.epoch, head.header_digest.hex(),
                    nbytes, path,
                )
            )  # fmt: skip
        return out

    def _pinned(self, copy: LocalCopy) -> bool:
        """A restore reads the copy's step, or is planning (retention holds still)."""
        return copy.step in self.pins.steps(copy.job) or self.pins.held(copy.job)

    async def _fate(self, copy: LocalCopy, floors: Floors, keep: Keep) -> Fate:
        """What becomes of a copy below the NVMe floor (`nvme_fate`), from its step's record
        and the evidence about it; "wait" while the job state cannot be read."""
        if keep.evict_unflushed:
            return "unflushed"
        found = await self._evidence(copy)
        if found is None:
            return "wait"
        return nvme_fate(copy.step, floors, keep, in_s3=found[1], record=found[0])

    async def _in_s3(self, copy: LocalCopy) -> bool:
        """Whether this very copy is in object storage (an unreadable job state is none)."""
        found = await self._evidence(copy)
        return found is not None and found[1]

    async def _evidence(self, copy: LocalCopy) -> tuple[StepRecord | None, bool] | None:
        """`copy_evidence` for `copy`; None while the job state cannot be read."""
        here = self.flushed_here.get((copy.job, copy.step, copy.rank))
        try:
            return await copy_evidence(
                self.store, copy.job, copy.step, copy.rank, copy.header_digest, flushed_here=here
            )
        except TierpipeError as e:
            log.warning("nvme_eviction_deferred", path=str(copy.path), error=str(e))
            return None

    async def _remove(self, copy: LocalCopy, reason: str) -> bool:
        removed = await self.nvme.delete(copy.path, header_digest=copy.header_digest)
        if removed:
            self.flushed_here.pop((copy.job, copy.step, copy.rank), None)
            evicted = shard_event(
                ShardEvicted, copy, node=self.node, tier="nvme", location=str(copy.path),
                reason=reason,
            )  # fmt: skip
            await self.bus.publish(evicted)
            self.batcher.add(evicted)  # (the coordinator reads the node's batch: `_removed`)
            log.info("copy_evicted", job=copy.job, step=copy.step, rank=copy.rank, tier="nvme",
                     location=str(copy.path), reason=reason)  # fmt: skip
        return removed

    # --- object storage (the coordinator's removals)

    async def remove_objects(
        self, job: str, step: int, world_size: int, ranks: Sequence[int] | None
    ) -> None:
        """Remove one step's COMMIT, then every rank's object (ranks None) or those of `ranks`
        (DeleteObjects, 1,000 keys a request): a COMMIT never names an object that is gone."""
        store = await self._object_store()
        if ranks is None:
            await remove_commit(store, job, step)
        ranks = range(world_size) if ranks is None else ranks
        await store.delete_many([store.key(job, step, r, world_size) for r in ranks])

    async def commit_step(self, manifest: CommitManifest) -> bool:
        """Create a step's COMMIT manifest (see `s3_commit.put_commit`)."""
        return await put_commit(await self._object_store(), manifest)

    async def _object_store(self) -> S3Store:
        # Connected on first use: a node without object storage never needs it.
        if self._s3 is None:
            self._s3 = await self._stack.enter_async_context(S3Store(self.settings))
        return self._s3


handle = Evict.handle


def floor_verdict(step: int, floors: Floors, keep: Keep) -> Verdict:
    """What a node does with its NVMe copy of `step` under the job's floors: "keep" it (at
    or above the NVMe floor, or a step the floors keep), remove it "if-flushed" (once the same
    save is in object storage), or remove it as "unflushed" (the job keeps none below the
    floor)."""
    if step >= floors.nvme or step in floors.keep:
        return "keep"
    return "unflushed" if keep.evict_unflushed else "if-flushed"


class _FailedShard(NamedTuple):
    """The shard of a failed save, whose `StageFailed` has it (its fields are optional there)."""

    job: str
    step: int
    rank: int
    world_size: int
    epoch: int


def _failed_save(event: Event, node: str) -> ShardEvicted | None:
    """The slot release due when `event` ends a save of this node for good (a permanent
    nvme-write or verify failure: nothing will need the staging copy again), else None."""
    if not (
        isinstance(event, StageFailed)
        and not event.retryable
        and event.node == node
        and event.stage in _SAVE_STAGES
        and event.step is not None
        and event.rank is not None
        and event.world_size is not None
    ):
        return None
    try:
        shard = _FailedShard(event.job, event.step, event.rank, event.world_size, event.epoch)
        return shard_event(
            ShardEvicted,
            shard,
            node=node,
            tier="ram",
            location="",
            reason=f"save failed in {event.stage}: {event.error}: {event.message}",
        )
    except ValueError:  # an identity no save can have (rank >= world size): nothing to release
        return None
