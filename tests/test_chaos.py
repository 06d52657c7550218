"""Chaos: lose a node mid-training, restart with a replacement, resume exactly.

2 simulated nodes x 2 ranks on this machine, each node with its own NVMe root, staging root and
agent, sharing NATS and S3. Node b is killed (SIGKILL to its agent; the whole job's ranks die
too, as an elastic restart does) and its NVMe root deleted; the job restarts with a replacement
node c. Survivors must load from their NVMe, the replacement from S3, bitwise equal to what was
saved; training must then continue exactly as an uninterrupted run would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Agent, Events, finish_ranks
from tierpipe.schemas import ShardFlushed, StageFailed
from tierpipe.settings import Settings

# Its own waits bound it (agents ready, every rank flushed, the restarted run finished, the last
# flush): on a loaded 2-core machine they add up to more than the suite's 180 s per test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

STEPS, EVERY, WORLD = 40, 4, 4
RANK_SCRIPT = Path(__file__).parent / "chaos_rank.py"


def node_settings(base: Settings, tmp: Path, name: str) -> Settings:
    return base.replace(
        node=f"{base.node}-{name}",
        nvme_root=str(tmp / f"nvme-{name}"),
        staging_root=f"{base.staging_root}-{name}",
    )


def launch(settings: Settings, job: str, rank: int, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": "warning"}
    args = [sys.executable, str(RANK_SCRIPT), job, str(rank), str(WORLD), str(STEPS), str(EVERY)]
    return subprocess.Popen([*args, str(out), *extra], env=env, cwd=RANK_SCRIPT.parent.parent)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_node_loss_restart_resumes_exactly(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """Kill node b mid-run and delete its NVMe; the restarted job restores the newest complete
    step (node a from NVMe, replacement c from S3), bitwise, and finishes like a clean run."""
    a, b, c = (node_settings(settings, tmp_path, n) for n in "abc")
    ref = tmp_path / "reference.jsonl"
    ref_node = node_settings(settings, tmp_path, "ref")
    agent("nvme-write", "verify", "evict", settings=ref_node)  # frees the reference's slots
    reference = [launch(ref_node, f"{job}-ref", r, ref) for r in range(WORLD)]
    agent(settings=a).wait_ready()
    agent_b = agent(settings=b).wait_ready()
    run1 = tmp_path / "run1.jsonl"
    ranks = [launch(a if r < 2 else b, job, r, run1) for r in range(WORLD)]
    try:
        deadline = time.monotonic() + 120
        # Ranks run unsynchronised and start at different times on a loaded machine: wait until
        # every rank (not only node b's) has a flushed save, so a complete step exists.
        while {
            e.rank
            for e in events.all("flushed")
            if isinstance(e, ShardFlushed) and e.step >= 2 * EVERY
        } != set(range(WORLD)):
            assert all(p.poll() is None for p in ranks), "a rank died before the kill"
            assert time.monotonic() < deadline, "not every rank flushed step 8"
            time.sleep(0.1)
        time.sleep(0.5)  # a few more steps and an unflushed save or two on node b
    finally:
        for p in ranks:
            p.send_signal(signal.SIGKILL)
        agent_b.stop(signal.SIGKILL)
    for p in ranks:
        p.wait()
    killed_ns = time.time_ns()  # every save of the restarted run has a later epoch
    killed_at = max(r["step"] for r in records(run1) if r["event"] == "step")
    shutil.rmtree(b.nvme_root)
    shutil.rmtree(b.staging_root, ignore_errors=True)

    agent(settings=c).wait_ready()
    run2 = tmp_path / "run2.jsonl"
    t0 = time.monotonic()
    restarted = [launch(a if r < 2 else c, job, r, run2, "resume") for r in range(WORLD)]
    finish_ranks([*restarted, *reference], timeout=180)
    wall = time.monotonic() - t0

    saved = {(r["rank"], r["step"]): r["digest"] for r in records(run1) if r["event"] == "saved"}
    restored = {r["rank"]: r for r in records(run2) if r["event"] == "restored"}
    finals = {r["rank"]: r["digest"] for r in records(run2) if r["event"] == "done"}
    expected = {r["rank"]: r["digest"] for r in records(ref) if r["event"] == "done"}
    steps = {r["step"] for r in restored.values()}
    assert len(restored) == WORLD and len(steps) == 1, restored
    step = steps.pop()
    assert step >= 2 * EVERY and step % EVERY == 0
    # Survivors read their NVMe, or object storage where the step restored is one their NVMe no
    # longer keeps (no replica of the replaced node's ranks of a newer one was made yet: a
    # loaded machine); the replaced node's ranks a replica on node a, or object storage.
    tiers = [restored[r]["tier"] for r in range(WORLD)]
    assert set(tiers[:2]) <= {"nvme", "s3"} and set(tiers[2:]) <= {"peer", "s3"}, tiers
    assert "peer" not in tiers or tiers[:2] == ["nvme", "nvme"], tiers
    for r in range(WORLD):
        assert restored[r]["digest"] == saved[(r, step)], f"rank {r} restored state differs"
        assert finals[r] == expected[r], f"rank {r} did not continue exactly"
    # The restarted run saved steps the killed run had saved too (a branch of the history at the
    # restored step): its saves replace the abandoned ones on every tier, none fails, and the
    # newest step is complete in object storage with the restarted run's bytes.
    events.wait_for(
        lambda e: isinstance(e, ShardFlushed) and e.step == STEPS and e.rank == WORLD - 1,
        kind="flushed",
        timeout=60,
    )
    # (The killed run's own late saves may fail against the new ones: they were abandoned.)
    hard = [
        e
        for e in events.all("failed")
        if isinstance(e, StageFailed) and not e.retryable and e.epoch > killed_ns
    ]
    assert hard == [], hard
    report = {
        "steps_lost": killed_at - step,
        "killed_at_step": killed_at,
        "restored_step": step,
        "seconds_to_resume": round(max(r["seconds"] for r in restored.values()), 3),
        "restart_wall_s": round(wall, 3),
    }
    print("\nchaos:", json.dumps(report))
    (Path(os.environ.get("TIERPIPE_CHAOS_REPORT", tmp_path / "chaos.json"))).write_text(
        json.dumps(report)
    )
