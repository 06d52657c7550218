"""Soak: 200 checkpoints of a small state, the agent SIGKILLed at random points along the way.

Every save ends verified, the newest step restores bitwise, and the resident memory of the agent
that lives through the last 100 checkpoints stays flat (no per-checkpoint leak: a mapping, a
buffer or a catalog entry that is never freed would show here). Deselected by default (marker
`soak`); `.ci/run` runs it when time allows, `pytest -m soak` runs it by hand.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 200
#: The agent of the last stretch lives from here to the end; its memory is measured.
MEASURED_FROM = 100


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def state(step: int) -> dict[str, object]:
    return {"w": torch.full((1 << 16,), float(step)), "b": torch.arange(64) + step, "step": step}


def test_soak_200_checkpoints_with_random_kills(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """200 saves with random agent kills: all verified, newest restores exactly, and the last
    agent's resident memory grows by less than 16 MiB over its last 100 checkpoints."""
    rng = random.Random(int(os.environ.get("TIERPIPE_SOAK_SEED", "8")))
    cfg = settings.replace(nvme_keep_latest_k=2, s3_keep_latest_k=3, ack_wait_s=2.0)
    kills = set(rng.sample(range(5, MEASURED_FROM), 5))
    current = agent(settings=cfg).wait_ready()
    samples: list[tuple[int, int]] = []
    with Checkpointer(job, rank=0, world_size=1, settings=cfg) as ckpt:
        for step in range(1, STEPS + 1):
            ckpt.save(step, state(step))
            if step in kills:
                current.stop(signal.SIGKILL)
                current = agent(settings=cfg).wait_ready()
            if step >= MEASURED_FROM and step % 10 == 0:
                assert current.proc is not None
                samples.append((step, rss_bytes(current.proc.pid)))
        ckpt.wait_until_finished(timeout=120)
        events.wait_for(
            lambda e: isinstance(e, ShardFlushed) and e.step == STEPS, kind="flushed", timeout=60
        )
    with Checkpointer(job, rank=0, world_size=1, settings=cfg) as fresh:
        restored = fresh.restore()
        assert restored.step == STEPS
        assert torch.equal(restored.state["w"], state(STEPS)["w"])
    first = min(rss for _, rss in samples[:2])
    last = samples[-1][1]
    report = {
        "checkpoints": STEPS,
        "agent_kills": len(kills),
        "agent_rss_mib_at_step_100": round(first / 2**20, 1),
        "agent_rss_mib_at_step_200": round(last / 2**20, 1),
        "agent_rss_growth_mib": round((last - first) / 2**20, 2),
    }
    print("\nsoak:", json.dumps(report))
    (Path(os.environ.get("TIERPIPE_SOAK_REPORT", tmp_path / "soak.json"))).write_text(
        json.dumps(report)
    )
    assert last - first < 16 << 20, report
