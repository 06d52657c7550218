"""NVMe-write stage: `staged` -> a sealed shard file on node-local NVMe -> `written`.

Reads the unsealed image from the staging slot, writes it to a temp file with large aligned
O_DIRECT writes while hashing, fsyncs, links into place (never over a valid file) and fsyncs the
directory (`NvmeStore.write_image`). The slot must still be at the generation the event names,
before and after the copy (`StagedImage.check`): a writer that was paused while the trainer reused
the slot fails instead of sealing another step's bytes. Holds the node's nvme-write lock; temp
files left by a crash are swept on start. Idempotent: a redelivered event finds the final file
holding the same save and only republishes (deduplicated).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus

from tierpipe.bus import Bus
from tierpipe.errors import StagingGoneError, TierpipeError
from tierpipe.faults import maybe_die
from tierpipe.names import node_name, shard_relpath
from tierpipe.runner import serve
from tierpipe.schemas import ShardStaged, ShardWritten
from tierpipe.settings import Settings
from tierpipe.staging import StagedImage, open_image
from tierpipe.storage.nvme import NvmeStore, WriteResult, read_head

__all__ = ["STAGE", "run"]

STAGE = "nvme-write"
log = structlog.get_logger(__name__)


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)
    async with AsyncExitStack() as stack:
        store = stack.enter_context(NvmeStore.from_settings(settings))
        await stack.enter_async_context(store.lock(STAGE, timeout_s=settings.agent_lock_timeout_s))
        # Under the lock: another instance's temp files are dead for sure, whatever their PID.
        await anyio.to_thread.run_sync(store.sweep_temp, STAGE)

        async def handle(event: ShardStaged, attempt: int) -> None:
            result, image = await anyio.to_thread.run_sync(
                _write, store, settings.staging_root, event
            )
            try:
                await bus.publish(
                    event.follow(
                        ShardWritten,
                        node=node,
                        path=result.path,
                        nbytes=result.nbytes,
                        header_digest=result.header_digest,
                        tensors=result.tensors,
                        seconds=round(result.seconds, 6),
                        origin=event.origin,
                    )
                )
            finally:
                if image is not None:  # unmapping a large slot takes tens of ms: after the event
                    await anyio.to_thread.run_sync(image.close)
            maybe_die("nvme-write:before-ack", settings.fault_point)
            log.info(
                "shard_written",
                path=result.path,
                nbytes=result.nbytes,
                existed=result.existed,
                seconds=round(result.seconds, 4),
                mib_s=round(result.nbytes / 2**20 / max(result.seconds, 1e-9), 1),
            )

        await serve(
            bus,
            settings,
            stage=STAGE,
            node=node,
            kinds=("staged",),
            handler=handle,
            task_status=task_status,
        )


def _write(
    store: NvmeStore, staging_root: str, event: ShardStaged
) -> tuple[WriteResult, StagedImage | None]:
    """Write the shard; returns the result and the still-mapped staging image (caller closes)."""
    final = store.path_for(shard_relpath(event.job, event.step, event.rank, event.world_size))
    try:
        image = open_image(staging_root, event)
    except StagingGoneError:
        # Released or replaced after a redelivery: fine if the shard already made it to NVMe.
        done = _already_written(final, event)
        if done is None:
            raise
        return done, None
    try:
        with image.view() as view:
            result = store.write_image(
                view, image.head, final, check=image.check, rewind_to=event.rewind_to
            )
    except StagingGoneError:
        # The slot was reused or released mid-copy (nothing was placed): fine if the shard
        # made it to NVMe meanwhile (another writer's copy, say), else the save is gone.
        image.close()
        done = _already_written(final, event)
        if done is None:
            raise
        return done, None
    except BaseException:
        image.close()
        raise
    return result, image


def _already_written(final: Path, event: ShardStaged) -> WriteResult | None:
    try:
        head = read_head(final)
    except (OSError, TierpipeError):
        return None
    h = head.header
    if (h.job, h.step, h.rank, h.world_size, h.epoch) != (
        event.job,
        event.step,
        event.rank,
        event.world_size,
        event.epoch,
    ):
        return None  # another shard, or this step of another timeline
    return WriteResult(
        str(final), head.file_nbytes, head.header_digest.hex(), len(h.tensors), 0.0, True
    )
