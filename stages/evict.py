"""Evict stage: retention on every tier, without ever losing the last good copy.

Each node's evict worker folds every node's events into one catalog (rebuilt by replaying the
stream at start), so it knows when a step is complete on a tier. After each event it asks
`retention.plan_evictions` what this node may remove, removes it (its own NVMe files, and the
objects it uploaded), and publishes `evicted` for each removal.

The RAM tier's rule lives here too: a staging slot is released once the shard's NVMe copy is
verified (never earlier: verify rewrites a corrupt file from the staging copy), or once nvme-write
or verify failed for good (nothing will ever need the copy again; the trainer's handle reports the
failure); a slot whose trainer has exited is deleted. Holds the node's evict lock.

A step that an in-progress restore planned is pinned: its copies stay while the ranks read
them, until the restore ends (rank 0's final plan, or its error) or times out (the plan's time
plus `restore_timeout_s`). The pins come from the newest plan of each job, read at start and
then followed live on `tp.*.plan`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from tierpipe.bus import Bus
from tierpipe.catalog import Catalog
from tierpipe.errors import StorageAuthError, UnavailableError
from tierpipe.faults import maybe_fail
from tierpipe.names import filter_subject, node_name, plan_subject
from tierpipe.retention import Eviction, Policy, plan_evictions
from tierpipe.schemas import (
    Event,
    RecoveryPlanned,
    ShardEvicted,
    ShardVerified,
    StageFailed,
    decode_event,
)
from tierpipe.settings import Settings
from tierpipe.staged_image import release
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3 import S3Store

__all__ = ("EVERY_NODE", "KINDS", "STAGE", "Evict", "RestorePins", "handle", "open")

STAGE = "evict"
KINDS = ("written", "verified", "flushed", "evicted", "failed")
#: Every node's events: completeness of a step on a tier is a fact about the whole job.
EVERY_NODE = True
#: Stages whose permanent failure ends a save on this node: its staging slot is released.
_SAVE_STAGES = ("nvme-write", "verify")
log = structlog.get_logger(__name__)


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[Evict]:
    """Hold the node's evict lock, fold the stream into the catalog, follow restore plans."""
    async with AsyncExitStack() as stack:
        nvme = stack.enter_context(NvmeStore.from_settings(settings))
        await stack.enter_async_context(nvme.lock(STAGE, timeout_s=settings.agent_lock_timeout_s))
        evict = Evict(settings, bus, nvme, stack)
        for event in await bus.history(filter_subject("*", node="*")):
            evict.catalog.apply(event)
        log.info("catalog_rebuilt", jobs=len(evict.catalog.jobs()))
        # Subscribed before the read: no plan falls between the two.
        await bus.subscribe(plan_subject("*"), evict.pins.on_msg)
        for _, plan in await bus.latest(plan_subject("*")):
            evict.pins.note(plan)
        yield evict


