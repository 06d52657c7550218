"""The `peer` tier: a verified replica of a shard on another node's NVMe counts in the job state
only when the saver's verified copy backs it, and the planner reads a lost node's ranks there."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import msgspec
import pytest

from tests.conftest import run_cli
from tests.oracle_catalog import Catalog
from tierpipe.bus.client import Bus
from tierpipe.control.bitmap import StepBits, bitmap, ranks_of
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import NoCheckpointError
from tierpipe.recovery.kvplan import kv_plan, node_ranks, replica_ranks
from tierpipe.recovery.plan import Source, choose, recorded
from tierpipe.recovery.survey import Reads, replica_sources
from tierpipe.schemas import (
    Event,
    RankSteps,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardVerified,
    ShardWritten,
    StageFailed,
    encode_event,
)
from tierpipe.schemas.facts import ReplicatedFact, decode_fact, fact_of
from tierpipe.schemas.jobstate import Keep, StepRecord, decode_record, encode_record
from tierpipe.settings import Settings

WORLD = 4
#: rank -> the node that saves it, and the node that holds its replica (a ring of two).
SAVER = {0: "a", 1: "a", 2: "b", 3: "b"}
PARTNER = {"a": "b", "b": "a"}
EVERYTHING = Keep(nvme_keep_latest_k=1000, s3_keep_latest_k=1000)


def digest(step: int, rank: int) -> str:
    return f"{step:016x}{rank:016x}"


def ident(job: str, step: int, rank: int, node: str, epoch: int = 0) -> dict[str, Any]:
    return dict(job=job, node=node, ts=time.time(), step=step, rank=rank, world_size=WORLD,
                epoch=epoch)  # fmt: skip


def saved(step: int, rank: int, *, job: str = "j", flushed: bool = False) -> list[Event]:
    """The saver's `written` and `verified` of `rank`'s shard (and `flushed`)."""
    i, d = ident(job, step, rank, SAVER[rank]), digest(step, rank)
    where: dict[str, Any] = dict(
        path=f"/nvme/{SAVER[rank]}/{step}/{rank}", nbytes=4096, header_digest=d
    )
    out: list[Event] = [
        ShardWritten(**i, **where, tensors=1, seconds=0),
        ShardVerified(**i, **where, seconds=0),
    ]
    if flushed:
        out.append(ShardFlushed(**i, bucket="b", key=f"{step}/{rank}", etag="e", checksum="c",
                                header_digest=d, nbytes=4096, seconds=0))  # fmt: skip
    return out


def replicated(
    step: int, rank: int, *, job: str = "j", holder: str | None = None, source: str | None = None,
    nbytes: int = 4096, epoch: int = 0,
) -> ShardReplicated:  # fmt: skip
    """A replica of `rank`'s shard on its partner (`holder`) of the saver's copy (`source`)."""
    source = source or SAVER[rank]
    holder = holder or PARTNER[SAVER[rank]]
    return ShardReplicated(
        **ident(job, step, rank, holder, epoch),
        source=source, path=f"/nvme/{holder}/peer/{step}/{rank}", nbytes=nbytes,
        header_digest=digest(step, rank), seconds=0,
    )  # fmt: skip


def evicted_replica(step: int, rank: int, holder: str) -> ShardEvicted:
    return ShardEvicted(**ident("j", step, rank, holder), tier="peer", location="/x",
                        reason="test")  # fmt: skip


def fold(events: list[Event], keep: Keep = EVERYTHING, state: JobState | None = None) -> JobState:
    state = state or JobState("j", keep)
    for event in events:
        state.apply(state.seq + 1, event)
    return state


def peer_ranks(state: JobState, step: int) -> list[int]:
    rec = state.record(step)
    return [] if rec is None else ranks_of(rec.peer)


def both(events: list[Event]) -> tuple[JobState, Catalog]:
    catalog = Catalog()
    for e in events:
        catalog.apply(e)
    return fold(events), catalog


# --- the fold


def test_a_replicated_fact_decodes_like_the_event() -> None:
    """`decode_fact` reads a `replicated` event into a `ReplicatedFact` with its source."""
    event = replicated(3, 1)
    fact = fact_of(event)
    assert isinstance(fact, ReplicatedFact)
    assert (fact.node, fact.source, fact.header_digest) == ("b", "a", digest(3, 1))
    bad = json.dumps({**json.loads(encode_event(event)), "source": "a b"}).encode()
    with pytest.raises(msgspec.ValidationError, match="not a valid name"):
        decode_fact(bad)


def test_a_replica_counts_only_when_the_savers_verified_copy_backs_it() -> None:
    """A replica before its source copy is verified, of another size, or naming a source that
    never verified the shard counts for nothing; one matching the saver's verified copy does."""
    early = [replicated(1, 0), *saved(1, 0)]
    state, catalog = both(early)
    assert peer_ranks(state, 1) == [] and not catalog.shard("j", 1, 0).usable("peer")  # type: ignore[union-attr]
    wrong = [*saved(2, 0), replicated(2, 0, nbytes=1), replicated(2, 1, source="a")]
    assert peer_ranks(fold(wrong), 2) == []
    good = [*saved(3, 0), replicated(3, 0)]
    state, catalog = both(good)
    assert peer_ranks(state, 3) == [0]
    assert [c.node for c in catalog.shard("j", 3, 0).usable("peer")] == ["b"]  # type: ignore[union-attr]


