"""Staging a shard read back from object storage again, so this node's NVMe gets its copy.

Once a restore from object storage is over, the sealed image the rank downloaded is copied into
one of its staging slots and announced with `staged` (`origin="restore"`, the restored save's
own epoch); the node agent then writes and verifies it as it does every save. A write-back that
fails is logged and dropped: the restore itself already succeeded.
"""

from __future__ import annotations

import contextlib
import mmap
import time

import anyio
import structlog

from tierpipe.bus import Bus
from tierpipe.errors import ConfigError, TierpipeError
from tierpipe.schemas import ShardStaged
from tierpipe.settings import Settings
from tierpipe.shard import Head
from tierpipe.staging import Slot, SlotPool

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
    h = head.header
    step = h.step
    slot: Slot | None = None
    try:
        slot = await anyio.to_thread.run_sync(_stage, settings, pool, step, image, head)
        if slot is None:  # (cannot happen: `_stage` waits for a slot)
            return
        event = ShardStaged(
            job=h.job,
            node=node,
            ts=time.time(),
            step=step,
            rank=h.rank,
            world_size=h.world_size,
            staging_path=str(slot.path),
            slot=slot.index,
            nbytes=head.file_nbytes,
            tensors=len(h.tensors),
            stall_s=0.0,
            origin="restore",
            generation=slot.generation,
            epoch=h.epoch,  # the restored save's own timeline
        )
        published = await bus.publish(event, timeout=settings.publish_timeout_s)
        if published.duplicate:  # no agent will ever see this copy: give the slot back
            raise ConfigError(f"write-back of step {step} was deduplicated by the server")
        slot = None  # the agent releases it
    except (TierpipeError, TimeoutError, OSError) as e:
        log.warning("restore_writeback_failed", step=step, error=str(e))
    finally:
        if slot is not None:
            pool.unmark(slot, step)
        close_image(image)


def close_image(image: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still exported: the GC unmaps it later
        image.close()


def _stage(
    settings: Settings, pool: SlotPool, step: int, image: mmap.mmap, head: Head
) -> Slot | None:
    """Copy a sealed image into a staging slot (waiting for a free one) and mark it."""
    slot = pool.acquire(wait=True, timeout_s=settings.slot_wait_timeout_s)
    if slot is None:
        return None
    mm = slot.ensure(head.file_nbytes)
    with memoryview(image) as src:
        slot.begin(src[: head.data_offset])  # the generation first, as for every save
        mm[head.data_offset : head.file_nbytes] = src[head.data_offset : head.file_nbytes]
    pool.mark(slot, step)
    return slot
