"""Staging slots in shared memory: ownership, busy markers, release and orphan cleanup."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tierpipe.errors import ConfigError, ShardFormatError, StagingGoneError
from tierpipe.schemas import ShardStaged
from tierpipe.state import plan_state
from tierpipe.storage.shard import slot_generation
from tierpipe.storage.staged_image import open_image, release
from tierpipe.storage.staging import SlotPool, stale_markers


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
        assert pool.reclaim(stale_markers(pool.busy(), published_up_to=4)) == {9: "never published"}
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


def test_markers_the_stream_proves_dead_are_stale() -> None:
    """Markers of a verified, a superseded and a permanently failed step are stale; a step
    still on its way (staged after those events) and an unpublished-but-older one are not."""
    busy = {0: 3, 1: 5, 2: 7, 3: 8}
    assert stale_markers(busy, published_up_to=8, verified_up_to=5, failed=7) == {
        3: "superseded by verified step 5",
        5: "verified",
        7: "failed permanently",
    }
    # A newer save of step 5 was staged after the verify of an older one: not stale.
    assert stale_markers({1: 5}, published_up_to=5, verified_up_to=5, pending=5) == {}


def test_each_image_bumps_the_slot_generation_before_its_head(root: Path) -> None:
    """`Slot.begin` bumps the generation and writes the head around it, so the head's own
    (zero) generation field never resets it."""
    pool = SlotPool(root, "j", 0, 1)
    try:
        slot = pool.slots[0]
        mm = slot.ensure(8192)
        head = bytes(range(256)) * 16
        assert slot.begin(head) == 1 and slot.begin(head) == 2
        assert slot_generation(mm) == 2 == slot.generation
        assert mm[:40] == head[:40] and mm[48:4096] == head[48:4096]
    finally:
        pool.close()


def test_release_for_another_epoch_leaves_the_slot_alone(root: Path) -> None:
    """After a rewind, a late release for the abandoned save of a step never frees the slot now
    holding the new save of that step (the slot's image names its epoch)."""
    pool = SlotPool(root, "j", 0, 1)
    try:
        slot = pool.acquire(wait=False, timeout_s=0)
        assert slot is not None
        plan = plan_state(
            {"w": torch.ones(8)}, job="j", step=5, rank=0, world_size=1, node="n", epoch=222
        )
        mm = slot.ensure(plan.nbytes)
        mm[: len(plan.head)] = plan.head
        pool.mark(slot, 5)
        assert release(root, "j", 0, 5, epoch=111) is None
        assert pool.busy() == {slot.index: 5}
        assert release(root, "j", 0, 5, epoch=222) == slot.path
    finally:
        pool.close()
