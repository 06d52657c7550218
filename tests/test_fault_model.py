"""A stateful model of a job under faults, on real parts: saves, agent crashes, trainer restarts
(restore, then train on: a branch of the history), corrupted NVMe files, object-store outages,
reindex runs, with retention running throughout (small keeps, so evictions happen).

Whatever the sequence, four things hold at the end:
- every step reported complete restores bitwise from some tier (a step whose only copy the
  model corrupted may instead be refused, never returned wrong);
- a restore never returns the bytes of another step, mid-run or at the end;
- nothing was removed from NVMe before object storage held the same save;
- the agent is still serving: one more save reaches `verified`.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from tests.conftest import Agent, Events
from tierpipe.dev import S3Server
from tierpipe.errors import NoCheckpointError
from tierpipe.recovery.reindex import reindex
from tierpipe.schemas import ShardEvicted, ShardFlushed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow

_jobs = itertools.count()


def state(step: int, value: float) -> dict[str, object]:
    return {"w": torch.full((4096,), value), "step": step}


@pytest.mark.timeout(480)  # (4 examples of 8 rules: agents killed and started, on 2 loaded cores)
def test_pipeline_keeps_its_invariants_under_random_faults(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    s3_server: S3Server,
) -> None:
    """Random sequences of saves and faults never break the four invariants (module docstring)."""
    cfg = settings.replace(
        nvme_keep_latest_k=2,
        s3_keep_latest_k=2,
        restore_timeout_s=30.0,
        s3_read_timeout_s=5.0,
        agent_lock_timeout_s=5.0,
    )
    current: list[Agent] = [agent(settings=cfg).wait_ready()]

    class JobUnderFaults(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.job = f"{job}-{next(_jobs)}"
            self.events = Events(cfg, self.job)
            self.values: dict[int, float] = {}  # step -> saved value, live history only
            self.corrupted: set[int] = set()
            self.step = 0
            self.ckpt: Checkpointer | None = None

        @initialize()
        def open(self) -> None:
            self.ckpt = Checkpointer(self.job, rank=0, world_size=1, settings=cfg)

        # Every rule saves first (1-3 steps), so faults land on work in flight.
        def _save(self, count: int) -> None:
            assert self.ckpt is not None
            for _ in range(count):
                self.step += 1
                value = random.uniform(-1e6, 1e6)
                self.ckpt.save(self.step, state(self.step, value))
                self.values[self.step] = value

        # (Named to sort first: hypothesis's first, simplest example repeats the first rule.)
        @rule(count=hs.integers(1, 3))
        def add_saves(self, count: int) -> None:
            self._save(count)

        @rule(count=hs.integers(1, 3))
        def crash_agent(self, count: int) -> None:
            self._save(count)
            current[0].stop(signal.SIGKILL)
            current[0] = agent(settings=cfg).wait_ready()

        @rule(count=hs.integers(1, 3))
        def restart_trainer(self, count: int) -> None:
            self._save(count)
            assert self.ckpt is not None
            self.ckpt.close()
            self.ckpt = Checkpointer(self.job, rank=0, world_size=1, settings=cfg)
            try:
                restored = self.ckpt.restore()
            except NoCheckpointError:
                self.ckpt.close()  # nothing complete yet: start the job over
                self.ckpt = Checkpointer(
                    self.job, rank=0, world_size=1, settings=cfg, overwrite=True
                )
                return
            self._check(restored.step, restored.state)
            # Training goes on from the restored step: later saves of the old run are abandoned.
            self.values = {s: v for s, v in self.values.items() if s <= restored.step}

        @rule(count=hs.integers(1, 3), pick=hs.integers(0, 1 << 16))
        def corrupt_a_file(self, count: int, pick: int) -> None:
            self._save(count)
            files = sorted((Path(cfg.nvme_root) / self.job).glob("step-*/rank-*.shard"))
            if not files:
                return
            path = files[pick % len(files)]  # (drawn independently of the files there)
            size = path.stat().st_size
            if size <= 8192:
                return
            with open(path, "r+b") as f:
                f.seek(size - 100)
                byte = f.read(1)
                f.seek(size - 100)
                f.write(bytes([byte[0] ^ 0xFF]))
            self.corrupted.add(int(path.parent.name.removeprefix("step-")))

        @rule(count=hs.integers(1, 3), seconds=hs.floats(0.2, 1.5))
        def object_store_outage(self, count: int, seconds: float) -> None:
            self._save(count)
            s3_server.kill()
            time.sleep(seconds)
            s3_server.start()

        @rule(count=hs.integers(1, 3))
        def run_reindex(self, count: int) -> None:
            self._save(count)
            anyio.run(lambda: reindex(cfg, self.job))

        def _check(self, step: int, restored: object) -> None:
            assert isinstance(restored, dict) and restored["step"] == step, (step, restored)
            want = state(step, self.values[step])["w"]
            assert torch.equal(restored["w"], want), f"step {step} restored other bytes"

        def teardown(self) -> None:
            if self.ckpt is None:
                return
            try:
                self.ckpt.wait_until_finished(timeout=60)
                # The agent still serves: one more save reaches `verified`.
                self.step += 1
                self.ckpt.save(self.step, state(self.step, 0.5)).result(timeout=60)
                self.values[self.step] = 0.5
                complete = self.ckpt.all_steps()
            finally:
                self.ckpt.close()
            assert self.step in complete
            # Every complete step restores bitwise from some tier. (The newest two: retention
            # keeps those; an older one may be evicted between listing and restoring it.)
            for step in complete[-2:]:
                with Checkpointer(self.job, rank=0, world_size=1, settings=cfg) as fresh:
                    try:
                        restored = fresh.restore(step=step)
                    except NoCheckpointError:
                        still = step in fresh.all_steps()
                        assert step in self.corrupted or not still, f"step {step} did not restore"
                        continue
                    self._check(step, restored.state)
            self._check_nothing_removed_early()

        def _check_nothing_removed_early(self) -> None:
            """An NVMe copy went only after object storage held the same save."""
            flushed: set[tuple[int, int, int]] = set()
            for e in self.events.all():
                if isinstance(e, ShardFlushed):
                    flushed.add((e.step, e.rank, e.epoch))
                elif (
                    isinstance(e, ShardEvicted)
                    and e.tier == "nvme"
                    and e.reason in ("retention", "disk pressure")
                ):
                    assert (e.step, e.rank, e.epoch) in flushed, f"step {e.step} left NVMe early"

    random.seed(os.getpid())
    run_state_machine_as_test(
        JobUnderFaults,
        settings=settings_for_faults(),
    )


def settings_for_faults() -> settings:
    return settings(
        max_examples=int(os.environ.get("TIERPIPE_FAULT_EXAMPLES", "4")),
        stateful_step_count=8,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
