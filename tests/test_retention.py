"""Retention decisions from the catalog: the policy, and the last good copy always survives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierpipe.catalog import Catalog
from tierpipe.retention import Policy, plan_evictions
from tierpipe.schemas import (
    Event,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    StageFailed,
)

NODES = ("a", "b")  # rank r lives on node NODES[r]


def digest(step: int, rank: int) -> str:
    return f"{step:016x}{rank:016x}"


def lifecycle(step: int, rank: int, *, flushed: bool = True) -> list[Event]:
    node = NODES[rank]
    ident = dict(job="j", node=node, ts=0.0, step=step, rank=rank, world_size=2)
    path = f"/nvme/{node}/j/step-{step:012d}/rank-{rank:05d}-of-00002.shard"
    events: list[Event] = [
        ShardWritten(
            **ident, path=path, nbytes=4096, header_digest=digest(step, rank), tensors=1, seconds=0
        ),
        ShardVerified(**ident, path=path, nbytes=4096, header_digest=digest(step, rank), seconds=0),
    ]
    if flushed:
        events.append(
            ShardFlushed(**ident, bucket="b", key=f"j/{step}/{rank}", etag="e", checksum="c",
                         header_digest=digest(step, rank), nbytes=4096, seconds=0)
        )  # fmt: skip
    return events


def apply_evictions(catalog: Catalog, policy: Policy, node: str) -> list[ShardEvicted]:
    out = []
    for e in plan_evictions(catalog, "j", policy, node=node):
        ev = ShardEvicted(job="j", node=node, ts=0.0, step=e.step, rank=e.rank, world_size=2,
                          tier=e.tier, location=e.location, reason=e.reason)  # fmt: skip
        catalog.apply(ev)
        out.append(ev)
    return out


def kept(catalog: Catalog, tier: str) -> list[int]:
    return sorted({s.step for s in catalog.shards("j") if s.usable(tier)})  # type: ignore[arg-type]


def test_policy_tier_by_tier_over_twelve_steps() -> None:
    """12 steps x 2 ranks with K=3, M=4, keep_period=5: exactly the policy's steps remain."""
    policy = Policy(nvme_keep_latest_k=3, s3_keep_latest_k=4, s3_keep_period=5)
    catalog = Catalog()
    for step in range(1, 13):
        for rank in (0, 1):
            for event in lifecycle(step, rank):
                catalog.apply(event)
                for node in NODES:
                    apply_evictions(catalog, policy, node)
    assert kept(catalog, "nvme") == [10, 11, 12]
    assert kept(catalog, "s3") == [5, 9, 10, 11, 12]


def test_unflushed_nvme_copies_stay_and_newer_in_flight_steps_are_kept() -> None:
    """NVMe copies never flushed are not removed; a newer incomplete step is not counted."""
    policy = Policy(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    catalog = Catalog()
    for step in range(1, 6):
        for rank in (0, 1):
            for event in lifecycle(step, rank, flushed=step != 2):
                catalog.apply(event)
    for event in lifecycle(6, 0):  # step 6: only rank 0 so far
        catalog.apply(event)
    for node in NODES:
        apply_evictions(catalog, policy, node)
    assert kept(catalog, "nvme") == [2, 4, 5, 6]  # 2 was never flushed
    assert kept(catalog, "s3") == [4, 5, 6]


def test_disk_pressure_takes_oldest_flushed_copies_but_not_the_newest_step() -> None:
    """Under pressure even kept copies go, oldest first, never the newest complete step."""
    policy = Policy(nvme_keep_latest_k=3, s3_keep_latest_k=10, nvme_min_free_bytes=1 << 40)
    catalog = Catalog()
    for step in (1, 2, 3):
        for rank in (0, 1):
            for event in lifecycle(step, rank):
                catalog.apply(event)
    plan = plan_evictions(catalog, "j", policy, node="a", nvme_free_bytes=0)
    assert [(e.step, e.tier, e.reason) for e in plan] == [
        (1, "nvme", "disk pressure"),
        (2, "nvme", "disk pressure"),
    ]


def test_corrupt_copies_go_without_a_flush() -> None:
    """A copy verify found corrupt is removed once old enough, flushed or not."""
    policy = Policy(nvme_keep_latest_k=2)
    catalog = Catalog()
    catalog.apply(lifecycle(1, 0)[0])
    catalog.apply(StageFailed(job="j", node="a", ts=0, stage="verify", error="IntegrityError",
                              message="m", retryable=False, attempt=1, step=1, rank=0,
                              world_size=2))  # fmt: skip
    for step in (2, 3):
        for rank in (0, 1):
            for event in lifecycle(step, rank, flushed=False):
                catalog.apply(event)
    (e,) = plan_evictions(catalog, "j", policy, node="a")
    assert (e.step, e.tier, e.reason) == (1, "nvme", "corrupt copy")


shard_fates = st.lists(
    st.tuples(
        st.integers(1, 8),  # step
        st.integers(0, 1),  # rank
        st.integers(1, 3),  # how far its life got: written, verified, flushed
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    fates=shard_fates,
    order=st.randoms(use_true_random=False),
    k=st.integers(2, 4),
    m=st.integers(1, 4),
    period=st.sampled_from([0, 3]),
)
def test_newest_complete_step_of_every_tier_survives(fates, order, k, m, period) -> None:
    """Whatever arrives in whatever order (crashes cut lifecycles short, redeliveries repeat
    events), no eviction removes a copy of the newest complete step of a tier."""
    policy = Policy(nvme_keep_latest_k=k, s3_keep_latest_k=m, s3_keep_period=period)
    events = [e for step, rank, life in fates for e in lifecycle(step, rank)[:life]]
    events += order.sample(events, len(events) // 4)  # redeliveries
    order.shuffle(events)
    catalog = Catalog()
    for event in events:
        catalog.apply(event)
        for node in NODES:
            before = {
                tiers: catalog.complete_steps("j", tiers)
                for tiers in (("nvme",), ("s3",), ("nvme", "s3"))
            }
            flushed = {(s.step, s.rank) for s in catalog.shards("j") if s.usable("s3")}
            evicted = apply_evictions(catalog, policy, node)
            for tiers, done in before.items():
                if done:
                    assert done[-1] in catalog.complete_steps("j", tiers), (tiers, done, evicted)
            for ev in evicted:
                if ev.tier == "nvme":  # only ever once the same save is in object storage
                    assert (ev.step, ev.rank) in flushed, ev
