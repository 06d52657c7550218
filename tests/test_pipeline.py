"""End to end on real parts: a trainer's Checkpointer, agent processes, a real nats-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.bus.client import Bus
from tierpipe.errors import InvalidNameError, SlotTimeoutError
from tierpipe.names import shard_relpath, stream_name
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import ShardStaged, ShardVerified, ShardWritten, StageFailed
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


@pytest.fixture
def ckpt(settings: Settings, job: str) -> Iterator[Checkpointer]:
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        yield c


def model_state(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    return model, opt


def final_path(settings: Settings, job: str, step: int, rank: int = 0, world: int = 1) -> Path:
    return Path(settings.nvme_root).absolute() / shard_relpath(job, step, rank, world)


def test_save_is_written_and_verified_with_exact_bytes(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, job: str, events: Events
) -> None:
    """save -> written -> verified; the NVMe file holds exactly the saved tensors, even though the
    trainer mutates its state right after save() returns."""
    agent()
    model, opt = model_state()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ckpt.save(10, {"model": model, "optim": opt, "step": 10})
    with torch.no_grad():  # a mutation right after save() must not reach the checkpoint
        for p in model.parameters():
            p.add_(1.0)
    written = handle.wait("written", timeout=30)
    verified = handle.wait("verified", timeout=30)
    assert isinstance(written, ShardWritten) and isinstance(verified, ShardVerified)
    assert written.path == verified.path == str(final_path(settings, job, 10))
    assert handle.done() and handle.result() == verified
    _, saved = load_shard(verified.path)
    for k, v in expected.items():
        assert torch.equal(saved["model"][k], v), k
    assert saved["step"] == 10
    kinds = [type(e).__struct_config__.tag for e in events.all()]
    assert kinds[:3] == ["staged", "written", "verified"]
    # The agent released the staging slot once the NVMe copy was verified.
    events.wait_for(lambda e: getattr(e, "tier", None) == "ram", kind="evicted")


def test_a_verified_save_is_listed_at_once(
    settings: Settings, job: str, agent: Callable[..., Agent], cpu_hog: None
) -> None:
    """Once save().result() returns (its rank's `verified`), all_steps() lists the step: it
    waits for the node's batch that carries that `verified` to be folded, which is published
    a moment after the rank's own event."""
    agent().wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, {"w": torch.full((1000,), float(step))}).result(timeout=30)
            assert step in ckpt.all_steps()


