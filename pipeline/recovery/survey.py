"""What the ranks of a restart can read: from the job's state in KV and their own disk, no replay.

A node's local leader reads the job's head, then, for a few candidate steps (the newest with a
record, and the newest complete ones), the step's record, and for each of the node's ranks checks
its NVMe copy: a handful of small KV reads per node (`Reads`: each key once, the chunk of header
digests only where a copy is on disk), whatever the job's size or history. A rank's NVMe copy
sits at a path that follows from (job, step, rank, world size); it counts only if the file's
header names that shard and hashes to the digest the job state recorded when the copy was
verified. Its object counts if the record says the store confirmed it (and retention has not
removed it since), its replica on a peer if the record counts one (`Survey.peer`; where it is,
`replica_sources` reads from the holders' `replicated` events); the loader checks the same digest
(`sources` reads it) before any byte of any copy reaches a tensor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.coordinator import Coordinator
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    LeaseLostError,
    StorageUnavailableError,
    TierpipeError,
    WorldSizeMismatchError,
)
from tierpipe.names import batch_subject, shard_subject, state_subjects
from tierpipe.recovery.load import Expected, check_head
from tierpipe.recovery.plan import Source, counts, unusable
from tierpipe.schemas import ShardReplicated, decode_event
from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, JobHead, RankDigests, StepRecord
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head

__all__ = (
    "Reads", "Survey", "current_head", "own_events", "replica_sources", "sources", "survey",
)  # fmt: skip

log = structlog.get_logger(__name__)

#: (job, step, rank, world size) -> where that shard is on a tier.
Locate = Callable[[str, int, int, int], str]

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Survey:
    """One rank's copies of the candidate steps (newest first), as its `ready` says them."""

    candidates: list[int]
    #: step -> this rank's NVMe copy, checked on disk.
    local: dict[int, Source] = field(default_factory=dict)
    #: Steps whose object of this rank the job state confirms.
    remote: set[int] = field(default_factory=set)
    #: Steps of which the job state counts a verified replica of this rank on another node than
    #: the one that saved it (the `peer` tier: what a replaced node's rank can read there).
    peer: set[int] = field(default_factory=set)
    #: step -> why this rank has no copy of it.
    missing: dict[int, str] = field(default_factory=dict)
    #: step -> what proved this rank's NVMe copy is not the verified one (to report).
    bad: dict[int, TierpipeError] = field(default_factory=dict)


class Reads:
    """The job-state keys of one restart, each read at most once (concurrent readers of a key
    share the one read): a node's leader reads a step's record and digest chunk once for all
    the node's ranks."""

    def __init__(self, store: JobStore, job: str) -> None:
        self.store, self.job = store, job
        self._records: dict[int, _Shared[StepRecord | None]] = {}
        self._chunks: dict[tuple[int, int], _Shared[RankDigests | None]] = {}

    def add(self, head: JobHead) -> None:
        """Take the records `head` carries (`JobHead.records`): no read of their keys.

        Raises:
            msgspec.ValidationError: a record the head carries is garbled.
        """
        for stored in head.records:
            self._records[stored.step] = _Shared.of(stored.record())

    async def record(self, step: int) -> StepRecord | None:
        """`step`'s record, or None."""
        return await _once(self._records, step, lambda: self.store.record(self.job, step))

    async def digest(self, step: int, rank: int) -> tuple[str, int] | None:
        """(header digest, size) of `rank`'s verified copy of `step`, or None."""
        chunk = rank // RANKS_PER_CHUNK
        found = await _once(
            self._chunks, (step, chunk), lambda: self.store.digests(self.job, step, chunk)
        )
        return None if found is None else found.of(rank)


