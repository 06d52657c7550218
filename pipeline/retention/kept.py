"""What a job keeps on each tier, read from its state in KV: one rule for every remover.

The job's coordinator moves the retention floors (`tierpipe.control.jobstate`); these functions read
them, with a step's record, to say what becomes of one copy. The evict stage removes this node's
NVMe copies with them, the flush stage uploads only the steps the job wants there (and never
leaves an object of a step object storage does not keep), and `tierpipe gc` removes what they
say no kept step owns.

- Object storage keeps a step at or above its floor, a step the floors keep (the newest complete
  step of each tier, a step a restore reads), and a step below the floor whose objects retention
  left there (`Keep.s3_keep_period`: its record says they were not removed).
- Object storage is sent only the steps the job wants there (`upload_wanted`): the upload
  target the coordinator names (`Floors.upload`, `tierpipe.control.upload`) and the steps
  `Keep.s3_keep_period` keeps; every other verified step stays on NVMe alone.
- NVMe keeps a step at or above its floor, or one the floors keep. Below the floor, a copy that is
  in object storage goes ("flushed"); one that is not goes once the job keeps its step on no tier
  any more ("not kept": its upload is never started, or withdrawn); one whose step is wanted in
  object storage stays while it is on its way there ("wait"); any other goes as "superseded":
  it will never be uploaded (a target is always the newest step complete on NVMe when it is
  named, so never one below the floor), and no restore reads it (a restart with every node
  reads a newer complete NVMe step, one after a node loss the newest safe step, `Floors.safe`,
  which the floors keep). A job that keeps no unflushed copies (`Keep.evict_unflushed`) has them
  all go at once ("unflushed").

Evidence that a copy is in object storage is about that copy (`in_object_storage`): this node's
`flushed` event of the same header digest, or the step's record with the rank in `s3` and the
rank's recorded header digest equal to the copy's. A step missing from the job state is never
taken to be there.
"""

from __future__ import annotations

from typing import Literal

from tierpipe.control.bitmap import has_rank
from tierpipe.control.kvstate import JobStore
from tierpipe.schemas.jobstate import Floors, Keep, StepRecord

__all__ = (
    "REASONS",
    "Fate",
    "copy_evidence",
    "in_object_storage",
    "kept_in_s3",
    "nvme_fate",
    "s3_keeps",
    "upload_wanted",
)

#: What becomes of an NVMe copy (`nvme_fate`).
Fate = Literal["keep", "wait", "flushed", "unflushed", "not kept", "superseded"]
#: The `evicted` reason of each fate that removes the copy.
REASONS: dict[Fate, str] = {
    "flushed": "retention (flushed)",
    "unflushed": "retention (unflushed)",
    "not kept": "retention (not kept)",
    "superseded": "retention (superseded)",
}


def upload_wanted(step: int, floors: Floors, keep: Keep) -> bool:
    """Whether the job wants `step` sent to object storage now: it is the upload target
    (`Floors.upload`), or a step `Keep.s3_keep_period` keeps (at or above the object-storage
    floor: below it, the coordinator removed it unless it was complete there)."""
    period = keep.s3_keep_period
    return step == floors.upload or (bool(period) and step % period == 0 and step >= floors.s3)


def s3_keeps(step: int, floors: Floors, record: StepRecord | None) -> bool:
    """Whether object storage keeps `step`: at or above its floor, kept by the floors, or left
    there below the floor by retention (its `record` says its objects were not removed)."""
    return (
        step >= floors.s3 or step in floors.keep or (record is not None and not record.s3_removed)
    )


def in_object_storage(
    rank: int,
    header_digest: str,
    record: StepRecord | None,
    recorded_digest: str | None,
    *,
    flushed_here: str | None = None,
) -> bool:
    """Whether the copy of `rank` with `header_digest` is (or was, before retention removed the
    step's objects) in object storage: this node flushed that very copy (`flushed_here`: the
    header digest of its `flushed` event), or the step's `record` has the rank in `s3` and the
    rank's `recorded_digest` is the copy's."""
    if flushed_here == header_digest:
        return True
    return record is not None and has_rank(record.s3, rank) and recorded_digest == header_digest


def nvme_fate(
    step: int, floors: Floors, keep: Keep, *, in_s3: bool, record: StepRecord | None
) -> Fate:
    """What becomes of a node's NVMe copy of `step` (see the module's docstring)."""
    if step >= floors.nvme or step in floors.keep:
        return "keep"
    if keep.evict_unflushed:
        return "unflushed"
    if in_s3:
        return "flushed"
    if not s3_keeps(step, floors, record):
        return "not kept"
    return "wait" if upload_wanted(step, floors, keep) else "superseded"


async def kept_in_s3(store: JobStore, job: str, step: int) -> bool:
    """Whether object storage keeps `step` of `job` as its state in KV says now (the floors,
    then the step's record only if the floors alone do not keep it).

    Raises:
        BusUnavailableError, BusError: the job state cannot be read (never taken as "not kept").
    """
    floors = await store.floors(job)
    if step >= floors.s3 or step in floors.keep:
        return True
    return s3_keeps(step, floors, await store.record(job, step))


async def copy_evidence(
    store: JobStore, job: str, step: int, rank: int, header_digest: str, *,
    flushed_here: str | None = None,
) -> tuple[StepRecord | None, bool]:  # fmt: skip
    """(the step's record, whether the copy of `rank` with `header_digest` is in object
    storage: `in_object_storage`), read from KV (the rank's digest only where the record has the
    rank in `s3`).

    Raises:
        BusUnavailableError, BusError: the job state cannot be read.
    """
    rec = await store.record(job, step)
    if flushed_here == header_digest:
        return rec, True
    recorded = None
    if rec is not None and has_rank(rec.s3, rank):
        found = await store.rank_digest(job, step, rank)
        recorded = None if found is None else found[0]
    return rec, in_object_storage(rank, header_digest, rec, recorded)
