"""Ranged reads of saved shards, every block checked before its bytes are used.

A resharded restore reads parts of other ranks' shards. `read_parts` reads one saved rank's
head (prefix and header: its identity and header digest checked against the job state's
record, `check_head`), then the whole blocks the caller asks for (`layout.Span`s, which it
works out from that header), each block's xxh3-64 compared with the header's
`BlobEntry.blocks` before the bytes reach the caller (`take`). A blob without block digests (a
plain tensor read as the whole of a DTensor) is read whole and checked by its xxh3-128. A
copy's spans are read `DEPTH` at once, each into a reused buffer (`tierpipe.reshard.buffers`),
and checked and taken in worker threads, so the reads go on while a span is checked and copied;
a span reaches `take` whole and checked, or not at all.

Copies are tried best first: this node's NVMe file (pread, O_DIRECT where the filesystem has
it), then a peer's endpoint (ranged GETs: the node that saved the shard serves its own copy,
partners their replicas), then object storage (ranged GETs). A copy that is missing,
unreachable or proven bad (a digest, a garbled head) is dropped for the spans still to read,
which the next copy serves; spans already taken are not read again (their bytes were checked).
A copy that is unavailable (an outage) is tried again after the others, up to `OUTAGE_TRIES`
times, with a growing wait between rounds.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog
import xxhash

from tierpipe.bus.client import Bus
from tierpipe.control.advert import read_node
from tierpipe.errors import (
    EVIDENCE_ERRORS,
    ConfigError,
    IntegrityError,
    PeerUnavailableError,
    ShardFormatError,
    ShardMissingError,
    TierpipeError,
    UnavailableError,
)
from tierpipe.peer.client import PeerClient, shard_url
from tierpipe.recovery.load import Expected, check_head
from tierpipe.reshard.buffers import Budget, ReadBuffer, first_error
from tierpipe.reshard.copies import File, Object, Peer, Ranged
from tierpipe.reshard.layout import Span
from tierpipe.schemas import ALIGN, BLOCK_BYTES, BLOCK_DIGEST_BYTES, BlobEntry, SourceRef
from tierpipe.settings import Settings
from tierpipe.storage.aligned import aligned_buffer, close_quietly, open_direct
from tierpipe.storage.aligned import round_up as align_up
from tierpipe.storage.resources import translated
from tierpipe.storage.shard import PREFIX_NBYTES, Head, parse_head, parse_prefix

if TYPE_CHECKING:
    from tierpipe.storage.s3.store import S3Store

__all__ = ("DEPTH", "OUTAGE_TRIES", "Origin", "Tiers", "read_parts", "verify_span")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Origin:
    """One saved rank's shard of a step: what it must be and where its copies are, best first."""

    expected: Expected
    nbytes: int
    copies: list[SourceRef]


@dataclass(slots=True)
class Tally:
    """Bytes read per tier (heads and blocks), the headers read, and the copies that failed:
    (saved rank, the copy, why)."""

    nbytes: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[int, SourceRef, TierpipeError]] = field(default_factory=list)
    #: Shard headers read (a copy's head each: what planning from a layout spares).
    heads: int = 0

    def add(self, tier: str, n: int) -> None:
        self.nbytes[tier] = self.nbytes.get(tier, 0) + n


#: Tries of one copy during an outage (its store or peer down, or hung) before it is given up
#: (as `tierpipe.recovery.load`'s restore tries a source).
OUTAGE_TRIES = 3
#: Spans of one copy read at once (while one is checked and taken, the next are read).
DEPTH = 2

#: What a reader hands on: a span once its blocks were checked, and its bytes.
Take = Callable[[Head, Span, memoryview], None]


