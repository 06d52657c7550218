"""A shard read back from a peer during a restore: the restore's third source, after this node's
NVMe and before object storage where a plan says so.

The copy to read is a replica on another node (or that node's own copy: the endpoint serves
either). Its holders are the node the plan names, then the nodes whose `replicated` events of
this rank (`tp.<job>.replicated.*.<rank>`) name that very save (same header digest), newest
first; each holder's endpoint is the `peer_url` of its live node record. The file is fetched
with `part_concurrency` ranged GETs of `part_size_bytes` into one page-aligned buffer, the same
memory an object-storage read fills, and handed to the restore's sink from there
(`reader.deliver_image`): its identity and header digest are checked before any byte reaches a
target, and every blob's digest before its bytes do. A holder that does not answer, or no
longer has the save, is skipped for the next one; a copy that fails a check is evidence and
raises.
"""

from __future__ import annotations

import mmap
import time

import anyio
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.advert import read_node
from tierpipe.errors import (
    PeerUnavailableError,
    ShardMissingError,
    TierpipeError,
)
from tierpipe.names import shard_subject
from tierpipe.peer.client import PeerClient, shard_url
from tierpipe.schemas import ShardReplicated, SourceRef
from tierpipe.settings import Settings
from tierpipe.storage.aligned import aligned_buffer, close_quietly
from tierpipe.storage.reader import deliver_image, image_head
from tierpipe.storage.resources import translated
from tierpipe.storage.store import BlobSink, ReadBack

__all__ = ("PeerSource", "holders")

log = structlog.get_logger(__name__)


async def holders(bus: Bus, job: str, step: int, rank: int, header_digest: str) -> list[str]:
    """The nodes that said they hold a replica of this save of the shard, newest first."""
    found: list[str] = []
    for e in reversed(await bus.history(shard_subject(job, "replicated", "*", rank))):
        if (
            isinstance(e, ShardReplicated)
            and e.step == step
            and e.header_digest == header_digest
            and e.node not in found
        ):
            found.append(e.node)
    return found


class PeerSource:
    """One rank's shard of one step on the peer tier (what `Loader.load` reads a peer source
    with: `read_into`, as a store's)."""

    def __init__(
        self,
        settings: Settings,
        bus: Bus,
        client: PeerClient,
        source: SourceRef,
        *,
        job: str,
        step: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.settings, self.bus, self.client, self.source = settings, bus, client, source
        self.job, self.step, self.rank, self.world_size = job, step, rank, world_size

    async def read_into(self, location: str, sink: BlobSink, *, nbytes: int) -> ReadBack:
        """Fetch the copy from its first holder that has it and hand it to `sink` from memory;
        the image comes back with the result (the sink may hold views of it).

        Raises:
            ShardMissingError: no holder has it (or none is known).
            PeerUnavailableError: no holder that has it answered.
            IntegrityError, ShardFormatError: the copy fetched is not the shard, or is corrupt.
        """
        t0 = time.perf_counter()
        digest = self.source.header_digest
        named = [self.source.node] if self.source.node else []
        found = await holders(self.bus, self.job, self.step, self.rank, digest)
        problem: TierpipeError = ShardMissingError(location, "no node holds a replica of it")
        for node in dict.fromkeys(named + found):
            state = await read_node(self.bus, self.settings, node)
            record = state.record
            if record is None or not record.peer_url or state.absent():
                problem = PeerUnavailableError(node, "no live agent with a peer endpoint there")
                continue
            url = shard_url(record.peer_url, self.job, self.step, self.world_size, self.rank,
                            header_digest=digest)  # fmt: skip
            try:
                image = await self._fetch(url, nbytes)
            except (PeerUnavailableError, ShardMissingError) as e:
                log.warning("peer_copy_skipped", holder=node, error=str(e))
                problem = e
                continue
            try:
                head = image_head(image, url, nbytes)
                with translated(url):
                    await anyio.to_thread.run_sync(deliver_image, image, head, url, sink)
            except BaseException:
                close_quietly(image)
                raise
            log.info("peer_copy_read", holder=node, nbytes=nbytes,
                     seconds=round(time.perf_counter() - t0, 6))  # fmt: skip
            return ReadBack(head, time.perf_counter() - t0, image)
        raise problem

    async def _fetch(self, url: str, nbytes: int) -> mmap.mmap:
        """The `nbytes` at `url`, by concurrent ranged GETs into a page-aligned buffer."""
        image = aligned_buffer(nbytes)
        part = self.settings.part_size_bytes
        lanes = anyio.Semaphore(max(1, self.settings.part_concurrency))

        async def one(start: int) -> None:
            async with lanes:
                end = min(nbytes, start + part)
                with memoryview(image) as view:
                    await self.client.read_range(url, start, view[start:end])

        try:
            async with anyio.create_task_group() as tg:
                for start in range(0, nbytes, part):
                    tg.start_soon(one, start)
        except BaseExceptionGroup as group:
            close_quietly(image)
            raise group.exceptions[0] from group
        except BaseException:
            close_quietly(image)
            raise
        return image
