"""`tierpipe gc`: find, and on request remove, what of a job no step it keeps owns.

Retention removes what the floors pass as they pass it; what it misses stays for good: an object
uploaded after its step's objects were removed (an agent re-driving its uploads after a restart,
a late save), an NVMe copy whose events the stream no longer holds, a COMMIT whose objects went.
`gc` lists the job's objects (shards under each of its 256 hash prefixes, and its COMMITs) and
this node's files under the job's NVMe folder, and judges each by its step against the job state
in KV (`unkept`, with the rules of `tierpipe.retention.kept`):

- an object or COMMIT goes when object storage does not keep its step: below the object-storage
  floor (and not left there by a rule), or with no record in the job state;
- a file on this node's NVMe goes when its step is below the NVMe floor and object storage does
  not keep it either (a copy waiting for its upload stays: the evict stage removes it once it is
  in object storage);
- never: a step the floors keep (the newest complete step of each tier, a step a restore reads),
  a step newer than any the job state knows (a save in flight), or anything younger than
  `min_age_s` (a save the job state has not folded yet).

A dry run by default (`apply=False`): it lists what it would remove and why. It refuses when the
job state cannot be read, or the job has none (`tierpipe reindex` rebuilds it): without it,
every object would look unowned. Every shard removed is published as `evicted` (reason `gc:
...`); NVMe removals also in the node's batch, so the coordinator forgets those copies.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio
import msgspec
import structlog

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.control.location import check_location
from tierpipe.errors import JobStateMissingError, ShardFormatError, TierpipeError
from tierpipe.names import node_name, validate_token
from tierpipe.retention.kept import s3_keeps
from tierpipe.schemas import ShardEvicted, Tier
from tierpipe.schemas.jobstate import Floors, JobHead, StepRecord
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3.commit import commit_key, commits_prefix, remove_commit
from tierpipe.storage.s3.store import S3Store

__all__ = ("MIN_AGE_S", "Found", "GcReport", "gc", "job_objects", "unkept")

log = structlog.get_logger(__name__)

#: Objects and files younger than this are never removed (a save the job state has not folded).
MIN_AGE_S = 600.0

Kind = Literal["shard", "commit", "file"]


@dataclass(frozen=True, slots=True)
class Found:
    """One object or file no kept step owns."""

    tier: Tier
    kind: Kind
    #: `s3://<bucket>/<key>`, or a path on this node.
    location: str
    step: int
    nbytes: int
    reason: str
    #: The shard it is (job, step, rank, world size, epoch, header digest), if known.
    shard: tuple[str, int, int, int, int, str] | None = None


@dataclass(slots=True)
class GcReport:
    job: str
    applied: bool
    found: list[Found] = field(default_factory=list)
    #: What was left alone, and why (too recent, not a shard of the job).
    skipped: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """For a terminal: one line per object or file, then the totals."""
        verb = "removed" if self.applied else "would remove"
        out = [f"{verb} {f.location} (step {f.step}, {f.nbytes} B): {f.reason}" for f in self.found]
        out += [f"left alone {s}" for s in self.skipped]
        total = sum(f.nbytes for f in self.found)
        out.append(f"{self.job}: {verb} {len(self.found)} objects and files, {total} B")
        if not self.applied and self.found:
            out.append("(a dry run: --apply removes them)")
        return out

    def json_lines(self) -> list[str]:
        """One JSON object per object or file, then one with the totals."""
        out = [msgspec.json.encode({**_fields(f), "applied": self.applied}).decode()
               for f in self.found]  # fmt: skip
        out.append(msgspec.json.encode({
            "job": self.job, "applied": self.applied, "count": len(self.found),
            "bytes": sum(f.nbytes for f in self.found), "skipped": self.skipped,
        }).decode())  # fmt: skip
        return out


def _fields(f: Found) -> dict[str, object]:
    return {"tier": f.tier, "kind": f.kind, "location": f.location, "step": f.step,
            "nbytes": f.nbytes, "reason": f.reason}  # fmt: skip


@dataclass(slots=True)
class _KeptState:
    """What the job state in KV says of a job, with the records read so far."""

    head: JobHead
    floors: Floors
    store: JobStore
    records: dict[int, StepRecord | None] = field(default_factory=dict)

    @classmethod
    async def read(cls, store: JobStore, job: str) -> _KeptState:
        """Raises:
        JobStateMissingError: the job has no state in KV.
        BusUnavailableError, BusError: the job state cannot be read.
        """
        head = await store.head(job)
        if head is None:
            raise JobStateMissingError(job)
        return cls(head, await store.floors(job), store)

    async def record(self, step: int) -> StepRecord | None:
        if step not in self.records:
            self.records[step] = await self.store.record(self.head.job, step)
        return self.records[step]


def unkept(step: int, tier: Tier, head: JobHead, floors: Floors, rec: StepRecord | None) -> str:
    """Why the job state keeps `step` on `tier` nowhere ("" if it keeps it, or it may be a save
    in flight). `rec`: the step's record (None: it has none)."""
    if step in floors.keep or step in (head.newest_nvme, head.newest_s3):
        return ""
    if not head.steps or step > head.steps[-1]:
        return ""  # newer than any step the job state knows: in flight
    if tier == "nvme" and step >= floors.nvme:
        return ""
    if s3_keeps(step, floors, rec) and (rec is not None or tier == "nvme"):
        return ""  # (an NVMe copy of a step object storage keeps waits for its upload)
    if tier == "nvme":
        return "below both floors"
    return "below the object-storage floor" if step < floors.s3 else "no record in the job state"


