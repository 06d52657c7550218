"""Retention as the coordinator and the nodes run it: the job state's floors (`JobState`), the
coordinator's object removals and each node's verdict on its own NVMe copies
(`floor_verdict`), simulated together; the last good copy of every tier always survives."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierpipe.control.jobstate import JobState
from tierpipe.schemas import Event, ShardEvicted, ShardFlushed, ShardVerified, ShardWritten
from tierpipe.schemas.jobstate import Floors, Keep
from tierpipe.stages.evict import floor_verdict

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


class Job:
    """The coordinator's fold, the bucket and every node's NVMe, driven by the same events."""

    def __init__(self, keep: Keep) -> None:
        self.keep = keep
        self.state = JobState("j", keep)
        self.seq = 0
        #: (step, rank) -> header digest: the NVMe files (rank r on node NODES[r]) and objects.
        self.nvme: dict[tuple[int, int], str] = {}
        self.s3: dict[tuple[int, int], str] = {}
        self.removed_unflushed: list[tuple[int, int]] = []

    def feed(self, event: Event) -> None:
        self.seq += 1
        self.state.apply(self.seq, event)
        if isinstance(event, ShardWritten):
            self.nvme[(event.step, event.rank)] = event.header_digest
        elif isinstance(event, ShardFlushed):
            self.s3[(event.step, event.rank)] = event.header_digest
        changes = self.state.take_changes()
        for step in changes.s3_removed:  # the coordinator's DeleteObjects
            for rank in range(2):
                self.s3.pop((step, rank), None)
        if changes.floors or changes.s3_removed:
            self.apply_floors(self.state.floors())

    def apply_floors(self, floors: Floors) -> None:
        """Every node removes its own copies its verdict allows, and says so."""
        for (step, rank), held in sorted(self.nvme.items()):
            if (step, rank) not in self.nvme:
                continue  # (removed by the floors its own removal moved: the upload target)
            verdict = floor_verdict(step, floors, self.keep)
            flushed = self.s3.get((step, rank)) == held
            if verdict == "keep" or (verdict == "if-flushed" and not flushed):
                continue
            if not flushed:
                self.removed_unflushed.append((step, rank))
            del self.nvme[(step, rank)]
            where = dict(tier="nvme", location="", reason=verdict)
            self.feed(ShardEvicted(job="j", node=NODES[rank], ts=0.0, step=step, rank=rank,
                                   world_size=2, **where))  # fmt: skip

    def kept(self, tier: str) -> list[int]:
        held = self.nvme if tier == "nvme" else self.s3
        return sorted({step for step, _ in held})


def test_policy_tier_by_tier_over_twelve_steps() -> None:
    """12 steps x 2 ranks with K=3, M=4, keep_period=5: exactly the policy's steps remain."""
    job = Job(Keep(nvme_keep_latest_k=3, s3_keep_latest_k=4, s3_keep_period=5))
    for step in range(1, 13):
        for rank in (0, 1):
            for event in lifecycle(step, rank):
                job.feed(event)
    assert job.kept("nvme") == [10, 11, 12]
    assert job.kept("s3") == [5, 9, 10, 11, 12]
    assert job.state.head().steps == [5, 9, 10, 11, 12]


def test_unflushed_nvme_copies_stay_and_newer_in_flight_steps_are_kept() -> None:
    """NVMe copies never flushed are not removed; a newer incomplete step is not counted."""
    job = Job(Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2))
    for step in range(1, 6):
        for rank in (0, 1):
            for event in lifecycle(step, rank, flushed=step != 2):
                job.feed(event)
    for event in lifecycle(6, 0):  # step 6: only rank 0 so far
        job.feed(event)
    assert job.kept("nvme") == [2, 4, 5, 6]  # 2 was never flushed
    assert job.kept("s3") == [4, 5, 6]
    assert job.removed_unflushed == []


def test_unflushed_copies_go_when_the_job_keeps_none() -> None:
    job = Job(Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2, evict_unflushed=True))
    for step in range(1, 5):
        for rank in (0, 1):
            for event in lifecycle(step, rank, flushed=False):
                job.feed(event)
    assert job.kept("nvme") == [3, 4] and job.kept("s3") == []


def test_the_newest_step_complete_in_object_storage_keeps_its_nvme_copies_too() -> None:
    """Object storage lags (only step 1 is complete there): NVMe keeps step 1 as well, since it
    is the newest complete step of a tier."""
    job = Job(Keep(nvme_keep_latest_k=2, s3_keep_latest_k=1))
    for step in range(1, 6):
        for rank in (0, 1):
            for event in lifecycle(step, rank, flushed=step == 1):
                job.feed(event)
    assert job.state.floors().keep == [1]
    assert job.kept("nvme") == [1, 2, 3, 4, 5] and job.kept("s3") == [1]


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
    events), no removal takes a copy of the newest complete step of a tier, and a node removes
    an NVMe copy only once the same save is in object storage."""
    job = Job(Keep(nvme_keep_latest_k=k, s3_keep_latest_k=m, s3_keep_period=period))
    events = [e for step, rank, life in fates for e in lifecycle(step, rank)[:life]]
    events += order.sample(events, len(events) // 4)  # redeliveries
    order.shuffle(events)
    newest: dict[str, int] = {}
    for event in events:
        job.feed(event)
        head = job.state.head()
        for tier, done in (("nvme", head.nvme_steps), ("s3", head.s3_steps)):
            if done:
                newest[tier] = max(newest.get(tier, -1), done[-1])
        for tier, step in newest.items():
            assert step in job.kept(tier), (tier, step, job.kept(tier))
    assert job.removed_unflushed == []
