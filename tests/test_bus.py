"""The bus against a real nats-server: stream and consumer management (`tierpipe.bus.consumer`),
dedup, readable events."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from nats.js import api
from structlog.testing import capture_logs

from tests.conftest import make_staged as staged
from tierpipe.bus.client import Bus, redact_url
from tierpipe.bus.consumer import FETCH_WAIT_S, ensure_consumer, fetch, missing, pull
from tierpipe.dev import NatsServer
from tierpipe.errors import BusUnavailableError
from tierpipe.names import stream_name
from tierpipe.schemas import decode_event
from tierpipe.settings import Settings, load_settings

pytestmark = pytest.mark.anyio

#: The job of the tests that need no events of their own.
J = "j1"


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A server of this test's own (stream config changes must not leak into other tests)."""
    with NatsServer(tmp_path / "nats") as server:
        yield server


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


async def test_ensure_stream_is_idempotent_and_applies_changes(own_server: NatsServer) -> None:
    """Ensuring twice changes nothing; a changed setting is applied to the existing stream."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.ensure_stream(J)
        with capture_logs() as logs:
            await bus.ensure_stream(J)
        assert [e["event"] for e in logs if e["event"].startswith("stream_")] == []
        info = await bus.js.stream_info(stream_name(s.stream, J))
        assert info.config.subjects == ["tp.j1.>"] and info.config.allow_direct
        assert info.config.deny_delete and info.config.max_msgs_per_subject == -1
        assert info.config.max_age == s.stream_max_age_s
        assert info.config.retention == "limits" and info.config.duplicate_window == 120
    changed = s.replace(stream_max_bytes=1 << 30, duplicate_window_s=30.0)
    async with Bus(changed) as bus:
        await bus.ensure_stream(J)
        info = await bus.js.stream_info(stream_name(s.stream, J))
        assert info.config.max_bytes == 1 << 30 and info.config.duplicate_window == 30


async def test_stream_takes_the_consumers_of_thousands_of_nodes(own_server: NatsServer) -> None:
    """nats-server caps a stream at 1,000 consumers unless the stream says otherwise (250 nodes
    of 4 durable stage consumers each): the stream allows `stream_max_consumers`, also when an
    older stream is updated."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.js.add_stream(
            name=stream_name(s.stream, J), subjects=["tp.j1.>"]
        )  # (as an older tierpipe made)
        await bus.ensure_stream(J)
        info = await bus.js.stream_info(stream_name(s.stream, J))
        assert info.config.max_consumers == s.stream_max_consumers >= 40_000
        for i in range(1_001):
            await bus.js.add_consumer(
                stream_name(s.stream, J),
                api.ConsumerConfig(durable_name=f"c{i}", ack_policy="explicit"),
            )


async def test_ensure_consumer_updates_changed_config(own_server: NatsServer) -> None:
    """Re-ensuring a durable consumer with a new ack_wait updates it in place."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.ensure_stream(J)
        await ensure_consumer(bus, J, "verify_n1", ["tp.j1.written.n1.*"])
        await ensure_consumer(bus, J, "verify_n1", ["tp.j1.written.n1.*"])
        bus.settings = s.replace(ack_wait_s=12.0, max_deliver=3)
        await ensure_consumer(bus, J, "verify_n1", ["tp.j1.written.n1.*"])
        info = await bus.js.consumer_info(stream_name(s.stream, J), "verify_n1")
        assert info.config.ack_wait == 12.0 and info.config.max_deliver == 3


async def test_an_idle_long_poll_is_no_failure(own_server: NatsServer) -> None:
    """Fetches from idle consumers return nothing, never an error: nats-py ends some idle pulls
    with the builtin `TimeoutError` (no message), which the agent logged as 283 `fetch_failed`
    warnings ("fetch: ") in 30 minutes of a healthy run."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.ensure_stream(J)
        subs = []
        for i in range(8):
            await ensure_consumer(bus, J, f"idle_{i}", [f"tp.j1.written.idle{i}.*"])
            subs.append(await pull(bus, J, f"idle_{i}"))
        got: list[object] = []

        async def poll(sub: object) -> None:
            for _ in range(4):  # (as the stages poll: the third such poll ended so on main)
                got.extend(await fetch(sub, batch=16, timeout=FETCH_WAIT_S))  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:
            for sub in subs:
                tg.start_soon(poll, sub)
        assert got == []


