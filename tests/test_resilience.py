"""Workers never wedge and outages never lose work: hostile messages, a deleted stream, S3 down or
hung for longer than any retry budget, NATS killed -9 under load, and a 3-server NATS cluster
losing a server. Real agent processes, real nats-server, real SeaweedFS."""

from __future__ import annotations

import collections
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import boto3
import pytest
import torch

from tests.conftest import Agent, Events, make_staged
from tierpipe.bus.client import Bus
from tierpipe.dev import NatsServer, S3Server, free_ports
from tierpipe.errors import BusUnavailableError
from tierpipe.names import shard_relpath, stream_name, subject_job
from tierpipe.schemas import (
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    StageFailed,
    encode_event,
)
from tierpipe.settings import Settings
from tierpipe.storage.s3.store import S3Store
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow

DIGEST = "0" * 32


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def publish(settings: Settings, *events: Any) -> list[int]:
    """Publish events (or (subject, raw bytes) pairs) as a forger would; their stream seqs."""

    async def go() -> list[int]:
        async with Bus(settings) as bus:
            for job in {subject_job(e[0]) if isinstance(e, tuple) else e.job for e in events}:
                await bus.ensure_stream(job)
            seqs = []
            for e in events:
                if isinstance(e, tuple):
                    seqs.append(await bus.publish_raw(*e))
                else:
                    seqs.append((await bus.publish(e)).seq)
            return seqs

    return anyio.run(go)


def log_lines(agent: Agent) -> list[dict[str, Any]]:
    return [json.loads(x) for x in agent.log().splitlines() if x.startswith("{")]


def state(step: int, n: int = 1000) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step}


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A server of this test's own: the test deletes its stream or kills it."""
    with NatsServer(tmp_path / "own-nats", sync_always=True) as server:
        yield server


# --- item 5: no message content may crash a worker


def test_an_unexpected_error_on_a_failed_event_does_not_stop_the_agent(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Evict raising an unexpected error on a `failed` event (once an assert took down all four
    stages, and the unacked message crashed every restart) terms that message with a `failed`
    report; the agent stays up, saves complete, and a restarted agent does not crash again."""
    s = settings.replace(fault_point="evict:on-failed")
    first = agent(settings=s).wait_ready()
    failure = StageFailed(
        job=job, node=s.node or "", ts=time.time(), stage="nvme-write", error="OSError",
        message="forged", retryable=False, attempt=1, step=3, rank=0, world_size=1,
    )  # fmt: skip
    (seq,) = publish(s, failure)
    report = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "evict" and e.stream_seq == seq,
        kind="failed",
    )
    assert isinstance(report, StageFailed) and not report.retryable
    assert report.error == "RuntimeError" and "injected fault" in report.message
    assert first.proc is not None and first.proc.poll() is None, first.log()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(10, state(1)).wait("verified", timeout=30)
        assert first.stop() == 0
        second = agent(settings=s).wait_ready()  # same fault point: the message is not back
        ckpt.save(11, state(2)).wait("verified", timeout=30)
    assert second.proc is not None and second.proc.poll() is None, second.log()
    assert not [x for x in log_lines(second) if x["level"] in ("critical", "exception")]


def test_copies_outside_the_node_root_never_stop_retention(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """Forged copies whose paths lie outside this node's NVMe root are never touched (a node
    removes only files under its own root, found there, never paths an event names), never fail
    a message, and retention goes on removing the job's real copies."""
    s = settings.replace(nvme_keep_latest_k=2, evict_unflushed=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for step in (1, 2, 3):
        (elsewhere / f"{step}.shard").write_bytes(b"not ours")
    a = agent("nvme-write", "verify", "evict", settings=s).wait_ready()
    node = s.node or ""
    forged: list[Any] = [
        kind(
            job=job,
            node=node,
            ts=time.time(),
            step=step,
            rank=0,
            world_size=1,
            path=str(tmp_path / "elsewhere" / f"{step}.shard"),
            nbytes=4096,
            header_digest=DIGEST,
            seconds=0.0,
            **extra,
        )
        for step in (1, 2, 3)
        for kind, extra in ((ShardWritten, {"tensors": 1}), (ShardVerified, {}))
    ]  # written/verified pairs: the evidence the catalog needs
    publish(s, *forged)
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        for step in (10, 11, 12, 13):
            ckpt.save(step, state(step)).wait("verified", timeout=30)
    for step in (10, 11):  # the real copies below the floor are removed all the same
        events.wait_for(
            lambda e, step=step: (
                isinstance(e, ShardEvicted) and e.step == step and e.tier == "nvme"
            ),
            kind="evicted",
        )
    assert not [e for e in events.all("failed") if getattr(e, "stage", "") == "evict"]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["1.shard", "2.shard", "3.shard"]
    assert a.proc is not None and a.proc.poll() is None


def test_slot_releases_go_on_while_the_object_store_is_down(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, s3_server: Any
) -> None:
    """A removal from object storage that meets an outage is put off (and retried later), never
    waited out in place: evict goes on releasing staging slots, so saves do not stall."""
    s = settings.replace(s3_keep_latest_k=1, staging_slots=2, slot_wait_timeout_s=10.0)
    agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step)).wait("verified", timeout=30)
        events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 2, kind="flushed")
        s3_server.kill()
        try:
            # An old object of this node that retention now wants gone: its delete meets the
            # outage (every copy below the floor goes through the same path).
            node = s.node or ""
            ident = dict(job=job, node=node, ts=time.time(), step=0, rank=0, world_size=1)
            path = str(Path(s.nvme_root) / shard_relpath(job, 0, 0, 1))
            key = S3Store(s).key(job, 0, 0, 1)
            publish(
                s,
                ShardWritten(**ident, path=path, nbytes=4096, header_digest=DIGEST, tensors=1,
                             seconds=0.0),
                ShardVerified(**ident, path=path, nbytes=4096, header_digest=DIGEST, seconds=0.0),
                ShardFlushed(**ident, bucket=s.s3_bucket, key=str(key), etag="e", checksum="c",
                             header_digest=DIGEST, nbytes=4096, seconds=0.0),
            )  # fmt: skip
            for step in (3, 4, 5, 6):  # two slots: each save needs an earlier one released
                ckpt.save(step, state(step)).wait("verified", timeout=30)
        finally:
            s3_server.start()


