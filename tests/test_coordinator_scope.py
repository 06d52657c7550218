"""Which jobs an agent's coordinator leads, and into which object store: only jobs its node takes
part in, and only into the store the job's objects are bound to (issue 20, item 2). Real agent
processes, nats-server and SeaweedFS."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import pytest

from tests.conftest import Agent
from tests.test_coordinator import publish, saved, wait_for
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore, head_key
from tierpipe.dev import S3Server
from tierpipe.schemas.jobstate import Lease
from tierpipe.settings import Settings
from tierpipe.storage.s3.keys import object_key


def kv(settings: Settings, key: str) -> bytes | None:
    """The value of `key` in the job-state bucket, as stored."""

    async def main() -> bytes | None:
        async with Bus(settings) as bus:
            return await (await JobStore(bus.js, settings).open()).value(key)

    return anyio.run(main)


def kv_put(settings: Settings, key: str, value: bytes) -> None:
    """Write `key` as any holder of KV write permission can."""

    async def main() -> None:
        async with Bus(settings) as bus:
            await (await JobStore(bus.js, settings).open()).kv.put(key, value)

    anyio.run(main)


def objects(s3_server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    import boto3

    s3 = boto3.client("s3", **s3_server.client_kwargs())
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def holds_for(seconds: float, check: Callable[[], str]) -> None:
    """`check` finds nothing wrong ("") at every look for `seconds` (an absence: no event says
    it will not come)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        wrong = check()
        assert not wrong, wrong
        time.sleep(0.2)


def location(settings: Settings, bucket: str) -> bytes:
    """A `<job>.location` value as the KV stores it (written raw, as a test of the old code can)."""
    return json.dumps({"endpoint": settings.s3_endpoint, "bucket": bucket, "prefix": ""}).encode()


def log_lines(a: Agent, event: str) -> list[dict[str, Any]]:
    out = []
    for line in a.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            out.append(entry)
    return out


@pytest.mark.slow
def test_an_agent_never_coordinates_a_job_its_node_has_nothing_of(
    settings: Settings, job: str, agent: Callable[..., Agent], s3_server: S3Server
) -> None:
    """An agent whose node has no folder of a job never takes that job's lease nor writes
    anything for it (job state, COMMIT), even when the lease expired long ago."""
    s = settings.replace(lease_ttl_s=1.0, coordinator_flush_s=0.05)
    foreign = f"{job}-elsewhere"
    dead = Lease(holder="node-gone", term=1, expires=time.time() - 3600)
    kv_put(s, f"{foreign}.lease", msgspec.json.encode(dead))
    kv_put(s, f"{foreign}.keep", b"{}")  # (registered, as its trainer does)
    # The other job is complete in object storage (a COMMIT is due); this node's own job too.
    publish(s, [e for r in (0, 1) for e in saved(foreign, 1, r, "node-gone")])
    publish(s, [e for r in (0, 1) for e in saved(job, 1, r, s.node or "")])
    a = agent("evict", settings=s).wait_ready()

    def own_job_folded() -> bool:
        return kv(s, head_key(job)) is not None

    wait_for("the agent to coordinate its own job", own_job_folded)

    def touched() -> str:
        lease = kv(s, f"{foreign}.lease")
        if lease != msgspec.json.encode(dead):
            return f"the other job's lease was taken: {lease!r}"
        if kv(s, head_key(foreign)) is not None:
            return "the other job's state was written"
        commits = objects(s3_server, s.s3_bucket, f"commit/{foreign}/")
        return f"the other job's COMMITs were written into this agent's bucket: {commits}" * bool(
            commits
        )

    # A bid for a lease expired long ago comes every 2-4 TTLs: two of those, at the least.
    holds_for(8 * s.lease_ttl_s, touched)
    assert foreign not in a.log()


@pytest.mark.slow
def test_an_agent_refuses_a_job_bound_to_another_object_store(
    settings: Settings, job: str, uid: str, agent: Callable[..., Agent], s3_server: S3Server
) -> None:
    """An agent whose object store (bucket B2) is not the one the job's objects are bound to
    (B1) logs an error naming both and writes no object into B2 and deletes none there."""
    s = settings.replace(lease_ttl_s=1.0, coordinator_flush_s=0.05, s3_keep_latest_k=1)
    b1 = f"team-a-{uid}"
    kv_put(s, f"{job}.location", location(s, b1))
    # Objects that retention would remove (steps 1 and 2: it keeps 1 step in object storage).
    import boto3

    s3 = boto3.client("s3", **s3_server.client_kwargs())
    doomed = sorted(object_key("", job, step, rank, 2) for step in (1, 2) for rank in (0, 1))
    for key in doomed:
        s3.put_object(Bucket=s.s3_bucket, Key=key, Body=b"x")
    publish(s, [e for t in (1, 2, 3) for r in (0, 1) for e in saved(job, t, r, s.node or "")])
    a = agent("evict", settings=s).wait_ready()

    def refused_or_touched() -> bool:
        return (
            bool(log_lines(a, "coordinator_refused")) or objects(s3_server, s.s3_bucket) != doomed
        )

    wait_for("the coordinator to refuse the job (or touch its objects)", refused_or_touched)
    assert objects(s3_server, s.s3_bucket) == sorted(doomed)  # no COMMIT, nothing removed
    (refused,) = log_lines(a, "coordinator_refused")
    assert b1 in refused["error"] and s.s3_bucket in refused["error"], refused
    assert refused["level"] == "error"
    assert kv(s, head_key(job)) is None  # it did not lead the job
    assert kv(s, f"{job}.location") == location(s, b1)