async def read_parts(
    tiers: Tiers,
    origin: Origin,
    need: Callable[[Head], Sequence[Span]],
    take: Take,
    tally: Tally,
    *,
    budget: Budget | None = None,
    depth: int = DEPTH,
) -> Head:
    """Read the spans `need` names (from the header) of `origin`'s shard from its first good
    copies, each span handed to `take` once its blocks were checked (in a worker thread).

    Up to `depth` spans of a copy are read at once, each reader's buffer reused for its next
    span (`budget`: shared by the readers of one restore, see `tierpipe.reshard.buffers`):
    while a span is checked and taken, the next ones are read.

    Returns:
        The header (of the last copy read).

    Raises:
        ShardMissingError: no copy was left for some span (the message names why each failed).
    """
    left: list[Span] | None = None
    problems: list[str] = []
    head: Head | None = None
    budget = Budget() if budget is None else budget
    tries = dict.fromkeys(range(len(origin.copies)), 0)
    delay = tiers.settings.retry_base_s
    while tries:
        for i in list(tries):
            copy = origin.copies[i]
            tries[i] += 1
            try:
                async with tiers.open(copy, origin) as ranged:
                    head = await _head(ranged, copy.location, origin)
                    tally.add(copy.tier, head.data_offset)
                    tally.heads += 1
                    if left is None:
                        left = list(need(head))
                    await _spans(ranged, head, left, copy, take, tally, budget, depth)
                return head
            except ConfigError:  # (the plan does not fit the shard: no other copy would)
                raise
            except TierpipeError as e:
                outage = isinstance(e, UnavailableError) and tries[i] < OUTAGE_TRIES
                evidence = type(e).__name__ in EVIDENCE_ERRORS
                log.warning("reshard_source_failed", rank=origin.expected.rank,
                            step=origin.expected.step, tier=copy.tier, node=copy.node,
                            location=copy.location, error=str(e), corrupt=evidence,
                            again=outage)  # fmt: skip
                if outage:  # (tried again after the other copies, as the normal restore does)
                    continue
                del tries[i]
                tally.failed.append((origin.expected.rank, copy, e))
                problems.append(f"{copy.tier}: {type(e).__name__}")
        if tries:
            await anyio.sleep(delay)
            delay = min(delay * 2, tiers.settings.retry_max_s)
    where = f"rank {origin.expected.rank} of step {origin.expected.step}"
    raise ShardMissingError(where, "no good copy left (" + (", ".join(problems) or "none") + ")")


async def _spans(
    ranged: Ranged,
    head: Head,
    left: list[Span],
    copy: SourceRef,
    take: Take,
    tally: Tally,
    budget: Budget,
    depth: int,
) -> None:
    """Read the spans in `left` from one copy, `depth` readers at once, each span dropped
    from `left` once taken (what is left when this raises, the next copy reads)."""
    todo = list(left)

    async def reader() -> None:
        buf = ReadBuffer(budget)
        try:
            while todo:
                span = todo.pop(0)
                await _span(ranged, head, span, copy, take, tally, buf)
                left.remove(span)  # (taken: no other copy reads it again)
        finally:
            buf.close()

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(max(1, depth), len(todo))):
                tg.start_soon(reader)
    except BaseExceptionGroup as group:
        raise first_error(group) from group


async def _head(ranged: Ranged, location: str, origin: Origin) -> Head:
    """Read and check a copy's head (its identity and header digest: `origin.expected`)."""
    first = await _bytes(ranged, 0, min(ALIGN, origin.nbytes))
    need = PREFIX_NBYTES + parse_prefix(first, location)[0]
    if need > len(first):
        if need > origin.nbytes:
            raise ShardFormatError(location, f"header of {need} bytes in a {origin.nbytes} file")
        first += await _bytes(ranged, len(first), need - len(first))
    head = parse_head(first[:need], location, actual_nbytes=origin.nbytes)
    check_head(head, origin.expected, location)
    return head


async def _bytes(ranged: Ranged, start: int, nbytes: int) -> bytes:
    buf = aligned_buffer(max(align_up(nbytes), ALIGN))
    try:
        await ranged.read(start, buf, nbytes)
        return buf[:nbytes]
    finally:
        close_quietly(buf)


