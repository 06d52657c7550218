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
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from tierpipe.bus import Bus
from tierpipe.catalog import Catalog
from tierpipe.errors import StorageAuthError, UnavailableError
from tierpipe.faults import maybe_fail
from tierpipe.names import SUBJECT_ROOT, node_name, plan_subject, shard_relpath
from tierpipe.retention import Eviction, Policy, plan_evictions
from tierpipe.runner import serve
from tierpipe.schemas import (
    Event,
    RecoveryPlanned,
    ShardEvicted,
    ShardVerified,
    StageFailed,
    decode_event,
)
from tierpipe.settings import Settings
from tierpipe.staging import release
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3 import S3Store

__all__ = ["STAGE", "RestorePins", "run"]

STAGE = "evict"
KINDS = ("written", "verified", "flushed", "evicted", "failed")
#: Stages whose permanent failure ends a save on this node: its staging slot is released.
_SAVE_STAGES = ("nvme-write", "verify")
log = structlog.get_logger(__name__)


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)
    policy = Policy.from_settings(settings)
    async with AsyncExitStack() as stack:
        nvme = stack.enter_context(NvmeStore.from_settings(settings))
        await stack.enter_async_context(nvme.lock(STAGE, timeout_s=settings.agent_lock_timeout_s))
        catalog = Catalog()
        for event in await bus.history(f"{SUBJECT_ROOT}.*.*.*.*"):
            catalog.apply(event)
        log.info("catalog_rebuilt", jobs=len(catalog.jobs()))
        pins = RestorePins(settings.restore_timeout_s)
        # Subscribed before the read: no plan falls between the two.
        await bus.subscribe(plan_subject("*"), pins.on_msg)
        for _, plan in await bus.latest(plan_subject("*")):
            pins.note(plan)
        s3: S3Store | None = None
        refused: set[tuple[str, str | None]] = set()  # objects left alone, logged once each

        async def object_store() -> S3Store:
            nonlocal s3  # connected on first use: a node without object storage never needs it
            if s3 is None:
                s3 = await stack.enter_async_context(S3Store(settings))
            return s3

        store_down_until = [0.0]

        async def remove(e: Eviction) -> bool:
            """Remove one copy; False if it was left in place: an NVMe file now holds another
            save, the copy is not this node's (a forged or stale event: logged once), or the
            object store is down or refuses (retried with a later event). Never raises for one
            copy: retention of every other copy, and slot releases, go on regardless."""
            if e.tier == "nvme":
                path = nvme.path_for(shard_relpath(e.job, e.step, e.rank, e.world_size))
                if Path(e.location) != path:
                    if (e.location, e.header_digest) not in refused:
                        refused.add((e.location, e.header_digest))
                        log.warning(
                            "nvme_eviction_refused",
                            location=e.location,
                            expected=str(path),
                            reason="not this node's shard path",
                        )
                    return False
                removed = await anyio.to_thread.run_sync(
                    functools.partial(nvme.remove, path, header_digest=e.header_digest)
                )
                return removed or not await anyio.Path(path).exists()
            if anyio.current_time() < store_down_until[0]:
                return False  # the store was down moments ago: don't wait on it per copy
            try:
                return await _remove_object(await object_store(), e, catalog, node, refused)
            except UnavailableError as err:
                # Back off before the next try, so a down or hung store does not make every
                # event (and the slot releases behind it) wait out a timeout per copy.
                store_down_until[0] = anyio.current_time() + settings.retry_max_s
                log.warning(
                    "object_eviction_deferred",
                    location=e.location,
                    error=str(err),
                    retry_s=settings.retry_max_s,
                )
            except StorageAuthError as err:
                log.error("object_eviction_refused_by_store", location=e.location, error=str(err))
            return False

        async def publish(evicted: ShardEvicted) -> None:
            await bus.publish(evicted)
            catalog.apply(evicted)

        async def release_slot(evicted: ShardEvicted) -> None:
            """Release the slot of `evicted`'s step and publish it (location: the slot)."""
            slot = await anyio.to_thread.run_sync(
                functools.partial(
                    release,
                    settings.staging_root,
                    evicted.job,
                    evicted.rank,
                    evicted.step,
                    epoch=evicted.epoch,
                )
            )
            if slot is not None:
                await publish(msgspec.structs.replace(evicted, location=str(slot)))
                log.info("staging_released", slot=str(slot), reason=evicted.reason)

        async def handle(event: Event, attempt: int) -> None:
            if isinstance(event, StageFailed):
                maybe_fail("evict:on-failed", settings.fault_point)
            catalog.apply(event)
            if isinstance(event, ShardVerified) and event.node == node:
                await release_slot(
                    event.follow(
                        ShardEvicted,
                        node=node,
                        tier="ram",
                        location="",
                        reason="nvme copy verified",
                    )
                )
            elif (failed := _failed_save(event, node)) is not None:
                await release_slot(failed)
            free = None
            if policy.nvme_min_free_bytes:
                free = await anyio.to_thread.run_sync(nvme.free_bytes)
            pinned = pins.steps(event.job)
            for e in plan_evictions(
                catalog, event.job, policy, node=node, nvme_free_bytes=free, pinned=pinned
            ):
                if not await remove(e):
                    continue  # left in place (a newer save, or not this node's); publish nothing
                await publish(
                    ShardEvicted(
                        job=e.job,
                        node=node,
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
                log.info(
                    "copy_evicted",
                    job=e.job,
                    step=e.step,
                    rank=e.rank,
                    tier=e.tier,
                    location=e.location,
                    reason=e.reason,
                )

        await serve(
            bus,
            settings,
            stage=STAGE,
            node=node,
            kinds=KINDS,
            handler=handle,
            every_node=True,
            task_status=task_status,
        )


async def _remove_object(
    store: S3Store, e: Eviction, catalog: Catalog, node: str, refused: set[tuple[str, str | None]]
) -> bool:
    """Delete the object an eviction names, only if it is this node's copy of that shard: at
    the shard's own key in the configured bucket, uploaded by this node with the header digest
    the catalog holds. Anything else (a forged or stale `flushed` event naming some other
    object) stays where it is; it is logged once and the eviction is skipped.

    Returns:
        True if the object is gone; False if it was left in place.
    """
    shard = catalog.shard(e.job, e.step, e.rank)
    copy = shard.copy("s3") if shard is not None else None
    digest = copy.header_digest if copy is not None else None
    if (e.location, digest) in refused:
        return False
    key = store.key_for(shard_relpath(e.job, e.step, e.rank, e.world_size))
    if e.location != f"s3://{store.bucket}/{key}" or digest is None:
        log.warning(
            "object_eviction_refused",
            location=e.location,
            expected=f"s3://{store.bucket}/{key}",
            reason="not this shard's key in the configured bucket",
        )
        refused.add((e.location, digest))
        return False
    if not await store.delete_owned(key, node=node, header_digest=digest):
        refused.add((e.location, digest))
        return False
    return True


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