@pytest.mark.slow
def test_a_jobs_object_store_is_bound_once_and_kept_from_an_agent_with_another(
    settings: Settings, job: str, agent: Callable[..., Agent], s3_server: S3Server
) -> None:
    """The first agent to write an object of a job binds it to its own store; an agent with
    another bucket that sees the job after it stays off it, and the binding stays."""
    s = settings.replace(lease_ttl_s=1.0, coordinator_flush_s=0.05)
    nodes = {n: s.replace(node=f"{s.node}-{n}", nvme_root=f"{s.nvme_root}-{n}") for n in "ab"}
    nodes["b"] = nodes["b"].replace(s3_bucket=f"{s.s3_bucket}-other")
    first = agent("evict", settings=nodes["a"]).wait_ready()
    publish(s, [e for r in (0, 1) for e in saved(job, 1, r, nodes["a"].node or "")])

    def committed() -> bool:
        return bool(objects(s3_server, s.s3_bucket, f"commit/{job}/"))

    wait_for("the first agent's COMMIT", committed)
    bound = kv(s, f"{job}.location")
    assert bound is not None and json.loads(bound)["bucket"] == s.s3_bucket, bound
    assert json.loads(bound)["endpoint"].rstrip("/") == (s.s3_endpoint or "").rstrip("/")

    first.stop(signal.SIGKILL)  # (its lease runs out: the other agent would take the job over)
    second = agent("evict", settings=nodes["b"]).wait_ready()
    wait_for("the second agent's refusal", lambda: bool(log_lines(second, "coordinator_refused")))
    assert kv(s, f"{job}.location") == bound
    lease = msgspec.json.decode(kv(s, f"{job}.lease") or b"", type=Lease)
    assert lease.holder == nodes["a"].node, lease


@pytest.mark.slow
def test_flush_uploads_nothing_for_a_job_bound_to_another_object_store(
    settings: Settings, job: str, uid: str, agent: Callable[..., Agent], s3_server: S3Server
) -> None:
    """An agent whose object store (bucket B2) is not the job's (B1) uploads none of the job's
    shards into B2: each fails for good, naming both stores, and its NVMe copy stays."""
    import torch

    from tests.conftest import Events
    from tierpipe import Checkpointer
    from tierpipe.schemas import ShardVerified, StageFailed

    b1 = f"team-a-{uid}"
    kv_put(settings, f"{job}.location", location(settings, b1))
    agent(settings=settings).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)}).result(timeout=60)
    events = Events(settings, job)
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "flush", kind="failed", timeout=60
    )
    assert isinstance(failed, StageFailed) and not failed.retryable, failed
    assert failed.error == "StoreMismatchError"
    assert b1 in failed.message and settings.s3_bucket in failed.message
    assert objects(s3_server, settings.s3_bucket) == []
    assert [e for e in events.all("flushed")] == []
    assert any(isinstance(e, ShardVerified) for e in events.all("verified"))


def test_gc_refuses_a_job_bound_to_another_object_store(
    settings: Settings, job: str, uid: str, s3_server: S3Server
) -> None:
    """gc and rm list and remove no object in a store that is not the job's, and say so."""
    from tests.conftest import run_cli
    from tierpipe import Checkpointer

    publish(settings, [e for r in (0, 1) for e in saved(job, 1, r, settings.node or "")])
    with Checkpointer(job, rank=0, world_size=2, settings=settings) as ckpt:
        assert ckpt.latest_step() == 1  # (the job state folded: gc judges by it)
    kv_put(settings, f"{job}.location", location(settings, f"team-a-{uid}"))
    for args in (["gc"], ["rm", "--force"]):
        done = run_cli(settings, *args, "--job", job, "--apply")
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert f"team-a-{uid}" in done.stderr and settings.s3_bucket in done.stderr, done.stderr