async def test_a_fetch_hands_over_a_message_as_it_arrives(own_server: NatsServer) -> None:
    """A fetch returns a message as it arrives, never at the end of its wait. When the server
    answers a fetch's first pull at once with a status (here 408 "Requests Pending": a message is
    pending and an earlier pull still waits), nats-py falls back to a long pull for the whole
    batch and held the message it got until `FETCH_WAIT_S` was over (on the agents: a replica
    made 4-5 s after its shard was verified, past test_replicate's 5 s bound)."""
    s = load_settings(env={}, nats_url=own_server.url, max_ack_pending=1)
    async with Bus(s) as bus:
        await bus.ensure_stream(J)
        await ensure_consumer(bus, J, "verify_n1", ["tp.j1.staged.n1.*"])
        sub = await pull(bus, J, "verify_n1")
        for step in (1, 2):
            await bus.publish(staged(J, "n1", step))
        (first,) = await fetch(sub, timeout=5.0)  # (step 2 waits: one unacked at a time)
        # An earlier pull still waiting on this subscription's inbox (as one a fetch gave up on).
        assert bus.nc is not None
        earlier = json.dumps({"batch": 16, "expires": 30_000_000_000}).encode()
        await bus.nc.publish(sub._nms, earlier, reply=sub._deliver)  # type: ignore[attr-defined]

        async def ack_later() -> None:
            await anyio.sleep(1.0)
            await first.ack()  # (step 2 goes out now)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ack_later)
            t0 = anyio.current_time()
            got = await fetch(sub, batch=16, timeout=FETCH_WAIT_S)
            waited = anyio.current_time() - t0
        assert [decode_event(m.data).step for m in got] == [2]  # type: ignore[union-attr]
        assert waited < 2.5, waited


async def test_republished_event_is_deduplicated(settings: Settings, job: str) -> None:
    """Publishing the same event twice (a redelivered stage) stores it once."""
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        event = staged(job, settings.node or "")
        first = await bus.publish(event)
        again = await bus.publish(event)
        assert not first.duplicate and again.duplicate and again.seq == first.seq


async def test_a_replay_cancelled_at_any_moment_leaves_no_consumer(
    settings: Settings, job: str
) -> None:
    """A history replay cancelled at any moment (a CLI interrupted, a stage stopping) deletes
    its consumer: one cancelled while the server was making it was left on the stream (30 s),
    each counting towards the stream's consumer limit."""
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        for step in range(1, 201):
            await bus.publish(staged(job, settings.node or "", step))
        for i in range(40):  # (a replay of 200 events takes a few ms here: cut in the first 10)
            with anyio.move_on_after(i / 4000):
                await bus.history(f"tp.{job}.>")
        info = await bus.js.stream_info(stream_name(settings.stream, job))
        assert info.state.consumer_count == 0


async def test_events_are_readable_json_with_headers(
    settings: Settings, job: str, nats_server: NatsServer
) -> None:
    """Operators see compact JSON bodies with kind/schema headers (as `nats stream view` shows)."""
    event = staged(job, settings.node or "", step=4)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        await bus.publish(event)
        raw = await bus.js.get_last_msg(
            stream_name(settings.stream, job), f"tp.{job}.staged.{settings.node}.0"
        )
    body = json.loads(raw.data)
    assert body["kind"] == "staged" and body["step"] == 4 and body["v"] == 1
    assert raw.headers["Tp-Kind"] == "staged"
    node = settings.node
    assert raw.headers["Nats-Msg-Id"] == f"{job}/4/0/staged/{node}/0/{round(event.ts * 1e6)}"
    assert decode_event(raw.data) == event
    jsz = await anyio.to_thread.run_sync(get_json, f"{nats_server.monitor_url}/jsz?streams=true")
    streams = [s["name"] for a in jsz["account_details"] for s in a["stream_detail"]]
    assert stream_name(settings.stream, job) in streams


async def test_unreachable_server_is_a_clear_retryable_error() -> None:
    """Connecting to a dead address fails with BusUnavailableError naming it, without secrets."""
    s = load_settings(env={}, nats_url="nats://user:hunter2@127.0.0.1:1", connect_timeout_s=0.5)
    with pytest.raises(BusUnavailableError) as err:
        async with Bus(s):
            pass
    assert "127.0.0.1:1" in str(err.value) and "hunter2" not in str(err.value)


def test_redact_url_hides_credentials() -> None:
    """Credentials in server URLs never reach logs."""
    assert redact_url("nats://u:p@h:4222,nats://h2:4223") == "nats://***@h:4222,nats://h2:4223"


