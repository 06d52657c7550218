"""The job state in JetStream KV (a real nats-server): what is stored equals the fold of the
events, whatever batches it was written in; one writer at a time, fenced by its lease."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js import api

from tests.oracle_catalog import Catalog
from tests.test_jobstate import WORLD, histories, lifecycle
from tierpipe.bus.client import Bus
from tierpipe.bus.kv import BucketConfig, bind_bucket, open_bucket
from tierpipe.control.bitmap import ranks_of
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore, digests_key, shares_key, step_key
from tierpipe.dev import NatsServer
from tierpipe.errors import BucketMissingError, BusUnavailableError, LeaseLostError
from tierpipe.names import stream_name
from tierpipe.schemas import Event
from tierpipe.schemas.jobstate import Keep, Shares, StepRecord
from tierpipe.settings import Settings, load_settings

KEEP = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2)


def kv_settings(server: NatsServer, bucket: str) -> Settings:
    return load_settings(env={}, nats_url=server.url, kv_bucket=bucket)


async def stored(store: JobStore, job: str) -> tuple[object, object, dict[int, object]]:
    head = await store.head(job)
    return head, await store.floors(job), await store.records(job, range(0, 10))


async def write_in_batches(
    store: JobStore, job: str, events: list[Event], cuts: set[int]
) -> JobState:
    state = JobState(job, KEEP)
    lease = await store.acquire(job, "node-a", 30)
    assert lease is not None
    for seq, event in enumerate(events, 1):
        state.apply(seq, event.__class__(**{**_fields(event), "job": job}))
        if seq in cuts:
            await store.write(state, state.take_changes())
    await store.write(state, state.take_changes())
    return state


async def assert_digests_are_the_fold(
    store: JobStore, job: str, records: dict[int, StepRecord], events: list[Event]
) -> None:
    """Every rank with a copy in a stored record has, in the KV, the header digest and size
    of its verified copy as a fold of the whole history has them."""
    catalog = Catalog()
    for event in events:
        catalog.apply(event.__class__(**{**_fields(event), "job": job}))
    for step, rec in records.items():
        for rank in sorted(set(ranks_of(rec.nvme)) | set(ranks_of(rec.s3))):
            shard = catalog.shard(job, step, rank)
            assert shard is not None
            copies = {(c.header_digest, c.nbytes) for t in ("nvme", "s3") for c in shard.usable(t)}
            if copies:  # (an s3 bit of removed objects outlives its copies)
                assert await store.rank_digest(job, step, rank) in copies


def _fields(event: Event) -> dict[str, object]:
    return {f: getattr(event, f) for f in event.__struct_fields__}


@pytest.mark.anyio
async def test_the_bucket_takes_the_watchers_of_thousands_of_agents(
    nats_server: NatsServer, uid: str
) -> None:
    """Every agent watches the floors and the jobs (2 consumers each): the bucket's stream
    admits `stream_max_consumers`, not nats-server's default of 1,000 (500 agents)."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        await JobStore(bus.js, s).open()
        stream = f"KV_{s.kv_bucket}"
        assert (await bus.js.stream_info(stream)).config.max_consumers == s.stream_max_consumers
        for i in range(1_001):
            await bus.js.add_consumer(
                stream, api.ConsumerConfig(durable_name=f"w{i}", ack_policy="explicit")
            )
        await bus.js.delete_stream(stream)  # (1,001 consumers: not left to the other tests)


@pytest.mark.anyio
async def test_what_is_stored_is_the_fold(nats_server: NatsServer, uid: str) -> None:
    events = [e for step in range(1, 6) for rank in range(WORLD) for e in lifecycle(step, rank)]
    async with Bus(kv_settings(nats_server, f"kv-{uid}")) as bus:
        store = await JobStore(bus.js, bus.settings).open()
        state = await write_in_batches(store, "j", events, {4, 9, 20})
        head, floors, records = await stored(store, "j")
        assert head == state.head() and floors == state.floors()
        assert records == state.records() and sorted(records) == head.steps
        assert head.nvme_steps == [4, 5] and head.s3_steps == [4, 5]
        await assert_digests_are_the_fold(store, "j", records, events)
        assert await store.rank_digest("j", 1, 0) is None  # dropped: its digests went too
        # A coordinator taking over rebuilds the same state from the KV and the events.
        again = await store.load("j", KEEP)
        for seq in range(head.resume_seq, len(events) + 1):
            again.apply(seq, events[seq - 1])
        assert again.records() == state.records() and again.floors() == state.floors()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(histories(), st.sets(st.integers(1, 40), max_size=5))
