"""The evict stage removes an NVMe copy as flushed only on evidence about that copy, and removes
every copy of a step the job keeps on no tier, with or without its events (issue 20, items 5
and 6). Against a real nats-server: the job state is written to KV as a coordinator would."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tierpipe.bus.client import Bus
from tierpipe.control.bitmap import bitmap
from tierpipe.control.kvstate import JobStore, digests_key, floor_key, step_key
from tierpipe.names import shard_relpath
from tierpipe.retention.kept import REASONS, nvme_fate, s3_keeps
from tierpipe.schemas import ShardEvicted, ShardFlushed
from tierpipe.schemas.jobstate import (
    DIGEST_BYTES,
    SIZE_BYTES,
    Floors,
    Keep,
    RankDigests,
    StepRecord,
    encode_record,
)
from tierpipe.settings import Settings
from tierpipe.stages.evict import Evict, LocalCopy
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.shardfile import write_shard

pytestmark = pytest.mark.slow

#: Floors of a job that keeps steps 3 and 4 on NVMe and 4 in object storage.
FLOORS = Floors(nvme=3, s3=4, keep=[])


def plant(settings: Settings, job: str, step: int) -> tuple[Path, str]:
    """A shard file of `step` at its path on this node's NVMe, with no event about it."""
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, step, 0, 1)
    digest = write_shard(path, {"w": torch.full((1024,), float(step))}, job=job, step=step)
    return path, digest


def record(step: int, *, s3: bool, s3_removed: bool = False) -> StepRecord:
    return StepRecord(
        step=step, world_size=1, nvme=bitmap([0], 1), s3=bitmap([0] if s3 else [], 1),
        s3_removed=s3_removed,
    )  # fmt: skip


def run_evict(
    settings: Settings,
    job: str,
    records: dict[int, tuple[StepRecord, str]],
    *,
    flushed: list[ShardFlushed] = (),  # type: ignore[assignment]
    floors: Floors = FLOORS,
) -> list[LocalCopy]:
    """Store `floors` and `records` (with each step's recorded digest of rank 0) in KV as the
    job's coordinator would, publish `flushed`, then apply the floors once; what was removed."""

    async def main() -> list[LocalCopy]:
        async with Bus(settings) as bus, AsyncExitStack() as stack:
            await bus.ensure_job_stream(job)
            store = await JobStore(bus.js, settings).open()
            for step, (rec, digest) in records.items():
                await store.kv.put(step_key(job, step), encode_record(rec))
                chunk = RankDigests(
                    step=step, first=0, digests=bytes.fromhex(digest)[:DIGEST_BYTES],
                    sizes=(4096).to_bytes(SIZE_BYTES, "little"),
                )  # fmt: skip
                await store.kv.put(digests_key(job, step, 0), msgspec.json.encode(chunk))
            await store.kv.put(floor_key(job), msgspec.json.encode(floors))
            nvme = stack.enter_context(NvmeStore.from_settings(settings))
            evict = Evict(settings, bus, nvme, store, stack)
            await evict.follow_flushed()
            for event in flushed:
                await bus.publish(event)
            with anyio.fail_after(10):
                while len(evict.flushed_here) < len(flushed):  # noqa: ASYNC110 (a subscription)
                    await anyio.sleep(0.01)
            evict.floors[job] = await store.floors(job)
            return await evict.apply_floors(job)

    return anyio.run(main)


def evictions(events: Callable[[str], list], step: int) -> list[ShardEvicted]:
    return [
        e for e in events("evicted")
        if isinstance(e, ShardEvicted) and e.tier == "nvme" and e.step == step
    ]  # fmt: skip


def test_a_copy_of_a_step_missing_from_the_job_state_is_never_removed_as_flushed(
    settings: Settings, job: str, events
) -> None:
    """A copy below both floors whose step has no record (a late save, its upload perhaps still
    running) goes as a step the job keeps on no tier, never as one in object storage."""
    path, _ = plant(settings, job, 1)
    removed = run_evict(settings, job, {})
    assert [c.step for c in removed] == [1] and not path.exists()
    (evicted,) = evictions(events.all, 1)
    assert evicted.reason == REASONS["not kept"]