# --- item 16: unknown schema versions are refused


def test_an_event_of_an_unknown_schema_version_is_termed_naming_it(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A v99 `staged` event is termed with a permanent `failed` event naming the version,
    never processed as v1; the worker goes on."""
    node = settings.node or ""
    agent("nvme-write").wait_ready()
    body = json.loads(encode_event(make_staged(job, node, step=1)))
    body["v"] = 99
    (seq,) = publish(settings, (f"tp.{job}.staged.{node}.0", json.dumps(body).encode()))
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stream_seq == seq, kind="failed"
    )
    assert isinstance(failed, StageFailed)
    assert failed.stage == "nvme-write" and not failed.retryable
    assert "schema version 99" in failed.message
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        written = ckpt.save(2, state(2)).wait("written", timeout=30)
    assert isinstance(written, ShardWritten) and written.step == 2
    assert [e.step for e in events.all("written")] == [2]


# --- item 7: the stream deleted under a running agent


def test_a_deleted_stream_is_recreated_by_the_running_agent_and_trainer(
    settings: Settings, job: str, agent: Callable[..., Agent], own_nats: NatsServer
) -> None:
    """After `delete_stream` the next save reaches `verified` with nothing restarted, and each
    stage says once that it recreated the stream or its consumer."""
    s = settings.replace(nats_url=own_nats.url)
    running = agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, state(1)).wait("verified", timeout=30)

        async def delete() -> None:
            async with Bus(s) as bus:
                assert (await bus.js.stream_info(stream_name(s.stream, job))).config.deny_delete
                assert await bus.js.delete_stream(stream_name(s.stream, job))

        anyio.run(delete)
        verified = ckpt.save(2, state(2)).wait("verified", timeout=30)
    assert isinstance(verified, ShardVerified) and verified.step == 2
    Events(s, job).wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 2, kind="flushed")

    def said() -> collections.Counter[str]:
        lines = log_lines(running)
        recreated = ("stream_recreated", "consumer_recreated")
        return collections.Counter(x["stage"] for x in lines if x["event"] in recreated)

    wait_until(lambda: len(said()) == 5, what="every stage to rebind")
    assert said() == {"nvme-write": 1, "verify": 1, "replicate": 1, "flush": 1, "evict": 1}, said()
    assert running.proc is not None and running.proc.poll() is None


# --- item 8: outages are retried for as long as they last; re-drive at start


def test_an_s3_outage_longer_than_the_retry_budget_is_waited_out(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    s3_server: S3Server,
) -> None:
    """S3 down far longer than max_deliver x retry_max_s: the flush is retried until S3 is
    back, reported once (not per attempt), never given up."""
    s = settings.replace(retry_base_s=0.05, retry_max_s=0.2, max_deliver=3)
    agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        s3_server.kill()
        try:
            ckpt.save(1, state(1)).wait("verified", timeout=30)
            first = events.wait_for(
                lambda e: isinstance(e, StageFailed) and e.stage == "flush", kind="failed"
            )
            assert isinstance(first, StageFailed) and first.retryable
            assert first.error == "StorageUnavailableError"
            time.sleep(3.0)  # the outage: ~10x what the old retry budget allowed
        finally:
            s3_server.restart()
    flushed = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed", timeout=60)
    assert isinstance(flushed, ShardFlushed) and flushed.step == 1
    reports = [e for e in events.all("failed") if isinstance(e, StageFailed)]
    assert [(r.stage, r.retryable) for r in reports] == [("flush", True)]


def test_a_restarted_agent_flushes_what_an_older_agent_gave_up_on(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A verified shard whose flush was given up for good (a terminated message) is uploaded
    by the next agent that starts on the node."""
    refused = settings.replace(s3_secret_access_key="not-the-secret")
    old = agent(settings=refused).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, state(1)).wait("verified", timeout=30)
    events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "flush" and not e.retryable,
        kind="failed",
    )
    assert old.stop() == 0
    assert events.all("flushed") == []
    agent(settings=settings)
    flushed = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed", timeout=30)
    assert isinstance(flushed, ShardFlushed) and flushed.step == 1


