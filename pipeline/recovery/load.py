"""Loading this rank's shard back, from any tier, verified before any byte reaches the model.

`Loader.load(source, into, step=...)` is the one entry for every tier: the tier's store
(`tierpipe.storage`) reads the copy into an `_read.Assembly`, which copies its blobs into the
targets. A copy on this node's NVMe is read in place at queue depth (as `load_into` does); a
copy in object storage is downloaded (parallel ranged GETs, capped per node) and read from
memory (as `load_image`), and so is a replica on a peer node (`tierpipe.peer.reader`). Either
way the shard's identity and header digest are checked against the plan first (`Expected`),
and each blob's digest before its bytes reach a target. A shard read from object storage or a
peer is staged again once the restore is over (`Loader.settle`), so this node's agent writes
it back to its NVMe.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    EVIDENCE_ERRORS,
    IntegrityError,
    ResourceExhaustedError,
    ShardMissingError,
    SourceUnreachableError,
    StorageAuthError,
    TierpipeError,
    UnavailableError,
)
from tierpipe.peer.client import PeerClient
from tierpipe.peer.reader import PeerSource
from tierpipe.recovery._read import Assembly
from tierpipe.recovery._short import short_report
from tierpipe.recovery._writeback import write_back
from tierpipe.recovery.plan import Source
from tierpipe.schemas import ShardHeader, StageFailed, Tier
from tierpipe.settings import Settings
from tierpipe.state import gc_paused
from tierpipe.storage.aligned import close_quietly
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import deliver_image, read_shard
from tierpipe.storage.shard import Head
from tierpipe.storage.staging import NodeSlots, SlotPool
from tierpipe.storage.store import SealedFile, ShardStore, StagedShard

if TYPE_CHECKING:
    from tierpipe.storage.s3.store import S3Store

__all__ = (
    "Expected",
    "Loaded",
    "Loader",
    "check_head",
    "load_image",
    "load_into",
    "load_shard",
    "s3_reads_per_node",
)

log = structlog.get_logger(__name__)

#: Tries of one source during an outage (the store down or hung) before this restore skips it.
_OUTAGE_TRIES = 3


class Loader:
    """Loads one rank's shards from the sources a plan names, NVMe or object storage.

    One per `Checkpointer`: it keeps the object-storage client (opened on first use) and the
    write-backs of shards read from there. `aclose()` waits for those, then closes the client.
    """

    def __init__(
        self,
        settings: Settings,
        bus: Bus,
        pool: SlotPool,
        *,
        job: str,
        rank: int,
        world_size: int,
        node: str,
    ) -> None:
        self.settings, self.bus = settings, bus
        self.job, self.rank, self.world_size, self.node = job, rank, world_size, node
        self._pool = pool
        self._stack = contextlib.AsyncExitStack()
        self._nvme = NvmeStore.from_settings(settings)
        self._store: S3Store | None = None
        self._peers: PeerClient | None = None
        #: The last shard read from object storage (step, sealed image, head), until `settle`.
        self._held: tuple[int, mmap.mmap, Head] | None = None
        #: Write-backs under way. Plain asyncio tasks: each outlives the restore that started
        #: it (the bus thread's loop runs one call at a time), and `written_back()` awaits them.
        self._writebacks: set[asyncio.Task[None]] = set()

    @property
    def nvme(self) -> NvmeStore:
        """This node's NVMe store (where its copies are: `locate`)."""
        return self._nvme

    async def load(self, source: Source, into: Any, *, step: int) -> Loaded:
        """This rank's shard of `step` from `source`, checked against the plan's identity and
        header digest before any byte reaches `into` (targets, as for `load_into`).

        Raises:
            ShardMissingError: the copy is not there (or not reachable from this node).
            IntegrityError, ShardFormatError: the copy is not the shard planned, or is corrupt.
            StorageUnavailableError, StorageAuthError: object storage is down or refused.
        """
        expected = Expected(self.job, step, self.rank, self.world_size, source.header_digest)
        store: ShardStore[StagedShard] | ShardStore[SealedFile] | PeerSource
        if source.tier == "nvme":
            if source.node != self.node:
                raise ShardMissingError(source.location, f"on node {source.node}, not {self.node}")
            store = self._nvme
        elif source.tier == "peer":  # (read whole into memory, as from object storage)
            store = PeerSource(self.settings, self.bus, await self._peer_client(), source,
                               job=self.job, step=step, rank=self.rank,
                               world_size=self.world_size)  # fmt: skip
        else:
            store = await self._object_store()
        sink = _sink(into, expected)
        with gc_paused():
            got = await store.read_into(source.location, sink, nbytes=source.nbytes)
        if got.image is not None:  # read whole (object storage, a peer): kept for `settle`
            self._hold((step, got.image, got.head))
        return _loaded(got.head, sink, got.seconds)

    async def first_good(
        self, sources: list[Source], into: Any, *, step: int, attempt: int, deadline: float
    ) -> tuple[Source, Loaded] | str:
        """This rank's shard of `step` from its first good source, or why there was none (for
        its `failed` report). `deadline` is the restore's (`time.monotonic()`); `attempt` its
        round.

        Only evidence (a digest or identity mismatch, a garbled file) is reported as a bad copy
        (`failed`, not retryable); a copy that is unreachable (an outage, retried a few times
        first), refused (credentials) or missing is skipped for this restore only (`failed`,
        retryable), so the next restore tries it again. This process running out of a resource
        (memory, mappings, file descriptors, threads) is no verdict on any copy either: it is
        reported the same way, and ends this rank's attempt at once (every other source and step
        would need the same), and rank 0 stops the restore (`_short`).
        """
        problems = []
        for source in sources:
            try:
                return source, await self._load_retrying(source, into, step, deadline)
            except ResourceExhaustedError as e:
                log.warning("restore_source_failed", **_where(source, step), error=str(e),
                            corrupt=False)  # fmt: skip
                await self.report(source.tier, step, e, attempt=attempt, node=_holder(source))
                return short_report(e)
            except TierpipeError as e:
                evidence = type(e).__name__ in EVIDENCE_ERRORS
                message = str(e)
                if isinstance(e, StorageAuthError):
                    message += (
                        " (the trainer's own S3 credentials are used for restores: set "
                        "s3_access_key_id / s3_secret_access_key, or TIERPIPE_S3_*, for trainers)"
                    )
                log.warning(
                    "restore_source_failed", **_where(source, step), error=message, corrupt=evidence
                )
                problems.append(f"{source.tier}: {type(e).__name__}")
                await self.report(source.tier, step, e, message=message, attempt=attempt,
                                  node=_holder(source))  # fmt: skip
        return "no good copy left (" + (", ".join(problems) or "no sources") + ")"

    async def report(
        self,
        tier: Tier,
        step: int,
        e: TierpipeError,
        *,
        message: str = "",
        attempt: int = 1,
        rank: int | None = None,
        node: str | None = None,
    ) -> None:
        """Publish that this rank's copy of `step` on `tier` failed with `e` (a bad copy, if
        `e` is evidence, so the job state stops counting it; else skipped this time only).
        `rank`: another rank of this node (its local leader checked the copy); `node`: the
        node holding the copy, where it is not this one (a peer's replica: its holder)."""
        await self.bus.publish(
            StageFailed(
                job=self.job,
                node=node or self.node,
                ts=time.time(),
                stage="restore",
                error=type(e).__name__,
                message=message or str(e),
                retryable=type(e).__name__ not in EVIDENCE_ERRORS,
                attempt=attempt,
                step=step,
                rank=self.rank if rank is None else rank,
                world_size=self.world_size,
                tier=tier,
            )
        )

    async def _load_retrying(self, source: Source, into: Any, step: int, deadline: float) -> Loaded:
        """Load `source`, retrying an outage a few times while the restore's deadline allows
        (leaving the other ranks time to hear from this one)."""
        delay = self.settings.retry_base_s
        margin = min(30.0, self.settings.restore_timeout_s / 4)
        for tries in itertools.count(1):
            left = deadline - margin - time.monotonic()
            try:
                with anyio.fail_after(max(left, 1.0)):
                    return await self.load(source, into, step=step)
            except TimeoutError as e:
                if isinstance(e, TierpipeError):
                    raise
                raise SourceUnreachableError(source.location) from e
            except UnavailableError as e:
                if tries >= _OUTAGE_TRIES or delay > deadline - margin - time.monotonic():
                    raise
                log.warning(
                    "restore_source_unavailable", **_where(source, step), attempt=tries,
                    retry_in_s=delay, error=str(e),
                )  # fmt: skip
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
        raise AssertionError("unreachable")

    def settle(self, step: int | None) -> None:
        """The restore is over, having restored `step` (None: it failed). A shard of `step`
        this loader read from object storage is staged again in the background, so this node's
        agent writes it to NVMe; any other image it still holds is dropped."""
        held, self._held = self._held, None
        if held is None:
            return
        if held[0] != step:
            close_quietly(held[1])
            return
        _, image, head = held
        task = asyncio.get_running_loop().create_task(
            write_back(self.settings, self.bus, self._pool, image, head, node=self.node)
        )
        self._writebacks.add(task)
        task.add_done_callback(self._writebacks.discard)

    async def written_back(self) -> None:
        """Wait for the write-backs started so far (they log their own failures)."""
        await asyncio.gather(*self._writebacks)

    async def aclose(self) -> None:
        """Wait for the write-backs, drop a held image and close the object-storage client
        (idempotent)."""
        await self.written_back()
        self._hold(None)
        self._store = self._peers = None
        await self._stack.aclose()
        self._nvme.close()

    async def _object_store(self) -> S3Store:
        if self._store is None:
            from tierpipe.storage.s3.store import S3Store

            s = self.settings
            cap = await s3_reads_per_node(s, self.bus, self.job)
            reads = NodeSlots(s.staging_root, "s3-reads", cap)
            store = S3Store(s, read_slot=reads.hold)
            self._store = await self._stack.enter_async_context(store)
        return self._store

    async def _peer_client(self) -> PeerClient:
        if self._peers is None:
            client = PeerClient(token=self.settings.peer_token)
            self._peers = await self._stack.enter_async_context(client)
        return self._peers

    def _hold(self, held: tuple[int, mmap.mmap, Head] | None) -> None:
        """Keep `held` for `settle` (an image of an earlier round is closed)."""
        if self._held is not None:
            close_quietly(self._held[1])
        self._held = held