def test_a_replica_on_its_own_source_node_is_refused() -> None:
    """A forged `replicated` naming its holder as its source (a replica that survives nothing)
    never counts, even matching a verified copy of that node."""
    forged = [*saved(1, 0), replicated(1, 0, holder="a", source="a")]
    state, catalog = both(forged)
    assert peer_ranks(state, 1) == []
    shard = catalog.shard("j", 1, 0)
    assert shard is not None and not shard.usable("peer") and shard.doubts


def test_an_evicted_or_proven_bad_replica_no_longer_counts() -> None:
    """The holder's `evicted` of tier `peer` removes its replica (another node's does not); a
    permanent failure with evidence from the holder proves it bad."""
    events = saved(1, 0) + saved(1, 1) + [replicated(1, 0), replicated(1, 1)]
    events.append(evicted_replica(1, 0, "a"))  # (not the holder)
    assert peer_ranks(fold(events), 1) == [0, 1]
    events.append(evicted_replica(1, 0, "b"))
    events.append(StageFailed(job="j", node="b", ts=0.0, stage="restore", error="IntegrityError",
                              message="x", retryable=False, attempt=1, step=1, rank=1,
                              world_size=WORLD, tier="peer"))  # fmt: skip
    state, catalog = both(events)
    assert peer_ranks(state, 1) == [] and catalog.complete_steps("j", ("peer",)) == []
    rec = state.record(1)
    assert rec is not None and ranks_of(rec.nvme) == [0, 1]  # (the savers' copies stay)


def test_a_rewind_supersedes_a_replica() -> None:
    """A rank's rewind below a step abandons its replica of that step like its other copies."""
    events = [*saved(2, 0), replicated(2, 0)]
    rewind = ShardWritten(**ident("j", 1, 0, "a", epoch=7), path="/p", nbytes=1,
                          header_digest=digest(1, 0), tensors=1, seconds=0,
                          rewind_to=1)  # fmt: skip
    state, catalog = both([*events, rewind])
    assert peer_ranks(state, 2) == [] and not catalog.shard("j", 2, 0).usable("peer")  # type: ignore[union-attr]


def test_a_step_completes_on_the_peer_tier_and_its_newest_is_kept() -> None:
    """Every rank replicated: the step is complete on the peer tier (`JobHead.peer_steps`); the
    newest such step is kept by the floors like the other tiers' newest, and with its savers'
    NVMe copies evicted it is still complete on some tier."""
    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=1)
    events = [e for r in range(WORLD) for e in saved(1, r, flushed=True)]
    events += [e for r in range(WORLD) for e in [*saved(2, r), replicated(2, r)]]
    for step in range(3, 7):
        events += [e for r in range(WORLD) for e in saved(step, r)]
    state = fold(events, keep)
    head = state.head()
    assert head.peer_steps == [2] and head.s3_steps == [1] and head.nvme_steps[-1] == 6
    assert 2 in state.floors().keep and 2 in head.steps
    evicted = [ShardEvicted(**ident("j", 2, r, SAVER[r]), tier="nvme", location="/p",
                            reason="test") for r in range(WORLD)]  # fmt: skip
    state = fold(evicted, keep, state)
    rec = state.record(2)
    assert rec is not None and ranks_of(rec.nvme) == [] and ranks_of(rec.peer) == [0, 1, 2, 3]
    assert state.head().peer_steps == [2] and 2 in state.head().steps