def test_the_kv_always_agrees_with_the_fold(
    nats_server: NatsServer, uid: str, events: list[Event], cuts: set[int]
) -> None:
    job = f"j{time.monotonic_ns()}"

    async def main() -> None:
        async with Bus(kv_settings(nats_server, f"kv-{uid}")) as bus:
            store = await JobStore(bus.js, bus.settings).open()
            state = await write_in_batches(store, job, events, cuts)
            head, floors, records = await stored(store, job)
            assert head == state.head()
            assert floors == state.floors()
            assert records == state.records()
            await assert_digests_are_the_fold(store, job, records, events)

    anyio.run(main)


@pytest.mark.anyio
async def test_one_writer_at_a_time_fenced_by_the_lease(nats_server: NatsServer, uid: str) -> None:
    """B cannot take a live lease; once A's expires B takes it (a new term), and A, paused
    past its expiry, can neither renew nor write over B."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus_a, Bus(s) as bus_b:
        a = await JobStore(bus_a.js, s).open()
        b = await JobStore(bus_b.js, s).open()
        lease_a = await a.acquire("j", "node-a", 1.0)
        assert lease_a is not None and lease_a.term == 1
        assert await b.acquire("j", "node-b", 1.0) is None
        state_a = JobState("j", KEEP)
        for seq, event in enumerate(lifecycle(1, 0), 1):
            state_a.apply(seq, event)
        await a.write(state_a, state_a.take_changes())

        await anyio.sleep(1.2)  # A is paused past its lease
        lease_b = await b.acquire("j", "node-b", 30.0)
        assert lease_b is not None and lease_b.term == 2
        state_b = await b.load("j", KEEP)
        for seq, event in enumerate(lifecycle(1, 0) + lifecycle(1, 1), 1):
            state_b.apply(seq, event)
        await b.write(state_b, state_b.take_changes())

        with pytest.raises(LeaseLostError):
            await a.renew("j", lease_a, 1.0)
        state_a.apply(10, lifecycle(2, 0)[0])
        with pytest.raises(LeaseLostError):
            await a.write(state_a, state_a.take_changes())
        assert (await b.head("j")) == state_b.head()


@pytest.mark.anyio
async def test_a_writer_does_not_bring_back_a_removed_key(
    nats_server: NatsServer, uid: str
) -> None:
    """A writer's compare-and-set of a key whose newest write is a purge (what `tierpipe rm`
    leaves) is refused as a lost lease: a coordinator that still runs does not write back the
    state of a job an operator removed."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        first = await JobStore(bus.js, s).open()
        await first.write_shares("j", Shares(nodes=1))
        await first.purge([shares_key("j")])
        store = await JobStore(bus.js, s).open()
        with pytest.raises(LeaseLostError):
            await store.write_shares("j", Shares(nodes=2))
        assert await store.kv.get(shares_key("j")) is None