def test_a_hung_store_during_a_flush_delays_it_but_stops_nothing(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    s3_server: S3Server,
) -> None:
    """SIGSTOP the store mid-upload: other saves are still written and verified, nothing is
    evicted, and after SIGCONT every shard is flushed."""
    s = settings.replace(
        flush_max_bytes_per_s=4 << 20,
        s3_read_timeout_s=2.0,
        retry_base_s=0.1,
        retry_max_s=0.5,
        nvme_keep_latest_k=2,
    )
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    agent(settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, state(1, 4 << 20)).wait("verified", timeout=30)  # 16 MiB: ~4 s upload
        wait_until(
            lambda: s3.list_multipart_uploads(Bucket=s.s3_bucket).get("Uploads"),
            what="an upload to start",
        )
        s3_server.pause()
        try:
            ckpt.save(2, state(2)).wait("verified", timeout=30)  # the agent stays responsive
            time.sleep(2 * s.s3_read_timeout_s)  # the hang outlasts the store's read timeout
            assert events.all("flushed") == []
            assert [e for e in events.all("evicted") if getattr(e, "tier", "") != "ram"] == []
            assert (Path(s.nvme_root) / shard_relpath(job, 1, 0, 1)).exists()
        finally:
            s3_server.resume()
    wait_until(
        lambda: sorted(e.step for e in events.all("flushed")) == [1, 2],
        timeout=60,
        what="both steps flushed",
    )
    reports = [e for e in events.all("failed") if isinstance(e, StageFailed)]
    assert all(r.retryable for r in reports), reports


# --- item 22: save() during a NATS outage


def test_a_save_during_a_nats_outage_raises_bus_unavailable_and_frees_its_slot(
    settings: Settings, job: str, own_nats: NatsServer
) -> None:
    """With NATS down and `save_errors = "raise"`, save() raises BusUnavailableError (cause
    kept) within about publish_timeout_s and frees its slot; once NATS is back the same step
    saves fine. (The default reports it on the handle instead: tests/test_save_outage.py.)"""
    s = settings.replace(
        nats_url=own_nats.url,
        publish_timeout_s=2.0,
        request_timeout_s=2.0,
        staging_slots=1,
        save_errors="raise",
    )
    slots = Path(s.staging_root) / job / "rank-00000"
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, state(1)).wait_staged(timeout=10)  # (the job is made by its first save)
        for marker in slots.glob("*.step-*"):
            marker.unlink()  # (no agent here: release step 1's slot as it would)
        own_nats.stop()
        t0 = time.monotonic()
        with pytest.raises(BusUnavailableError) as err:
            ckpt.save(2, state(2))
        assert time.monotonic() - t0 < s.publish_timeout_s + 2.0
        assert err.value.__cause__ is not None
        own_nats.start()
        handle = ckpt.save(2, state(2))  # the same step, in the only slot: it was freed
        handle.wait_staged(timeout=10)

    async def staged_steps() -> list[int]:
        async with Bus(s) as bus:
            return [e.step for e in await bus.history(f"tp.{job}.staged.>")]

    assert anyio.run(staged_steps) == [1, 2]  # the failed attempt was never sent


