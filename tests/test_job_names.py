"""A job name that has no state: opening it creates nothing until the first save, and looking it
up while similar jobs exist names them (a typo must not silently start training from scratch)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import NoCheckpointError
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def traces(settings: Settings, job: str) -> dict[str, bool]:
    """What of `job` exists: its stream, its policy in KV, its staging folder."""

    async def look() -> dict[str, bool]:
        async with Bus(settings) as bus:
            stream = await bus.stream_made(job) is not None
            keep = await JobStore(bus.js, settings).bind().keep(job) is not None
        return {"stream": stream, "keep": keep}

    found = anyio.run(look)
    found["staging"] = (Path(settings.staging_root) / job).exists()
    return found


def test_looking_at_a_job_that_has_no_state_creates_nothing(settings: Settings, job: str) -> None:
    """Opening a new job and asking for its steps leaves no stream, policy or staging folder."""
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert traces(settings, job) == {"stream": False, "keep": False, "staging": False}


def test_a_first_save_makes_the_job(settings: Settings, job: str) -> None:
    """The first save makes what a job needs: its stream, its policy and its staging folder."""
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
    assert traces(settings, job) == {"stream": True, "keep": True, "staging": True}


def test_latest_step_of_a_misspelt_job_names_the_nearest_jobs(settings: Settings, job: str) -> None:
    """latest_step() of a job with no state, while a similar one exists on the node, warns
    with the similar names (and still returns None)."""
    with Checkpointer(f"{job}-llama", rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
    with (
        Checkpointer(f"{job}-lama", rank=0, world_size=1, settings=settings) as ckpt,
        structlog.testing.capture_logs() as logs,
    ):
        assert ckpt.latest_step() is None
    warnings = [e for e in logs if e["event"] == "job_unknown"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["nearest"] == [f"{job}-llama"]
    assert traces(settings, f"{job}-lama") == {"stream": False, "keep": False, "staging": False}


def test_restore_of_a_misspelt_job_fails_at_once_naming_the_nearest(
    settings: Settings, job: str
) -> None:
    """restore() of a job with no state raises NoCheckpointError at once, naming the similar
    jobs, and creates nothing."""
    with Checkpointer(f"{job}-llama", rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
    with Checkpointer(f"{job}-lama", rank=0, world_size=1, settings=settings) as ckpt:
        t0 = time.monotonic()
        with pytest.raises(NoCheckpointError, match=f"{job}-llama"):
            ckpt.restore()
        assert time.monotonic() - t0 < 5
    assert traces(settings, f"{job}-lama") == {"stream": False, "keep": False, "staging": False}


def test_a_job_whose_state_is_only_in_its_stream_is_not_new(settings: Settings, job: str) -> None:
    """A job with events in its stream but nothing in KV (never folded, or its KV bucket lost)
    is folded again from the stream, not taken for a new job that starts from scratch."""
    from tests.test_forged_head import saved_steps  # (events of verified, flushed steps)

    saved_steps(settings, job, [1, 2])
    assert traces(settings, job)["keep"] is False
    with Checkpointer(job, rank=0, world_size=2, settings=settings) as ckpt:
        assert ckpt.latest_step() == 2
