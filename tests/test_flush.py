"""Tier 2 end to end: flush to a real S3 store (SeaweedFS), outages, credentials, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import boto3
import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from tests.conftest import Agent, Events
from tierpipe.dev import S3Server
from tierpipe.errors import StorageConflictError
from tierpipe.names import shard_relpath
from tierpipe.recovery.load import load_shard
from tierpipe.schemas import FlushControl, ShardEvicted, ShardFlushed, ShardVerified, StageFailed
from tierpipe.settings import Settings
from tierpipe.stages.flush import _apply
from tierpipe.storage.s3 import store as s3_store
from tierpipe.storage.s3.keys import parse_object_key
from tierpipe.storage.s3.store import S3Store, Uploaded
from tierpipe.storage.shardfile import write_shard
from tierpipe.throttle import Throttle
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


@pytest.fixture
def s3(s3_server: S3Server) -> object:
    return boto3.client("s3", **s3_server.client_kwargs())


@pytest.fixture
def ckpt(settings: Settings, job: str) -> Iterator[Checkpointer]:
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        yield c


def nvme_file(settings: Settings, job: str, step: int, rank: int = 0, world: int = 1) -> Path:
    return Path(settings.nvme_root).absolute() / shard_relpath(job, step, rank, world)


def uploads(s3: object, bucket: str) -> list[dict]:
    return s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])  # type: ignore[attr-defined]


def exists(s3: object, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)  # type: ignore[attr-defined]
    except s3.exceptions.ClientError:  # type: ignore[attr-defined]
        return False
    return True


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_flushed_object_holds_the_exact_shard(
    ckpt: Checkpointer,
    agent: Callable[..., Agent],
    settings: Settings,
    job: str,
    events: Events,
    s3,
) -> None:
    """staged -> ... -> flushed; the object's bytes equal the NVMe file and the saved tensors,
    and the store confirmed its checksum."""
    agent()
    state = {"w": torch.randn(3 << 20), "step": 7}  # 12 MiB: two parts
    ckpt.save(7, state)
    flushed = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    assert isinstance(flushed, ShardFlushed)
    assert flushed.bucket == settings.s3_bucket
    assert flushed.key == S3Store(settings).key(job, 7, 0, 1)
    assert flushed.checksum.endswith("-2")  # composite CRC32C over two parts
    body = s3.get_object(Bucket=flushed.bucket, Key=flushed.key)["Body"].read()
    local = nvme_file(settings, job, 7).read_bytes()
    assert body == local and flushed.nbytes == len(body)
    head = s3.head_object(Bucket=flushed.bucket, Key=flushed.key, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == flushed.checksum
    assert head["Metadata"]["tp-header-digest"] == flushed.header_digest
    copy = Path(settings.nvme_root) / "from-s3.shard"
    copy.write_bytes(body)
    _, loaded = load_shard(copy)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7


def test_killed_flush_worker_leaves_no_object_and_completes_once(
    ckpt: Checkpointer,
    agent: Callable[..., Agent],
    settings: Settings,
    job: str,
    events: Events,
    s3,
) -> None:
    """SIGKILL mid-upload: no object at the final key, the orphaned multipart upload is aborted
    by the restarted worker, and the shard is flushed exactly once."""
    slow = settings.replace(flush_max_bytes_per_s=4 << 20, ack_wait_s=2.0)
    agent("nvme-write", "verify", "evict")  # (evict: the coordinator names the upload target)
    flusher = agent("flush", settings=slow)
    ckpt.save(1, {"w": torch.randn(4 << 20)})  # 16 MiB at 4 MiB/s: ~4 s
    wait_until(lambda: uploads(s3, settings.s3_bucket), what="an upload to start")
    time.sleep(0.5)
    flusher.stop(signal.SIGKILL)
    key = S3Store(settings).key(job, 1, 0, 1)
    assert not exists(s3, settings.s3_bucket, key)
    (orphan,) = uploads(s3, settings.s3_bucket)
    agent("flush")  # unthrottled
    flushed = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    assert exists(s3, settings.s3_bucket, key) and isinstance(flushed, ShardFlushed)
    wait_until(lambda: not uploads(s3, settings.s3_bucket), what="the orphan to be aborted")
    assert orphan["UploadId"] not in [u["UploadId"] for u in uploads(s3, settings.s3_bucket)]
    time.sleep(1.0)
    assert len(events.all("flushed")) == 1


def test_store_outage_is_retried_and_nothing_is_evicted(
    ckpt: Checkpointer,
    agent: Callable[..., Agent],
    settings: Settings,
    job: str,
    events: Events,
    s3_server: S3Server,
    s3,
) -> None:
    """S3 down mid-flush: a retryable failure is reported, the NVMe copy stays, and the flush
    completes once S3 is back."""
    slow = settings.replace(
        flush_max_bytes_per_s=4 << 20,
        retry_base_s=0.2,
        retry_max_s=1.0,
        nvme_keep_latest_k=2,
        evict_unflushed=False,
    )
    agent(settings=slow)
    ckpt.save(1, {"w": torch.randn(4 << 20)})
    wait_until(lambda: uploads(s3, settings.s3_bucket), what="an upload to start")
    s3_server.kill()
    try:
        failed = events.wait_for(
            lambda e: isinstance(e, StageFailed) and e.stage == "flush",
            kind="failed",
        )
        assert isinstance(failed, StageFailed) and failed.retryable
        assert failed.error == "StorageUnavailableError"
        assert nvme_file(settings, job, 1).exists()
    finally:
        s3_server.restart()
    flushed = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed", timeout=60)
    assert isinstance(flushed, ShardFlushed)
    assert [e for e in events.all("evicted") if getattr(e, "tier", "") == "nvme"] == []
    assert nvme_file(settings, job, 1).exists()
    assert len(events.all("flushed")) == 1


def test_wrong_credentials_fail_permanently_and_evict_nothing(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, job: str, events: Events
) -> None:
    """Refused credentials give one clear permanent `failed` event; the NVMe copy stays."""
    bad = settings.replace(s3_secret_access_key="not-the-secret")
    agent(settings=bad)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"w": torch.ones(1000)})
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "flush", kind="failed"
    )
    assert isinstance(failed, StageFailed)
    assert failed.error == "StorageAuthError" and not failed.retryable and failed.attempt == 1
    assert "credentials" in failed.message and "not-the-secret" not in failed.message
    events.wait_for(lambda e: isinstance(e, ShardVerified) and e.step == 4, kind="verified")
    time.sleep(1.0)
    assert [e for e in events.all("evicted") if getattr(e, "tier", "") != "ram"] == []
    assert all(nvme_file(settings, job, s).exists() for s in (1, 2, 3, 4))


def test_retention_over_twelve_steps_matches_the_policy(
    agent: Callable[..., Agent], settings: Settings, job: str, events: Events, s3
) -> None:
    """12 steps x 2 ranks through the real stages with K=2, M=3, keep_period=4: exactly the
    policy's steps remain on NVMe and in S3 (there: the period steps and the newest three of
    the steps the job uploaded), and every removal was announced."""
    policy = settings.replace(nvme_keep_latest_k=2, s3_keep_latest_k=3, s3_keep_period=4)
    agent(settings=policy)
    with (
        Checkpointer(job, rank=0, world_size=2, settings=policy) as r0,
        Checkpointer(job, rank=1, world_size=2, settings=policy) as r1,
    ):
        for step in range(1, 13):
            for c in (r0, r1):
                c.save(step, {"w": torch.full((1000,), float(step))})
            for c in (r0, r1):
                c.wait_until_finished(timeout=30)

    def on_nvme() -> list[int]:  # os.walk: step directories vanish while it looks
        return sorted(
            {
                int(Path(d).name[5:])
                for d, _, files in os.walk(policy.nvme_root)
                if any(f.endswith(".shard") for f in files)
            }
        )

    def in_s3() -> list[int]:
        listing = s3.list_objects_v2(Bucket=policy.s3_bucket).get("Contents", [])
        shards = [parse_object_key(policy.s3_prefix, o["Key"]) for o in listing]
        return sorted({shard.step for shard in shards if shard is not None})

    # Object storage gets the job's upload targets (which steps those are depends on timing:
    # the newest complete on NVMe as the last one completes) and the period steps (issue 22).
    def policy_s3() -> list[int]:
        up = sorted({e.step for e in events.all("flushed") if isinstance(e, ShardFlushed)})
        return sorted({t for t in up if t % 4 == 0} | set(up[-3:]))

    wait_until(lambda: on_nvme() == [11, 12] and 12 in in_s3(), 60, "retention on NVMe")
    wait_until(lambda: in_s3() == policy_s3(), 60, "retention in object storage")
    uploaded = {e.step for e in events.all("flushed") if isinstance(e, ShardFlushed)}
    assert {4, 8, 12} <= uploaded and len(uploaded) < 12, uploaded
    # (rank 0's own uploads: a step the target passed may have gone up from rank 1 only)
    uploaded0 = {
        e.step for e in events.all("flushed") if isinstance(e, ShardFlushed) and e.rank == 0
    }
    gone_from_s3 = uploaded0 - set(in_s3())
    want = sorted([("nvme", s) for s in range(1, 11)] + [("s3", s) for s in gone_from_s3])

    def announced() -> list[tuple[str, int]]:  # (an announcement follows its deletion)
        evicted = events.all("evicted")
        return sorted(
            (e.tier, e.step)
            for e in evicted
            if isinstance(e, ShardEvicted) and e.tier != "ram" and e.rank == 0
        )

    deadline = time.monotonic() + 30
    while announced() != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert announced() == want


def test_flush_rate_can_be_changed_and_paused_at_run_time(
    ckpt: Checkpointer, agent: Callable[..., Agent], settings: Settings, events: Events
) -> None:
    """`tierpipe flush pause|resume|rate` reach the running flush worker."""

    def cli(*args: str) -> None:  # this node only: other tests' workers share the server
        subprocess.run(
            [sys.executable, "-m", "tierpipe.cli", "flush", *args, "--node", settings.node or ""],
            check=True,
            env={**os.environ, **settings.as_env()},
            capture_output=True,
        )

    crawl = settings.replace(flush_max_bytes_per_s=1 << 20)  # 16 MiB would take 16 s
    agent(settings=crawl).wait_ready()
    cli("pause")
    ckpt.save(1, {"w": torch.randn(4 << 20)})
    events.wait_for(lambda e: isinstance(e, ShardVerified), kind="verified")
    time.sleep(1.0)
    assert events.all("flushed") == []  # held
    cli("rate", "0")  # unlimited, still paused
    cli("resume")
    t0 = time.monotonic()
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed", timeout=20)
    assert time.monotonic() - t0 < 8  # far below the 16 s the original rate needed
    ckpt.set_flush_rate(2 << 20, this_node_only=True)  # the trainer's API: the same command
    body = json.loads(_last_control(settings, f"tp.ctl.flush.{settings.node}"))
    assert body["action"] == "rate" and body["rate_bytes_per_s"] == 2 << 20


def _last_control(settings: Settings, subject: str) -> bytes:
    import anyio

    from tierpipe.bus.client import Bus

    async def get() -> bytes:
        async with Bus(settings) as bus:
            found = await bus.last_raw(subject)
            assert found is not None
            return found[1]

    return anyio.run(get)


# --- rewinds: a rewound run's save may replace an abandoned timeline's object, nothing else


def _upload(settings: Settings, path: Path, key: str, digest: str, **timeline: Any) -> Uploaded:
    async def go() -> Uploaded:
        async with S3Store(settings) as store:
            return await store.upload(path, key, header_digest=digest, **timeline)

    return anyio.run(go)


@pytest.fixture
def two_saves(tmp_path: Path, job: str) -> tuple[tuple[Path, str], tuple[Path, str]]:
    """Two different shards of step 5 (an old timeline's and a newer one's), with digests."""
    old, new = tmp_path / "old.shard", tmp_path / "new.shard"
    d_old = write_shard(old, {"w": torch.zeros(1000)}, job=job, step=5, epoch=100)
    d_new = write_shard(new, {"w": torch.ones(1000)}, job=job, step=5, epoch=200)
    return (old, d_old), (new, d_new)


def test_rewound_save_replaces_an_abandoned_timelines_object(
    settings: Settings, job: str, two_saves: tuple[tuple[Path, str], tuple[Path, str]], s3
) -> None:
    """An object of an older epoch at a step after the one a newer run rewound to is replaced
    by that run's save, which records its own node, digest and epoch."""
    (old, d_old), (new, d_new) = two_saves
    key = S3Store(settings).key(job, 5, 0, 1)
    _upload(settings, old, key, d_old, epoch=100, step=5)
    with capture_logs() as logs:
        done = _upload(settings, new, key, d_new, epoch=200, step=5, rewind_to=3)
    assert not done.existed
    assert s3.get_object(Bucket=settings.s3_bucket, Key=key)["Body"].read() == new.read_bytes()
    meta = s3.head_object(Bucket=settings.s3_bucket, Key=key)["Metadata"]
    assert meta == {"tp-header-digest": d_new, "tp-node": settings.node, "tp-epoch": "200"}
    assert [r["key"] for r in logs if r["event"] == "superseded_object_replaced"] == [key]


