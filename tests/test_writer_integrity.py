"""The writer proves what it writes, one agent serves a node, and staging slots never leak.

Unit tests drive the NVMe store and staging slots directly; the slow ones run real
`tierpipe worker` processes against the session's nats-server (SIGSTOP, SIGKILL, fault points).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from tests.conftest import Agent, Events
from tierpipe.bus.client import Bus
from tierpipe.errors import (
    AgentLockedError,
    NoSpaceError,
    ShardFailedError,
    StagingGoneError,
    StorageConflictError,
)
from tierpipe.faults import POINTS
from tierpipe.names import consumer_name, shard_relpath, stream_name
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import (
    ShardEvicted,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
)
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.staged_image import StagedImage, open_image, release
from tierpipe.storage.staging import SlotPool
from tierpipe.trainer.checkpointer import Checkpointer
from tierpipe.trainer.snapshot import Snapshot

JOB = "j"


def final_path(settings: Settings, job: str, step: int) -> Path:
    return Path(settings.nvme_root) / shard_relpath(job, step, 0, 1)


class Trainer:
    """What a trainer does to stage a save (plan, prepare, copy and mark: the snapshot stage),
    without a bus."""

    def __init__(self, root: Path, *, slots: int = 1, job: str = JOB, node: str = "n") -> None:
        self.root, self.job, self.node = root, job, node
        self.pool = SlotPool(root, job, 0, slots)
        self.snapshot = Snapshot(self.pool, node=node)

    def stage(self, step: int, value: float, *, epoch: int = 0, n: int = 50_000) -> ShardStaged:
        plan = plan_state(
            {"w": torch.full((n,), value)},
            job=self.job,
            step=step,
            rank=0,
            world_size=1,
            node=self.node,
            epoch=epoch,
        )
        slot = self.pool.acquire(wait=False, timeout_s=0)
        assert slot is not None
        copy = self.snapshot.prepare(slot, plan)
        return self.snapshot.copy(copy, started=time.perf_counter(), rewind_to=None)

    def close(self) -> None:
        self.snapshot.close()
        self.pool.close()


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Trainer]:
    t = Trainer(tmp_path / "staging")
    yield t
    t.close()


def write(
    store: NvmeStore, image: StagedImage, final: Path, *, rewind_to: int | None = None
) -> str:
    """Seal `image` into `final` as nvme-write does; returns the header digest."""
    with image.view() as view:
        done = store.write_image(view, image.head, final, check=image.check, rewind_to=rewind_to)
    image.close()
    return done.header_digest


def temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(".*.tmp"))


# --- slot generations


def test_agent_refuses_a_slot_at_another_generation(trainer: Trainer) -> None:
    """A `staged` event whose generation is not the slot's (the slot was reused) is refused."""
    event = trainer.stage(1, 1.0)
    open_image(trainer.root, event).close()
    stale = msgspec.structs.replace(event, generation=event.generation - 1)
    with pytest.raises(StagingGoneError, match="generation"):
        open_image(trainer.root, stale)


def test_copy_of_a_slot_reused_mid_copy_is_never_placed(trainer: Trainer, tmp_path: Path) -> None:
    """A writer whose slot was released and reused after it opened the image fails with
    StagingGoneError and places nothing: no final file, no temp file."""
    first = trainer.stage(1, 1.0)
    image = open_image(trainer.root, first)
    release(trainer.root, JOB, 0, 1)
    trainer.stage(3, 3.0)  # the same slot, now step 3
    final = tmp_path / "nvme" / "step-1.shard"
    with NvmeStore(tmp_path / "nvme") as store, pytest.raises(StagingGoneError, match="reused"):
        write(store, image, final)
    assert not final.exists() and temps(final.parent) == []


# --- a valid final file is never replaced


def test_another_save_never_replaces_a_valid_shard_file(trainer: Trainer, tmp_path: Path) -> None:
    """A second, different save of the same shard (a stale redelivery, a second writer) fails
    with StorageConflictError and leaves the verified file byte for byte."""
    final = tmp_path / "nvme" / "step-1.shard"
    with NvmeStore(tmp_path / "nvme") as store:
        digest = write(store, open_image(trainer.root, trainer.stage(1, 1.0)), final)
        store.verify_file(final, header_digest=digest, nbytes=final.stat().st_size)
        kept = final.read_bytes()
        release(trainer.root, JOB, 0, 1)
        other = open_image(trainer.root, trainer.stage(1, 2.0))
        with pytest.raises(StorageConflictError) as err:
            write(store, other, final)
    assert err.value.location == str(final) and "never replaced" in err.value.reason
    assert final.read_bytes() == kept and temps(final.parent) == []