def test_overlapped_save_with_guard_never_stores_a_mutated_state(
    ckpt: Checkpointer, agent: Callable[..., Agent]
) -> None:
    """save(blocking=False) returns before the copy finishes; the guarded optimizer step waits
    for it, so the shard holds the pre-step weights."""
    agent()
    model, opt = model_state(width=512)
    ckpt.guard(opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ckpt.save(1, {"model": model, "optim": opt}, blocking=False)
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()  # the guard waits for the copy first
    handle.wait_staged(timeout=30)
    verified = handle.wait("verified", timeout=30)
    _, saved = load_shard(verified.path)
    for k, v in before.items():
        assert torch.equal(saved["model"][k], v), k
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_killed_writer_leaves_no_partial_file_and_completes_once(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """SIGKILL nvme-write mid-write: no partial final file is ever visible; after a restart the
    temp file is swept and the shard is written exactly once."""
    slow = settings.replace(io_chunk_bytes=64 << 10, io_queue_depth=1, ack_wait_s=2.0)
    final = final_path(slow, job, 5)
    seen_partial: list[int] = []
    stop = threading.Event()

    def watch() -> None:  # any visible final file must already be complete
        while not stop.is_set():
            try:
                size = final.stat().st_size
            except FileNotFoundError:
                continue
            try:
                read_head(final)
            except Exception:
                seen_partial.append(size)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with Checkpointer(job, rank=0, world_size=1, settings=slow) as ckpt:
        state = {"big": torch.randn(12 << 20)}  # 48 MiB
        handle = ckpt.save(5, state)
        writer = agent("nvme-write", settings=slow)
        deadline = time.monotonic() + 30
        while not (final.parent.exists() and list(final.parent.glob(".*.tmp"))):
            assert time.monotonic() < deadline, writer.log()
            time.sleep(0.001)
        writer.stop(signal.SIGKILL)
        (tmp,) = final.parent.glob(".*.tmp")
        assert not final.exists()
        agent("nvme-write", "verify", settings=slow)
        verified = handle.wait("verified", timeout=60)
    stop.set()
    watcher.join()
    assert seen_partial == []
    assert not tmp.exists() and not list(final.parent.glob(".*.tmp"))
    assert [type(e) for e in events.all("written")] == [ShardWritten]
    assert [type(e) for e in events.all("staged")] == [ShardStaged]
    _, saved = load_shard(verified.path)
    assert torch.equal(saved["big"], state["big"])


def _write_only(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings
) -> tuple[ShardWritten, Agent]:
    writer = agent("nvme-write")
    handle = ckpt.save(3, {"w": torch.arange(100_000, dtype=torch.float32)})
    written = handle.wait("written", timeout=30)
    assert isinstance(written, ShardWritten)
    writer.stop()
    return written, writer


def _flip_data_byte(path: str) -> None:
    head = read_head(path)
    with open(path, "r+b") as f:
        f.seek(head.data_offset + head.header.blobs[0].offset + 12345)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_is_caught_and_not_verified(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, job: str, events: Events
) -> None:
    """A byte flipped on disk is caught by verify: `failed` names the file and both digests,
    and the shard is never marked verified (no staging copy left to rewrite from)."""
    written, _ = _write_only(ckpt, agent, settings)
    _flip_data_byte(written.path)
    for marker in (Path(settings.staging_root) / job / "rank-00000").glob("slot-*.step-*"):
        marker.unlink()  # the staging copy is gone
    agent("verify")
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "verify", kind="failed"
    )
    assert isinstance(failed, StageFailed)
    assert failed.error == "IntegrityError" and not failed.retryable
    assert written.path in failed.message and "tensor w" in failed.message
    head = read_head(written.path)
    assert f"expected {head.header.blobs[0].digest.hex()}" in failed.message
    assert "got " in failed.message
    time.sleep(1.0)
    assert events.all("verified") == []


def test_corrupt_shard_is_rewritten_once_from_staging(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, job: str, events: Events
) -> None:
    """With the staging copy still there, verify reports the corruption, rewrites the shard
    from staging and verifies the new copy."""
    written, _ = _write_only(ckpt, agent, settings)
    _flip_data_byte(written.path)
    agent("verify")
    verified = events.wait_for(lambda e: isinstance(e, ShardVerified), kind="verified")
    assert isinstance(verified, ShardVerified) and verified.rewritten
    (failed,) = events.all("failed")
    assert isinstance(failed, StageFailed) and failed.retryable and "rewritten" in failed.message
    _, saved = load_shard(written.path)
    assert torch.equal(saved["w"], torch.arange(100_000, dtype=torch.float32))


def test_malformed_message_is_terminated_and_worker_keeps_serving(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, job: str, events: Events
) -> None:
    """Garbage on a stage's subject is terminated and reported with subject and sequence; the
    worker then processes the next good event."""
    subject = f"tp.{job}.staged.{settings.node}.0"

    async def publish_garbage() -> int:
        async with Bus(settings) as bus:
            await bus.ensure_stream(job)  # (a Checkpointer makes it with its first save)
            ack = await bus.js.publish(
                subject, b"{not json", stream=stream_name(settings.stream, job)
            )
            return ack.seq

    seq = anyio.run(publish_garbage)
    agent("nvme-write")
    failed = events.wait_for(lambda e: isinstance(e, StageFailed), kind="failed")
    assert isinstance(failed, StageFailed)
    assert failed.subject == subject and failed.stream_seq == seq and not failed.retryable
    assert failed.step is None and "undecodable" in failed.message
    handle = ckpt.save(1, {"x": torch.ones(3)})
    assert isinstance(handle.wait("written", timeout=30), ShardWritten)


@pytest.mark.parametrize("bad", ["a.b", "", "x" * 65, "a b", "tp>", "../up", "naïve"])
def test_unsafe_names_are_rejected(settings: Settings, bad: str) -> None:
    """Job and node names that are not safe subject tokens and path parts fail clearly."""
    with pytest.raises(InvalidNameError, match=r"\[A-Za-z0-9_-\]"):
        Checkpointer(bad, settings=settings)
    with pytest.raises(InvalidNameError, match="node name"):
        Checkpointer("ok", node=bad or "-bad.", settings=settings)


def test_full_staging_pool_wait_times_out_clearly(settings: Settings, job: str) -> None:
    """With no agent releasing slots, policy `wait` times out with an error naming the steps."""
    s = settings.replace(staging_slots=2, slot_wait_timeout_s=0.3)
    with Checkpointer(job, settings=s) as ckpt:
        ckpt.save(1, {"a": torch.ones(4)})
        ckpt.save(2, {"a": torch.ones(4)})
        t0 = time.monotonic()
        with pytest.raises(SlotTimeoutError) as err:
            ckpt.save(3, {"a": torch.ones(4)})
        assert 0.3 <= time.monotonic() - t0 < 5
        assert err.value.busy == [1, 2] and "agent" in str(err.value)


def test_full_staging_pool_skip_returns_skipped_handle(settings: Settings, job: str) -> None:
    """Policy `skip` returns at once with a handle marked skipped, and counts it."""
    s = settings.replace(staging_slots=1, slot_policy="skip")
    with Checkpointer(job, settings=s) as ckpt:
        ckpt.save(1, {"a": torch.ones(4)})
        handle = ckpt.save(2, {"a": torch.ones(4)})
        assert handle.skipped and handle.done() and handle.result() is None
        assert ckpt.stats.skipped == 1 and ckpt.stats.staged == 1


def test_nvme_without_room_fails_before_any_final_file(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """When the NVMe filesystem cannot take the shard, nvme-write reports a retryable error and
    neither a final nor a temp file exists."""
    full = settings.replace(nvme_reserve_bytes=1 << 60)
    with Checkpointer(job, settings=full) as ckpt:
        ckpt.save(1, {"a": torch.ones(1000)})
        agent("nvme-write", settings=full)
        failed = events.wait_for(lambda e: isinstance(e, StageFailed), kind="failed")
    assert isinstance(failed, StageFailed)
    assert failed.error == "NoSpaceError" and failed.retryable and failed.stage == "nvme-write"
    assert not final_path(full, job, 1).parent.exists()  # no final file, no temp file


def test_trainer_crash_after_save_loses_nothing(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """A trainer killed right after save() returns still gets its shard written and verified
    (the bytes live in shared memory), and its orphaned slot is cleaned up on release."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, sys, torch\n"
        "from tierpipe.trainer.checkpointer import Checkpointer\n"
        "from tierpipe.settings import load_settings\n"
        f"c = Checkpointer({job!r}, rank=0, world_size=1, settings=load_settings())\n"
        "c.save(42, {'w': torch.arange(1000.0)})\n"
        "os._exit(9)  # no close(), no cleanup\n"
    )
    env = {**os.environ, **settings.as_env()}
    proc = subprocess.run([sys.executable, str(script)], env=env, timeout=60)
    assert proc.returncode == 9
    agent()
    verified = events.wait_for(lambda e: isinstance(e, ShardVerified), kind="verified")
    _, saved = load_shard(verified.path)  # type: ignore[union-attr]
    assert torch.equal(saved["w"], torch.arange(1000.0))
    events.wait_for(lambda e: getattr(e, "tier", None) == "ram", kind="evicted")
    slots = Path(settings.staging_root) / job / "rank-00000"
    assert sorted(p.name for p in slots.iterdir()) == ["owner.lock"]
