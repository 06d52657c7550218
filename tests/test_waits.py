"""Long waits warn within seconds, say what they wait for and why, and keep warning: a save on a
node without an agent, a save waiting for a staging slot (no agent; the NVMe full), a restore
waiting for a rank that never came. Real nats-server, real agent processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import structlog
import torch

from tests.conftest import Agent
from tierpipe.errors import RestoreTimeoutError, SlotTimeoutError
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def first(logs: list[dict[str, Any]], event: str, timeout: float) -> dict[str, Any]:
    """The first captured line of `event`, waited for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in logs if e["event"] == event]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {event} within {timeout} s: {logs}"
        time.sleep(0.02)


def test_a_save_on_a_node_without_an_agent_says_so_at_once(settings: Settings, job: str) -> None:
    """No agent serves this node: the first save warns within a second, naming the node and
    what to start."""
    with (
        Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt,
        structlog.testing.capture_logs() as logs,
    ):
        ckpt.save(1, {"w": torch.ones(4)})
        warning = first(logs, "node_agent_missing", timeout=1.0)
    assert warning["log_level"] == "warning" and warning["node"] == settings.node
    assert "tierpipe worker all" in warning["hint"] and "tierpipe up" in warning["hint"]


def test_a_slot_wait_without_an_agent_keeps_warning_why(
    settings: Settings, job: str, cpu_hog: None
) -> None:
    """With every slot busy and no agent to free one, the waiting save warns within seconds
    that no agent runs on the node, and again while it waits, before SlotTimeoutError."""
    s = settings.replace(staging_slots=1, slot_wait_timeout_s=4.0, wait_warning_s=0.5)
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            with pytest.raises(SlotTimeoutError) as err:
                ckpt.save(2, {"w": torch.ones(4)})
    waits = [e for e in logs if e["event"] == "slot_wait_continued"]
    assert len(waits) >= 3, logs
    assert all(e["busy_steps"] == [1] and "no node agent" in e["why"] for e in waits)
    assert waits[0]["waited_s"] < 2.0 and time.monotonic() - t0 >= 4.0
    assert "no node agent" in str(err.value)


def test_a_slot_wait_behind_a_full_nvme_names_it(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """The agent cannot write the busy slot's step (NVMe full, retrying): the waiting save says
    so within seconds, with the agent's own error."""
    full = settings.replace(nvme_reserve_bytes=1 << 60, max_deliver=1000)
    agent(settings=full).wait_ready()
    s = full.replace(staging_slots=1, slot_wait_timeout_s=4.0, wait_warning_s=0.5)
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)})
        with structlog.testing.capture_logs() as logs, pytest.raises(SlotTimeoutError):
            ckpt.save(2, {"w": torch.ones(1000)})
    waits = [e for e in logs if e["event"] == "slot_wait_continued"]
    assert waits and any("NoSpaceError" in e["why"] for e in waits), waits


def test_a_restore_waiting_for_a_missing_rank_names_it_within_seconds(
    settings: Settings, job: str, cpu_hog: None
) -> None:
    """Rank 1 of 2 never calls restore(): rank 0 warns within seconds, naming rank 1, and
    keeps warning until RestoreTimeoutError."""
    s = settings.replace(restore_timeout_s=6.0, wait_warning_s=0.5)
    with Checkpointer(job, rank=0, world_size=2, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)  # (the job exists)
        errors: list[BaseException] = []

        def restore() -> None:
            try:
                ckpt.restore()
            except BaseException as e:
                errors.append(e)

        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            thread = threading.Thread(target=restore)
            thread.start()
            warning = first(logs, "restore_wait_continued", timeout=5.0)
            warned_s = time.monotonic() - t0
            thread.join(60)
    assert warned_s < 4.0
    assert warning["missing_ranks"] == [1] and warning["log_level"] == "warning"
    assert len([e for e in logs if e["event"] == "restore_wait_continued"]) >= 3
    assert len(errors) == 1 and isinstance(errors[0], RestoreTimeoutError)
