"""Rebuild a job's events from the shards themselves, when the stream lost them.

The stream is an index, not the only truth (JetStream can lose acknowledged writes under some
faults, and a purge loses everything). Every shard file carries its identity and digests in its
header, and every uploaded object its size, checksum and header digest, so `tierpipe reindex`
republishes `written` + `verified` for the shards on this node's NVMe (re-reading each to verify
it, unless told not to) and `flushed` for the job's objects under the prefix (listed under each
of its 256 hash prefixes; a key whose hash does not match its job and rank is skipped).
Republishing is idempotent: message ids dedupe within the window, and folding an event twice
changes nothing.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from tierpipe.batcher import Batcher
from tierpipe.bus import Bus
from tierpipe.errors import TierpipeError
from tierpipe.names import node_name, shard_relpath, validate_token
from tierpipe.schemas import TOKEN_PATTERN, ShardFlushed, ShardVerified, ShardWritten, shard_event
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3 import S3Store

__all__ = ("Reindexed", "reindex")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Reindexed:
    nvme: int
    s3: int
    skipped: list[str]


async def reindex(
    settings: Settings, job: str, *, verify: bool = True, s3: bool = True
) -> Reindexed:
    """Republish the events of `job` from the shard files on this node's NVMe and the objects
    under the object-storage prefix. Bad or foreign files are skipped and listed."""
    validate_token("job", job)
    node = node_name(settings.node)
    suffix = f"/reindex/{time.time_ns()}"
    skipped: list[str] = []
    nvme_count = s3_count = 0
    async with Bus(settings, name=f"tierpipe-reindex-{node}") as bus:
        await bus.ensure_stream(update=False)
        batches = Batcher(bus, id_suffix=suffix)  # (what the job's coordinator reads)
        with NvmeStore.from_settings(settings) as store:
            for path in sorted((store.root / job).glob("step-*/rank-*.shard")):
                try:
                    events = await anyio.to_thread.run_sync(
                        _nvme_events, store, path, job, node, verify
                    )
                except (TierpipeError, OSError) as e:
                    skipped.append(f"{path}: {e}")
                    continue
                for event in events:
                    await bus.publish(event, id_suffix=suffix)
                    batches.add(event)
                nvme_count += 1
            await batches.flush()
        if s3:
            async with S3Store(settings) as objects:
                for key, size in await objects.list_job(job):
                    flushed = await _s3_event(objects, key, size, job, node)
                    if flushed is None:
                        skipped.append(f"s3://{objects.bucket}/{key}: not a shard of {job}")
                        continue
                    await bus.publish(flushed, id_suffix=suffix)
                    batches.add(flushed)
                    s3_count += 1
                await batches.flush()
    log.info("reindexed", job=job, nvme=nvme_count, s3=s3_count, skipped=len(skipped))
    return Reindexed(nvme_count, s3_count, skipped)


def _nvme_events(
    store: NvmeStore, path: Path, job: str, node: str, verify: bool
) -> list[ShardWritten | ShardVerified]:
    head = read_head(path)
    h = head.header
    if h.job != job or path != store.path_for(shard_relpath(h.job, h.step, h.rank, h.world_size)):
        raise TierpipeError(f"header says job {h.job!r} step {h.step} rank {h.rank}")
    digest = head.header_digest.hex()
    where = {"path": str(path), "nbytes": head.file_nbytes, "header_digest": digest}
    written = shard_event(ShardWritten, h, node=node, tensors=len(h.tensors), seconds=0.0, **where)
    if not verify:
        return [written]
    done = store.verify_file(path, header_digest=digest, nbytes=head.file_nbytes)
    return [
        written,
        shard_event(ShardVerified, h, node=node, seconds=round(done.seconds, 6), **where),
    ]


async def _s3_event(
    objects: S3Store, key: str, size: int, job: str, node: str
) -> ShardFlushed | None:
    shard = objects.shard_of(key)  # None for a key whose hash does not match its job and rank
    if shard is None or shard.job != job:
        return None
    _, step, rank, world = shard
    head = await objects.head(key)
    meta = (head or {}).get("Metadata", {})
    digest = meta.get("tp-header-digest", "")
    if head is None or not re.fullmatch(r"[0-9a-f]{32}", digest):
        return None
    # The node that uploaded it stays its owner (only it removes it); its save's epoch too.
    uploader = meta.get("tp-node", "")
    epoch = meta.get("tp-epoch", "0")
    return ShardFlushed(
        job=job,
        node=uploader if re.fullmatch(TOKEN_PATTERN, uploader) else node,
        epoch=int(epoch) if epoch.isdigit() else 0,
        ts=time.time(),
        step=step,
        rank=rank,
        world_size=world,
        bucket=objects.bucket,
        key=key,
        etag=head.get("ETag", "").strip('"'),
        checksum=head.get("ChecksumCRC32C", ""),
        header_digest=digest,
        nbytes=size,
        seconds=0.0,
        origin="reindex",
    )
