"""Staging slots in shared memory: ownership, busy markers, release and orphan cleanup."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, ShardFormatError, StagingGoneError
from pipeline.staging import SlotPool, open_image, release
from schemas import ShardStaged


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "staging"


def test_one_owner_per_rank(root: Path) -> None:
    """A second process staging the same job and rank on this node is refused."""
    pool = SlotPool(root, "j", 0, 2)
    try:
        with pytest.raises(ConfigError, match="already stages"):
            SlotPool(root, "j", 0, 2)
        SlotPool(root, "j", 1, 2).close()  # another rank is fine
    finally:
        pool.close()
    SlotPool(root, "j", 0, 2).close()  # and the rank is free again after close


def test_busy_slots_are_skipped_and_released_by_step(root: Path) -> None:
    """A marked slot is not handed out again until the agent releases that step."""
    pool = SlotPool(root, "j", 0, 2)
    try:
        a = pool.acquire(wait=False, timeout_s=0)
        assert a is not None
        a.ensure(10_000)
        pool.mark(a, 5)
        b = pool.acquire(wait=False, timeout_s=0)
        assert b is not None and b.index != a.index
        pool.mark(b, 6)
        assert pool.acquire(wait=False, timeout_s=0) is None
        assert release(root, "j", 0, 5) == a.path
        assert release(root, "j", 0, 5) is None  # idempotent
        assert pool.acquire(wait=False, timeout_s=0) is a
        assert a.path.exists()  # the trainer still owns it: not deleted
    finally:
        pool.close()


def test_slots_of_an_exited_trainer_are_deleted_on_release(root: Path) -> None:
    """A busy slot outlives its trainer (the agent still needs it) and is deleted on release."""
    pool = SlotPool(root, "j", 0, 1)
    slot = pool.acquire(wait=False, timeout_s=0)
    assert slot is not None
    slot.ensure(10_000)
    pool.mark(slot, 1)
    pool.close()
    assert slot.path.exists()
    release(root, "j", 0, 1)
    assert not slot.path.exists()


def test_unpublished_markers_are_reclaimed(root: Path) -> None:
    """Markers of steps never published (a crash between copy and publish) are dropped."""
    pool = SlotPool(root, "j", 0, 2)
    try:
        for i, step in enumerate((4, 9)):
            pool.mark(pool.slots[i], step)
        assert pool.reclaim(published_up_to=4) == [9]
        assert pool.busy() == {0: 4}
    finally:
        pool.close()


def test_wait_policy_times_out_with_busy_steps(root: Path) -> None:
    """Waiting for a slot ends after the timeout, listing what holds the slots."""
    pool = SlotPool(root, "j", 0, 1)
    try:
        pool.mark(pool.slots[0], 3)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"\[3\]"):
            pool.acquire(wait=True, timeout_s=0.2)
        assert time.monotonic() - t0 >= 0.2
    finally:
        pool.close()


def test_agent_refuses_foreign_or_released_slots(root: Path) -> None:
    """The agent maps only slots under its own staging root that still hold the step."""
    event = ShardStaged(
        job="j",
        node="n",
        ts=0,
        step=1,
        rank=0,
        world_size=1,
        staging_path="/etc/passwd",
        slot=0,
        nbytes=4096,
        tensors=0,
        stall_s=0,
    )
    with pytest.raises(ShardFormatError, match="share staging_root"):
        open_image(root, event)
    pool = SlotPool(root, "j", 0, 1)
    try:
        ok_path = str(pool.slots[0].path)
        event = ShardStaged(
            job="j",
            node="n",
            ts=0,
            step=1,
            rank=0,
            world_size=1,
            staging_path=ok_path,
            slot=0,
            nbytes=4096,
            tensors=0,
            stall_s=0,
        )
        with pytest.raises(StagingGoneError, match="released or never marked"):
            open_image(root, event)
    finally:
        pool.close()
