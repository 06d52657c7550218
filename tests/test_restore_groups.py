"""Restores where the ranks of a node share one survey (torchrun's local ranks), and the plan
reaches every rank on a core subscription, whenever it started listening."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shutil
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_replicate import wait_for_ring
from tierpipe.bus.client import Bus
from tierpipe.control.bitmap import bitmap
from tierpipe.control.kvstate import JobStore
from tierpipe.dev import NatsServer
from tierpipe.names import shard_relpath
from tierpipe.recovery.plan import counts
from tierpipe.schemas import (
    RecoveryPlanned,
    RestoreReport,
    ShardFlushed,
    StageFailed,
    decode_event,
    deflated_bitmap,
    encode_event,
)
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow

#: Ranks per node in these tests (two nodes: ranks 0-1 and 2-3).
LOCAL = 2


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def states(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture
def node_b(settings: Settings) -> Iterator[Settings]:
    """Settings of a second node (its own staging and NVMe)."""
    other = settings.replace(
        node=f"{settings.node}-b",
        staging_root=settings.staging_root + "-b",
        nvme_root=settings.nvme_root + "-b",
    )
    yield other
    shutil.rmtree(other.staging_root, ignore_errors=True)
    shutil.rmtree(other.nvme_root, ignore_errors=True)


def checkpointer(settings: Settings, job: str, rank: int, world: int, local: int) -> Checkpointer:
    return Checkpointer(
        job, rank=rank, world_size=world, settings=settings,
        local_rank=rank % local, local_world_size=local,
    )  # fmt: skip


def save(
    nodes: list[Settings], job: str, steps: list[int], events: Events, local: int = LOCAL
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Save `steps` from `local` ranks on each of `nodes`; wait until each is flushed."""
    world = local * len(nodes)
    saved = {}
    ckpts = [checkpointer(nodes[r // local], job, r, world, local) for r in range(world)]
    try:
        for step in steps:
            for r, c in enumerate(ckpts):
                m = model(step * 10 + r)
                saved[(step, r)] = states(m)
                c.save(step, {"model": m})
        for c in ckpts:
            c.wait_until_finished(timeout=60)
    finally:
        for c in ckpts:
            c.close()
    for r in range(world):
        events.wait_for(
            lambda e, r=r: isinstance(e, ShardFlushed) and e.step == steps[-1] and e.rank == r,
            kind="flushed",
        )
    # What a restore reads its sources from: the job state in KV, folded by the coordinator a
    # flush interval or two after the events (a plan made up by a test, not by rank 0, finds
    # no source for a step the job state does not show in object storage yet).
    deadline = time.monotonic() + 30
    while not set(steps) <= set(kv_head_s3_steps(nodes[0], job)):
        assert time.monotonic() < deadline, "the job state never showed the steps in S3"
        time.sleep(0.1)
    return saved


def kv_head_s3_steps(settings: Settings, job: str) -> list[int]:
    """The steps complete in object storage, as the job's head in KV lists them."""

    async def read() -> list[int]:
        async with Bus(settings) as bus:
            head = await (await JobStore(bus.js, settings).open()).head(job)
        return head.s3_steps if head else []

    return anyio.run(read)


def kv_counts(settings: Settings, job: str, step: int, rank: int) -> tuple[bool, bool, bool]:
    """Whether the job state counts `rank`'s copy of `step` on NVMe, in S3, on a peer."""

    async def read() -> tuple[bool, bool, bool]:
        async with Bus(settings) as bus:
            rec = await (await JobStore(bus.js, settings).open()).record(job, step)
        return (False, False, False) if rec is None else counts(rec, rank)

    return anyio.run(read)


def restore(settings: Settings, job: str, rank: int, world: int, local: int = LOCAL) -> Any:
    """Rank `rank` restores into a fresh model; (restored, model)."""
    with checkpointer(settings, job, rank, world, local) as c:
        target = model(999)
        return c.restore({"model": target}), target


def restore_all(nodes: list[Settings], job: str, local: int = LOCAL) -> list[Any]:
    world = local * len(nodes)
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(
            pool.map(lambda r: restore(nodes[r // local], job, r, world, local), range(world))
        )


def assert_state(target: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert torch.equal(target.state_dict()[k], v), k


def publish(settings: Settings, event: Any) -> None:
    async def go() -> None:
        async with Bus(settings) as bus:
            await bus.publish(event)

    asyncio.run(go())


def test_each_nodes_local_leader_reports_ready_for_its_ranks(
    settings: Settings,
    node_b: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
) -> None:
    """Two nodes of two ranks: one `ready` per node, from its local rank 0, covering both of
    its ranks; every rank restores the newest step from its own node's NVMe, bitwise."""
    agent()
    agent(settings=node_b)
    nodes = [settings, node_b]
    saved = save(nodes, job, [1, 2], events)
    for rank, (restored, target) in enumerate(restore_all(nodes, job)):
        assert (restored.step, restored.source.tier, restored.rounds) == (2, "nvme", 1), rank
        assert_state(target, saved[(2, rank)])
    ready = [
        e for e in events.all("restore") if isinstance(e, RestoreReport) and e.phase == "ready"
    ]
    assert sorted((e.rank, e.node, [c.rank for c in e.covers]) for e in ready) == [
        (0, settings.node, [0, 1]),
        (2, node_b.node, [2, 3]),
    ]
    assert all(c.local_steps[:1] == [2] for e in ready for c in e.covers)


def test_a_corrupt_copy_of_a_non_leader_rank_sends_only_that_rank_to_object_storage(
    settings: Settings,
    node_b: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
) -> None:
    """Rank 3's NVMe copy of the newest step is rank 2's file: its node's leader proves it is
    not the verified copy (reported as rank 3's, once: rank 3, sent to its replica on node a,
    does not check that copy again), the plan sends rank 3 alone elsewhere, and every rank
    restores the newest step, bitwise."""
    nodes = [settings, node_b]
    for ns in nodes:  # (each agent lists the job at once: node b's first shards get replicas)
        Path(ns.nvme_root, job).mkdir(parents=True)
    agent()
    agent(settings=node_b)
    wait_for_ring(settings, job, 2)
    saved = save(nodes, job, [1, 2], events)
    deadline = time.monotonic() + 60  # (the plan sends rank 3 to its replica, not the object)
    while not kv_counts(settings, job, 2, 3)[2]:
        assert time.monotonic() < deadline, "the job state never counted rank 3's replica"
        time.sleep(0.1)
    root = Path(node_b.nvme_root).absolute()
    two, three = root / shard_relpath(job, 2, 2, 4), root / shard_relpath(job, 2, 3, 4)
    assert two.stat().st_size == three.stat().st_size
    shutil.copyfile(two, three)
    results = restore_all(nodes, job)
    for rank, (restored, target) in enumerate(results):
        assert (restored.step, restored.rounds) == (2, 1), rank
        assert restored.source.tier == ("peer" if rank == 3 else "nvme"), rank
        assert (restored.from_peer, restored.from_s3) == ([3], []), rank
        assert_state(target, saved[(2, rank)])
    bad = [
        e
        for e in events.all("failed")
        if isinstance(e, StageFailed) and e.stage == "restore" and e.tier == "nvme"
    ]
    assert [(e.rank, e.step, e.node, e.retryable) for e in bad] == [(3, 2, node_b.node, False)]


def test_a_plan_published_before_a_rank_listened_is_still_seen(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Rank 1 (not its node's leader) starts only after rank 0 published the plan: it reads
    the stored plan within `restore_plan_poll_s`, and both restore the newest step."""
    agent()
    s = settings.replace(restore_plan_poll_s=0.5, restore_timeout_s=60.0)
    saved = save([settings], job, [1, 2], events)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leading = pool.submit(restore, s, job, 0, 2)
        events.wait_for(lambda e: isinstance(e, RecoveryPlanned) and not e.final, kind="plan")
        t0 = time.monotonic()
        late, target = restore(s, job, 1, 2)
        assert time.monotonic() - t0 < 30
        first, _ = leading.result(timeout=60)
    assert (first.step, late.step, late.rounds) == (2, 2, 1)
    assert_state(target, saved[(2, 1)])


def test_an_anonymous_restart_does_not_take_an_older_restarts_plan(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """An older anonymous restart died after planning step 1 (its plan is the newest stored):
    a rank that reads it before this restart's plan is out still ends on this restart's plan
    (step 2), and rank 0 never counts its load of the old one."""
    agent()
    s = settings.replace(restore_plan_poll_s=0.2, restore_timeout_s=60.0)
    saved = save([settings], job, [1, 2], events)
    stale = RecoveryPlanned(
        job=job, node=settings.node, ts=time.time(), restart="anonymous", round=1, step=1,
        world_size=2, from_s3=b"\x03",
    )  # fmt: skip
    publish(settings, stale)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        follower = pool.submit(restore, s, job, 1, 2)
        # (rank 1 loads the stale plan first: its `loaded` of step 1)
        events.wait_for(
            lambda e: isinstance(e, RestoreReport) and e.phase == "loaded" and e.step == 1,
            kind="restore",
        )
        first, _ = restore(s, job, 0, 2)
        (second, target) = follower.result(timeout=60)
    assert (first.step, second.step) == (2, 2)
    assert_state(target, saved[(2, 1)])


def test_a_plans_deflated_bitmap_round_trips_and_an_overlong_one_is_no_plan() -> None:
    """The plan of 80,000 ranks that all read object storage stays small on the wire and
    inflates to the same bitmap; a deflated bitmap longer than the world is refused."""
    bits = bitmap(range(80_000), 80_000)
    from_s3, from_s3_z = deflated_bitmap(bits)
    plan = RecoveryPlanned(
        job="j", node="n", ts=1.0, restart="r", round=1, step=3, world_size=80_000,
        from_s3=from_s3, from_s3_z=from_s3_z,
    )  # fmt: skip
    wire = encode_event(plan)
    assert len(wire) < 400
    got = decode_event(wire)
    assert isinstance(got, RecoveryPlanned) and got.s3_bitmap() == bits
    bomb = msgspec.json.encode(
        {**msgspec.to_builtins(plan), "world_size": 8, "from_s3_z": zlib.compress(bits)}
    )
    with pytest.raises(msgspec.ValidationError, match="inflates past"):
        decode_event(bomb)


def _api_requests(server: NatsServer) -> int:
    """The JetStream API requests the server has taken so far (`/jsz`)."""
    with urllib.request.urlopen(f"{server.monitor_url}/jsz", timeout=10) as r:
        return int(json.load(r)["api"]["total"])


def test_ranks_other_than_0_start_and_read_the_job_state_without_jetstream_api_requests(
    settings: Settings, job: str, nats_server: NatsServer
) -> None:
    """Every rank's start once asked JetStream for the stream's and the bucket's info: at
    80,000 ranks, 160,000 API requests in a burst, where the server queues 10,000 by default
    (`request_queue_limit`) and drops the rest (the ranks time out). Rank 0 makes sure the
    stream and the bucket exist (with its first save: opening a job creates nothing); the
    others bind them as they are, and their KV reads are direct gets (not API requests)."""
    with Checkpointer(job, rank=0, world_size=4, settings=settings) as first:
        first.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
    before = _api_requests(nats_server)
    for rank in (1, 2, 3):
        with Checkpointer(job, rank=rank, world_size=4, settings=settings) as ckpt:
            assert ckpt.latest_step() is None
    assert _api_requests(nats_server) == before