async def job_objects(settings: Settings, store: JobStore, job: str) -> S3Store:
    """The object store that holds `job`'s objects, not yet entered: the settings' (endpoint,
    bucket, prefix), once checked against the store the job is bound to in KV
    (`check_location`), so gc and rm never list or remove another store's objects.

    Raises:
        StoreMismatchError: the job's objects are bound to another store.
    """
    await check_location(store, job)
    return S3Store(settings)


async def gc(
    settings: Settings, job: str, *, apply: bool = False, min_age_s: float = MIN_AGE_S
) -> GcReport:
    """Find what of `job` no kept step owns (see the module docstring); remove it if `apply`.

    Raises:
        JobStateMissingError: the job has no state in KV.
        BusUnavailableError, StorageUnavailableError: the job state or a store is unreachable.
    """
    validate_token("job", job)
    node = node_name(settings.node)
    report = GcReport(job, apply)
    async with Bus(settings, name=f"tierpipe-gc-{node}") as bus:
        store = await JobStore.opened(bus)
        view = await _KeptState.read(store, job)
        cutoff = time.time() - min_age_s
        with NvmeStore.from_settings(settings) as nvme:
            files = await _nvme_found(nvme, view, job, cutoff, report.skipped)
            async with await job_objects(settings, store, job) as objects:
                found = files + await _objects_found(objects, view, job, cutoff, report.skipped)
                report.found = sorted(found, key=lambda f: (f.step, f.tier, f.location))
                if apply:
                    await _remove(bus, node, job, nvme, objects, report.found)
    log.info("gc_done", job=job, applied=apply, found=len(report.found),
             nbytes=sum(f.nbytes for f in report.found))  # fmt: skip
    return report


async def _nvme_found(
    nvme: NvmeStore, view: _KeptState, job: str, cutoff: float, skipped: list[str]
) -> list[Found]:
    """This node's files under the job's NVMe folder whose step the job keeps on no tier."""
    found = []
    for folder in sorted((nvme.root / job).glob("step-*")):
        step = _step_of(folder.name)
        if step is None:
            continue
        why = unkept(step, "nvme", view.head, view.floors, await view.record(step))
        if not why:
            continue
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            stat = path.stat()
            if stat.st_mtime > cutoff:
                skipped.append(f"{path}: younger than the minimum age")
                continue
            shard = await anyio.to_thread.run_sync(_identity, path)
            kind: Kind = "shard" if shard is not None else "file"
            found.append(Found("nvme", kind, str(path), step, stat.st_size, why, shard))
    return found