async def _span(
    ranged: Ranged,
    head: Head,
    span: Span,
    copy: SourceRef,
    take: Take,
    tally: Tally,
    reader: ReadBuffer,
) -> None:
    """Read `span` into the reader's buffer, check its blocks and hand it to `take` (both in
    a worker thread)."""
    blob = _blob(head, span.blob, copy.location)
    if not blob.blocks:  # (no block digests: the blob is read whole, checked whole)
        span = Span(span.blob, 0, -(-blob.nbytes // BLOCK_BYTES))
    start, stop = span.byte_range(blob.nbytes)
    at = head.data_offset + blob.offset + start
    t0 = time.perf_counter()
    buf = await reader.fit(max(align_up(stop - start), ALIGN))
    t1 = time.perf_counter()
    await ranged.read(at, buf, stop - start)
    t2 = time.perf_counter()
    tally.add(copy.tier, stop - start)
    with translated(copy.location), memoryview(buf) as view, view[: stop - start] as data:
        await anyio.to_thread.run_sync(_check_then_take, head, span, data, copy, take)
    log.debug("reshard_span_read", rank=head.header.rank, blob=span.blob, tier=copy.tier,
              nbytes=stop - start, wait_s=round(t1 - t0, 4), read_s=round(t2 - t1, 4),
              check_take_s=round(time.perf_counter() - t2, 4))  # fmt: skip


def _check_then_take(head: Head, span: Span, data: memoryview, copy: SourceRef, take: Take) -> None:
    verify_span(head, span, data, copy.location)
    take(head, span, data)


def _blob(head: Head, index: int, location: str) -> BlobEntry:
    blobs = head.header.blobs
    if not 0 <= index < len(blobs):
        raise ShardFormatError(location, f"no blob {index} (the plan needs it)")
    return blobs[index]


def verify_span(head: Head, span: Span, data: memoryview, location: str) -> None:
    """Check the bytes of `span` against the blob's block digests (or, for a blob without
    them, read whole, its digest).

    Raises:
        IntegrityError: a block (or the blob) does not match (names the block).
        ShardFormatError: the header's block digests do not fit the blob.
    """
    blob = _blob(head, span.blob, location)
    name = _tensor_name(head, span.blob)
    if not blob.blocks:
        actual = xxhash.xxh3_128_digest(data)
        if actual != blob.digest:
            raise IntegrityError(location, name, blob.digest.hex(), actual.hex())
        return
    count = -(-blob.nbytes // BLOCK_BYTES)
    if len(blob.blocks) != count * BLOCK_DIGEST_BYTES:
        raise ShardFormatError(location, f"{name}: {len(blob.blocks)} bytes of block digests "
                                         f"for {count} blocks")  # fmt: skip
    for k in range(span.first, span.stop):
        piece = data[(k - span.first) * BLOCK_BYTES : (k - span.first + 1) * BLOCK_BYTES]
        actual = xxhash.xxh3_64_digest(piece)
        expected = blob.blocks[k * BLOCK_DIGEST_BYTES : (k + 1) * BLOCK_DIGEST_BYTES]
        if actual != expected:
            raise IntegrityError(location, f"{name} block {k}", expected.hex(), actual.hex())


def _tensor_name(head: Head, blob: int) -> str:
    return next(
        ("tensor " + "/".join(map(str, e.path)) for e in head.header.tensors if e.blob == blob),
        f"blob {blob}",
    )


class Tiers:
    """Opens copies for ranged reads: this node's NVMe files, peers' endpoints (by their node
    records, or `endpoints`: node -> URL), object storage (one client, opened on first use).
    An async context manager."""

    def __init__(
        self,
        settings: Settings,
        bus: Bus | None,
        *,
        node: str,
        endpoints: dict[str, str] | None = None,
    ) -> None:
        self.settings, self.bus, self.node = settings, bus, node
        self._stack = contextlib.AsyncExitStack()
        self._peers: PeerClient | None = None
        self._s3: S3Store | None = None
        self._urls: dict[str, str] = dict(endpoints or {})

    async def __aenter__(self) -> Tiers:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
        self._peers = self._s3 = None

    @contextlib.asynccontextmanager
    async def open(self, copy: SourceRef, origin: Origin) -> AsyncIterator[Ranged]:
        """`copy` open for ranged reads (a file descriptor is closed on the way out).

        Raises:
            ShardMissingError: an NVMe copy on another node, or not there; no endpoint.
            PeerUnavailableError: the holder's node has no live agent with an endpoint.
        """
        if copy.tier == "nvme":
            if copy.node != self.node:
                raise ShardMissingError(copy.location, f"on node {copy.node}, not {self.node}")
            try:
                with translated(copy.location):
                    fd = open_direct(copy.location, os.O_RDONLY | os.O_CLOEXEC,
                                     direct=self.settings.direct_io)  # fmt: skip
            except FileNotFoundError as e:
                raise ShardMissingError(copy.location, "file is missing") from e
            try:
                yield File(fd, copy.location)
            finally:
                os.close(fd)
        elif copy.tier == "peer":
            yield Peer(await self._peer_client(), await self._url(copy, origin))
        else:
            yield Object(await self._object_store(), copy.location)

    async def _url(self, copy: SourceRef, origin: Origin) -> str:
        if copy.node not in self._urls:
            if self.bus is None:
                raise PeerUnavailableError(copy.node, "no bus to find its endpoint")
            state = await read_node(self.bus, self.settings, copy.node)
            record = state.record
            if record is None or not record.peer_url or state.absent():
                raise PeerUnavailableError(copy.node, "no live agent with a peer endpoint there")
            self._urls[copy.node] = record.peer_url
        e = origin.expected
        return shard_url(self._urls[copy.node], e.job, e.step, e.world_size, e.rank,
                         header_digest=e.header_digest)  # fmt: skip

    async def _peer_client(self) -> PeerClient:
        if self._peers is None:
            client = PeerClient(token=self.settings.peer_token)
            self._peers = await self._stack.enter_async_context(client)
        return self._peers

    async def _object_store(self) -> S3Store:
        if self._s3 is None:
            from tierpipe.storage.s3.store import S3Store  # (boto: only once a read needs it)

            self._s3 = await self._stack.enter_async_context(S3Store(self.settings))
        return self._s3
