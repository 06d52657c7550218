"""Evict stage: retention on every tier, without ever losing the last good copy.

Each node's evict worker folds every node's events into one catalog (rebuilt by replaying the
stream at start), so it knows when a step is complete on a tier. After each event it asks
`retention.plan_evictions` what this node may remove, removes it (its own NVMe files, and the
objects it uploaded), and publishes `evicted` for each removal.

The RAM tier's rule lives here too: a staging slot is released once the shard's NVMe copy is
verified (never earlier: verify rewrites a corrupt file from the staging copy); a slot whose
trainer has exited is deleted.

A step that an in-progress restore planned is pinned: its copies stay while the ranks read
them, until the restore ends (rank 0's final plan, or its error) or times out (the plan's time
plus `restore_timeout_s`). The pins come from the newest plan of each job, read at start and
then followed live on `tp.*.plan`.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from pipeline.bus import Bus
from pipeline.catalog import Catalog
from pipeline.errors import ConfigError, ShardFormatError
from pipeline.names import SUBJECT_ROOT, node_name, plan_subject, shard_relpath
from pipeline.retention import Eviction, Policy, plan_evictions
from pipeline.runner import serve
from pipeline.settings import Settings
from pipeline.staging import release
from pipeline.storage.nvme import NvmeStore
from pipeline.storage.s3 import S3Store
from schemas import Event, RecoveryPlanned, ShardEvicted, ShardVerified, decode_event

__all__ = ["STAGE", "RestorePins", "run"]

STAGE = "evict"
KINDS = ("written", "verified", "flushed", "evicted", "failed")
log = structlog.get_logger(__name__)


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)
    policy = Policy.from_settings(settings)
    catalog = Catalog()
    for event in await bus.history(f"{SUBJECT_ROOT}.*.*.*.*"):
        catalog.apply(event)
    log.info("catalog_rebuilt", jobs=len(catalog.jobs()))
    pins = RestorePins(settings.restore_timeout_s)
    await bus.subscribe(plan_subject("*"), pins.on_msg)  # before the read: no plan falls between
    for _, plan in await bus.latest(plan_subject("*")):
        pins.note(plan)

    async with AsyncExitStack() as stack:
        nvme = stack.enter_context(NvmeStore.from_settings(settings))
        s3: S3Store | None = None

        async def object_store() -> S3Store:
            nonlocal s3  # connected on first use: a node without object storage never needs it
            if s3 is None:
                s3 = await stack.enter_async_context(S3Store(settings))
            return s3

        async def remove(e: Eviction) -> None:
            if e.tier == "nvme":
                path = nvme.path_for(shard_relpath(e.job, e.step, e.rank, e.world_size))
                if Path(e.location) != path:
                    raise ShardFormatError(e.location, f"not this node's shard path {path}")
                await anyio.to_thread.run_sync(nvme.remove, path)
            else:
                store = await object_store()
                bucket, _, key = e.location.removeprefix("s3://").partition("/")
                if bucket != store.bucket:
                    raise ConfigError(
                        f"{e.location} is not in the configured bucket {store.bucket}"
                    )
                await store.delete(key)

        async def publish(evicted: ShardEvicted) -> None:
            await bus.publish(evicted)
            catalog.apply(evicted)

        async def handle(event: Event, attempt: int) -> None:
            catalog.apply(event)
            if isinstance(event, ShardVerified) and event.node == node:
                slot = await anyio.to_thread.run_sync(
                    release, settings.staging_root, event.job, event.rank, event.step
                )
                if slot is not None:
                    await publish(
                        event.follow(
                            ShardEvicted,
                            node=node,
                            tier="ram",
                            location=str(slot),
                            reason="nvme copy verified",
                        )
                    )
                    log.info("staging_released", slot=str(slot))
            free = None
            if policy.nvme_min_free_bytes:
                free = await anyio.to_thread.run_sync(nvme.free_bytes)
            pinned = pins.steps(event.job)
            for e in plan_evictions(
                catalog, event.job, policy, node=node, nvme_free_bytes=free, pinned=pinned
            ):
                await remove(e)
                await publish(
                    ShardEvicted(
                        job=e.job,
                        node=node,
                        ts=time.time(),
                        step=e.step,
                        rank=e.rank,
                        world_size=e.world_size,
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