def test_records_with_peer_bits_round_trip_through_the_kv_and_a_takeover() -> None:
    """A record's peer bitmap survives its KV form and a coordinator taking over from it; an
    `evicted` of a replica clears its rank in a step known by its record alone."""
    rec = StepRecord(step=5, world_size=WORLD, nvme=bitmap(range(WORLD), WORLD),
                     s3=bitmap([], WORLD), peer=bitmap([1, 3], WORLD))  # fmt: skip
    assert decode_record(encode_record(rec)) == rec
    assert StepBits.of(rec).record(5) == rec
    events = [e for r in range(WORLD) for e in [*saved(1, r), replicated(1, r)]]
    events += [e for r in range(WORLD) for e in saved(2, r)]
    first = fold(events)
    head = first.head()
    assert head.peer_steps == [1]
    head = msgspec.structs.replace(head, window=2)  # (step 1 known by its record alone)
    second = JobState("j", EVERYTHING, head=head, floors=first.floors(), records=first.records())
    assert second.head().peer_steps == [1] and peer_ranks(second, 1) == [0, 1, 2, 3]
    second.apply(head.seq + 1, evicted_replica(1, 2, "a"))
    assert peer_ranks(second, 1) == [0, 1, 3] and second.head().peer_steps == []


def test_a_restart_considers_the_newest_steps_complete_on_peers() -> None:
    """The head's candidates include the newest steps complete on the peer tier, however many
    newer steps have records since."""
    events = [e for r in range(WORLD) for e in [*saved(1, r), replicated(1, r)]]
    for step in range(2, 6):
        events += [e for r in range(WORLD) for e in saved(step, r)[:1]]  # (written only)
    head = fold(events).head()
    assert head.peer_steps == [1] and head.candidates() == [5, 4, 3, 1]


# --- the planner


def test_a_lost_nodes_ranks_read_their_replica_on_a_survivor() -> None:
    """Losing node b: its ranks read their replicas on a (peer), a's ranks their NVMe; with
    every NVMe lost, the replicas go too and every rank reads object storage."""
    events = [e for r in range(WORLD) for e in saved(1, r, flushed=True)]
    events += [e for r in range(WORLD) for e in [*saved(2, r), replicated(2, r)]]
    records = fold(events).records()
    plan = kv_plan("j", [2, 1], records, lost_nodes=["b"], lost_ranks=[2, 3])
    assert (plan.step, plan.peer_ranks, plan.s3_ranks, plan.from_nvme) == (2, [2, 3], [], 2)
    assert "2 from NVMe, 0 from object storage, 2 from peers" in plan.describe()
    assert "2 from peers" in plan.summary() and plan.to_json()["peer_ranks"] == [2, 3]
    lost = kv_plan("j", [2, 1], records, nvme_lost=True)
    assert (lost.step, lost.peer_ranks, lost.s3_ranks) == (1, [], [0, 1, 2, 3])
    assert "step 2 rejected: 4 of 4 ranks have no copy" in lost.describe()


def test_no_replica_counts_when_its_holder_is_lost_too() -> None:
    """Ranks whose replica a lost node holds (`replicas_lost`) read object storage, and a step
    they have only there and on lost NVMe is not restorable."""
    events = [e for r in range(WORLD) for e in [*saved(2, r), replicated(2, r)]]
    records = fold(events).records()
    plan = kv_plan("j", [2], records, lost_ranks=[2, 3], replicas_lost=[0, 1])
    assert plan.peer_ranks == [2, 3]  # (a holds b's replicas; a's ranks read their NVMe)
    with pytest.raises(NoCheckpointError, match="2 of 4 ranks have no copy"):
        kv_plan("j", [2], records, lost_ranks=[2, 3], replicas_lost=[2, 3])


def test_choose_prefers_nvme_then_a_peer_then_object_storage() -> None:
    """A rank reads its NVMe copy where it has one, else a replica, else its object."""
    reports = {
        0: RankSteps(rank=0, local_steps=[1], s3_steps=[1]),
        1: RankSteps(rank=1, local_steps=[], s3_steps=[1]),
        2: RankSteps(rank=2, local_steps=[], s3_steps=[1]),
    }
    choice = choose("j", reports, 3, peer={0: [1], 1: [1]})
    assert ranks_of(choice.from_peer) == [1] and ranks_of(choice.from_s3) == [2]
    rec = StepRecord(step=1, world_size=3, nvme=bitmap([0], 3), peer=bitmap([1, 2], 3))
    _, _, _, peer = recorded([1], {1: rec}, 3, nvme_lost=[0, 1, 2], replicas_lost=[2])
    assert peer == {1: [1]}