def test_abandoned_object_appearing_mid_upload_is_replaced_not_a_conflict(
    settings: Settings,
    job: str,
    two_saves: tuple[tuple[Path, str], tuple[Path, str]],
    s3,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The abandoned timeline's own agent may flush its object between this upload's look at
    the key and its completion (the write-once condition then fails): the rewound save looks
    again and replaces it, instead of failing for good."""
    (old, d_old), (new, d_new) = two_saves
    key = S3Store(settings).key(job, 5, 0, 1)
    real = s3_store.upload_parts
    raced: list[bool] = []

    async def parts_then_race(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        if not raced:  # the other agent completes its upload of the old save right now
            raced.append(True)
            await anyio.to_thread.run_sync(
                lambda: _upload(settings, old, key, d_old, epoch=100, step=5)
            )
        return result

    monkeypatch.setattr(s3_store, "upload_parts", parts_then_race)
    done = _upload(settings, new, key, d_new, epoch=200, step=5, rewind_to=3)
    assert raced and not done.existed
    assert s3.get_object(Bucket=settings.s3_bucket, Key=key)["Body"].read() == new.read_bytes()


@pytest.mark.parametrize(
    "timeline",
    [
        {"epoch": 200, "step": 5},  # a newer epoch that did not rewind
        {"epoch": 50, "step": 5, "rewind_to": 3},  # a rewind, but from an older epoch
        {"epoch": 200, "step": 5, "rewind_to": 5},  # rewound to this very step: not after it
    ],
    ids=["no-rewind", "older-epoch", "not-after-rewind"],
)
def test_different_object_at_the_key_stays_a_conflict_unless_superseded(
    settings: Settings,
    job: str,
    two_saves: tuple[tuple[Path, str], tuple[Path, str]],
    s3,
    timeline: dict[str, int],
) -> None:
    """A different shard at the key that the upload's timeline does not supersede is a
    StorageConflictError, and the object stays as it was."""
    (old, d_old), (new, d_new) = two_saves
    key = S3Store(settings).key(job, 5, 0, 1)
    _upload(settings, old, key, d_old, epoch=100, step=5)
    with pytest.raises(StorageConflictError) as err:
        _upload(settings, new, key, d_new, **timeline)
    assert err.value.location == f"s3://{settings.s3_bucket}/{key}"
    assert s3.get_object(Bucket=settings.s3_bucket, Key=key)["Body"].read() == old.read_bytes()


def test_a_flush_command_of_an_unknown_schema_version_is_refused() -> None:
    """A `FlushControl` of schema version 99 changes nothing and is logged as rejected."""
    throttle = Throttle(None)
    with capture_logs() as logs:
        _apply(throttle, msgspec.json.encode({"v": 99, "action": "pause"}))
    assert not throttle.paused
    (rejected,) = [e for e in logs if e["event"] == "flush_control_rejected"]
    assert "schema version 99" in rejected["error"]
    _apply(throttle, msgspec.json.encode(FlushControl(action="pause")))
    assert throttle.paused
