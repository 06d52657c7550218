"""The replicate stage between real agents on loopback (separate NVMe roots): a node's verified
shard lands, verified, on its partner's NVMe with the partner's `replicated` event; a copy that
changed after its verify is refused and never published; a partner that was down gets the copy
once it is back; one paused for a moment holds no newer shard back; a new job's first shards,
verified before the partner lists the job, get their copies once it does, and an older shard
waiting for its partner gives way to a newer one; replicas below the job's NVMe floor go, each an
`evicted` of tier peer; and a restore reads the replica back from the partner, every digest
checked."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.bus.client import Bus
from tierpipe.control.advert import job_nodes
from tierpipe.control.kvstate import JobStore, floor_key
from tierpipe.errors import ShardMissingError
from tierpipe.peer.client import PeerClient
from tierpipe.peer.reader import PeerSource
from tierpipe.recovery.load import Expected, _loaded, _sink
from tierpipe.schemas import (
    NodeBatch,
    ShardEvicted,
    ShardReplicated,
    ShardVerified,
    SourceRef,
    StageFailed,
)
from tierpipe.schemas.jobstate import Floors
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.shardfile import write_shard

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture
def two_nodes(settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, Settings]]:
    """Node A (the test's settings) and node B: own name, NVMe and staging roots; records
    refreshed every second."""
    a = settings.replace(node_heartbeat_s=1.0, max_deliver=30)
    b = a.replace(
        node=f"{settings.node}-b",
        nvme_root=str(tmp_path / "nvme-b"),
        staging_root=settings.staging_root + "-b",
    )
    yield a, b
    shutil.rmtree(b.staging_root, ignore_errors=True)


def saved(settings: Settings, job: str, step: int, rank: int = 0) -> ShardVerified:
    """A shard sealed on the node's NVMe (what nvme-write and verify leave), and its
    `verified` event."""
    with NvmeStore.from_settings(settings) as store:
        path = Path(store.locate(job, step, rank, WORLD))
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"w": torch.full((200_000,), float(step)), "step": step}
    write_shard(path, state, job=job, step=step, rank=rank, world_size=WORLD, node=settings.node)
    head = read_head(path)
    return ShardVerified(
        job=job, node=settings.node or "", ts=time.time(), step=step, rank=rank,
        world_size=WORLD, path=str(path), nbytes=path.stat().st_size,
        header_digest=head.header_digest.hex(), seconds=0.0,
    )  # fmt: skip


def publish_verified(settings: Settings, event: ShardVerified) -> None:
    """As the verify stage reports it: on the rank's subject and in the node's batch."""

    async def go() -> None:
        async with Bus(settings) as bus:
            await bus.ensure_stream(event.job)
            await bus.publish(event)
            batch = NodeBatch(job=event.job, node=event.node, ts=time.time(), batch="verified",
                              events=[event])  # fmt: skip
            await bus.publish(batch)

    anyio.run(go)


def replicated(events: Events, holder: str, step: int, timeout: float = 60) -> ShardReplicated:
    e = events.wait_for(
        lambda e: isinstance(e, ShardReplicated) and e.node == holder and e.step == step,
        kind="replicated",
        timeout=timeout,
    )
    assert isinstance(e, ShardReplicated)
    return e


def start_pair(
    agent: Callable[..., Agent], a: Settings, b: Settings, job: str
) -> tuple[Agent, Agent]:
    """Both agents, once each one's record lists the job and its endpoint (the ring)."""
    first, second = agent("replicate", settings=a), agent("replicate", settings=b)
    first.wait_ready()
    second.wait_ready()
    wait_for_ring(a, job, 2)
    return first, second


def wait_for_ring(settings: Settings, job: str, nodes: int) -> None:
    """Until `nodes` agents' records list the job and a peer endpoint (the replica ring)."""

    async def ring() -> None:
        async with Bus(settings) as bus:
            with anyio.fail_after(30):
                for _ in iter(int, 1):  # (the records are in KV: no event to await)
                    if len([r for r in await job_nodes(bus, settings, job) if r.peer_url]) >= nodes:
                        return
                    await anyio.sleep(0.1)

    anyio.run(ring)


def test_a_verified_shard_lands_verified_on_the_partner(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """A's verified shard is copied to B (its only partner): B's `replicated` event names B as
    holder and A as source, with A's header digest, and B's file is A's, byte for byte."""
    a, b = two_nodes
    start_pair(agent, a, b, job)
    event = saved(a, job, 3)
    publish_verified(a, event)
    done = replicated(events, b.node or "", 3)
    assert (done.source, done.header_digest, done.nbytes) == (a.node, event.header_digest,
                                                              event.nbytes)  # fmt: skip
    replica = Path(done.path)
    assert replica.is_relative_to(Path(b.nvme_root, ".peer"))
    assert replica.read_bytes() == Path(event.path).read_bytes()
    assert not any(e.node == a.node for e in events.all("replicated"))  # (A holds its own)


def test_a_copy_changed_after_its_verify_is_refused_and_not_published(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """A source file flipped after its verify fails B's digest check: the stage's `failed`
    names it, nothing is published as replicated, and B keeps no file of it."""
    a, b = two_nodes
    start_pair(agent, a, b, job)
    event = saved(a, job, 4)
    with open(event.path, "r+b") as f:
        f.seek(read_head(event.path).data_offset + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))
    publish_verified(a, event)
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "replicate" and e.step == 4,
        kind="failed",
    )
    assert isinstance(failed, StageFailed) and "IntegrityError" in failed.message
    assert events.all("replicated") == []
    assert [p for p in Path(b.nvme_root).rglob("*.shard*") if p.is_file()] == []


def test_a_partner_down_gets_the_copy_once_it_is_back(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """B's agent killed: A's attempts fail (retryable) and are tried again; B restarted (a new
    port, advertised in its record), the copy lands."""
    a, b = two_nodes
    _, second = start_pair(agent, a, b, job)
    second.stop(signal.SIGKILL)
    event = saved(a, job, 5)
    publish_verified(a, event)
    events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "replicate" and e.retryable,
        kind="failed",
    )
    agent("replicate", settings=b).wait_ready()
    done = replicated(events, b.node or "", 5)
    assert Path(done.path).read_bytes() == Path(event.path).read_bytes()


def replicated_at(
    events: Events, holder: str, steps: list[int], timeout: float
) -> dict[int, float]:
    """When each of `steps` got its replica on `holder` (the `replicated` event's time)."""
    found: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while set(found) != set(steps) and time.monotonic() < deadline:
        for e in events.all("replicated"):
            if isinstance(e, ShardReplicated) and e.node == holder and e.step in steps:
                found.setdefault(e.step, e.ts)
        time.sleep(0.3)
    return found


def test_a_partner_back_after_the_retries_ran_out_still_gets_the_newest_copy(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """B's agent killed for longer than A's tries of its shard last (`max_deliver` 3): the
    shard is kept and tried again, and once B is back (a new port, advertised in its record)
    the copy lands within a few seconds of B's record listing it."""
    a, b = (s.replace(retry_base_s=0.5, retry_max_s=30.0, max_deliver=3) for s in two_nodes)
    first, second = start_pair(agent, a, b, job)
    second.stop(signal.SIGKILL)
    event = saved(a, job, 5)
    publish_verified(a, event)
    deadline = time.monotonic() + 60
    while '"replica_waiting"' not in first.log():  # (its third try failed)
        assert time.monotonic() < deadline, first.log()
        time.sleep(0.2)
    third = agent("replicate", settings=b).wait_ready()
    assert third.proc is not None
    pid = third.proc.pid

    async def back() -> float:
        """When the new agent's record lists the job."""
        async with Bus(a) as bus:
            with anyio.fail_after(30):
                while True:
                    if any(r.pid == pid for r in await job_nodes(bus, a, job)):
                        return time.time()
                    await anyio.sleep(0.1)

    listed = anyio.run(back)
    done = replicated(events, b.node or "", 5)
    assert Path(done.path).read_bytes() == Path(event.path).read_bytes()
    assert done.ts - listed < 5.0, done.ts - listed


def test_a_partner_silent_for_a_moment_holds_no_newer_shard_back(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """B's agent paused (SIGSTOP) for longer than three heartbeats, so its record goes stale,
    while A verifies a shard every half second: once B runs again, every shard A verifies gets
    its copy within a few seconds, whatever became of the ones verified during the pause (with
    the product's retry settings: delays that grow to `retry_max_s` 30 s)."""
    a, b = (s.replace(retry_base_s=0.5, retry_max_s=30.0, max_deliver=10) for s in two_nodes)
    _, second = start_pair(agent, a, b, job)
    publish_verified(a, saved(a, job, 1))
    replicated(events, b.node or "", 1)
    assert second.proc is not None
    published: dict[int, float] = {}
    step = 1
    second.proc.send_signal(signal.SIGSTOP)
    paused = time.monotonic()
    try:
        while time.monotonic() - paused < 4.5:  # (records go stale after 3 beats of 1 s)
            step += 1
            published[step] = time.time()
            publish_verified(a, saved(a, job, step))
            time.sleep(0.5)
    finally:
        second.proc.send_signal(signal.SIGCONT)
    resumed, during = time.time(), step
    for _ in range(6):
        step += 1
        published[step] = time.time()
        publish_verified(a, saved(a, job, step))
        time.sleep(0.5)
    after = list(range(during + 1, step + 1))
    got = replicated_at(events, b.node or "", after, timeout=30)
    late = {s: round(got[s] - published[s], 1) if s in got else None for s in after}
    assert all(v is not None and v < 5.0 for v in late.values()), (late, resumed)


def test_a_shard_verified_before_its_partner_lists_the_job_gets_its_copy(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], job: str
) -> None:
    """A new job: A's first shard is verified before B's record lists the job (a record lists a
    job from the scan after its folder appears on the node), so A's ring has no partner yet.
    It is tried again for a while rather than acked without a copy: once B's trainers make the
    job's folder there, B lists it and the shard lands on B; so does the next one."""
    a, b = two_nodes
    start_pair(agent, a, b, job)
    fresh = f"{job}-new"
    events = Events(a, fresh)
    publish_verified(a, saved(a, fresh, 1))
    time.sleep(3.0)  # (A's agent serves the job by now; B has no folder of it)
    Path(b.staging_root, fresh).mkdir(parents=True)
    assert replicated_at(events, b.node or "", [1], timeout=30).keys() == {1}
    publish_verified(a, saved(a, fresh, 2))
    replicated(events, b.node or "", 2, timeout=30)


def test_an_older_shard_waiting_for_its_partner_is_skipped_for_a_newer_one(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], job: str
) -> None:
    """Shards of a job whose partner does not list it yet wait (tried again); once a newer
    step of the same rank is verified, the older one is skipped, said at info with the reason,
    and only the newest gets its copy when the partner comes."""
    a, b = two_nodes
    first, _ = start_pair(agent, a, b, job)
    fresh = f"{job}-new"
    events = Events(a, fresh)

    def logged(*parts: str) -> bool:
        return any(all(p in line for p in parts) for line in first.log().splitlines())

    def wait_logged(*parts: str) -> None:
        deadline = time.monotonic() + 30
        while not logged(*parts):
            assert time.monotonic() < deadline, (parts, first.log())
            time.sleep(0.2)

    publish_verified(a, saved(a, fresh, 1))
    wait_logged('"retrying"', '"stage": "replicate"', fresh, '"step": 1,')
    publish_verified(a, saved(a, fresh, 2))
    wait_logged('"replica_skipped"', fresh, '"step": 1,', '"newer_step": 2')
    Path(b.staging_root, fresh).mkdir(parents=True)
    replicated(events, b.node or "", 2, timeout=30)
    assert [e.step for e in events.all("replicated")] == [2]


def test_a_job_with_no_other_agent_is_left_without_a_copy_at_once(
    settings: Settings, agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """One agent alone (no other node serves a peer endpoint): a new job's shard, one rank of
    two, is acked at once without a copy, said once at info, never retried as a failure."""
    a = settings.replace(node_heartbeat_s=1.0)
    alone = agent("replicate", settings=a).wait_ready()
    publish_verified(a, saved(a, job, 1))
    deadline = time.monotonic() + 30
    while '"replicas_not_made"' not in alone.log():
        assert time.monotonic() < deadline, alone.log()
        time.sleep(0.2)
    assert '"retrying"' not in alone.log()
    assert [e for e in events.all("failed") if isinstance(e, StageFailed)] == []


def test_replicas_below_the_nvme_floor_are_evicted(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """With the job's NVMe floor past a replicated step (and the floors keeping none), B
    removes its replica and publishes `evicted` (tier peer, node B); a kept step stays."""
    a, b = two_nodes
    start_pair(agent, a, b, job)
    # One after the other: a step whose copy failed once is skipped for a newer one of the rank
    # (by design), so step 6 has its replica before step 7 is saved.
    publish_verified(a, saved(a, job, 6))
    old = replicated(events, b.node or "", 6)
    publish_verified(a, saved(a, job, 7))
    kept = replicated(events, b.node or "", 7)

    async def raise_floor() -> None:
        async with Bus(a) as bus:
            store = await JobStore(bus.js, a).open()
            await store.kv.put(floor_key(job), msgspec.json.encode(Floors(nvme=8, keep=[7])))

    anyio.run(raise_floor)
    gone = events.wait_for(
        lambda e: isinstance(e, ShardEvicted) and e.tier == "peer" and e.step == 6,
        kind="evicted",
    )
    assert isinstance(gone, ShardEvicted) and gone.node == b.node
    assert gone.location == old.path and not Path(old.path).exists()
    assert Path(kept.path).exists()


def test_a_restore_reads_the_replica_from_its_holder(
    two_nodes: tuple[Settings, Settings], agent: Callable[..., Agent], events: Events, job: str
) -> None:
    """With A's own copy gone (its NVMe lost), the replica on B is read over B's endpoint into
    the restore's sink, every digest checked; the holder is found from `replicated` events
    when the plan names none. A save nobody replicated is missing."""
    a, b = two_nodes
    start_pair(agent, a, b, job)
    event = saved(a, job, 9)
    publish_verified(a, event)
    replicated(events, b.node or "", 9)
    Path(event.path).unlink()  # (node A's NVMe is lost)

    async def restore(node: str, digest: str) -> dict[str, object]:
        source = SourceRef(tier="peer", node=node, location="", nbytes=event.nbytes,
                           header_digest=digest)  # fmt: skip
        expected = Expected(job, 9, 0, WORLD, digest)
        async with Bus(a) as bus, PeerClient(token=None) as client:
            peer = PeerSource(a, bus, client, source, job=job, step=9, rank=0, world_size=WORLD)
            sink = _sink(None, expected)
            got = await peer.read_into("", sink, nbytes=event.nbytes)
            loaded = _loaded(got.head, sink, got.seconds)
        assert isinstance(loaded.state, dict)
        return loaded.state

    for node in (b.node or "", ""):
        state = anyio.run(restore, node, event.header_digest)
        assert torch.equal(state["w"], torch.full((200_000,), 9.0))  # type: ignore[arg-type]
    with pytest.raises(ShardMissingError):
        anyio.run(restore, "", "0" * 32)


def test_a_replica_from_an_abandoned_timeline_is_superseded() -> None:
    """A replica is superseded by one of the same rank from a newer epoch at the same or an
    earlier step (the run rewound there), never by an older epoch or another rank."""
    from tierpipe.peer.replicas import Replica
    from tierpipe.stages.replicate import superseded

    def r(step: int, epoch: int, rank: int = 0) -> Replica:
        return Replica("j", step, rank, 2, epoch, "0" * 32, 1, Path(f"/x/{step}/{rank}"))

    held = [r(5, 1), r(6, 1), r(7, 1), r(6, 2), r(8, 1, rank=1)]
    assert [superseded(x, held) for x in held] == [False, True, True, False, False]
