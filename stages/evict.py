"""Evict stage: retention for every tier, without ever losing the last good copy.

The RAM tier's rule lives here: a staging slot is released once the shard's NVMe copy is
verified (never earlier: verify rewrites a corrupt file from the staging copy). Each release
publishes `evicted` with tier `ram`; a slot whose trainer has exited is deleted.
"""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import TaskStatus

from pipeline.bus import Bus
from pipeline.names import node_name
from pipeline.runner import serve
from pipeline.settings import Settings
from pipeline.staging import release
from schemas import ShardEvicted, ShardVerified

__all__ = ["STAGE", "run"]

STAGE = "evict"
log = structlog.get_logger(__name__)


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)

    async def handle(event: ShardVerified, attempt: int) -> None:
        slot = await anyio.to_thread.run_sync(
            release, settings.staging_root, event.job, event.rank, event.step
        )
        if slot is None:
            log.debug("staging_already_released")
            return
        await bus.publish(
            event.follow(
                ShardEvicted, node=node, tier="ram", location=str(slot), reason="nvme copy verified"
            )
        )
        log.info("staging_released", slot=str(slot))

    await serve(
        bus,
        settings,
        stage=STAGE,
        node=node,
        kinds=("verified",),
        handler=handle,
        task_status=task_status,
    )
