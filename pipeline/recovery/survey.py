"""What one rank of a restart can read: from the job's state in KV and its own disk, no replay.

A rank reads the job's head, then, for a few candidate steps (the newest with a record, and the
newest complete ones), the step's record and the chunk of header digests that holds its rank: a
handful of small KV reads, whatever the job's size or history. Its NVMe copy sits at a path that
follows from (job, step, rank, world size); it counts only if the file's header names that shard
and hashes to the digest the job state recorded when the copy was verified. Its object counts if
the record says the store confirmed it (and retention has not removed it since); the loader
checks the same digest before any byte of either reaches a tensor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import structlog

from tierpipe.bus import Bus
from tierpipe.coordinator import Coordinator
from tierpipe.errors import TierpipeError, WorldSizeMismatchError
from tierpipe.jobstate import has_rank
from tierpipe.kvstate import JobStore
from tierpipe.names import batch_subject, shard_subject, state_subjects
from tierpipe.recovery.load import Expected, check_head
from tierpipe.recovery.plan import Source
from tierpipe.schemas.jobstate import JobHead, StepRecord
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head

__all__ = ("Survey", "candidates", "current_head", "own_events", "survey")

log = structlog.get_logger(__name__)

#: Candidate steps: the newest with a record (complete or not) and the newest complete ones
#: on each tier (a node that was replaced has only object storage).
NEWEST, COMPLETE = 3, 2

#: (job, step, rank, world size) -> where that shard is on a tier.
Locate = Callable[[str, int, int, int], str]


@dataclass(frozen=True, slots=True)
class Survey:
    """One rank's copies of the candidate steps (newest first), as its report says them."""

    candidates: list[int]
    #: step -> this rank's NVMe copy, checked on disk.
    local: dict[int, Source] = field(default_factory=dict)
    #: step -> this rank's object, as the job state has it.
    remote: dict[int, Source] = field(default_factory=dict)
    #: step -> why this rank has no copy of it.
    missing: dict[int, str] = field(default_factory=dict)
    #: step -> what proved this rank's NVMe copy is not the verified one (to report).
    bad: dict[int, TierpipeError] = field(default_factory=dict)

    def sources(self, step: int, *, nvme: bool = True) -> list[Source]:
        """This rank's copies of `step`, best first (`nvme=False`: the plan sends it to object
        storage)."""
        found = [self.local[step]] if nvme and step in self.local else []
        return found + ([self.remote[step]] if step in self.remote else [])


async def current_head(
    bus: Bus, store: JobStore, settings: Settings, *, job: str, holder: str,
    deadline: float, own: list[tuple[str, str]] | None = None,
) -> JobHead | None:  # fmt: skip
    """The job's head in KV once it has folded the job's newest event the coordinator reads
    (the saves before a restart; this waits for the coordinator, a flush interval). A job with
    no live coordinator (no agent runs evict, or the holder died and its lease expired) is
    folded up to that event here, as `holder`, under the lease (a dead holder's lease expires
    within `lease_ttl_s`). At `deadline` (`time.monotonic()`) it goes on with the state as it
    is, logged: that can only cost newer steps, never give a wrong one.

    `own`: wait for the node batches that carry this rank's own newest events (`own_events`),
    by exact subject, answered at once at any job size. Default: everything the coordinator
    folds (wildcard lookups, which the server answers by scanning the job's subjects: rank 0
    only)."""
    if own is None:
        seq = max([await _newest(bus, subject) for subject in state_subjects(job)])
    else:
        seq = max([await _batch_after(bus, *pair, deadline) for pair in own])
    folded = False
    while True:
        head = await store.head(job)
        if not seq or (head is not None and head.seq >= seq):
            return head
        if not folded:
            lease = await store.lease(job)
            if lease is None or lease.expires < time.time():
                coordinator = Coordinator(settings, bus, store, holder, _no_removal)
                folded = await coordinator.catch_up(job, seq)
                continue
        if time.monotonic() > deadline:
            log.warning("job_state_behind", job=job, folded=head and head.seq, seq=seq)
            return head
        await anyio.sleep(0.05)