async def s3_reads_per_node(settings: Settings, bus: Bus, job: str) -> int:
    """Concurrent object GETs a node's ranks may hold while restoring `job`:
    `restore_s3_reads_per_node`, or the node's share of the job's GET budget if lower (one KV
    read; unreadable: the node's own cap alone)."""
    cap = settings.restore_s3_reads_per_node
    try:
        shares = await JobStore(bus.js, settings).bind().shares(job)
    except TierpipeError as e:
        log.warning("restore_shares_unread", job=job, error=str(e))
        return cap
    if shares.restore_gets_per_node:
        cap = min(cap, shares.restore_gets_per_node)
    return cap


@dataclass(frozen=True, slots=True)
class Loaded:
    """A shard read back: its header, the rebuilt state, and how it went."""

    header: ShardHeader
    state: Any
    nbytes: int
    seconds: float
    #: How many tensors were written in place into the caller's targets.
    in_place: int


@dataclass(frozen=True, slots=True)
class Expected:
    """What the catalog says a copy holds: checked against the shard's own header before any
    byte reaches a target, so a stale, misplaced or swapped file never loads as this shard."""

    job: str
    step: int
    rank: int
    world_size: int
    #: The header digest recorded when the copy was written (hex).
    header_digest: str


def check_head(head: Head, expected: Expected | None, path: str) -> None:
    """Refuse a shard whose identity or header digest is not the one expected.

    Raises:
        IntegrityError: names what was expected and what the file holds.
    """
    if expected is None:
        return
    h = head.header
    want = (expected.job, expected.step, expected.rank, expected.world_size)
    got = (h.job, h.step, h.rank, h.world_size)
    if got != want:
        raise IntegrityError(
            path, "identity (job, step, rank, world size)", _identity(want), _identity(got)
        )
    actual = head.header_digest.hex()
    if actual != expected.header_digest:
        raise IntegrityError(path, "header", expected.header_digest, actual)


