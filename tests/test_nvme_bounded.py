"""NVMe is bounded (issue 22, item 2): a node keeps its `nvme_keep_latest_k` newest copies, the
ones in flight and the ones the job still needs (the upload target, the newest complete on each
tier, a step being restored); superseded copies that will never be uploaded go. With NVMe full,
the oldest removable copy goes first, before any save waits. The rule alone, then through a real
agent, nats-server and SeaweedFS, with saves faster than object storage takes them."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.retention.kept import REASONS, nvme_fate
from tierpipe.schemas import ShardEvicted, ShardFlushed, ShardVerified, StageFailed
from tierpipe.schemas.jobstate import Floors, Keep, StepRecord
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer


def fate(step: int, floors: Floors, keep: Keep | None = None, *, removed: bool = False) -> str:
    keep = keep or Keep()
    rec = StepRecord(step=step, world_size=1, s3_removed=removed)
    return nvme_fate(step, floors, keep, in_s3=False, record=rec)


def test_a_copy_below_the_floor_never_to_be_uploaded_is_superseded() -> None:
    floors = Floors(nvme=10, s3=-1, upload=8, safe=5, keep=[5])
    assert fate(3, floors) == "superseded"  # older than the safe step
    assert fate(6, floors) == "superseded"  # older than the target: never uploaded
    assert fate(9, floors) == "superseded"  # newer, but below the floor: never a target
    assert fate(8, floors) == "wait"  # the target itself: on its way to object storage
    assert fate(5, floors) == "keep"  # the newest complete in object storage
    assert fate(11, floors) == "keep"  # at or above the floor (keep_latest_k, in flight)
    assert fate(6, floors, Keep(s3_keep_period=3)) == "wait"  # a period step goes up too
    assert fate(2, Floors(nvme=10, s3=4, upload=8), removed=True) == "not kept"
    assert REASONS["superseded"] == "retention (superseded)"


# --- through a real agent


def copies(nvme_root: str, job: str) -> set[int]:
    """The steps with a sealed shard file on the node's NVMe now."""
    out = set()
    for p in Path(nvme_root, job).glob("step-*/rank-*.shard"):
        try:
            out.add(int(p.parent.name.removeprefix("step-")))
        except ValueError:
            continue
    return out


class HighWater:
    """The most NVMe copies seen at once of steps complete on NVMe then (the job's head: the
    copies retention answers for, not the saves in flight), sampled in a thread; a copy counts
    if two samples in a row hold it."""

    def __init__(self, settings: Settings, job: str) -> None:
        self.settings, self.job, self.most, self.at = settings, job, 0, set[int]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=anyio.run, args=(self._run,), daemon=True)

    def __enter__(self) -> HighWater:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        async with Bus(self.settings) as bus:
            store = await JobStore(bus.js, self.settings).open()
            before: set[int] = set()
            while not self._stop.is_set():
                head = await store.head(self.job)  # (first: the copies of a newer head count)
                newest = head.nvme_steps[-1] if head is not None and head.nvme_steps else -1
                now = copies(self.settings.nvme_root, self.job)
                settled = {t for t in now if t <= newest}
                # (a copy the evict stage is removing right now is not counted: in two samples
                # 0.25 s apart, it is the node's; this machine is a loaded 2-core one)
                held, before = settled & before, settled
                if len(held) > self.most:
                    self.most, self.at = len(held), held
                await anyio.sleep(0.25)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nvme_stays_bounded_while_object_storage_is_slower_than_the_saves(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A 2 MiB save every 0.5 s, uploads at 2 MiB/s (one step in two): on main every verified
    step waited for its upload, and NVMe grew with the run; here the copies on NVMe stay at
    most `nvme_keep_latest_k` + 2 checkpoints (measured: k + 1; the upload target and the
    newest in object storage are among the k newest or next to them)."""
    k = 3
    s = settings.replace(nvme_keep_latest_k=k, s3_keep_latest_k=2, coordinator_flush_s=0.05,
                         flush_max_bytes_per_s=2 << 20)  # fmt: skip
    agent(settings=s).wait_ready(60)
    steps = 30
    with (
        HighWater(s, job) as high,
        Checkpointer(job, rank=0, world_size=1, settings=s) as c,
    ):
        for step in range(1, steps + 1):
            t0 = time.monotonic()
            c.save(step, {"w": torch.full((2 << 18,), float(step))})
            time.sleep(max(0.0, 0.5 - (time.monotonic() - t0)))
        c.wait_until_finished(timeout=60)
        time.sleep(2.0)  # (retention catches up with the last saves)
    evicted = [e for e in events.all("evicted") if isinstance(e, ShardEvicted) and e.tier == "nvme"]
    assert high.most <= k + 2, f"{high.most} copies at once on NVMe: steps {sorted(high.at)}"
    superseded = sorted(e.step for e in evicted if e.reason == REASONS["superseded"])
    assert superseded, f"no copy superseded: {[(e.step, e.reason) for e in evicted]}"


@pytest.fixture
def small_nvme(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs as the node's NVMe (needs root, as in CI and this project's dev machines)."""
    mnt = tmp_path / "nvme-small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_nvme_removes_the_oldest_removable_copy_before_a_save_waits(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, small_nvme: Path
) -> None:
    """NVMe of 24 MiB (five 4 MiB copies), `nvme_keep_latest_k` 8: retention alone would keep
    more than fits. Each step is uploaded before the next save (so it is the upload target,
    then in object storage). Every save is verified in time and none waits for space (no
    nvme-write failure, no NoSpaceError): the copies that made room went oldest first, and
    never the newest step."""
    s = settings.replace(nvme_root=str(small_nvme), nvme_keep_latest_k=8, direct_io=False,
                         coordinator_flush_s=0.05)  # fmt: skip
    a = agent(settings=s).wait_ready(60)
    steps = 12  # 48 MiB in all: twice the disk
    with Checkpointer(job, rank=0, world_size=1, settings=s) as c:
        for step in range(1, steps + 1):
            # (a save that waited for room would miss this deadline: nvme-write backs off)
            c.save(step, {"w": torch.full((1 << 20,), float(step))}).wait("verified", 20)
            events.wait_for(
                lambda e, t=step: isinstance(e, ShardFlushed) and e.step == t,
                kind="flushed",
                timeout=30,
            )
    verified = {e.step for e in events.all("verified") if isinstance(e, ShardVerified)}
    assert verified == set(range(1, steps + 1))
    failed = [e for e in events.all("failed") if isinstance(e, StageFailed)]
    assert not [e for e in failed if e.stage == "nvme-write"], failed
    assert "NoSpaceError" not in a.log()
    made_room = [
        e.step for e in events.all("evicted")
        if isinstance(e, ShardEvicted) and e.tier == "nvme" and e.reason == "disk pressure"
    ]  # fmt: skip
    assert made_room and made_room == sorted(made_room), made_room
    assert steps not in made_room and made_room[0] == 1