# --- through the bus and the CLI


def _publish_and_store(settings: Settings, job: str, events: list[Event]) -> None:
    """Publish `events` on the job's stream and store their fold in KV, as its coordinator
    would (no agent)."""

    async def go() -> None:
        async with Bus(settings) as bus:
            state = JobState(job, EVERYTHING)
            for e in events:
                state.apply((await bus.publish(e)).seq, e)
            store = await JobStore(bus.js, settings).open()
            await store.register(job, EVERYTHING)
            await store.write(state, state.take_changes())

    anyio.run(go)


def _two_nodes(job: str, *, forged: bool = False) -> list[Event]:
    """Step 1 everywhere, step 2 on NVMe with every rank replicated on its partner (`forged`:
    b's ranks "replicated" on b itself)."""
    events = [e for r in range(WORLD) for e in saved(1, r, job=job, flushed=True)]
    for r in range(WORLD):
        holder = SAVER[r] if forged and SAVER[r] == "b" else None
        events += [*saved(2, r, job=job), replicated(2, r, job=job, holder=holder)]
    return events


def test_plan_with_a_lost_node_reads_its_ranks_from_peers(settings: Settings, job: str) -> None:
    """`tierpipe plan --lost-node b` sends b's ranks to their replicas on a (a holder's own
    `replicated` events do not make the ranks it holds replicas of its own);
    `--lost-node a --lost-node b` loses the replicas too, `--nvme-lost` every one."""
    _publish_and_store(settings, job, _two_nodes(job))

    async def ranks() -> tuple[list[int], list[int]]:
        async with Bus(settings) as bus:
            return await node_ranks(bus, job, ["b"], WORLD), await replica_ranks(
                bus, job, ["b"], WORLD
            )

    assert anyio.run(ranks) == ([2, 3], [0, 1])

    async def sources(rank: int, step: int = 2, skip: tuple[str, ...] = ()) -> list[Source]:
        async with Bus(settings) as bus:
            reads = Reads(await JobStore(bus.js, settings).open(), job)
            return await replica_sources(bus, reads, step=step, rank=rank, world_size=WORLD,
                                         skip=skip)  # fmt: skip

    assert anyio.run(sources, 2) == [
        Source(tier="peer", node="a", location="/nvme/a/peer/2/2", nbytes=4096,
               header_digest=digest(2, 2))
    ]  # fmt: skip
    assert anyio.run(sources, 2, 2, ("a",)) == [] and anyio.run(sources, 2, 1) == []

    def plan(*args: str) -> dict[str, object]:
        out = run_cli(settings, "plan", "--job", job, "--json", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        found = json.loads(out.stdout)
        assert isinstance(found, dict)
        return found

    lost_b = plan("--lost-node", "b")
    assert (lost_b["step"], lost_b["from_nvme"], lost_b["peer_ranks"], lost_b["s3_ranks"]) == (
        2, 2, [2, 3], []
    )  # fmt: skip
    both_lost = plan("--lost-node", "a", "--lost-node", "b")
    assert (both_lost["step"], both_lost["from_peer"], both_lost["from_s3"]) == (1, 0, WORLD)
    assert (plan("--nvme-lost")["step"], plan()["from_peer"]) == (1, 0)
    text = run_cli(settings, "plan", "--job", job, "--lost-node", "b")
    assert "2 from NVMe, 0 from object storage, 2 from peers" in text.stdout, text.stdout


def test_a_self_sourced_replica_does_not_make_a_step_restorable(
    settings: Settings, job: str
) -> None:
    """b's ranks "replicated" on b itself: losing b, step 2 has no copy of them; the plan
    falls back to step 1 in object storage."""
    _publish_and_store(settings, job, _two_nodes(job, forged=True))
    out = run_cli(settings, "plan", "--job", job, "--json", "--lost-node", "b")
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout)
    assert (found["step"], found["from_peer"], found["s3_ranks"]) == (1, 0, [2, 3])

    async def sources() -> list[Source]:
        async with Bus(settings) as bus:
            await bus.publish(replicated(2, 2, job=job, holder="c", nbytes=1))  # (another size)
            reads = Reads(await JobStore(bus.js, settings).open(), job)
            return await replica_sources(bus, reads, step=2, rank=2, world_size=WORLD)

    assert anyio.run(sources) == []  # (b's own "replica", and one not the verified copy)