def test_corrupt_copy_of_the_same_save_is_set_aside_and_rewritten(
    trainer: Trainer, tmp_path: Path
) -> None:
    """Rewriting a save whose file there fails verification (verify's rewrite, a restore's
    write-back) replaces it and keeps the bad copy aside as `.<name>.corrupt`."""
    final = tmp_path / "nvme" / "step-1.shard"
    event = trainer.stage(1, 1.0)
    with NvmeStore(tmp_path / "nvme") as store:
        write(store, open_image(trainer.root, event), final)
        head = read_head(final)
        with open(final, "r+b") as f:  # flip one data byte
            f.seek(head.data_offset + 100)
            f.write(b"\x7f")
        digest = write(store, open_image(trainer.root, event), final)
        store.verify_file(final, header_digest=digest, nbytes=final.stat().st_size)
    assert (final.parent / ".step-1.shard.corrupt").exists()
    assert torch.equal(load_shard(final)[1]["w"], torch.full((50_000,), 1.0))


@pytest.mark.parametrize("found", ["garbage", "another shard"])
def test_unreadable_or_misplaced_file_is_set_aside(
    trainer: Trainer, tmp_path: Path, found: str
) -> None:
    """A file at the shard's path that is no shard, or another shard's (another step), is set
    aside as `.<name>.corrupt` and the save is placed."""
    final = tmp_path / "nvme" / "step-1.shard"
    final.parent.mkdir(parents=True)
    with NvmeStore(tmp_path / "nvme") as store:
        if found == "garbage":
            final.write_bytes(b"\x00" * 8192)
        else:
            write(store, open_image(trainer.root, trainer.stage(2, 2.0)), final)
            release(trainer.root, JOB, 0, 2)
        write(store, open_image(trainer.root, trainer.stage(1, 1.0)), final)
    assert (final.parent / ".step-1.shard.corrupt").exists()
    assert read_head(final).header.step == 1


def test_save_of_a_rewound_run_replaces_the_abandoned_timeline(
    trainer: Trainer, tmp_path: Path
) -> None:
    """A save of a newer epoch whose run rewound to before this step replaces the older
    epoch's file (logged); without that rewind it is a conflict."""
    final = tmp_path / "nvme" / "step-5.shard"
    with NvmeStore(tmp_path / "nvme") as store:
        write(store, open_image(trainer.root, trainer.stage(5, 1.0, epoch=100)), final)
        release(trainer.root, JOB, 0, 5)
        newer = trainer.stage(5, 2.0, epoch=200)
        for rewind_to in (None, 5):  # no rewind, or a rewind to this very step: keep
            with pytest.raises(StorageConflictError):
                write(store, open_image(trainer.root, newer), final, rewind_to=rewind_to)
        with capture_logs() as logs:
            write(store, open_image(trainer.root, newer), final, rewind_to=3)
    assert [e["event"] for e in logs].count("superseded_shard_replaced") == 1
    assert read_head(final).header.epoch == 200
    assert torch.equal(load_shard(final)[1]["w"], torch.full((50_000,), 2.0))


# --- one agent per node


def test_stage_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    """A second holder of a stage's lock waits, says who holds it, and gives up after its
    timeout with AgentLockedError naming the holder."""

    async def main() -> None:
        with NvmeStore(tmp_path) as a, NvmeStore(tmp_path) as b:
            async with a.lock("verify", timeout_s=0):
                async with b.lock("evict", timeout_s=0):  # another stage: its own lock
                    pass
                with capture_logs() as logs, pytest.raises(AgentLockedError) as err:
                    async with b.lock("verify", timeout_s=0.3):
                        pass
            async with b.lock("verify", timeout_s=0):  # free again once released
                pass
        assert f"pid {os.getpid()}" in err.value.holder
        assert err.value.path == str(tmp_path / ".agent-verify.lock")
        assert [e["event"] for e in logs] == ["agent_lock_busy"]

    anyio.run(main)


# --- real agents


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.001)