async def _objects_found(
    objects: S3Store, view: _KeptState, job: str, cutoff: float, skipped: list[str]
) -> list[Found]:
    """The job's shard objects and COMMITs whose step object storage does not keep."""
    found = []
    listed: list[tuple[Kind, str, int, int]] = []  # (kind, key, step, size)
    for key, size in await objects.list_job(job):
        shard = objects.shard_of(key)
        if shard is None or shard.job != job:
            skipped.append(f"s3://{objects.bucket}/{key}: not a shard of {job}")
            continue
        listed.append(("shard", key, shard.step, size))
    prefix = commits_prefix(objects.prefix, job)
    for key, size in await objects.list_objects(prefix):
        step = _step_of(key.removeprefix(prefix).partition("/")[0])
        if step is None or commit_key(objects.prefix, job, step) != key:
            skipped.append(f"s3://{objects.bucket}/{key}: not a COMMIT of {job}")
            continue
        listed.append(("commit", key, step, size))
    for kind, key, step, size in listed:
        why = unkept(step, "s3", view.head, view.floors, await view.record(step))
        if not why:
            continue
        location = f"s3://{objects.bucket}/{key}"
        head = await objects.head(key)
        if head is None:
            continue  # (removed meanwhile)
        if head["LastModified"].timestamp() > cutoff:
            skipped.append(f"{location}: younger than the minimum age")
            continue
        identity = None
        if kind == "shard" and (k := objects.shard_of(key)) is not None:
            meta = head.get("Metadata", {})
            epoch = meta.get("tp-epoch", "0")
            digest = meta.get("tp-header-digest", "")
            identity = (job, k.step, k.rank, k.world_size, int(epoch) if epoch.isdigit() else 0,
                        digest)  # fmt: skip
        found.append(Found("s3", kind, location, step, size, why, identity))
    return found


async def _remove(
    bus: Bus, node: str, job: str, nvme: NvmeStore, objects: S3Store, found: Iterable[Found]
) -> None:
    """Remove what was found: each step's COMMIT before its shards, then the shards (a COMMIT
    never names an object that is gone); each shard removed is published as `evicted`."""
    found = list(found)
    for f in found:
        if f.kind == "commit":
            await remove_commit(objects, job, f.step)
    keys = [f.location.removeprefix(f"s3://{objects.bucket}/") for f in found
            if f.tier == "s3" and f.kind == "shard"]  # fmt: skip
    await objects.delete_many(keys)
    batch = Batcher(bus)
    for f in found:
        if f.tier == "nvme":
            await nvme.delete(f.location, header_digest=f.shard[5] if f.shard else None)
        if f.shard is None or f.kind == "commit":
            continue
        _, step, rank, world_size, epoch, _ = f.shard
        event = ShardEvicted(
            job=job, node=node, ts=time.time(), step=step, rank=rank, world_size=world_size,
            epoch=epoch, tier=f.tier, location=f.location, reason=f"gc: {f.reason}",
        )  # fmt: skip
        try:
            await bus.publish(event)
        except TierpipeError as e:  # (the removal stands; only its report is missing)
            log.warning("gc_removal_unreported", location=f.location, error=str(e))
            continue
        if f.tier == "nvme":
            batch.add(event)  # (the coordinator forgets the copy)
    await batch.flush()


def _step_of(name: str) -> int | None:
    """The step of a folder named `step-<12 digits>`, or None."""
    digits = name.removeprefix("step-")
    ok = name.startswith("step-") and len(digits) == 12 and digits.isdigit()
    return int(digits) if ok else None


def _identity(path: Path) -> tuple[str, int, int, int, int, str] | None:
    """The shard a file holds, from its head (None: not a readable shard)."""
    try:
        head = read_head(path)
    except (OSError, ShardFormatError, TierpipeError):
        return None
    h = head.header
    return (h.job, h.step, h.rank, h.world_size, h.epoch, head.header_digest.hex())