async def test_a_deleted_consumer_or_stream_is_told_apart_from_an_outage(
    own_server: NatsServer,
) -> None:
    """nats-py 2.16 answers a pull from a deleted consumer with "no responders" (503) at once;
    `missing()` then says whether the consumer or the whole stream is gone."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.ensure_stream(J)
        await ensure_consumer(bus, J, "verify_n1", ["tp.j1.written.n1.*"])
        sub = await pull(bus, J, "verify_n1")
        assert await fetch(sub, timeout=0.2) == [] and await missing(bus, J, "verify_n1") is None
        await bus.js.delete_consumer(stream_name(s.stream, J), "verify_n1")
        with pytest.raises(BusUnavailableError):
            await fetch(sub, timeout=0.5)
        assert await missing(bus, J, "verify_n1") == "consumer"
        await bus.js.delete_stream(stream_name(s.stream, J))
        assert await missing(bus, J, "verify_n1") == "stream"


@pytest.mark.parametrize("listener", [False, True])
async def test_a_publish_recreates_a_deleted_stream(
    own_server: NatsServer, job: str, listener: bool
) -> None:
    """A publish finding the stream gone creates it again and lands, whether the server says
    "no stream" at once or (with a core subscriber on the subject) the publish just times out."""
    s = load_settings(env={}, nats_url=own_server.url, request_timeout_s=4.0)
    async with Bus(s) as bus:
        await bus.ensure_stream(job)
        if listener:  # e.g. a trainer's own progress subscription

            async def ignore(msg: object) -> None:
                return None

            await bus.subscribe(f"tp.{job}.>", ignore)
        await bus.js.delete_stream(stream_name(s.stream, job))
        published = await bus.publish(staged(job, "n1", step=2))
        assert published.seq == 1 and not published.duplicate
        assert [e.step for e in await bus.history(f"tp.{job}.>")] == [2]


async def test_a_watch_gives_the_newest_on_each_subject_then_every_new_one(
    settings: Settings, job: str
) -> None:
    """A watch starts with the newest stored event of each matching subject, then delivers each
    later one as the stream stores it, with its stream sequence."""
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        await bus.publish(staged(job, "a", step=1))
        newest = [await bus.publish(staged(job, n, step=2)) for n in ("a", "b")]
        async with bus.watch(f"tp.{job}.staged.*.*") as watch:
            first = [await watch.next(5), await watch.next(5)]
            later = await bus.publish(staged(job, "b", step=3))
            got = await watch.next(5)
            assert await watch.next(0.2) is None
    assert [(s.seq, s.subject) for s in first if s] == [
        (newest[0].seq, f"tp.{job}.staged.a.0"),
        (newest[1].seq, f"tp.{job}.staged.b.0"),
    ]
    assert got is not None and got.seq == later.seq and getattr(got.event, "step", 0) == 3


async def test_a_watch_misses_nothing_stored_while_its_server_restarted(
    own_server: NatsServer, job: str
) -> None:
    """Events stored while the watching client was away (its server restarted, its consumer
    lost) still arrive once it is back."""
    s = load_settings(env={}, nats_url=own_server.url)
    async with Bus(s) as bus:
        await bus.ensure_stream(job)
        async with bus.watch(f"tp.{job}.staged.*.*") as watch:
            before = await bus.publish(staged(job, "a", step=1))
            assert (await watch.next(5) or before).seq == before.seq
            own_server.stop()
            own_server.start()
            async with Bus(s) as other:
                after = await other.publish(staged(job, "a", step=2))
            got = await watch.next(30)
    assert got is not None and got.seq == after.seq


async def test_one_jobs_history_never_pushes_out_anothers(own_server: NatsServer) -> None:
    """Each job has a stream of its own, with its own limits: a busy job that fills its size
    limit drops its own oldest events, never a quiet job's (one stream for all jobs dropped
    the quiet job's history first: it was the oldest)."""
    s = load_settings(env={}, nats_url=own_server.url, stream_max_bytes=32 << 10)
    async with Bus(s) as bus:
        for job in ("quiet", "busy"):
            await bus.ensure_stream(job)
        quiet = [await bus.publish(staged("quiet", "n1", step=t)) for t in range(1, 6)]
        for t in range(1, 400):
            await bus.publish(staged("busy", "n1", step=t))
        assert [e.step for e in await bus.history("tp.quiet.>")] == [1, 2, 3, 4, 5]
        assert [p.seq for p in quiet] == [1, 2, 3, 4, 5]  # (its own sequence)
        busy = await bus.js.stream_info(stream_name(s.stream, "busy"))
        assert busy.state.first_seq > 1 and busy.state.bytes <= 32 << 10
        assert busy.state.last_seq == 399
        assert await bus.jobs() == ["busy", "quiet"]
        assert bus.stream("tp.busy.staged.n1.0") == stream_name(s.stream, "busy") == "TIERPIPE_busy"
