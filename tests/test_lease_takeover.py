"""A restart does not wait for the lease of a coordinator whose node's record shows it gone (a
new agent of the node runs, or the holder's agent stopped, went silent, or its endpoint refuses
connections): it takes the lease over at once, with a new term that fences the old holder out.
A holder whose record shows it alive keeps its lease."""

from __future__ import annotations

import os
import socket
import time

import anyio
import msgspec
import pytest
import structlog
import structlog.testing

from tests.test_coordinator import publish, saved
from tierpipe.bus.client import Bus
from tierpipe.bus.kv import BucketConfig, open_bucket
from tierpipe.control.advert import bucket_name
from tierpipe.control.coordinator import Coordinator
from tierpipe.control.holder import gone_reason, take_over
from tierpipe.control.kvstate import JobStore, lease_key
from tierpipe.errors import LeaseLostError
from tierpipe.recovery.survey import current_head, own_events
from tierpipe.schemas.jobstate import Lease
from tierpipe.schemas.node import NodeRecord
from tierpipe.settings import Settings

#: The lost holder's agent, as its lease and its node's record name it.
PID, HOST = 4242, "host-b"
TTL_S = 8.0


def record(**changes: object) -> NodeRecord:
    """node-b's record as the holder's agent (PID on HOST) stored it a moment ago."""
    now = time.time()
    base = NodeRecord(
        node="node-b", pid=PID, host=HOST, started_ts=now - 60, heartbeat_ts=now,
        heartbeat_s=2.0, stages=["nvme-write", "verify", "flush", "evict"], staging_root="/s",
        nvme_root="/n", s3_endpoint=None, s3_region="r", s3_bucket="b", s3_prefix="",
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def refusing_url() -> str:
    """The URL of a loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def hold(bus: Bus, s: Settings, job: str, node_record: NodeRecord) -> Lease:
    """node-b's agent (PID on HOST) holds the job's lease and stops renewing it (lost), and
    `node_record` is what node-b's record says now. Written as the raw JSON a holder writes."""
    store = await JobStore(bus.js, s).open()
    lease = Lease(
        holder="node-b", term=3, expires=time.time() + TTL_S, pid=PID, host=HOST,
        since=time.time() - 30,
    )  # fmt: skip
    await store.kv.put(lease_key(job), msgspec.json.encode(lease))
    nodes = await open_bucket(bus.js, BucketConfig(name=bucket_name(s)))
    await nodes.put("node-b", msgspec.json.encode(node_record))
    return lease


GONE = {
    "another_agent_of_the_node": lambda: record(pid=PID + 1, started_ts=time.time()),
    "its_agent_stopped": lambda: record(stopped_ts=time.time()),
    "its_agent_silent": lambda: record(heartbeat_ts=time.time() - 10),  # (3 beats: 6 s)
    "its_endpoint_refuses": lambda: record(peer_url=refusing_url()),
}


@pytest.mark.parametrize("case", sorted(GONE))
def test_a_restart_takes_a_gone_holders_lease_at_once(
    settings: Settings, job: str, case: str
) -> None:
    """A replacement node's rank folds the job state itself well before the lost holder's lease
    runs out (today it waited for it: up to `lease_ttl_s`), under a new term."""
    s = settings.replace(lease_ttl_s=TTL_S)
    publish(s, saved(job, 1, 0, "node-b") + saved(job, 1, 1, "node-b"))

    async def main() -> tuple[float, Lease | None]:
        async with Bus(s) as bus:
            await hold(bus, s, job, GONE[case]())
            store = await JobStore(bus.js, s).open()
            t0 = time.monotonic()
            head = await current_head(
                bus, store, s, job=job, holder="node-c-rank-1",
                deadline=time.monotonic() + 30, own=own_events(job, "node-c", 1), ranks=[1],
            )  # fmt: skip
            waited = time.monotonic() - t0
            assert head is not None and head.s3_steps == [1], head
            return waited, await store.lease(job)

    waited, lease = anyio.run(main)
    print(f"restart to folded ({case}): {waited:.2f} s (lease_ttl_s {TTL_S:g})")
    assert waited < TTL_S / 3, f"waited {waited:.1f} s for a gone holder's lease"
    assert lease is not None and lease.term == 4 and lease.holder == "node-c-rank-1"


def test_a_live_holder_keeps_its_lease(settings: Settings, job: str) -> None:
    """Neither a restart nor another agent takes the lease of a holder whose record shows it
    alive (its own process, beating, its endpoint accepting), nor while the record is another
    process's that does not coordinate (no evict stage) or an older agent's (started before
    the term began: the holder has not stored its own yet)."""
    s = settings.replace(lease_ttl_s=TTL_S)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"

        async def main() -> None:
            async with Bus(s) as bus:
                store = await JobStore(bus.js, s).open()
                for alive in (
                    record(peer_url=url),
                    record(pid=PID + 1, started_ts=time.time(), stages=["verify"]),
                    record(pid=PID + 1, started_ts=time.time() - 60),  # (an older agent's)
                ):
                    held = await hold(bus, s, job, alive)
                    rank = Coordinator(s, bus, store, "node-c-rank-1", _never)
                    assert not await rank.catch_up(job, 10**9)
                    assert await take_over(bus, s, store, job, "node-a", agent=True) is None
                    assert await store.lease(job) == held

        anyio.run(main)


def test_a_paused_holder_finds_its_lease_taken(settings: Settings, job: str) -> None:
    """A holder that was only paused (its record went silent) and is taken over finds its next
    renewal refused."""
    s = settings.replace(lease_ttl_s=TTL_S)

    async def main() -> None:
        async with Bus(s) as bus_a, Bus(s) as bus_b:
            a = await JobStore(bus_a.js, s).open()
            b = await JobStore(bus_b.js, s).open()
            mine = await a.acquire(job, "node-b", TTL_S, pid=PID, host=HOST)
            assert mine is not None
            nodes = await open_bucket(bus_b.js, BucketConfig(name=bucket_name(s)))
            await nodes.put("node-b", msgspec.json.encode(record(heartbeat_ts=time.time() - 10)))
            taken = await take_over(bus_b, s, b, job, "node-a", agent=True)
            assert taken is not None and taken.term == mine.term + 1
            assert (taken.pid, taken.host) == (os.getpid(), socket.gethostname())
            with pytest.raises(LeaseLostError):
                await a.renew(job, mine, TTL_S)

    anyio.run(main)


def test_what_shows_a_holder_gone() -> None:
    """The record rules (pure): its own process stopped or silent, or another agent of the node
    that coordinates and started after the term began; nothing else (no record, a holder that
    is no agent, another process that does not run evict, is itself silent, or started before
    the term: an older agent whose record the holder has not overwritten yet)."""
    now = time.time()
    lease = Lease(holder="node-b", term=1, expires=now + 5, pid=PID, host=HOST, since=now - 30)
    assert gone_reason(lease, record(stopped_ts=now), now)
    assert gone_reason(lease, record(heartbeat_ts=now - 6.5), now)
    assert gone_reason(lease, record(pid=PID + 1, started_ts=now - 5), now)
    assert gone_reason(lease, record(host="host-c", started_ts=now - 5), now)
    assert not gone_reason(lease, record(), now)
    assert not gone_reason(lease, None, now)
    assert not gone_reason(msgspec.structs.replace(lease, pid=0), record(stopped_ts=now), now)
    assert not gone_reason(lease, record(pid=PID + 1, started_ts=now, stages=["verify"]), now)
    assert not gone_reason(lease, record(pid=PID + 1, heartbeat_ts=now - 10), now)
    # (an older agent's record, not overwritten yet by the holder that started since)
    assert not gone_reason(lease, record(pid=PID + 1, started_ts=now - 60), now)


async def _never(job: str, step: int, world_size: int) -> None:
    raise AssertionError("no removal")


def test_a_restart_whose_fold_loses_the_lease_waits_for_the_other_coordinator(
    settings: Settings, job: str
) -> None:
    """A rank folding the job state itself (no coordinator held the lease) that finds a key
    changed under it (another coordinator began meanwhile: an agent restarted) does not fail
    the restart with `LeaseLostError` (CI: `Checkpointer.all_steps` raised it), nor bid again
    and again (CI: its bids every 0.5 s kept the agent's coordinator from leading): it waits for
    the state the other coordinator folds."""
    publish(settings, saved(job, 1, 0, "node-b") + saved(job, 1, 1, "node-b"))

    async def main() -> None:
        async with Bus(settings) as bus, Bus(settings) as other_bus:
            store = await JobStore(bus.js, settings).open()
            other = await JobStore(other_bus.js, settings).open()
            revision, raced = store.kv.revision, anyio.Event()

            async def revision_then_another_writes(key: str) -> int:
                rev = await revision(key)
                if not raced.is_set():  # (once: the other coordinator's write lands under it)
                    raced.set()
                    await other.kv.put(key, b"{}")
                return rev

            async def the_other_coordinator_folds() -> None:
                await raced.wait()
                await anyio.sleep(1.0)  # (after the rank's lease is handed back)
                agent = Coordinator(settings, other_bus, other, "node-a", _never)
                assert await agent.catch_up(job, 1)  # (it folds what the stream holds)

            store.kv.revision = revision_then_another_writes  # type: ignore[method-assign]
            with structlog.testing.capture_logs() as logs:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(the_other_coordinator_folds)
                    head = await current_head(
                        bus, store, settings, job=job, holder="node-c-rank-0",
                        deadline=time.monotonic() + 30,
                    )  # fmt: skip
            assert raced.is_set(), "the fold never wrote a key"
            assert head is not None and head.s3_steps == [1], head
            bids = [e for e in logs if e["event"] == "lease_acquired" and e["holder"] != "node-a"]
            assert len(bids) == 1, bids

    anyio.run(main)
