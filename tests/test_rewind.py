"""Going back in a job's history is explicit: refused by default, a branch when asked for.

A run restarted from scratch under the same job name would save steps the job already has (or
older ones) and be shadowed by the old run's newer steps. Such a save is refused unless the
process restored first (a branch at the restored step) or says `overwrite=True` (a branch at its
first save). Either way the abandoned steps of this rank are superseded: never restored again,
their files and objects replaced by the new saves of the same steps.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.errors import NoCheckpointError, StaleStepError
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import ShardFlushed, StageFailed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def state(value: float) -> dict[str, object]:
    return {"w": torch.full((256,), value), "b": torch.arange(8) * value}


def save_all(ckpt: Checkpointer, steps: list[int], value: float) -> None:
    for step in steps:
        ckpt.save(step, state(value + step)).result(timeout=30)


def test_fresh_process_may_not_save_an_older_step(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """A new process that did not restore gets StaleStepError for a step at or before the job's
    newest; a newer step is fine."""
    agent("nvme-write", "verify", "evict").wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as first:
        save_all(first, [10, 20], 1.0)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as second:
        for step in (5, 20):
            with pytest.raises(StaleStepError) as err:
                second.save(step, state(2.0))
            assert (err.value.job, err.value.step, err.value.newest) == (job, step, 20)
        assert "overwrite=True" in str(err.value)
        second.save(21, state(2.0)).result(timeout=30)
        assert second.latest_step() == 21


def test_overwrite_supersedes_the_newer_steps_and_replaces_the_same_step(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """overwrite=True: saving step 10 again supersedes the old 10 and 20; the new 10 replaces the
    old file on NVMe and the old object in S3, and only it is listed and restored."""
    agent().wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as first:
        save_all(first, [10, 20], 1.0)
    events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 20, kind="flushed")
    with Checkpointer(job, rank=0, world_size=1, settings=settings, overwrite=True) as second:
        verified = second.save(10, state(5.0)).result(timeout=30)
        _, on_disk = load_shard(verified.path)
        assert torch.equal(on_disk["w"], state(5.0)["w"])
        events.wait_for(
            lambda e: isinstance(e, ShardFlushed) and e.step == 10 and e.epoch == second.epoch,
            kind="flushed",
        )
        assert second.all_steps() == [10]
        with pytest.raises(NoCheckpointError, match="superseded"):
            second.restore(step=20)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as third:
        restored = third.restore()
        assert restored.step == 10 and torch.equal(restored.state["w"], state(5.0)["w"])
    failures = [e for e in events.all("failed") if isinstance(e, StageFailed) and not e.retryable]
    assert failures == []


def test_restore_then_save_branches_the_history(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Restoring step 20 of 10/20/30 and training on: the new 30 replaces the abandoned 30 on
    every tier and is what the next restart restores."""
    agent().wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as first:
        save_all(first, [10, 20, 30], 1.0)
    events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 30, kind="flushed")
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as second:
        assert second.restore(step=20).step == 20
        save_all(second, [30], 7.0)
        events.wait_for(
            lambda e: isinstance(e, ShardFlushed) and e.step == 30 and e.epoch == second.epoch,
            kind="flushed",
        )
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as third:
        restored = third.restore()
        assert restored.step == 30 and torch.equal(restored.state["w"], state(37.0)["w"])


def test_a_restore_right_after_a_branching_save_never_returns_the_abandoned_step(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """A run restores step 10 of 10/20, saves 15 (a branch at 10) and dies at once: the next
    restore gets 10, not the abandoned 20. The job state learns of the branch only from the
    agent's events about the new save, which may not have come yet (here: the agent is
    paused); the restore read the newest `staged` events too late, and returned 20."""
    worker = agent("nvme-write", "verify", "evict").wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as first:
        save_all(first, [10, 20], 1.0)
        deadline = time.monotonic() + 30
        while 20 not in first.all_steps():
            assert time.monotonic() < deadline, "step 20 never complete"
            time.sleep(0.05)
    assert worker.proc is not None
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        with Checkpointer(job, rank=0, world_size=1, settings=settings) as second:
            assert second.restore(step=10).step == 10
            second.save(15, state(7.0))  # (staged: the paused agent never takes it)
        with Checkpointer(job, rank=0, world_size=1, settings=settings) as third:
            restored = third.restore()
            assert restored.step == 10 and torch.equal(restored.state["w"], state(11.0)["w"])
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
