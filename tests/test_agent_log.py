"""The agent's log in a healthy run (issue 24, item 4): no warning without a cause, and an idle
long poll is no failure, so a healthy run logs no warning at all."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_healthy_run_logs_no_warning(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Saves, uploads and retention, then 20 s idle (each stage's long polls end empty a few
    times): not one line at warning or above in the agent's log."""
    a = agent(settings=settings.replace(nvme_keep_latest_k=2, s3_keep_latest_k=2))
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        for step in range(1, 7):
            c.save(step, {"w": torch.full((4096,), float(step))})
            c.wait_until_finished(timeout=60)
        events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 6, kind="flushed")
        time.sleep(20)
    lines = [json.loads(line) for line in a.log().splitlines() if line.startswith("{")]
    assert len(lines) > 10, a.log()[-2000:]  # (the log is there, and JSON)
    loud = [e for e in lines if e.get("level") in ("warning", "error", "critical")]
    assert loud == [], loud