@pytest.mark.anyio
async def test_a_step_retention_deleted_is_stored_again_when_the_fold_makes_it_again(
    nats_server: NatsServer, uid: str
) -> None:
    """Retention deletes a step's keys (a delete, not rm's purge). A fold that makes the step
    again (a rewind lowered the floors under it, and a late event of it came) stores it: the
    write is no lost lease. A coordinator taking over, or a restart's catch-up fold, was
    refused so for good in CI and left the job state behind."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        first = await JobStore(bus.js, s).open()
        state = JobState("j", KEEP)
        events = [e for r in range(WORLD) for e in lifecycle(1, r)]
        for seq, event in enumerate(events, 1):
            state.apply(seq, event)
        await first.write(state, state.take_changes())
        gone = [step_key("j", 1), digests_key("j", 1, 0)]
        for key in gone:
            await first.kv.delete(key)
        store = await JobStore(bus.js, s).open()
        again = JobState("j", KEEP)
        for seq, event in enumerate(events, len(events) + 1):
            again.apply(seq, event)
        await store.write(again, again.take_changes())
        assert await store.record("j", 1) == again.record(1)
        assert await store.digests("j", 1, 0) == again.rank_digests(1, 0)


@pytest.mark.anyio
async def test_the_bucket_answers_in_its_own_terms(nats_server: NatsServer, uid: str) -> None:
    """A key never written, deleted or purged reads as None, a compare-and-set that lost
    returns None, and a read of a bucket that does not exist raises `BucketMissingError`
    naming it."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        kv = (await JobStore(bus.js, s).open()).kv
        assert await kv.get("j.x") is None and await kv.revision("j.x") == 0
        rev = await kv.create("j.x", b"1")
        assert rev is not None and await kv.create("j.x", b"2") is None
        assert await kv.update("j.x", b"3", last=rev - 1) is None
        assert await kv.update("j.x", b"3", last=rev) == await kv.revision("j.x")
        await kv.delete("j.x")  # (a delete's revision: a writer may store the key again)
        deleted = await kv.revision("j.x")
        assert await kv.get("j.x") is None and deleted > rev
        assert await kv.update("j.x", b"4", last=deleted) is not None
        await kv.purge("j.x")  # (a purge's is 0, which no update matches: removed for good)
        assert await kv.revision("j.x") == 0 and await kv.update("j.x", b"5", last=0) is None
        with pytest.raises(BucketMissingError) as e:
            await bind_bucket(bus.js, f"none-{uid}").get("k")
        assert e.value.bucket == f"none-{uid}"


@pytest.mark.anyio
async def test_what_is_stored_is_read_whole_however_busy_the_bucket(
    nats_server: NatsServer, uid: str
) -> None:
    """`stored` returns every key matching its pattern while another writer keeps the bucket's
    stream busy. A watch's "all delivered" marker came before values the server had already
    sent (nats-py issue 842): `tierpipe ls` showed a job without its state (CI)."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus, Bus(s) as writer:
        kv = (await JobStore(bus.js, s).open()).kv
        heads = sorted((f"j{i}.head", f"{i}".encode()) for i in range(5))
        for key, value in heads:
            await kv.put(key, value)
        busy, done = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_write_until, writer, f"$KV.{s.kv_bucket}.other.lease", busy, done)
            await busy.wait()
            for _ in range(300):  # (the watch came short in ~1 of 6 tries here)
                found = sorted(await kv.stored("*.head"))
                if found != heads:
                    break
            done.set()
        assert found == heads


@pytest.mark.anyio
async def test_what_is_stored_leaves_out_removed_keys_and_no_consumer(
    nats_server: NatsServer, uid: str
) -> None:
    """`stored` returns the newest value of each key matching its pattern, the deleted and
    purged ones left out, [] where none match, `BucketMissingError` for a bucket that does not
    exist; and it leaves no consumer on the bucket's stream (each counts towards its limit)."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        kv = (await JobStore(bus.js, s).open()).kv
        for key in ("a.head", "b.head", "c.head", "d.head", "a.lease"):
            await kv.put(key, b"old")
        await kv.put("a.head", b"new")
        await kv.put("d.head", b"")
        await kv.delete("b.head")
        await kv.purge("c.head")
        assert sorted(await kv.stored("*.head")) == [("a.head", b"new"), ("d.head", b"")]
        assert sorted(await kv.stored("a.>")) == [("a.head", b"new"), ("a.lease", b"old")]
        assert await kv.stored("*.floor") == []
        info = await bus.js.stream_info(f"KV_{s.kv_bucket}")
        assert info.state.consumer_count == 0
        with pytest.raises(BucketMissingError):
            await bind_bucket(bus.js, f"none-{uid}").stored(">")