def own_events(job: str, node: str, rank: int) -> list[tuple[str, str]]:
    """(this rank's subject, its node's batch subject) of `verified` and `flushed`: a rank's
    event is published a moment before the batch that carries it, which is what the
    coordinator folds."""
    return [
        (shard_subject(job, kind, node, rank), batch_subject(job, node, kind))
        for kind in ("verified", "flushed")
    ]


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


async def _no_removal(job: str, step: int, world_size: int) -> None:
    """Folding the job state to read it never removes objects (the floors hold meanwhile)."""
    raise AssertionError(f"no object removal while catching up ({job} step {step})")


def candidates(head: JobHead, step: int | None = None) -> list[int]:
    """The steps a restart considers, newest first (`step`: only that one)."""
    if step is not None:
        return [step]
    complete = head.nvme_steps[-COMPLETE:] + head.s3_steps[-COMPLETE:]
    return sorted(set(head.steps[-NEWEST:]) | set(complete), reverse=True)


async def survey(
    store: JobStore,
    head: JobHead | None,
    *,
    job: str,
    rank: int,
    world_size: int,
    node: str,
    locate_nvme: Locate,
    locate_object: Locate,
    step: int | None = None,
) -> Survey:
    """This rank's copies of the candidate steps of `job` (see the module docstring).

    Raises:
        WorldSizeMismatchError: the newest candidate was saved by another number of ranks.
    """
    if head is None:
        return Survey([] if step is None else [step], missing={} if step is None else {
            step: "the job has no state (never saved, or its state was lost: `tierpipe reindex`)"
        })  # fmt: skip
    found = Survey(candidates(head, step))
    for i, s in enumerate(found.candidates):
        rec = await store.record(job, s)
        if rec is None:
            found.missing[s] = "no record of the step in the job state (retention removed it?)"
            continue
        if rec.world_size != world_size:
            if i == 0:
                raise WorldSizeMismatchError(
                    f"step {s} of job {job!r} was saved by {rec.world_size} ranks, this run has "
                    f"{world_size}; restore needs the same world size (no resharding yet)"
                )
            found.missing[s] = f"saved with world size {rec.world_size}"
            continue
        digest = await store.rank_digest(job, s, rank)
        if digest is None:
            found.missing[s] = "no verified copy of this rank"
            continue
        why = await _check(found, rec, digest, job=job, rank=rank, node=node,
                           locate_nvme=locate_nvme, locate_object=locate_object)  # fmt: skip
        if why:
            found.missing[s] = why
    return found


async def _check(
    found: Survey, rec: StepRecord, digest: tuple[str, int], *, job: str, rank: int, node: str,
    locate_nvme: Locate, locate_object: Locate,
) -> str:  # fmt: skip
    """Note this rank's copies of `rec`'s step in `found`; why it has none ("" if it has)."""
    s, world = rec.step, rec.world_size
    header_digest, nbytes = digest
    path = locate_nvme(job, s, rank, world)
    local_why = "no usable NVMe copy (superseded by a rewind, evicted, or proven bad)"
    if has_rank(rec.nvme, rank):  # (a copy proven bad, or evicted, stays out)
        expected = Expected(job, s, rank, world, header_digest)
        problem = await anyio.to_thread.run_sync(_local_problem, path, expected, nbytes)
        if isinstance(problem, TierpipeError):
            found.bad[s] = problem
            problem = f"NVMe copy is not the verified one ({type(problem).__name__})"
        local_why = problem
        if not local_why:
            found.local[s] = Source(tier="nvme", node=node, location=path, nbytes=nbytes,
                                    header_digest=header_digest)  # fmt: skip
    if has_rank(rec.s3, rank) and not rec.s3_removed:
        found.remote[s] = Source(tier="s3", node="", location=locate_object(job, s, rank, world),
                                 nbytes=nbytes, header_digest=header_digest)  # fmt: skip
        return ""
    if s in found.local:
        return ""
    return f"{local_why}, none in object storage" + (" (removed)" if rec.s3_removed else "")


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
