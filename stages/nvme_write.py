"""NVMe-write stage: `staged` -> a sealed shard file on node-local NVMe -> `written`.

Reads the unsealed image from the staging slot, writes it to a temp file with large aligned
O_DIRECT writes while hashing, fsyncs, links into place (never over a valid file) and fsyncs the
directory (`NvmeStore.write`). The slot must still be at the generation the event names,
before and after the copy (`StagedImage.check`): a writer that was paused while the trainer reused
the slot fails instead of sealing another step's bytes. Holds the node's nvme-write lock; temp
files left by a crash are swept on start. Idempotent: a redelivered event finds the final file
holding the same save and only republishes (deduplicated).

A shard with sharded (DTensor) tensors names its save's global layout on `written`
(`tierpipe.reshard.steplayout`: the same for every rank), stored first in the job state under
its digest, once per process and layout; the job state's step record names it once every rank
reported it, and a resharded restore plans from it without reading a shard header.

NVMe short of room (below `nvme_min_free_bytes` free with this shard, or no room for it at all)
asks the evict stage of this process to remove the oldest removable copies first
(`tierpipe.storage.resources.make_room`); the save waits (`NoSpaceError`, retried) only when
nothing could be removed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
import xxhash
from anyio.abc import TaskGroup

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import NoSpaceError, StagingGoneError, TierpipeError
from tierpipe.log import bind_io
from tierpipe.names import node_name
from tierpipe.reshard.steplayout import layout_of, store_layout
from tierpipe.schemas import ShardHeader, ShardStaged, ShardWritten
from tierpipe.schemas.layout import encode_layout
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore, WriteResult
from tierpipe.storage.reader import read_head
from tierpipe.storage.resources import make_room
from tierpipe.storage.staged_image import StagedImage, open_image

__all__ = ("KINDS", "STAGE", "NvmeWrite", "handle", "open")

STAGE = "nvme-write"
KINDS = ("staged",)
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class NvmeWrite:
    settings: Settings
    node: str
    store: NvmeStore
    #: Unmaps staging images once their shard is written, off the `written` event's path.
    unmapper: TaskGroup
    #: The job state, where a sharded save's layout is stored; (job, digest) of the layouts
    #: this process stored or found there (one create per job and layout, not per shard).
    jobs: JobStore
    layouts: set[tuple[str, str]]


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[NvmeWrite]:
    """Hold the node's nvme-write lock (sweeping the temp files a killed writer left)."""
    with NvmeStore.from_settings(settings) as store:
        async with (
            store.lock(STAGE, timeout_s=settings.agent_lock_timeout_s),
            anyio.create_task_group() as unmapper,
        ):
            jobs = JobStore(bus.js, settings).bind()
            yield NvmeWrite(settings, node_name(settings.node), store, unmapper, jobs, set())


async def handle(ctx: NvmeWrite, event: ShardStaged, attempt: int) -> ShardWritten:
    """Seal the staged shard on NVMe (or find it sealed already) and say so, with the save's
    global layout (stored first) where the shard holds sharded tensors."""
    result, header = await _write(ctx, event)
    bind_io(result.nbytes, result.seconds, path=result.path, existed=result.existed)
    return event.follow(
        ShardWritten,
        node=ctx.node,
        path=result.path,
        nbytes=result.nbytes,
        header_digest=result.header_digest,
        tensors=result.tensors,
        seconds=round(result.seconds, 6),
        origin=event.origin,
        staged_ts=event.ts,
        layout=await _layout(ctx, header),
    )


async def _layout(ctx: NvmeWrite, header: ShardHeader) -> str:
    """The digest of the save's global layout, stored in the job state unless this process
    did already ("" for a shard without sharded tensors, or when the job state does not
    answer: the layout only spares a restore its header reads, the save goes on without)."""
    if not header.sharded:
        return ""
    data = encode_layout(layout_of(header))
    digest = xxhash.xxh3_64_hexdigest(data)
    if (header.job, digest) not in ctx.layouts:
        try:
            await store_layout(ctx.jobs, header.job, data)
        except TierpipeError as e:
            log.warning("layout_not_stored", job=header.job, step=header.step, error=str(e))
            return ""
        ctx.layouts.add((header.job, digest))
    return digest


async def _write(ctx: NvmeWrite, event: ShardStaged) -> tuple[WriteResult, ShardHeader]:
    """Write the shard from its staging image (unmapped in the background afterwards); the
    result, and the shard's header."""
    final = ctx.store.locate(event.job, event.step, event.rank, event.world_size)
    try:
        image = await anyio.to_thread.run_sync(open_image, ctx.settings.staging_root, event)
    except StagingGoneError as gone:
        # Released or replaced after a redelivery: fine if the shard already made it to NVMe.
        return await _already_written(final, event, gone)
    try:
        return await _place(ctx, image, final, event), image.head.header
    except StagingGoneError as gone:
        # The slot was reused or released mid-copy (nothing was placed): fine if the shard
        # made it to NVMe meanwhile (another writer's copy, say), else the save is gone.
        return await _already_written(final, event, gone)
    finally:
        # Unmapping a large slot takes tens of ms: in the background, `written` need not wait.
        ctx.unmapper.start_soon(anyio.to_thread.run_sync, image.close)


async def _place(ctx: NvmeWrite, image: StagedImage, final: str, event: ShardStaged) -> WriteResult:
    """`NvmeStore.write`, room made first where NVMe is short of it (see the module docstring).

    Raises:
        NoSpaceError: no room, and nothing could be removed to make some.
    """
    store, nbytes = ctx.store, image.head.file_nbytes
    if (low := ctx.settings.nvme_min_free_bytes) and (
        await anyio.to_thread.run_sync(store.free_bytes) - nbytes < low
    ):
        await make_room(store.root, nbytes)
    try:
        return await store.write(image, final, rewind_to=event.rewind_to)
    except NoSpaceError as full:
        if not await make_room(store.root, full.needed):
            raise
        log.info("nvme_room_made", path=final, nbytes=full.needed)
    return await store.write(image, final, rewind_to=event.rewind_to)


async def _already_written(
    final: str, event: ShardStaged, gone: StagingGoneError
) -> tuple[WriteResult, ShardHeader]:
    """This save as NVMe already holds it at `final`, and its header; raises `gone` if it
    does not."""
    done = await anyio.to_thread.run_sync(_found, Path(final), event)
    if done is None:
        raise gone
    return done


def _found(final: Path, event: ShardStaged) -> tuple[WriteResult, ShardHeader] | None:
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
    ), h
