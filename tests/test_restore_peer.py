"""A restart restores a replaced node's ranks from their partner's replica, end to end: two nodes
(agents with the replicate stage, separate NVMe roots, peer endpoints on loopback), object
storage hung for the newest steps, node b lost with its NVMe, an empty replacement: its rank reads
the newest replicated step from node a (tier peer), not an older step from object storage; and a
corrupt replica is refused (a `failed` of tier peer) for an older step; the same through
torch.distributed collectives; and the plan's peer bitmap and the reports' peer steps on the wire
(pure)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_one_planner import agrees, plan_json
from tests.test_restore_trust import paused
from tierpipe.control.bitmap import bitmap, ranks_of
from tierpipe.dev import S3Server
from tierpipe.recovery.leader import by_rank, plan
from tierpipe.schemas import (
    RankSteps,
    RecoveryPlanned,
    RestoreReport,
    ShardFlushed,
    ShardReplicated,
    StageFailed,
    decode_event,
    deflated_bitmap,
    encode_event,
)
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

#: Elements of each rank's tensor (1 MiB of float32): one blob well past the shard's header.
N = 1 << 18


def value(step: int, rank: int) -> float:
    return float(step * 10 + rank)


def save(job: str, rank: int, step: int, ns: Settings) -> None:
    with Checkpointer(job, rank=rank, world_size=2, settings=ns) as c:
        c.save(step, {"w": torch.full((N,), value(step, rank))})
        c.wait_until_finished(timeout=60)


def lose_node_b(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    s3_server: S3Server,
    tmp_path: Path,
) -> tuple[dict[str, Settings], dict[int, ShardReplicated]]:
    """Two nodes save steps 1-2 into object storage, then 3-4 with object storage hung (both
    replicated to the partner); node b is lost (agent killed, NVMe gone) while the store is
    still hung, and an empty node c replaces it. Returns the nodes' settings and, by rank, the
    `replicated` event of its step 4."""
    s = settings.replace(
        lease_ttl_s=2.0, coordinator_flush_s=0.05, peer_replicas=1, nvme_keep_latest_k=4,
        node_heartbeat_s=1.0,
    )  # fmt: skip
    nodes = {
        n: s.replace(
            node=f"{s.node}-{n}",
            nvme_root=str(tmp_path / f"nvme-{n}"),
            staging_root=f"{s.staging_root}-{n}",
        )
        for n in ("a", "b", "c")
    }
    agents = {n: agent(settings=nodes[n]) for n in ("a", "b")}
    for a in agents.values():
        a.wait_ready(60)
    on = {0: nodes["a"], 1: nodes["b"]}
    events = Events(s, job)

    def saved(steps: tuple[int, ...]) -> None:
        for step in steps:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(save, job, r, step, ns) for r, ns in on.items()]:
                    f.result(timeout=120)

    saved((1, 2))
    for rank in on:
        events.wait_for(
            lambda e, r=rank: isinstance(e, ShardFlushed) and e.step == 2 and e.rank == r,
            kind="flushed",
            timeout=60,
        )
    replicas: dict[int, ShardReplicated] = {}
    with paused(s3_server):  # (object storage hung: steps 3-4 reach only NVMe and the peer)
        saved((3, 4))
        for rank, holder in ((0, nodes["b"].node), (1, nodes["a"].node)):
            e = events.wait_for(
                lambda e, r=rank, h=holder: (
                    isinstance(e, ShardReplicated) and (e.step, e.rank, e.node) == (4, r, h)
                ),
                kind="replicated",
                timeout=60,
            )
            assert isinstance(e, ShardReplicated)
            replicas[rank] = e
        # Node b is lost: its agent killed, its NVMe gone; node c (empty) replaces it.
        agents["b"].stop(signal.SIGKILL)
    shutil.rmtree(nodes["b"].nvme_root)
    shutil.rmtree(nodes["b"].staging_root, ignore_errors=True)
    agent(settings=nodes["c"]).wait_ready(60)
    assert not [e for e in events.all("flushed") if isinstance(e, ShardFlushed) and e.step > 2
                and e.rank == 1]  # fmt: skip
    return nodes, replicas


def wait_for_plan(nodes: dict[str, Settings], job: str, step: int) -> dict[str, object]:
    """`tierpipe plan --lost-node b`, once the job state counts the replicas of `step`."""
    deadline = time.monotonic() + 30
    while True:
        plan = plan_json(nodes["a"], job, "--lost-node", nodes["b"].node or "")
        if plan["step"] == step or time.monotonic() > deadline:
            return plan
        time.sleep(0.2)


def restore_both(job: str, nodes: dict[str, Settings]) -> dict[int, tuple[int, str]]:
    """Rank 0 on node a, rank 1 on node c restore at once: (step, tier) by rank, each shard
    checked against what its rank saved."""

    def restore(rank: int, ns: Settings) -> tuple[int, str]:
        with Checkpointer(job, rank=rank, world_size=2, settings=ns) as c:
            got = c.restore()
            assert torch.equal(got.state["w"], torch.full((N,), value(got.step, rank)))
            return got.step, got.source.tier

    after = {0: nodes["a"], 1: nodes["c"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {r: pool.submit(restore, r, ns) for r, ns in after.items()}
        return {r: f.result(timeout=180) for r, f in futures.items()}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_replaced_node_restores_the_newest_step_from_its_partner(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    s3_server: S3Server,
    events: Events,
    tmp_path: Path,
) -> None:
    """Node b's rank reads step 4 from node a's replica (its `loaded` says tier peer), not step 2
    from object storage; rank 0 reads its own NVMe; it is what `tierpipe plan` showed."""
    nodes, _ = lose_node_b(settings, job, agent, s3_server, tmp_path)
    plan = wait_for_plan(nodes, job, 4)
    assert (plan["step"], plan["peer_ranks"], plan["s3_ranks"]) == (4, [1], []), plan
    restored = restore_both(job, nodes)
    assert restored == {0: (4, "nvme"), 1: (4, "peer")}
    agrees(plan, restored)
    loaded = [
        e for e in events.all("restore")
        if isinstance(e, RestoreReport) and e.phase == "loaded" and e.rank == 1
    ]  # fmt: skip
    assert [(e.step, e.tier) for e in loaded] == [(4, "peer")]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_corrupt_replica_is_refused_for_an_older_step(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    s3_server: S3Server,
    events: Events,
    tmp_path: Path,
) -> None:
    """A byte of node a's replica of rank 1's step 4 flipped: rank 1 refuses it (a `failed` of
    tier peer naming its holder, then its rank's `failed` report), every rank moves to an older
    step that rank 1 reads from its replica there, and the job state stops counting the bad
    replica (the plan no longer offers its step)."""
    nodes, replicas = lose_node_b(settings, job, agent, s3_server, tmp_path)
    assert wait_for_plan(nodes, job, 4)["step"] == 4
    path = Path(replicas[1].path)
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<f", value(4, 1)) * 16)
    assert at > 0, "the tensor's bytes are not in the replica"
    data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    restored = restore_both(job, nodes)
    # (step 3's replica on node a is older than the holder's newest, step 4: still found)
    assert restored == {0: (3, "nvme"), 1: (3, "peer")}, restored
    refused = [
        e for e in events.all("failed")
        if isinstance(e, StageFailed) and e.stage == "restore" and e.tier == "peer"
        and (e.step, e.rank) == (4, 1)
    ]  # fmt: skip
    assert refused and not refused[0].retryable, refused
    assert refused[0].node == nodes["a"].node  # (the replica's holder)
    failed = [
        e for e in events.all("restore")
        if isinstance(e, RestoreReport) and e.phase == "failed" and (e.step, e.rank) == (4, 1)
    ]  # fmt: skip
    assert failed and "peer" in failed[0].error, failed
    # The job state stops counting the corrupt replica: the plan no longer offers step 4.
    deadline = time.monotonic() + 30
    while (after := plan_json(nodes["a"], job, "--lost-node", nodes["b"].node or ""))["step"] == 4:
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["step"] == restored[1][0], after


#: One rank of a gloo group restoring (settings from its environment): one JSON line.
GLOO_RANK = """
import json, sys
import torch.distributed as dist
from tierpipe.trainer.checkpointer import Checkpointer
job, rank, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
try:
    with Checkpointer(job, rank=rank, world_size=2) as c:
        got = c.restore()
    print(json.dumps({"step": got.step, "tier": got.source.tier, "agreement": got.agreement,
                      "w": float(got.state["w"][0]), "from_peer": got.from_peer}))
    dist.barrier()
finally:
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ranks_agreeing_through_torch_distributed_read_the_replica_too(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    s3_server: S3Server,
    events: Events,
    tmp_path: Path,
) -> None:
    """The same loss, the two ranks in a gloo group (reports gathered, the plan broadcast):
    rank 1 on node c reads step 4 from node a's replica, and the published final plan says so."""
    nodes, _ = lose_node_b(settings, job, agent, s3_server, tmp_path)
    assert wait_for_plan(nodes, job, 4)["step"] == 4
    store = tmp_path / "gloo-store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GLOO_RANK, job, str(rank), str(store)],
            env={**os.environ, **ns.as_env(), "TIERPIPE_LOG_LEVEL": "warning"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, ns in ((0, nodes["a"]), (1, nodes["c"]))
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, r in enumerate(results):
        assert (r["step"], r["agreement"], r["w"]) == (4, "torch.distributed", value(4, rank)), r
        assert (r["tier"], r["from_peer"]) == (("nvme", "peer")[rank], [1]), r
    final = events.wait_for(
        lambda e: isinstance(e, RecoveryPlanned) and e.final and e.step == 4, kind="plan"
    )
    assert isinstance(final, RecoveryPlanned)
    assert (ranks_of(final.peer_bitmap()), ranks_of(final.s3_bitmap())) == ([1], [])


def test_a_plan_sends_a_rank_without_its_nvme_to_a_replica_before_object_storage() -> None:
    """Rank 0 plans from `ready` reports (covering several ranks, or one rank's own fields):
    the newest step every rank has on some tier, a rank without its NVMe copy reading a
    replica where one is counted, else the object; the reports' peer steps survive the wire."""
    ready = RestoreReport(
        job="j", node="a", ts=1.0, restart="r", rank=0, world_size=3, phase="ready",
        covers=[RankSteps(rank=0, local_steps=[4, 3], s3_steps=[2]),
                RankSteps(rank=1, s3_steps=[3, 2], peer_steps=[4, 3])],
    )  # fmt: skip
    alone = RestoreReport(
        job="j", node="c", ts=1.0, restart="r", rank=2, world_size=3, phase="ready",
        s3_steps=[3, 2], peer_steps=[3],
    )  # fmt: skip
    reports = by_rank(decode_event(encode_event(r)) for r in (ready, alone))  # type: ignore[misc]
    assert (reports[1].peer_steps, reports[2].peer_steps) == ([4, 3], [3])
    choice = plan("j", reports, 3, None, {}, 1)  # (step 4: rank 2 has no copy)
    assert (choice.step, ranks_of(choice.from_peer), ranks_of(choice.from_s3)) == (3, [1, 2], [])
    assert 4 in choice.rejected
    choice = plan("j", reports, 3, None, {3: "rank 1: IntegrityError"}, 2)
    assert (choice.step, ranks_of(choice.from_peer), ranks_of(choice.from_s3)) == (2, [], [0, 1, 2])


def test_a_plans_peer_bitmap_round_trips_deflated_and_an_overlong_one_is_no_plan() -> None:
    """80,000 ranks reading a replica stay small on the wire, as the object-storage bitmap."""
    bits = bitmap(range(40_000, 80_000), 80_000)
    from_peer, from_peer_z = deflated_bitmap(bits)
    planned = RecoveryPlanned(
        job="j", node="n", ts=1.0, restart="r", round=1, step=3, world_size=80_000,
        from_peer=from_peer, from_peer_z=from_peer_z,
    )  # fmt: skip
    wire = encode_event(planned)
    assert len(wire) < 400
    got = decode_event(wire)
    assert isinstance(got, RecoveryPlanned)
    assert (got.peer_bitmap(), got.s3_bitmap()) == (bits, b"")
    bomb = msgspec.json.encode({**msgspec.to_builtins(planned), "world_size": 8})
    with pytest.raises(msgspec.ValidationError, match="inflates past"):
        decode_event(bomb)