# --- the fault suite: NATS killed -9 under load; a 3-server cluster losing one


def test_nats_killed_under_load_loses_no_acked_event_and_everyone_resumes(
    settings: Settings, job: str, agent: Callable[..., Agent], own_nats: NatsServer
) -> None:
    """kill -9 the server while events are published, restart it on the same store: every
    acked event is there, and the running agent and Checkpointer carry on by themselves."""
    s = settings.replace(
        nats_url=own_nats.url, retry_base_s=0.1, retry_max_s=0.5, request_timeout_s=2.0
    )
    running = agent(settings=s).wait_ready()
    acked: list[tuple[int, bytes]] = []
    stop = threading.Event()

    async def load() -> None:
        async with Bus(s, name="load") as bus:
            n = 0
            while not stop.is_set():
                n += 1
                body = f"load {n}".encode()
                try:
                    acked.append((await bus.publish_raw(f"tp.{job}-load.plan", body), body))
                except BusUnavailableError:
                    await anyio.sleep(0.05)

    loader = threading.Thread(target=anyio.run, args=(load,))
    loader.start()
    try:
        with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
            ckpt.save(1, state(1)).wait("verified", timeout=30)
            wait_until(lambda: len(acked) > 50, what="load")
            own_nats.kill()
            before = len(acked)
            own_nats.start()
            wait_until(lambda: len(acked) > before + 50, what="load after the restart")
            verified = ckpt.save(2, state(2)).wait("verified", timeout=30)
            assert isinstance(verified, ShardVerified) and verified.step == 2
    finally:
        stop.set()
        loader.join(30)

    async def stored() -> dict[int, bytes]:
        async with Bus(s) as bus:
            return {
                seq: (await bus.js.get_msg(stream_name(s.stream, f"{job}-load"), seq)).data
                for seq, _ in acked[:before]
            }

    assert anyio.run(stored) == dict(acked[:before])
    assert running.proc is not None and running.proc.poll() is None


def _cluster_config(name: str, route_ports: list[int], port: int) -> str:
    routes = ", ".join(f"nats://127.0.0.1:{p}" for p in route_ports)
    return (
        f"server_name: {name}\n"
        f"cluster {{\n  name: tierpipe-test\n  listen: 127.0.0.1:{port}\n"
        f"  routes: [{routes}]\n}}\n"
    )


def _meta_cluster_size(server: NatsServer) -> int:
    try:
        with urllib.request.urlopen(f"{server.monitor_url}/jsz", timeout=1) as r:
            meta = json.loads(r.read()).get("meta_cluster") or {}
    except OSError:
        return 0
    return (meta.get("cluster_size") or 0) if meta.get("leader") else 0


def test_a_three_server_cluster_losing_one_server_keeps_the_pipeline_going(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """R3 stream on a loopback 3-server cluster; kill -9 the stream's leader mid-run: saves
    keep reaching `verified`."""
    routes = free_ports(3)
    servers = [
        NatsServer(tmp_path / f"n{i}", config=_cluster_config(f"n{i}", routes, routes[i]))
        for i in range(3)
    ]
    try:
        for server in servers:
            server.start()
        wait_until(
            lambda: all(_meta_cluster_size(x) == 3 for x in servers), what="the cluster to form"
        )
        s = settings.replace(
            nats_url=",".join(x.url for x in servers),
            stream_replicas=3,
            retry_base_s=0.1,
            retry_max_s=0.5,
            # Longer than a Raft election (4-9 s): a save waits out the new leader's election.
            request_timeout_s=20.0,
            publish_timeout_s=20.0,
            # A slot frees when evict has read `verified` from the stream, after the election
            # too: under load that took more than the suite's default 10 s (a flake).
            slot_wait_timeout_s=30.0,
        )
        running = agent(settings=s).wait_ready()
        with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
            ckpt.save(1, state(1)).wait("verified", timeout=30)

            async def leader() -> str:
                async with Bus(s) as bus:
                    info = await bus.js.stream_info(stream_name(s.stream, job))
                    assert info.config.num_replicas == 3
                    return info.cluster.leader

            victim = servers[int(anyio.run(leader).removeprefix("n"))]
            victim.kill()
            for step in (2, 3):
                verified = ckpt.save(step, state(step)).wait("verified", timeout=30)
                assert isinstance(verified, ShardVerified) and verified.step == step
        assert running.proc is not None and running.proc.poll() is None
    finally:
        for server in servers:
            server.stop()