class _Shared(Generic[T]):
    """One read's outcome, for every reader of its key: set once the read ended."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: T | None = None
        self.failed: BaseException | None = None

    @classmethod
    def of(cls, value: T) -> _Shared[T]:
        shared = cls()
        shared.value = value
        shared.done.set()
        return shared


async def _once(cache: dict[K, _Shared[T]], key: K, read: Callable[[], Awaitable[T]]) -> T:
    """`read()`'s value, read once for `key` by the first to ask (the others wait for it); a
    read that failed, or whose reader was cancelled, is read again by the next to ask."""
    while True:
        shared = cache.get(key)
        if shared is None or (shared.done.is_set() and shared.failed is not None):
            shared = cache[key] = _Shared()
            try:
                shared.value = await read()
            except BaseException as e:
                shared.failed = e
                raise
            finally:
                shared.done.set()
            return shared.value
        await shared.done.wait()
        if shared.failed is None:
            return shared.value  # type: ignore[return-value]  # (set with done)
        if not isinstance(shared.failed, anyio.get_cancelled_exc_class()):
            raise shared.failed
        # (its reader was cancelled, not this one: read again)


async def current_head(
    bus: Bus, store: JobStore, settings: Settings, *, job: str, holder: str,
    deadline: float, own: list[tuple[str, str]] | None = None, ranks: Sequence[int] = (),
) -> JobHead | None:  # fmt: skip
    """The job's head in KV once it has folded the job's newest event the coordinator reads
    (the saves before a restart; this waits for the coordinator, a flush interval). A job with
    no live coordinator (no agent runs evict, or the holder died and its lease expired) is
    folded up to that event here, as `holder`, under the lease (a dead holder's lease expires
    within `lease_ttl_s`; one its node's record shows gone is taken at once:
    `tierpipe.control.holder`). At `deadline` (`time.monotonic()`) it goes on with the state as it
    is, logged: that can only cost newer steps, never give a wrong one.

    `own`: wait for the node batches that carry this rank's own newest events (`own_events`),
    by exact subject, answered at once at any job size. Default: everything the coordinator
    folds (wildcard lookups, which the server answers by scanning the job's subjects: rank 0
    only). A node with no events of the job (a replacement) waits instead for those of its
    `ranks`, published by whichever node held them (a lookup per rank across nodes: only the
    replaced nodes pay it). That node may have died between a rank's event and the batch
    carrying it, which then never comes (nor is folded): such a wait ends `ack_wait_s` after
    the event, by when a live agent has sent the batch or had the message taken back."""
    if own is None:
        seq = max([await _newest(bus, subject) for subject in state_subjects(job)])
    else:
        seq = max([await _batch_after(bus, *pair, deadline) for pair in own])
        if not seq and ranks:
            seq = max(
                [await _rank_batch_after(bus, job, kind, r, deadline, settings.ack_wait_s)
                 for r in ranks for kind in _SAVED]
            )  # fmt: skip
    folded, bid_at, pause = False, 0.0, _FIRST_POLL_S
    while True:
        head = await store.head(job)
        if not seq or (head is not None and head.seq >= seq):
            return head
        if not folded and time.monotonic() >= bid_at:  # (free, expired, or its holder gone)
            bid_at = time.monotonic() + _BID_S
            coordinator = Coordinator(settings, bus, store, holder, _no_removal)
            try:
                if folded := await coordinator.catch_up(job, seq):
                    continue
            except LeaseLostError as e:  # (another coordinator folds: wait for it, bid no more)
                log.info("catch_up_lease_lost", job=job, holder=holder, error=str(e))
                bid_at = math.inf
        if time.monotonic() > deadline:
            log.warning("job_state_behind", job=job, folded=head and head.seq, seq=seq)
            return head
        await anyio.sleep(pause)  # (a direct get per look: KV watches are agents' alone)
        pause = min(pause * 1.5, _POLL_S)


#: The first pause between looks at the head (the coordinator stores a restore's `hold` at
#: once: rank 0 usually waits a few milliseconds), growing to `_POLL_S`.
_FIRST_POLL_S, _POLL_S = 0.003, 0.05

#: How often a restart waiting for the job's coordinator looks whether it is gone (the lease,
#: and while it holds, the holder's node record and maybe a connect to its endpoint: every
#: restarting rank does, so not at the wait's own pace). The first look is at once.
_BID_S = 0.5

#: The kinds whose fold a restoring rank waits for: what says a copy is there to read.
_SAVED = ("verified", "flushed")


def own_events(job: str, node: str, rank: int | str) -> list[tuple[str, str]]:
    """(this rank's subject, its node's batch subject) of `verified` and `flushed`: a rank's
    event is published a moment before the batch that carries it, which is what the
    coordinator folds. `rank="*"`: any rank of the node (a node's local leader)."""
    return [
        (shard_subject(job, kind, node, rank), batch_subject(job, node, kind)) for kind in _SAVED
    ]


async def _rank_batch_after(
    bus: Bus, job: str, kind: str, rank: int, deadline: float, grace: float
) -> int:
    """`_batch_after` for `rank`'s newest `kind` event on any node (the node is in it), waited
    for until `grace` seconds after the event (its node may be dead: see `current_head`)."""
    found = await bus.last_raw(shard_subject(job, kind, "*", rank))
    if found is None:
        return 0
    try:
        event = decode_event(found[1])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return found[0]  # (unreadable: at least the fold must have passed it)
    age = min(max(0.0, time.time() - event.ts), grace)  # (another node's clock: clamped)
    return await _batch_after(
        bus, shard_subject(job, kind, event.node, rank), batch_subject(job, event.node, kind),
        min(deadline, time.monotonic() + grace - age),
    )  # fmt: skip


async def _newest(bus: Bus, subject: str) -> int:
    found = await bus.last_raw(subject)
    return found[0] if found else 0


async def _batch_after(bus: Bus, mine: str, batch: str, deadline: float) -> int:
    """Stream seq of the newest batch on `batch`, once it is newer than the newest message on
    `mine` (the batch carrying it is on its way; by `deadline`, whatever is there)."""
    after = await _newest(bus, mine)
    while True:
        newest = await _newest(bus, batch)
        if newest > after or not after or time.monotonic() > deadline:
            return newest
        await anyio.sleep(0.02)


async def _no_removal(job: str, step: int, world_size: int, ranks: Sequence[int] | None) -> None:
    """Folding the job state to read it never removes objects: no step is removed (the floors
    hold meanwhile), and an object confirmed after its step's removal (`Changes.s3_late`) is
    left (the fold's coordinator logs it deferred; `tierpipe gc` removes it)."""
    if ranks is None:
        raise AssertionError(f"no object removal while catching up ({job} step {step})")
    raise StorageUnavailableError(
        f"{job} step {step}: a restart's fold removes no objects (ranks {list(ranks)} left to "
        "`tierpipe gc`)"
    )


async def survey(
    reads: Reads,
    steps: Sequence[int],
    *,
    ranks: Sequence[int],
    world_size: int,
    node: str,
    locate_nvme: Locate | None,
) -> dict[int, Survey]:
    """Each of `ranks`' copies of the candidate `steps` of the job (newest first; see the
    module docstring): the node's ranks share every read. `locate_nvme` None: no NVMe copy
    is looked at (none is counted).

    Raises:
        WorldSizeMismatchError: the newest candidate was saved by another number of ranks.
    """
    found = {r: Survey(list(steps)) for r in ranks}
    records: list[StepRecord | None] = [None] * len(steps)

    async def read(i: int, step: int) -> None:
        records[i] = await reads.record(step)

    async with anyio.create_task_group() as tg:  # (the candidates' records, at once)
        for i, s in enumerate(steps):
            tg.start_soon(read, i, s)
    for i, (s, rec) in enumerate(zip(steps, records, strict=True)):
        why = unusable(rec, world_size)  # (as `tierpipe plan` reads the record)
        if why or rec is None:
            if i == 0 and rec is not None:
                raise WorldSizeMismatchError(
                    f"step {s} of job {reads.job!r} was saved by {rec.world_size} ranks, this run "
                    f"has {world_size}; restore into DTensor targets or pass value_rank to reshard"
                )
            _all_missing(found, s, why)
            continue
        for rank in ranks:
            await _check(found[rank], reads, rec, rank=rank, node=node, locate_nvme=locate_nvme)
    return found


def _all_missing(found: dict[int, Survey], step: int, why: str) -> None:
    for survey_ in found.values():
        survey_.missing[step] = why


async def _check(
    found: Survey, reads: Reads, rec: StepRecord, *, rank: int, node: str,
    locate_nvme: Locate | None,
) -> None:  # fmt: skip
    """Note `rank`'s copies of `rec`'s step in `found` (and why it has none)."""
    s, world = rec.step, rec.world_size
    local_why = "no usable NVMe copy (superseded by a rewind, evicted, or proven bad)"
    nvme, s3, peer = counts(rec, rank)  # (as `tierpipe plan` reads the record; then the disk)
    if peer:
        found.peer.add(s)
    if nvme and locate_nvme is not None:  # (a copy proven bad, or evicted, stays out)
        path = locate_nvme(reads.job, s, rank, world)
        local_why = _absent(path)  # (a stat, on the loop: no digest read for a missing file)
        if not local_why:
            local_why = await _check_local(found, reads, rec, rank, node, path)
    if s3:
        found.remote.add(s)
    elif s not in found.local:
        removed = " (removed)" if rec.s3_removed else ""
        found.missing[s] = f"{local_why}, none in object storage{removed}"


async def _check_local(
    found: Survey, reads: Reads, rec: StepRecord, rank: int, node: str, path: str
) -> str:
    """Check the file at `path` against the verified copy's digest; why it is not that ("")."""
    digest = await reads.digest(rec.step, rank)
    if digest is None:
        return "no verified copy of this rank"
    header_digest, nbytes = digest
    expected = Expected(reads.job, rec.step, rank, rec.world_size, header_digest)
    problem = await anyio.to_thread.run_sync(_local_problem, path, expected, nbytes)
    if isinstance(problem, TierpipeError):
        found.bad[rec.step] = problem
        return f"NVMe copy is not the verified one ({type(problem).__name__})"
    if not problem:
        found.local[rec.step] = Source(tier="nvme", node=node, location=path, nbytes=nbytes,
                                       header_digest=header_digest)  # fmt: skip
    return problem


async def sources(
    reads: Reads,
    found: Survey,
    *,
    rank: int,
    world_size: int,
    step: int,
    nvme: bool,
    locate_object: Locate,
) -> list[Source]:
    """`rank`'s copies of `step`, best first (`nvme=False`: the plan sends it to object
    storage): its checked NVMe copy, then its object, named with the recorded digest."""
    out = [found.local[step]] if nvme and step in found.local else []
    if step in found.remote:
        digest = await reads.digest(step, rank)
        if digest is not None:
            location = locate_object(reads.job, step, rank, world_size)
            out.append(Source(tier="s3", node="", location=location, nbytes=digest[1],
                              header_digest=digest[0]))  # fmt: skip
    return out


async def replica_sources(
    bus: Bus, reads: Reads, *, step: int, rank: int, world_size: int, skip: Collection[str] = ()
) -> list[Source]:
    """`rank`'s replicas of `step` (the `peer` tier), as their holders announced them: each
    holder's newest `replicated` event of that step for the rank (the job state counts a rank's
    replicas, not where they are; a holder keeps its `nvme_keep_latest_k` newest, so an older
    step's replica is read from the rank's history, as `tierpipe.peer.reader.holders` does),
    each only if it is the verified copy the job state recorded (digest and size), none on a
    node in `skip` (lost, or this rank's own) or on its own source. By holder name; the loader
    checks every digest again.

    Raises:
        BusUnavailableError, BusError: NATS or the KV could not be read.
    """
    digest = await reads.digest(step, rank)
    if digest is None:
        return []
    out: dict[str, Source] = {}
    for event in reversed(await bus.history(shard_subject(reads.job, "replicated", "*", rank))):
        if (
            isinstance(event, ShardReplicated)
            and (event.step, event.world_size) == (step, world_size)
            and (event.header_digest, event.nbytes) == digest
            and event.node not in skip
            and event.node not in out
            and event.node != event.source
        ):
            out[event.node] = Source(
                tier="peer", node=event.node, location=event.path, nbytes=event.nbytes,
                header_digest=event.header_digest,
            )  # fmt: skip
    return sorted(out.values(), key=lambda source: source.node)


def _absent(path: str) -> str:
    """Why there is no file at `path` ("" if there is one)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "no NVMe copy on this node"
    except OSError as e:
        return f"NVMe copy unreadable ({e.strerror})"
    return ""


def _local_problem(path: str, expected: Expected, nbytes: int) -> str | TierpipeError:
    """Why the file at `path` is not the copy `expected` ("" if it is; the error if the file
    proves it is another shard or garbled)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "no NVMe copy on this node"
    except OSError as e:
        return f"NVMe copy unreadable ({e.strerror})"
    if size != nbytes:
        return f"NVMe copy has {size} bytes, the verified one {nbytes}"
    try:
        check_head(read_head(path), expected, path)
    except OSError as e:
        return f"NVMe copy unreadable ({e.strerror})"
    except TierpipeError as e:
        return e
    return ""
