"""Staging a shard read back from object storage again, so this node's NVMe gets its copy.

Once a restore from object storage is over, the sealed image the rank downloaded is copied into
one of its staging slots and announced with `staged` (`origin="restore"`, the restored save's
own epoch), both by the snapshot stage (`tierpipe.trainer.snapshot`), as a save is; the node agent
then writes and verifies it as it does every save. A write-back that fails is logged and
dropped: the restore itself already succeeded.
"""

from __future__ import annotations

import mmap
from functools import partial

import anyio
import structlog

from tierpipe.bus.client import Bus
from tierpipe.errors import DuplicateEventError, TierpipeError
from tierpipe.names import msg_id
from tierpipe.settings import Settings
from tierpipe.storage.aligned import close_quietly
from tierpipe.storage.shard import Head
from tierpipe.storage.staging import Slot, SlotPool, stage_image, staged_event

__all__: tuple[str, ...] = ()  # private to tierpipe.recovery: `Loader.settle` starts it

log = structlog.get_logger(__name__)


async def write_back(
    settings: Settings,
    bus: Bus,
    pool: SlotPool,
    image: mmap.mmap,
    head: Head,
    *,
    node: str,
) -> None:
    """Stage `image` (a sealed shard whose header `load` checked against the plan; closed
    afterwards) and publish its `staged` event as this node's."""
    step = head.header.step
    slot: Slot | None = None
    try:
        slot = await anyio.to_thread.run_sync(
            partial(stage_image, pool, image, head, timeout_s=settings.slot_wait_timeout_s)
        )
        if slot is None:  # (cannot happen: `stage_image` waits for a slot)
            return
        event = staged_event(
            head.header, slot, node=node, nbytes=head.file_nbytes, origin="restore"
        )  # with the restored save's own epoch, from its header
        published = await bus.publish(event, timeout=settings.publish_timeout_s)
        if published.duplicate:  # no agent will ever see this copy: give the slot back
            raise DuplicateEventError("staged", msg_id(event))
        slot = None  # the agent releases it
    except (TierpipeError, TimeoutError, OSError) as e:
        log.warning("restore_writeback_failed", step=step, error=str(e))
    finally:
        if slot is not None:
            pool.unmark(slot, step)
        close_quietly(image)