@pytest.mark.anyio
async def test_a_read_of_what_is_stored_cancelled_leaves_no_consumer(
    nats_server: NatsServer, uid: str
) -> None:
    """`stored` cancelled at any moment of its read (a CLI interrupted, a stage stopping)
    deletes its consumer all the same: each counts towards the stream's limit."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        kv = (await JobStore(bus.js, s).open()).kv
        for i in range(2_000):
            await kv.put(f"j{i}.head", b"x" * 100)
        for i in range(40):  # (reading 2,000 keys takes ~80 ms here: cut in the first 20)
            with anyio.move_on_after(i / 2000) as read:
                await kv.stored("*.head")
            assert read.cancelled_caught
        info = await bus.js.stream_info(f"KV_{s.kv_bucket}")
        assert info.state.consumer_count == 0


@pytest.mark.anyio
async def test_what_is_stored_is_read_while_keys_age_out(nats_server: NatsServer, uid: str) -> None:
    """`stored` of a bucket whose keys age out while it reads them (the node records) answers
    in time with those left: a key counted when the read began and gone before its turn is no
    outage (a fetch waiting for it would stall, then raise `BusUnavailableError`)."""
    async with Bus(kv_settings(nats_server, f"kv-{uid}")) as bus:
        kv = await open_bucket(bus.js, BucketConfig(name=f"ttl-{uid}", ttl_s=1.0))
        written = {f"n{i}": b"x" * 200 for i in range(400)}
        for key, value in written.items():  # (over ~1 s: they age out one by one)
            await kv.put(key, value)
            await anyio.sleep(0.0025)
        reads, until = 0, time.monotonic() + 1.5
        while time.monotonic() < until:
            with anyio.fail_after(3):
                assert set(await kv.stored(">")) <= set(written.items())
            reads += 1
        assert reads > 10


async def _write_until(bus: Bus, subject: str, started: anyio.Event, done: anyio.Event) -> None:
    """Store 8 KiB values under `subject`, 50 writes in flight at once, until `done`."""
    while not done.is_set():
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(bus.js.publish, subject, b"x" * 8192)
        started.set()


def test_a_bound_store_and_a_bus_make_sure_of_what_does_not_answer(tmp_path: Path) -> None:
    """A rank but 0 binds the bucket and reads the stream without asking JetStream whether
    they exist. Where one does not (a rank that starts before rank 0 and every agent), its
    first read makes it (once) and answers as for an empty job, not `BusUnavailableError`.
    (A server of its own: the stream takes every `tp.` subject.)"""
    with NatsServer(tmp_path / "nats") as server:
        _bound_reads(kv_settings(server, "bound"))


def _bound_reads(s: Settings) -> None:
    async def main() -> None:
        async with Bus(s) as bus:
            with pytest.raises(BusUnavailableError):  # (any other reader: it creates nothing)
                await bus.last_raw("tp.j.staged.*.1")
            bus.ensure_stream_on_first_miss()  # (as a rank but 0 does)
            assert await bus.last_raw("tp.j.staged.*.1") is None
            stream = stream_name(s.stream, "j")
            assert (await bus.js.stream_info(stream)).config.name == stream
            store = JobStore(bus.js, s).bind()
            assert await store.head("j") is None
            assert await store.value("j.step.1.ranks.0") is None
            await bus.js.key_value(s.kv_bucket)  # (exists now)

    anyio.run(main)


@pytest.mark.anyio
async def test_a_watch_stopped_leaves_no_consumer(nats_server: NatsServer, uid: str) -> None:
    """A watch (`changes`, opened by every `tierpipe status`, `plan`, `export`) deletes its
    consumer when it stops: nats-py left it on the bucket's stream for 5 minutes, each counting
    towards the stream's consumer limit."""
    s = kv_settings(nats_server, f"kv-{uid}")
    async with Bus(s) as bus:
        kv = (await JobStore(bus.js, s).open()).kv
        await kv.put("a.head", b"1")
        for _ in range(3):
            async with kv.changes("a.*") as written:
                await written.wait(1.0)  # (the value as stored)
        info = await bus.js.stream_info(f"KV_{s.kv_bucket}")
        assert info.state.consumer_count == 0