def _identity(ident: tuple[str, int, int, int]) -> str:
    job, step, rank, world = ident
    return f"job {job!r} step {step} rank {rank}/{world}"


def load_into(
    path: str,
    into: Any = None,
    *,
    expected: Expected | None = None,
    direct_io: bool | None = None,
    queue_depth: int = 4,
    chunk_bytes: int = 8 << 20,
) -> Loaded:
    """Read a sealed shard file, verify every blob, and rebuild its state.

    Args:
        direct_io: O_DIRECT reads (where the filesystem allows; True), buffered reads
            (False), or O_DIRECT unless the page cache holds the file (None; `read_shard`).
        into: optional targets shaped like the saved state (tensors, or objects with
            `state_dict()`, in nested dicts/lists): a saved tensor whose key path has a target of
            the same shape and dtype is copied into it in place; the rest come back as new CPU
            tensors. Objects with `load_state_dict()` get their restored state loaded.
        expected: the identity and header digest the file must have (a restore always passes
            the catalog's), checked before any byte is read into a target.

    Raises:
        ShardMissingError: the file is not there.
        ShardFormatError: truncated or garbled (names the file).
        IntegrityError: a digest does not match, or the file is another shard than `expected`.
    """
    t0 = time.perf_counter()
    sink = _sink(into, expected)
    with gc_paused():
        head = read_shard(
            path, sink, direct_io=direct_io, queue_depth=queue_depth, chunk_bytes=chunk_bytes
        )
    return _loaded(head, sink, time.perf_counter() - t0)


