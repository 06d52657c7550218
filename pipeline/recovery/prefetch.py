"""`tierpipe prefetch`: a standby node pulls a node's shards of the newest step complete in
object storage onto its own NVMe, so when it replaces that node the restore reads NVMe.

For each rank of the node named (its ranks are those of its events in the job's stream), the
object is downloaded, its header checked against the digest the job state recorded (a wrong or
stale object is refused before it is written), written to this node's NVMe path for the shard
(a temp file, fsync, an atomic rename), then re-read from the device with every digest checked,
and reported as `written` and `verified` by this node (per rank and in its node batch, as the
agent reports them), so the job's coordinator counts the copy and a restore on this node finds
it at its own deterministic path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.folded import folded_head
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, NoCheckpointError, ResourceExhaustedError
from tierpipe.names import node_name, shard_relpath
from tierpipe.progress import Progress, Ticker
from tierpipe.recovery.kvplan import node_ranks
from tierpipe.recovery.reindex import nvme_events
from tierpipe.settings import Settings
from tierpipe.storage.durable import fsync_dir, makedirs_durable, unlink_quietly
from tierpipe.storage.lock import temp_path
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import check_header, image_head
from tierpipe.storage.s3.store import S3Store

__all__ = ("Prefetched", "prefetch")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Prefetched:
    step: int
    #: Ranks fetched now, and ranks whose verified copy was on this node's NVMe already.
    fetched: list[int]
    present: list[int]


async def prefetch(
    settings: Settings,
    job: str,
    *,
    of_node: str | None = None,
    step: int | None = None,
    progress: Progress | None = None,
) -> Prefetched:
    """Fetch `of_node`'s ranks (default: this node's) of `step` (default: the newest complete in
    object storage) onto this node's NVMe; `progress` is called with (ranks done, ranks).

    Raises:
        NoCheckpointError: no such step in object storage, or a rank has no recorded copy.
        ConfigError: the node has no events of the job (so no known ranks).
    """
    here = node_name(settings.node)
    source = of_node or here
    async with Bus(settings, name=f"tierpipe-prefetch-{here}") as bus:
        store = await JobStore(bus.js, settings).open()
        if step is None:  # (the newest the operator could have seen flushed)
            step = (await folded_head(bus, store, job))[0].newest_s3
        rec = None if step is None else await store.record(job, step)
        if step is None or rec is None or rec.s3_removed:
            raise NoCheckpointError(f"job {job!r} has no step {step or ''} in object storage")
        ranks = await node_ranks(bus, job, [source], rec.world_size)
        if not ranks:
            raise ConfigError(
                f"node {source!r} has no events of job {job!r} at world size {rec.world_size}: "
                "name the node whose ranks to fetch (--node)"
            )
        fetched, present = [], []
        batches = Batcher(bus)
        tick = Ticker(progress)
        tick.more(len(ranks))
        with NvmeStore.from_settings(settings) as nvme:
            async with S3Store(settings) as s3:
                for rank in ranks:
                    tick()
                    found = await store.rank_digest(job, step, rank)
                    if found is None:
                        raise NoCheckpointError(f"rank {rank} of step {step} has no recorded copy")
                    digest, nbytes = found
                    path = nvme.path_for(shard_relpath(job, step, rank, rec.world_size))
                    if await anyio.to_thread.run_sync(_is_copy, nvme, path, digest, nbytes):
                        present.append(rank)
                        continue
                    where = s3.locate(job, step, rank, rec.world_size)
                    image = await s3.download(s3.key(job, step, rank, rec.world_size), nbytes)
                    try:  # (a wrong or stale object is refused before a byte is written)
                        check_header(image_head(image, where, nbytes), digest, where)
                        with memoryview(image) as view:
                            await anyio.to_thread.run_sync(_write, path, view)
                    finally:
                        image.close()
                    events = await anyio.to_thread.run_sync(nvme_events, nvme, path, job, here,
                                                            True)  # fmt: skip
                    for event in events:
                        await bus.publish(event)
                        batches.add(event)
                    fetched.append(rank)
                    log.info("shard_prefetched", job=job, step=step, rank=rank, path=str(path))
        await batches.flush()
        tick.done()
    return Prefetched(step, fetched, present)


def _is_copy(nvme: NvmeStore, path: Path, digest: str, nbytes: int) -> bool:
    """Whether `path` holds the recorded copy (every digest checked).

    Raises:
        ResourceExhaustedError: this process ran short checking it (no verdict on the copy).
    """
    if not path.exists():
        return False
    try:
        nvme.verify_file(path, header_digest=digest, nbytes=nbytes)
    except ResourceExhaustedError:
        raise
    except Exception:
        return False
    return True


def _write(path: Path, image: memoryview) -> None:
    """`image` into `path`, atomically and durably (a temp file, fsync, rename, fsync dir)."""
    makedirs_durable(path.parent)
    tmp = temp_path(path, "prefetch")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = image
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        unlink_quietly(tmp)
