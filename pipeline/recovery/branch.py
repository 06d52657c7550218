"""Branches the job state has not folded yet: a restore passes over the steps they superseded.

A run that restored (or saves with `overwrite=True`) branches the job's history: every save it
makes carries `rewind_to` and its timeline (`epoch`), and supersedes this rank's saves of later
steps from older timelines. The job's coordinator learns of a branch from the agents' events
about the new save (`rewind_to` rides on every event after the `staged` one), so a restart
right after such a save, before the agent wrote it out (or with the agent down), read a job
state in which the abandoned branch's newest step was still complete, and restored it.

Each rank's newest `staged` event says it first. `pass_over_branched` reads it (one read per
rank, of that rank's subject on every node) and takes out of the rank's survey every candidate
step above its `rewind_to` whose record's newest save is of an older timeline.
"""

from __future__ import annotations

from collections.abc import Iterable

import anyio

from tierpipe.bus.client import Bus
from tierpipe.names import shard_subject
from tierpipe.recovery.survey import Reads, Survey
from tierpipe.schemas import ShardStaged

__all__ = ("branches", "pass_over_branched")


async def branches(bus: Bus, job: str, ranks: Iterable[int]) -> dict[int, tuple[int, int]]:
    """rank -> (rewind_to, epoch) of its newest `staged` event, for the ranks whose newest save
    branched (a stream read per rank).

    Raises:
        BusUnavailableError, BusError: the stream could not be read.
    """
    newest: dict[int, tuple[int, ShardStaged]] = {}

    async def read(rank: int) -> None:
        for seq, event in await bus.latest(shard_subject(job, "staged", "*", rank)):
            if isinstance(event, ShardStaged) and seq > newest.get(rank, (0, None))[0]:
                newest[rank] = (seq, event)

    async with anyio.create_task_group() as tg:
        for rank in ranks:
            tg.start_soon(read, rank)
    return {
        rank: (e.rewind_to, e.epoch) for rank, (_, e) in newest.items() if e.rewind_to is not None
    }


async def pass_over_branched(bus: Bus, job: str, reads: Reads, surveys: dict[int, Survey]) -> None:
    """Take out of each rank's survey the candidate steps its newest save's branch superseded
    (see the module docstring); they are missing, and say why.

    Raises:
        BusUnavailableError, BusError: the stream or the job state could not be read.
    """
    for rank, (rewind_to, epoch) in (await branches(bus, job, surveys)).items():
        found = surveys[rank]
        for step in found.candidates:
            if step <= rewind_to or (rec := await reads.record(step)) is None:
                continue
            if rec.epoch < epoch:  # (no save of the step is of the branch's timeline or newer)
                found.local.pop(step, None)
                found.remote.discard(step)
                found.peer.discard(step)
                found.missing[step] = (f"superseded: this rank's newest save branched at step "
                                       f"{rewind_to}")  # fmt: skip
