"""What an operator's read of a job shows: its head in KV once the job's coordinator folded the
newest event the operator could have seen (`folded_head`), so `tierpipe status`, `plan`,
`export` and `prefetch` show what just happened, not the state of a flush interval ago.
"""

from __future__ import annotations

import time

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import JobStateMissingError
from tierpipe.names import state_subjects, stream_name
from tierpipe.schemas.jobstate import JobHead

__all__ = ("folded_head",)


async def folded_head(bus: Bus, store: JobStore, job: str) -> tuple[JobHead, int]:
    """The job's head in KV and the stream seq of its newest event the coordinator folds
    (`state_subjects`): while a live coordinator leads the job, once it has folded that event
    (a few flush intervals at most), so what an operator just saw happen shows; while no agent
    has taken the job up yet, after a grace of 2 s; with a dead coordinator, at once (the output
    says it lags).

    Raises:
        JobStateMissingError: the job has no state in KV (a mistyped name, or a lost state).
    """
    settings = bus.settings
    stream_seq = max([await bus.newest_seq(subject) for subject in state_subjects(job)])
    grace = time.monotonic() + 2.0
    deadline = grace + 10 * settings.coordinator_flush_s
    # Woken by each write of the job's head or lease (its coordinator's), else when the grace,
    # the lease or the deadline runs out: the moments the answer below can change.
    async with store.changes(job) as written:
        while True:
            head = await store.head(job)
            if head is not None and head.seq >= stream_seq:
                break
            lease = await store.lease(job)
            now = time.monotonic()
            # No lease yet: an agent may be about to take the job up (it does once its node
            # has a folder of the job): a short grace. An expired one: its coordinator is gone.
            gone = lease is not None and lease.expires < time.time()
            if gone or (lease is None and now > grace) or now > deadline:
                break
            until = grace if lease is None else now + lease.expires - time.time()
            await written.wait(min(until, deadline) - now + 0.001)
    if head is None:
        stream = stream_name(settings.stream, job)
        events = (
            f"though stream {stream} holds its events up to seq {stream_seq} (no "
            "coordinator has folded them: an agent's evict stage does)"
            if stream_seq
            else f"and no events on stream {stream} (check the name)"
        )
        raise JobStateMissingError(
            job,
            f"job {job!r} has no state in KV bucket {settings.kv_bucket} {events}; if its state "
            f"was lost, `tierpipe reindex --job {job}` republishes its events from shard files "
            "and objects",
        )
    return head, stream_seq