class Evict:
    """The evict worker's state: the catalog of every node's copies, the restore pins, and
    the object store (connected on first use, backed off from while it is down)."""

    def __init__(
        self, settings: Settings, bus: Bus, nvme: NvmeStore, stack: AsyncExitStack
    ) -> None:
        self.settings, self.bus, self.nvme = settings, bus, nvme
        self.node = node_name(settings.node)
        self.policy = Policy.from_settings(settings)
        self.catalog = Catalog()
        self.pins = RestorePins(settings.restore_timeout_s)
        self._stack = stack
        self._s3: S3Store | None = None
        #: Until when the object store is left alone after it was found down.
        self._store_down_until = 0.0
        #: Objects and files left alone (not this node's copy), logged once each.
        self._refused: set[tuple[str, str | None]] = set()

    async def handle(self, event: Event, attempt: int) -> None:
        """Fold `event` in, release the staging slot it frees, and remove what retention
        allows. Each removal is published as soon as it is done (not returned for the runner
        to publish), so the catalog folds it before the next removal is planned."""
        if isinstance(event, StageFailed):
            maybe_fail("evict:on-failed", self.settings.fault_point)
        self.catalog.apply(event)
        if isinstance(event, ShardVerified) and event.node == self.node:
            await self._release_slot(
                event.follow(
                    ShardEvicted,
                    node=self.node,
                    tier="ram",
                    location="",
                    reason="nvme copy verified",
                )
            )
        elif (failed := _failed_save(event, self.node)) is not None:
            await self._release_slot(failed)
        free = None
        if self.policy.nvme_min_free_bytes:
            free = await anyio.to_thread.run_sync(self.nvme.free_bytes)
        for e in plan_evictions(
            self.catalog,
            event.job,
            self.policy,
            node=self.node,
            nvme_free_bytes=free,
            pinned=self.pins.steps(event.job),
        ):
            if not await self._remove(e):
                continue  # left in place (a newer save, or not this node's); publish nothing
            await self._publish(
                ShardEvicted(
                    job=e.job,
                    node=self.node,
                    ts=time.time(),
                    step=e.step,
                    rank=e.rank,
                    world_size=e.world_size,
                    epoch=e.epoch,
                    tier=e.tier,
                    location=e.location,
                    reason=e.reason,
                )
            )
            log.info("copy_evicted", job=e.job, step=e.step, rank=e.rank, tier=e.tier,
                     location=e.location, reason=e.reason)  # fmt: skip

    async def _publish(self, evicted: ShardEvicted) -> None:
        await self.bus.publish(evicted)
        self.catalog.apply(evicted)

    async def _release_slot(self, evicted: ShardEvicted) -> None:
        """Release the slot of `evicted`'s step and publish it (location: the slot)."""
        slot = await anyio.to_thread.run_sync(
            functools.partial(
                release,
                self.settings.staging_root,
                evicted.job,
                evicted.rank,
                evicted.step,
                epoch=evicted.epoch,
            )
        )
        if slot is not None:
            await self._publish(msgspec.structs.replace(evicted, location=str(slot)))
            log.info("staging_released", slot=str(slot), reason=evicted.reason)

    async def _remove(self, e: Eviction) -> bool:
        """Remove one copy; False if it was left in place: an NVMe file now holds another
        save, the copy is not this node's (a forged or stale event: logged once), or the
        object store is down or refuses (retried with a later event). Never raises for one
        copy: retention of every other copy, and slot releases, go on regardless."""
        if e.tier == "nvme":
            return await self._remove_file(e)
        if anyio.current_time() < self._store_down_until:
            return False  # the store was down moments ago: don't wait on it per copy
        try:
            return await self._remove_object(e)
        except UnavailableError as err:
            # Back off before the next try, so a down or hung store does not make every
            # event (and the slot releases behind it) wait out a timeout per copy.
            retry_s = self.settings.retry_max_s
            self._store_down_until = anyio.current_time() + retry_s
            log.warning("object_eviction_deferred", location=e.location, error=str(err),
                        retry_s=retry_s)  # fmt: skip
        except StorageAuthError as err:
            log.error("object_eviction_refused_by_store", location=e.location, error=str(err))
        return False

    async def _remove_file(self, e: Eviction) -> bool:
        path = self.nvme.locate(e.job, e.step, e.rank, e.world_size)
        if Path(e.location) != Path(path):
            if (e.location, e.header_digest) not in self._refused:
                self._refused.add((e.location, e.header_digest))
                log.warning("nvme_eviction_refused", location=e.location, expected=path,
                            reason="not this node's shard path")  # fmt: skip
            return False
        return await self.nvme.delete(path, header_digest=e.header_digest)

    async def _remove_object(self, e: Eviction) -> bool:
        """Delete the object an eviction names, only if it is this node's copy of that shard:
        at the shard's own key in the configured bucket, uploaded by this node with the header
        digest the catalog holds. Anything else (a forged or stale `flushed` event naming some
        other object) stays where it is; it is logged once and the eviction is skipped.

        Returns:
            True if the object is gone; False if it was left in place.
        """
        store = await self._object_store()
        shard = self.catalog.shard(e.job, e.step, e.rank)
        copy = shard.copy("s3") if shard is not None else None
        digest = copy.header_digest if copy is not None else None
        if (e.location, digest) in self._refused:
            return False
        location = store.locate(e.job, e.step, e.rank, e.world_size)
        if e.location != location or digest is None:
            log.warning(
                "object_eviction_refused",
                location=e.location,
                expected=location,
                reason="not this shard's key in the configured bucket",
            )
            self._refused.add((e.location, digest))
            return False
        if not await store.delete(location, header_digest=digest):
            self._refused.add((e.location, digest))
            return False
        return True

    async def _object_store(self) -> S3Store:
        # Connected on first use: a node without object storage never needs it.
        if self._s3 is None:
            self._s3 = await self._stack.enter_async_context(S3Store(self.settings))
        return self._s3


handle = Evict.handle


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
        return ShardEvicted(
            job=event.job,
            node=node,
            ts=time.time(),
            step=event.step,
            rank=event.rank,
            world_size=event.world_size,
            epoch=event.epoch,
            tier="ram",
            location="",
            reason=f"save failed in {event.stage}: {event.error}: {event.message}",
        )
    except ValueError:  # an identity no save can have (rank >= world size): nothing to release
        return None


class RestorePins:
    """Per job, the step its in-progress restore reads (from the job's newest recovery plan)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._plans: dict[str, RecoveryPlanned] = {}

    def note(self, event: Event) -> None:
        """Take a plan into account (anything else, or an older plan, changes nothing)."""
        if not isinstance(event, RecoveryPlanned):
            return
        known = self._plans.get(event.job)
        if known is None or event.ts >= known.ts:
            self._plans[event.job] = event

    async def on_msg(self, msg: Any) -> None:
        try:
            self.note(decode_event(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return

    def steps(self, job: str, *, now: float | None = None) -> set[int]:
        """Steps of `job` no copy of which may go now."""
        plan = self._plans.get(job)
        if plan is None or plan.final or plan.error:
            return set()
        if (time.time() if now is None else now) > plan.ts + self._timeout_s:
            return set()  # the restore timed out
        return {plan.step}