def test_an_unflushed_copy_below_both_floors_goes_even_with_its_record_kept(
    settings: Settings, job: str, events
) -> None:
    """A step the coordinator keeps in the job state only because a node still holds an
    unflushed copy of it (its events lost from the stream, its upload never made) no longer
    pins that copy on NVMe forever: it goes, as not kept."""
    path, digest = plant(settings, job, 1)
    removed = run_evict(settings, job, {1: (record(1, s3=False, s3_removed=True), digest)})
    assert [c.step for c in removed] == [1] and not path.exists()
    (evicted,) = evictions(events.all, 1)
    assert evicted.reason == REASONS["not kept"]


def test_a_record_of_another_copy_in_object_storage_is_no_evidence_for_this_one(
    settings: Settings, job: str, events
) -> None:
    """Below the NVMe floor but the job's upload target, a copy whose rank the record has in
    `s3` with another header digest (another save's object) stays until its own is there."""
    path, _ = plant(settings, job, 3)
    removed = run_evict(
        settings, job, {3: (record(3, s3=True), "f" * 32)}, floors=Floors(nvme=4, upload=3)
    )
    assert removed == [] and path.exists()


def test_this_nodes_flushed_event_is_evidence_before_the_job_state_has_it(
    settings: Settings, job: str, events
) -> None:
    """Below the NVMe floor, a copy this node reported flushed (same header digest) goes as
    flushed, though the coordinator has not folded that yet."""
    path, digest = plant(settings, job, 3)
    flushed = ShardFlushed(
        job=job, node=settings.node or "", ts=time.time(), step=3, rank=0, world_size=1,
        bucket="b", key="k", etag="e", checksum="c", header_digest=digest, nbytes=4096,
        seconds=0.1,
    )  # fmt: skip
    removed = run_evict(
        settings, job, {3: (record(3, s3=False), digest)}, flushed=[flushed],
        floors=Floors(nvme=4),
    )  # fmt: skip
    assert [c.step for c in removed] == [3] and not path.exists()
    (evicted,) = evictions(events.all, 3)
    assert evicted.reason == REASONS["flushed"]


@pytest.mark.parametrize(
    ("step", "in_s3", "rec", "fate"),
    [
        (5, False, None, "keep"),  # at or above the NVMe floor
        (2, True, None, "flushed"),
        (3, False, None, "wait"),  # the upload target: on its way to object storage
        (2, False, None, "not kept"),  # below both floors, no record
        # Kept in object storage below its floor (period), but not this copy: never uploaded.
        (2, False, StepRecord(step=2, world_size=1), "superseded"),
        (2, False, StepRecord(step=2, world_size=1, s3_removed=True), "not kept"),
    ],
)
def test_the_fate_of_an_nvme_copy(
    step: int, in_s3: bool, rec: StepRecord | None, fate: str
) -> None:
    """One rule for every NVMe copy, from the floors, the step's record and the evidence."""
    floors = Floors(nvme=4, s3=3, upload=3)
    assert nvme_fate(step, floors, Keep(), in_s3=in_s3, record=rec) == fate
    assert nvme_fate(step, floors, Keep(evict_unflushed=True), in_s3=in_s3, record=rec) == (
        "keep" if fate == "keep" else "unflushed"
    )
    assert s3_keeps(4, Floors(nvme=5, s3=6, keep=[4]), None)


def test_a_copy_removed_while_retention_lists_the_copies_is_skipped(
    settings: Settings, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process removes a shard file after its header was read and before its size:
    the listing skips it, and the agent lives on (the evict stage died of FileNotFoundError,
    which took the whole agent down: `bench nvme` removes its shards under it)."""
    from tierpipe.stages import evict as evict_stage

    gone, _ = plant(settings, job, 3)
    kept, _ = plant(settings, job, 4)
    read_head = evict_stage.read_head

    def read_then_lose(path: Path) -> object:
        head = read_head(path)
        if Path(path) == gone:
            gone.unlink()  # (the other process, between the two reads)
        return head

    monkeypatch.setattr(evict_stage, "read_head", read_then_lose)

    async def main() -> list[LocalCopy]:
        async with Bus(settings) as bus, AsyncExitStack() as stack:
            store = await JobStore(bus.js, settings).open()
            nvme = stack.enter_context(NvmeStore.from_settings(settings))
            evict = Evict(settings, bus, nvme, store, stack)
            return await anyio.to_thread.run_sync(evict.local_copies, job)

    copies = anyio.run(main)
    assert [(c.step, c.path) for c in copies] == [(4, kept)]
    assert copies[0].nbytes == kept.stat().st_size
