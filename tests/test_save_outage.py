"""A checkpoint that cannot be taken never takes training with it: a NATS stall during `save()`
is reported on the save's handle and in the log, its slot is freed, and the next save tries
again (`save_errors = "raise"` keeps the old behaviour). Real nats-server, paused with SIGSTOP."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from tests.conftest import Agent
from tests.test_resilience import wait_until
from tierpipe.bus.client import Bus
from tierpipe.dev import NatsServer
from tierpipe.errors import BusUnavailableError
from tierpipe.schemas import ShardVerified
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A server of this test's own, to pause."""
    with NatsServer(tmp_path / "own-nats") as server:
        yield server


def pause(server: NatsServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)


def resume(server: NatsServer) -> None:
    assert server.proc is not None
    server.proc.send_signal(signal.SIGCONT)


def busy_markers(settings: Settings, job: str) -> list[str]:
    folder = Path(settings.staging_root) / job / "rank-00000"
    return sorted(p.name for p in folder.glob("*.step-*"))


def staged_steps(settings: Settings, job: str) -> list[int]:
    async def read() -> list[int]:
        async with Bus(settings) as bus:
            return [e.step for e in await bus.history(f"tp.{job}.staged.>")]  # type: ignore[attr-defined]

    return anyio.run(read)


def test_a_save_during_a_nats_stall_is_reported_on_its_handle_and_training_goes_on(
    settings: Settings,
    job: str,
    own_nats: NatsServer,
    agent: Callable[..., Agent],
    cpu_hog: None,
) -> None:
    """NATS paused past the save's retry window: save() returns, its handle and the log report
    the failure, the slot is free again, and a save after the stall is verified."""
    s = settings.replace(
        nats_url=own_nats.url, publish_timeout_s=1.0, save_retry_s=2.0, staging_slots=1
    )
    agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)}).result(timeout=30)
        wait_until(lambda: busy_markers(s, job) == [], what="the agent to free step 1's slot")
        pause(own_nats)
        try:
            with structlog.testing.capture_logs() as logs:
                t0 = time.monotonic()
                handle = ckpt.save(2, {"w": torch.full((1000,), 2.0)})  # does not raise
                returned_s = time.monotonic() - t0
                error = handle.exception(timeout=30)
            assert returned_s < s.publish_timeout_s + 2.0
            assert isinstance(error, BusUnavailableError)
            failed = [e for e in logs if e["event"] == "save_failed"]
            assert [(e["step"], e["log_level"]) for e in failed] == [(2, "error")]
            assert "NATS" in failed[0]["error"] or "publish" in failed[0]["error"]
            assert busy_markers(s, job) == []  # the only slot is free again
        finally:
            resume(own_nats)
        verified = ckpt.save(3, {"w": torch.full((1000,), 3.0)}).result(timeout=30)
        assert isinstance(verified, ShardVerified) and verified.step == 3


def test_a_stall_shorter_than_the_retry_window_loses_no_save(
    settings: Settings,
    job: str,
    own_nats: NatsServer,
    agent: Callable[..., Agent],
    cpu_hog: None,
) -> None:
    """NATS paused for a moment longer than one publish try: save() returns after that try,
    the `staged` event goes out once NATS is back (once: every retry has the save's message
    id) and the save is verified."""
    s = settings.replace(nats_url=own_nats.url, publish_timeout_s=1.0, save_retry_s=30.0)
    agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)}).result(timeout=30)
        pause(own_nats)
        resumer = threading.Timer(3.0, resume, args=(own_nats,))
        resumer.start()
        try:
            handle = ckpt.save(2, {"w": torch.full((1000,), 2.0)})  # does not raise
            assert not handle.done()
            verified = handle.result(timeout=60)
        finally:
            resumer.join()
        assert isinstance(verified, ShardVerified) and verified.step == 2
    assert staged_steps(s, job) == [1, 2]


def test_with_save_errors_raise_a_stalled_save_raises(
    settings: Settings, job: str, own_nats: NatsServer
) -> None:
    """`save_errors = "raise"`: a save whose `staged` event finds NATS stalled raises
    BusUnavailableError within about publish_timeout_s, and its slot is free again."""
    s = settings.replace(
        nats_url=own_nats.url, publish_timeout_s=1.0, save_errors="raise", staging_slots=1
    )
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
        release_markers(s, job)  # (no agent here: free the slot as it would)
        pause(own_nats)
        try:
            t0 = time.monotonic()
            with pytest.raises(BusUnavailableError):
                ckpt.save(2, {"w": torch.ones(4)})
            assert time.monotonic() - t0 < s.publish_timeout_s + 3.0
            assert busy_markers(s, job) == []
        finally:
            resume(own_nats)


def release_markers(settings: Settings, job: str) -> None:
    for name in busy_markers(settings, job):
        (Path(settings.staging_root) / job / "rank-00000" / name).unlink()