def load_shard(path: str | os.PathLike[str]) -> tuple[ShardHeader, Any]:
    """Read a sealed shard file and rebuild its state on the CPU, every digest checked first.

    Raises:
        ShardFormatError: truncated, garbled or not a shard (the message names the file).
        IntegrityError: a digest does not match.
    """
    loaded = load_into(os.fspath(path))
    return loaded.header, loaded.state


def load_image(
    image: memoryview, head: Head, path: str, into: Any = None, *, expected: Expected | None = None
) -> Loaded:
    """The same from a sealed image already in memory (e.g. downloaded from object storage)."""
    t0 = time.perf_counter()
    sink = _sink(into, expected)
    with gc_paused():
        deliver_image(image, head, path, sink)
    return _loaded(head, sink, time.perf_counter() - t0)


def _sink(into: Any, expected: Expected | None) -> Assembly:
    """What the readers put the shard into: `into`, once its head is the one `expected`."""
    return Assembly(into, lambda head, location: check_head(head, expected, location))


def _loaded(head: Head, sink: Assembly, seconds: float) -> Loaded:
    assert sink.result is not None  # the reader called `finish`
    state, in_place = sink.result
    return Loaded(head.header, state, head.file_nbytes, seconds, in_place)


def _holder(source: Source) -> str | None:
    """The node a failed copy is on, for its report: a replica's holder (None: this node's own
    copy, or an object, which the report names by tier)."""
    return (source.node or None) if source.tier == "peer" else None


def _where(source: Source, step: int) -> dict[str, object]:
    """A source as its log lines name it."""
    return {"step": step, "tier": source.tier, "node": source.node, "location": source.location}
