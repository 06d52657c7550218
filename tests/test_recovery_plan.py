"""The recovery planner: newest restorable step, per-rank sources, and why newer steps lost."""

from __future__ import annotations

import pytest

from tests.oracle_catalog import Catalog
from tests.oracle_plan import plan_recovery
from tierpipe.errors import NoCheckpointError, WorldSizeMismatchError
from tierpipe.schemas import (
    Event,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    StageFailed,
)

NODES = ("n0", "n0", "n1", "n1")  # 2 nodes x 2 ranks
RANK_NODES = dict(enumerate(NODES))


def shard_events(step: int, rank: int, *, flushed: bool = True, world: int = 4) -> list[Event]:
    node = NODES[rank] if world == 4 else "n0"
    ident = dict(job="j", node=node, ts=0.0, step=step, rank=rank, world_size=world)
    path = f"/nvme/j/step-{step:012d}/rank-{rank:05d}-of-{world:05d}.shard"
    d = f"{step:016x}{rank:016x}"
    out: list[Event] = [
        ShardWritten(**ident, path=path, nbytes=4096, header_digest=d, tensors=1, seconds=0),
        ShardVerified(**ident, path=path, nbytes=4096, header_digest=d, seconds=0),
    ]
    if flushed:
        out.append(
            ShardFlushed(
                **ident,
                bucket="b",
                key=f"j/{step}/{rank}",
                etag="e",
                checksum="c",
                header_digest=d,
                nbytes=4096,
                seconds=0,
            )
        )
    return out


def catalog(*groups: list[Event]) -> Catalog:
    cat = Catalog()
    for group in groups:
        for e in group:
            cat.apply(e)
    return cat


def full_step(step: int, **kw: object) -> list[Event]:
    return [e for r in range(4) for e in shard_events(step, r, **kw)]  # type: ignore[arg-type]


def test_survivors_read_nvme_and_everyone_else_reads_s3() -> None:
    """With n1 replaced, n0's ranks read their NVMe, n1's ranks read object storage."""
    plan = plan_recovery(
        catalog(full_step(10)), "j", world_size=4, alive={"n0"}, rank_nodes=RANK_NODES
    )
    assert plan.step == 10
    assert [plan.sources[r][0].tier for r in range(4)] == ["nvme", "nvme", "s3", "s3"]
    assert [len(plan.sources[r]) for r in range(4)] == [2, 2, 1, 1]  # nvme falls back to s3


def test_incomplete_newest_step_is_rejected_with_a_reason() -> None:
    """A step that rank 3 never finished loses to the one before it, and the plan says why."""
    partial = [e for r in range(3) for e in shard_events(20, r)]
    plan = plan_recovery(
        catalog(full_step(10), partial),
        "j",
        world_size=4,
        alive={"n0", "n1"},
        rank_nodes=RANK_NODES,
    )
    assert plan.step == 10
    assert "rank 3 never saved it" in plan.rejected[20]


def test_dead_node_without_flush_rejects_the_step() -> None:
    """An unflushed step whose node died cannot be restored; the older flushed one can."""
    plan = plan_recovery(
        catalog(full_step(10), full_step(20, flushed=False)),
        "j",
        world_size=4,
        alive={"n0"},
        rank_nodes=RANK_NODES,
    )
    assert plan.step == 10
    assert "rank 2 (on n1)" in plan.rejected[20] and "node gone" in plan.rejected[20]


def test_evicted_and_corrupt_copies_are_not_sources() -> None:
    """Evicted NVMe copies and copies verify found corrupt are skipped."""
    events = full_step(10)
    events.append(
        ShardEvicted(
            job="j",
            node="n0",
            ts=0,
            step=10,
            rank=0,
            world_size=4,
            tier="nvme",
            location="/x",
            reason="retention",
        )
    )
    events.append(
        StageFailed(
            job="j",
            node="n0",
            ts=0,
            stage="verify",
            error="IntegrityError",
            message="m",
            retryable=False,
            attempt=1,
            step=10,
            rank=1,
            world_size=4,
        )
    )
    plan = plan_recovery(
        catalog(events), "j", world_size=4, alive={"n0", "n1"}, rank_nodes=RANK_NODES
    )
    assert [plan.sources[r][0].tier for r in range(4)] == ["s3", "s3", "nvme", "nvme"]


def test_world_size_mismatch_is_a_clear_error() -> None:
    """Restoring with another world size fails naming both sizes."""
    with pytest.raises(WorldSizeMismatchError, match="saved by 4 ranks, this run has 2"):
        plan_recovery(
            catalog(full_step(10)), "j", world_size=2, alive={"n0"}, rank_nodes={0: "n0", 1: "n0"}
        )


def test_excluded_and_explicit_steps() -> None:
    """A step found bad at load time is skipped; an explicit older step is honoured."""
    cat = catalog(full_step(10), full_step(20))
    assert (
        plan_recovery(
            cat, "j", world_size=4, alive={"n0", "n1"}, rank_nodes=RANK_NODES, exclude={20}
        ).step
        == 10
    )
    assert (
        plan_recovery(cat, "j", world_size=4, alive=set(), rank_nodes=RANK_NODES, step=10).step
        == 10
    )
    with pytest.raises(NoCheckpointError, match="step 20"):
        plan_recovery(
            catalog(full_step(20, flushed=False)),
            "j",
            world_size=4,
            alive=set(),
            rank_nodes=RANK_NODES,
        )
