"""Rebuild a job's events, and its job state, from the shards themselves, when they are lost.

The stream is an index, not the only truth (JetStream can lose acknowledged writes under some
faults, and a purge loses everything), and so is the job state in KV. Every shard file carries
its identity and digests in its header, every uploaded object its size, checksum and header
digest, and every step complete in object storage a COMMIT manifest (`s3_commit`). So
`tierpipe reindex`:
- republishes `written` + `verified` for the shards on this node's NVMe (re-reading each to
  verify it, unless told not to), naming each sharded save's global layout, stored first;
- reads the job's COMMIT manifests (one listing) and republishes `flushed` for each object a
  manifest names, once a HEAD shows it there with the manifest's size and header digest (no
  download), with the layout the manifest carries (stored first); a rank that fails the check
  is skipped and listed;
- republishes `flushed` for the job's other objects (steps without a COMMIT), found by listing
  each of its 256 hash prefixes (a key whose hash does not match its job and rank is skipped);
- when the KV has no state of the job (lost, or never written), folds what it republished into
  one (`JobState`, the coordinator's fold: records with their bitmaps, rank digests, head) and
  stores it under the job's lease, so a restart finds the job without any coordinator running.
  That fold keeps every step: retention stays the coordinator's, which resumes from the
  republished events and applies the job's policy.
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
import xxhash

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import TierpipeError
from tierpipe.names import node_name, shard_relpath, validate_token
from tierpipe.progress import Progress, Ticker
from tierpipe.reshard.steplayout import layout_of, store_layout
from tierpipe.schemas import (
    TOKEN_PATTERN,
    Event,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    shard_event,
)
from tierpipe.schemas.commit import CommitManifest
from tierpipe.schemas.jobstate import Keep
from tierpipe.schemas.layout import encode_layout
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3.client import ObjectHead
from tierpipe.storage.s3.commit import check_objects, read_commits
from tierpipe.storage.s3.keys import ShardKey
from tierpipe.storage.s3.store import S3Store

__all__ = ("Reindexed", "nvme_events", "reindex")

log = structlog.get_logger(__name__)

#: The policy of reindex's own fold: no step goes (the coordinator applies the job's own).
_KEEP_ALL = Keep(nvme_keep_latest_k=2**31, s3_keep_latest_k=2**31)


@dataclass(frozen=True, slots=True)
class Reindexed:
    nvme: int
    s3: int
    skipped: list[str]
    #: Steps whose objects a COMMIT manifest named (their `flushed` among `s3`).
    committed: list[int] | None = None
    #: The job state was rebuilt in KV from what was republished.
    rebuilt: bool = False


async def reindex(
    settings: Settings,
    job: str,
    *,
    verify: bool = True,
    s3: bool = True,
    progress: Progress | None = None,
) -> Reindexed:
    """Republish the events of `job` from the shard files on this node's NVMe, the job's
    COMMIT manifests and the objects under the object-storage prefix, and rebuild its job
    state if the KV has none. Bad or foreign files are skipped and listed.

    Args:
        progress: called with (files and objects done, known so far) as the work goes.
    """
    validate_token("job", job)
    node = node_name(settings.node)
    suffix = f"/reindex/{time.time_ns()}"
    skipped: list[str] = []
    committed: list[int] = []
    published: list[tuple[int, Event]] = []
    nvme_count = s3_count = 0
    async with Bus(settings, name=f"tierpipe-reindex-{node}") as bus:
        await bus.ensure_stream(job, update=False)
        batches = Batcher(bus, id_suffix=suffix)  # (what the job's coordinator reads)
        kv = await JobStore(bus.js, settings).open()
        lost = await kv.head(job) is None
        layouts: set[tuple[str, str]] = set()

        async def publish(event: Event) -> None:
            published.append(((await bus.publish(event, id_suffix=suffix)).seq, event))
            batches.add(event)

        tick = Ticker(progress)
        with NvmeStore.from_settings(settings) as store:
            paths = sorted((store.root / job).glob("step-*/rank-*.shard"))
            tick.more(len(paths))
            for path in paths:
                tick()
                found: dict[str, bytes] = {}
                try:
                    events = await anyio.to_thread.run_sync(
                        nvme_events, store, path, job, node, verify, found
                    )
                    for digest, data in found.items():  # (stored before an event names it)
                        if (job, digest) not in layouts:
                            await store_layout(kv, job, data, digest=digest)
                            layouts.add((job, digest))
                except (TierpipeError, OSError) as e:
                    skipped.append(f"{path}: {e}")
                    continue
                for event in events:
                    await publish(event)
                nvme_count += 1
            await batches.flush()
        if s3:
            async with S3Store(settings) as objects:
                done: set[str] = set()  # keys a manifest vouched for
                manifests = await read_commits(objects, job)
                tick.more(len(manifests))
                for manifest in manifests:
                    tick()
                    layout = await _manifest_layout(kv, manifest, skipped)
                    good, bad = await check_objects(objects, manifest)
                    for rank, head in sorted(good.items()):
                        shard = ShardKey(job, manifest.step, rank, manifest.world_size)
                        key = objects.key(*shard)
                        digest, size = manifest.of(rank) or ("", 0)
                        await publish(
                            _flushed(objects, key, shard, head, digest, size, node, layout)
                        )
                        done.add(key)
                    skipped += [f"step {manifest.step} rank {r}: {why}" for r, why in bad.items()]
                    committed.append(manifest.step)
                    s3_count += len(good)
                listed = [(k, n) for k, n in await objects.list_job(job) if k not in done]
                tick.more(len(listed))
                for key, size in listed:
                    tick()
                    flushed = await _s3_event(objects, key, size, job, node)
                    if flushed is None:
                        skipped.append(f"s3://{objects.bucket}/{key}: not a shard of {job}")
                        continue
                    await publish(flushed)
                    s3_count += 1
                await batches.flush()
        tick.done()
        rebuilt = lost and bool(published) and await _rebuild(kv, settings, job, node, published)
    log.info("reindexed", job=job, nvme=nvme_count, s3=s3_count, committed=len(committed),
             skipped=len(skipped), rebuilt=rebuilt)  # fmt: skip
    return Reindexed(nvme_count, s3_count, skipped, committed, rebuilt)


async def _rebuild(
    kv: JobStore, settings: Settings, job: str, node: str, published: list[tuple[int, Event]]
) -> bool:
    """Fold the republished events into the job's state and store it, under the job's lease;
    False if a coordinator holds the lease or stored a state meanwhile (it folds them itself)."""
    holder = f"reindex-{node}"
    lease = await kv.acquire(job, holder, settings.lease_ttl_s)
    if lease is None:
        log.info("job_state_not_rebuilt", job=job, reason="a coordinator holds the lease")
        return False
    try:
        if await kv.head(job) is not None:
            return False
        state = JobState(job, _KEEP_ALL)
        for seq, event in sorted(published, key=lambda p: p[0]):
            state.apply(seq, event)
        await kv.write(state, state.take_changes())
        await kv.register(job)  # (the coordinators follow it; its policy, if it had none)
    finally:
        await kv.release(job, lease)
    head = state.head()
    log.info("job_state_rebuilt", job=job, steps=len(head.steps), s3_steps=head.s3_steps,
             nvme_steps=head.nvme_steps, seq=head.seq)  # fmt: skip
    return True


def nvme_events(
    store: NvmeStore,
    path: Path,
    job: str,
    node: str,
    verify: bool,
    layouts: dict[str, bytes] | None = None,
) -> list[ShardWritten | ShardVerified]:
    """The `written` (and, with `verify`, `verified`) events of a shard file on this node's
    NVMe, from its header. `layouts`: the events name the save's global layout (a shard with
    sharded tensors), whose encoding is put there by its digest for the caller to store first.

    Raises:
        TierpipeError, OSError: the file is not a readable shard of `job` at its own path.
    """
    head = read_head(path)
    h = head.header
    if h.job != job or path != store.path_for(shard_relpath(h.job, h.step, h.rank, h.world_size)):
        raise TierpipeError(f"header says job {h.job!r} step {h.step} rank {h.rank}")
    digest = head.header_digest.hex()
    where: dict[str, object] = {
        "path": str(path), "nbytes": head.file_nbytes, "header_digest": digest,
    }  # fmt: skip
    if layouts is not None and h.sharded:
        data = encode_layout(layout_of(h))
        where["layout"] = layout = xxhash.xxh3_64_hexdigest(data)
        layouts[layout] = data
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
    head = await objects.head(key)
    if head is None:
        return None
    digest = head.get("Metadata", {}).get("tp-header-digest", "")
    if not re.fullmatch(r"[0-9a-f]{32}", digest):
        return None
    return _flushed(objects, key, shard, head, digest, size, node)


def _flushed(
    objects: S3Store,
    key: str,
    shard: ShardKey,
    head: ObjectHead,
    digest: str,
    size: int,
    node: str,
    layout: str = "",
) -> ShardFlushed:
    """The `flushed` event of an object, from its HEAD (`layout`: its COMMIT's, stored)."""
    meta = head.get("Metadata", {})
    # The node that uploaded it stays its owner (only it removes it); its save's epoch too.
    uploader = meta.get("tp-node", "")
    epoch = meta.get("tp-epoch", "0")
    return ShardFlushed(
        job=shard.job,
        node=uploader if re.fullmatch(TOKEN_PATTERN, uploader) else node,
        epoch=int(epoch) if epoch.isdigit() else 0,
        ts=time.time(),
        step=shard.step,
        rank=shard.rank,
        world_size=shard.world_size,
        bucket=objects.bucket,
        key=key,
        etag=head.get("ETag", "").strip('"'),
        checksum=head.get("ChecksumCRC32C", ""),
        header_digest=digest,
        nbytes=size,
        seconds=0.0,
        origin="reindex",
        layout=layout,
    )


async def _manifest_layout(kv: JobStore, manifest: CommitManifest, skipped: list[str]) -> str:
    """The layout a COMMIT manifest carries, stored in the job state ("" if none, or if its
    bytes are not the layout it names: listed as skipped)."""
    if not manifest.layout or not manifest.layout_data:
        return ""
    try:
        return await store_layout(kv, manifest.job, manifest.layout_data, digest=manifest.layout)
    except ValueError as e:
        skipped.append(f"step {manifest.step} layout: {e}")
        return ""