@pytest.mark.slow
def test_paused_writer_never_seals_another_steps_bytes(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A writer stopped mid-copy while another agent verifies its step and the trainer reuses
    the slot for a later step resumes without touching the verified file: step 1 loads as
    step 1, step 3 as step 3, and the writer keeps serving."""
    s = settings.replace(staging_slots=1, io_chunk_bytes=64 << 10, io_queue_depth=1)
    final1, final3 = final_path(s, job, 1), final_path(s, job, 3)
    one, three = {"w": torch.full((12 << 20,), 1.0)}, {"w": torch.full((12 << 20,), 3.0)}
    writer = agent("nvme-write", settings=s).wait_ready()
    assert writer.proc is not None
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, one)
        _wait_for(lambda: final1.parent.exists() and bool(temps(final1.parent)), "no temp file")
        os.kill(writer.proc.pid, signal.SIGSTOP)
        try:
            # Meanwhile another agent of this node writes and verifies step 1, releases the slot.
            (staged,) = events.all("staged")
            assert isinstance(staged, ShardStaged)
            image = open_image(s.staging_root, staged)
            with NvmeStore.from_settings(s) as store, image.view() as view:
                digest = store.write_image(view, image.head, final1).header_digest
                store.verify_file(final1, header_digest=digest, nbytes=final1.stat().st_size)
            image.close()
            kept = final1.read_bytes()
            release(s.staging_root, job, 0, 1)
            ckpt.save(3, three)  # the trainer reuses slot 0
        finally:
            os.kill(writer.proc.pid, signal.SIGCONT)
        events.wait_for(lambda e: e.step == 3, kind="written", timeout=60)  # type: ignore[union-attr]
    assert final1.read_bytes() == kept
    assert torch.equal(load_shard(final1)[1]["w"], one["w"])
    assert torch.equal(load_shard(final3)[1]["w"], three["w"])
    assert temps(final1.parent) == [] and writer.proc.poll() is None
    assert all(e.header_digest == digest for e in events.all("written") if e.step == 1)  # type: ignore[union-attr]


@pytest.mark.slow
def test_second_agent_for_a_node_exits_naming_the_holder(
    settings: Settings, agent: Callable[..., Agent]
) -> None:
    """A second agent for the same node exits non-zero with one line naming the holder."""
    first = agent("nvme-write").wait_ready()
    second = agent("nvme-write", settings=settings.replace(agent_lock_timeout_s=0.2))
    assert second.proc is not None and first.proc is not None
    assert second.proc.wait(30) != 0
    log = second.log()
    (line,) = [x for x in log.splitlines() if "tierpipe: error" in x]
    assert f"pid {first.proc.pid}" in line and ".agent-nvme-write.lock" in line
    assert "Traceback" not in log and "ExceptionGroup" not in log
    assert first.proc.poll() is None


@pytest.mark.slow
def test_waiting_agent_takes_over_once_the_holder_exits(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """An agent started while another serves the node waits (saying so) and serves once the
    first one exits."""
    first = agent("nvme-write").wait_ready()
    second = agent("nvme-write")
    _wait_for(lambda: "agent_lock_busy" in second.log(), "the second agent did not wait")
    first.stop()
    second.wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        written = ckpt.save(1, {"x": torch.ones(4)}).wait("written", timeout=30)
    assert isinstance(written, ShardWritten)


# --- staging slots are released on every permanent end of a save


@pytest.mark.slow
def test_late_staged_event_of_a_failed_save_never_fails_its_retry(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A save reported failed can still reach the stream later (nats-py sends what it buffered
    before it noticed a disconnect; a paused server reads its socket when it resumes). That
    `staged` names the slot at an older generation: nvme-write refuses it, and the release its
    failure asks for must leave alone the slot that the retry of the same step now holds."""
    trainer = Trainer(Path(settings.staging_root), job=job, node=settings.node)
    try:
        late = trainer.stage(1, 1.0)
        release(trainer.root, job, 0, 1)  # save() raised: its slot was freed
        retry = trainer.stage(1, 2.0)  # the same step again, in the same slot
        agent("nvme-write", "evict").wait_ready()

        async def publish(event: ShardStaged) -> int:
            async with Bus(settings) as bus:
                return (await bus.publish(event)).seq

        seq = anyio.run(publish, late)
        events.wait_for(lambda e: isinstance(e, StageFailed) and e.step == 1, kind="failed")

        async def evict_done() -> None:  # evict has acted on the failure (or chose not to)
            async with Bus(settings) as bus:
                name = consumer_name("evict", settings.node)
                while True:
                    info = await bus.js.consumer_info(stream_name(settings.stream, job), name)
                    if info.ack_floor.stream_seq > seq and not info.num_pending:
                        return
                    await anyio.sleep(0.05)

        anyio.run(evict_done)
        anyio.run(publish, retry)
        written = events.wait_for(lambda e: isinstance(e, ShardWritten), kind="written", timeout=10)
        assert written.step == 1 and len(events.all("failed")) == 1
        (refused,) = events.all("failed")
        assert isinstance(refused, StageFailed) and refused.generation == late.generation
    finally:
        trainer.close()


@pytest.mark.slow
def test_permanently_failed_save_releases_its_slot(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A save whose write fails for good (a full disk that outlasts the retries) raises
    ShardFailedError on its handle and frees its slot; a new trainer then saves normally."""
    s = settings.replace(staging_slots=1, slot_wait_timeout_s=2.0)
    failing = agent(settings=settings.replace(nvme_reserve_bytes=1 << 60, max_deliver=2))
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        handle = ckpt.save(1, {"a": torch.ones(1000)})
        with pytest.raises(ShardFailedError) as err:
            handle.result(timeout=30)
        assert err.value.stage == "nvme-write" and err.value.error == "NoSpaceError"
        events.wait_for(
            lambda e: isinstance(e, ShardEvicted) and e.tier == "ram" and e.step == 1,
            kind="evicted",
        )
        assert ckpt._local().pool.busy() == {}
    failing.stop()
    agent()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        verified = ckpt.save(2, {"a": torch.ones(1000)}).result(timeout=30)
    assert isinstance(verified, ShardVerified)


@pytest.mark.slow
def test_new_trainer_reclaims_the_marker_of_a_verified_step(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """A marker left for a step the stream shows verified (its release never came) is
    reclaimed by the next Checkpointer of that rank, which logs why."""
    agent("nvme-write", "verify")  # no evict stage: nobody releases the slot
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"a": torch.ones(8)}).result(timeout=30)
        assert list(ckpt._local().pool.busy().values()) == [1]
    with capture_logs() as logs, Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        c.save(2, {"a": torch.ones(8)}).wait_staged(timeout=30)  # (its first save reclaims)
        assert list(c._local().pool.busy().values()) == [2]
    (entry,) = [e for e in logs if e["event"] == "staging_markers_reclaimed"]
    assert entry["steps"] == [1] and entry["reasons"] == ["verified"]


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root, as in CI and this project's dev machines)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_save_that_failed_to_stage_can_be_retried_with_the_same_step(
    settings: Settings, job: str, tiny_fs: Path
) -> None:
    """After staging ran out of room, saving the same step again (once there is room) works."""
    state = {"w": torch.ones(1 << 20)}  # 4 MiB: more than the 1 MiB staging filesystem
    with Checkpointer(
        job, rank=0, world_size=1, settings=settings.replace(staging_root=str(tiny_fs))
    ) as ckpt:
        with pytest.raises(NoSpaceError):
            ckpt.save(7, state)
        subprocess.run(["mount", "-o", "remount,size=64m", str(tiny_fs)], check=True)
        staged = ckpt.save(7, state).wait("staged", timeout=10)
    assert isinstance(staged, ShardStaged) and staged.step == 7


# --- the fault suite: kill -9 at each commit point of nvme-write


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_writer_killed_at_a_commit_point_is_completed_by_the_next(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, point: str
) -> None:
    """An nvme-write killed -9 at `point` leaves a save that a fresh agent completes: verified
    with the exact saved bytes, one final file, no temp file, the slot released."""
    s = settings.replace(ack_wait_s=1.0)  # redelivery to the fresh agent after 1 s
    dying = agent("nvme-write", settings=s.replace(fault_point=point))
    state = {"w": torch.randn(300_000), "step": 1}
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        handle = ckpt.save(1, state)
        assert dying.proc is not None and dying.proc.wait(30) == -signal.SIGKILL, dying.log()
        assert "fault_point_reached" in dying.log()
        agent(settings=s)
        verified = handle.result(timeout=60)
        assert isinstance(verified, ShardVerified)
        events.wait_for(lambda e: isinstance(e, ShardEvicted) and e.tier == "ram", kind="evicted")
        assert ckpt._local().pool.busy() == {}
    final = final_path(s, job, 1)
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]
    _, saved = load_shard(final)
    assert torch.equal(saved["w"], state["w"]) and saved["step"] == 1
    assert read_head(final).header_digest.hex() == verified.header_digest
