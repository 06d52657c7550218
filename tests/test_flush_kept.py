"""No upload of a step object storage no longer keeps, and no NVMe copy removed as flushed before
its upload is over (issue 20, items 5 and 6), through real agents, nats-server and SeaweedFS."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import boto3
import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_resilience import wait_until
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore, floor_key
from tierpipe.names import shard_relpath
from tierpipe.schemas import ShardEvicted, ShardFlushed, ShardVerified, ShardWritten
from tierpipe.schemas.jobstate import Floors
from tierpipe.settings import Settings
from tierpipe.stages import flush as flush_stage
from tierpipe.storage.s3.keys import parse_object_key
from tierpipe.storage.s3.store import Uploaded
from tierpipe.storage.shardfile import write_shard
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def objects(settings: Settings, s3_server) -> dict[int, list[str]]:
    """step -> the shard keys in the test's bucket."""
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    out: dict[int, list[str]] = {}
    for o in s3.list_objects_v2(Bucket=settings.s3_bucket).get("Contents", []):
        shard = parse_object_key(settings.s3_prefix, o["Key"])
        if shard is not None:
            out.setdefault(shard.step, []).append(o["Key"])
    return out


def floors(settings: Settings, job: str) -> Floors:
    async def read() -> Floors:
        async with Bus(settings) as bus:
            return await (await JobStore(bus.js, settings).open()).floors(job)

    return anyio.run(read)


def logged(agent: Agent, *events: str) -> list[dict]:
    lines = []
    for line in agent.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") in events:
            lines.append(entry)
    return lines


def handled(agent: Agent, stage: str, step: int) -> bool:
    """The agent's `stage` is done with a message about `step` (whatever its outcome; one that
    led to nothing is logged at debug, but flush says why it uploaded nothing)."""
    return any(
        e.get("stage") == stage and e.get("step") == step
        for e in logged(agent, "message_handled", *DROPPED)
    )


#: What flush logs when it uploads nothing for a step object storage does not keep.
DROPPED = ("upload_skipped", "upload_cancelled", "upload_withdrawn", "upload_abandoned")


def test_a_late_copy_is_never_removed_as_flushed_before_its_upload_and_leaves_no_object(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    s3_server,
    cpu_hog: None,
) -> None:
    """A copy of step 1 written (and verified) only once steps 2-5 are complete on both tiers
    and the floors passed it, while uploads are slow: it is not removed as flushed before a
    `flushed` event of it exists, and no object of a step below the object-storage floor is
    left at the end."""
    policy = settings.replace(
        nvme_keep_latest_k=2, s3_keep_latest_k=1, flush_max_bytes_per_s=2 << 20,
        slot_wait_timeout_s=60.0,
    )  # fmt: skip
    node = policy.node or ""
    a = agent(settings=policy).wait_ready(60)
    with Checkpointer(job, rank=0, world_size=1, settings=policy) as ckpt:
        for step in range(2, 6):
            ckpt.save(step, {"w": torch.randn(512 << 10)})  # 2 MiB: ~1 s to upload
        ckpt.wait_until_finished(timeout=60)
    wait_until(lambda: floors(policy, job).s3 > 1, 120, "the floors to pass step 1")
    # The late copy (its write waited, as in ENOSPC backoff): written as nvme-write does.
    path = Path(policy.nvme_root).absolute() / shard_relpath(job, 1, 0, 1)
    digest = write_shard(path, {"w": torch.randn(512 << 10)}, job=job, step=1, node=node)
    late = ShardWritten(
        job=job, node=node, ts=time.time(), step=1, rank=0, world_size=1, path=str(path),
        nbytes=path.stat().st_size, header_digest=digest, tensors=1, seconds=0.1,
    )  # fmt: skip
    anyio.run(publish, policy, late)
    # Whatever the order evict, verify and flush take it in: the copy goes, and every stage
    # that got it is done with it.
    wait_until(lambda: not path.exists(), 60, "step 1's copy to go")
    wait_until(lambda: handled(a, "verify", 1), 60, "verify to be done with step 1")
    if [e for e in events.all("verified") if isinstance(e, ShardVerified) and e.step == 1]:
        wait_until(lambda: handled(a, "flush", 1), 120, "flush to be done with step 1")
    flushed = [e for e in events.all("flushed") if isinstance(e, ShardFlushed)]
    for e in events.all("evicted"):
        if isinstance(e, ShardEvicted) and e.tier == "nvme" and "flushed" in e.reason:
            assert any((f.step, f.rank) == (e.step, e.rank) and f.ts <= e.ts for f in flushed), (
                f"step {e.step} removed as {e.reason!r} before its upload was done"
            )
    (gone,) = [
        e for e in events.all("evicted")
        if isinstance(e, ShardEvicted) and e.tier == "nvme" and e.step == 1
    ]  # fmt: skip
    assert gone.reason == "retention (not kept)"
    floor = floors(policy, job)
    left = {t for t in objects(policy, s3_server) if t < floor.s3 and t not in floor.keep}
    assert left == set(), f"objects of steps {left} below the floor {floor}"


async def publish(settings: Settings, event: ShardWritten) -> None:
    """Publish `event` as nvme-write does: on its rank's subject, and in its node's batch (what
    verify consumes)."""
    async with Bus(settings) as bus:
        await bus.publish(event)
        batch = Batcher(bus)
        batch.add(event)
        await batch.flush()


def test_the_start_up_redrive_uploads_no_step_below_the_floors(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, s3_server
) -> None:
    """A verified shard with no `flushed` event (its agent died before uploading it) of a step
    retention already dropped is not uploaded again when the flush stage starts."""
    node = settings.node or ""
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, 1, 0, 1)
    digest = write_shard(path, {"w": torch.ones(1024)}, job=job, step=1, node=node)

    async def setup() -> None:
        async with Bus(settings) as bus:
            await bus.ensure_job_stream(job)
            store = await JobStore(bus.js, settings).open()
            await store.kv.put(floor_key(job), msgspec.json.encode(Floors(nvme=3, s3=3)))
            await bus.publish(
                ShardVerified(
                    job=job, node=node, ts=time.time(), step=1, rank=0, world_size=1,
                    path=str(path), nbytes=path.stat().st_size, header_digest=digest,
                    seconds=0.0,
                )
            )  # fmt: skip

    anyio.run(setup)
    a = agent("flush").wait_ready(60)
    wait_until(
        lambda: logged(a, "flush_redriven", "upload_skipped", "flush_redrive_skipped"),
        60, "the re-drive to be done with step 1",
    )  # fmt: skip
    assert objects(settings, s3_server) == {}
    assert [e for e in events.all("flushed")] == []


def verified_copy(settings: Settings, job: str, step: int, mib: int) -> ShardVerified:
    """A shard of `step` on this node's NVMe and its `verified` event (not published)."""
    node = settings.node or ""
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, step, 0, 1)
    digest = write_shard(path, {"w": torch.randn(mib << 18)}, job=job, step=step, node=node)
    return ShardVerified(
        job=job, node=node, ts=time.time(), step=step, rank=0, world_size=1, path=str(path),
        nbytes=path.stat().st_size, header_digest=digest, seconds=0.0,
    )  # fmt: skip


def flush_one(
    settings: Settings,
    event: ShardVerified,
    drop: Callable[[], bool],
    *,
    after_upload: bool = False,
    passed: Floors | None = None,
) -> ShardFlushed | None:
    """The flush stage's handler on `event`, in this process, its step the job's upload target;
    the job's floors pass its step (or become `passed`) once `drop()` holds during the upload
    (or as soon as the object is complete)."""

    async def main() -> ShardFlushed | None:
        async with Bus(settings) as bus:
            await bus.ensure_job_stream(event.job)
            store = await JobStore(bus.js, settings).open()
            target = Floors(upload=event.step)  # (only the target is uploaded: issue 22)
            await store.kv.put(floor_key(event.job), msgspec.json.encode(target))

            async def pass_the_step() -> None:
                floors = passed or Floors(nvme=event.step + 2, s3=event.step + 2)
                await store.kv.put(floor_key(event.job), msgspec.json.encode(floors))

            result: list[ShardFlushed | None] = []
            with anyio.CancelScope() as scope:  # (the stage's background work runs until then)
                async with flush_stage.open(settings, bus) as ctx:
                    if after_upload:
                        write = ctx.s3.write

                        async def write_then_pass(*args: Any, **kw: Any) -> Uploaded:
                            done = await write(*args, **kw)
                            await pass_the_step()
                            return done

                        ctx.s3.write = write_then_pass  # type: ignore[method-assign]
                        result.append(await flush_stage.handle(ctx, event, 1))
                    else:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(_append, result, flush_stage.handle(ctx, event, 1))
                            while not await anyio.to_thread.run_sync(drop):  # noqa: ASYNC110
                                await anyio.sleep(0.05)
                            await pass_the_step()
                    scope.cancel()
            return result[0]

    return anyio.run(main)


async def _append(out: list, awaitable: Any) -> None:
    out.append(await awaitable)


def test_an_upload_is_cancelled_once_the_floors_pass_its_step(
    settings: Settings, job: str, s3_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floors pass a step while its shard is being uploaded: the upload is cancelled, its
    multipart upload aborted, and nothing is reported flushed."""
    monkeypatch.setattr(flush_stage, "KEPT_RECHECK_S", 0.2)
    slow = settings.replace(flush_max_bytes_per_s=1 << 20)
    event = verified_copy(slow, job, 1, mib=4)  # ~4 s at 1 MiB/s
    s3 = boto3.client("s3", **s3_server.client_kwargs())

    def uploading() -> bool:
        return bool(s3.list_multipart_uploads(Bucket=slow.s3_bucket).get("Uploads"))

    t0 = time.monotonic()
    assert flush_one(slow, event, uploading) is None
    assert time.monotonic() - t0 < 4.0  # (well before the upload could have completed)
    assert objects(slow, s3_server) == {} and not uploading()


def test_an_object_completed_as_the_floors_pass_its_step_is_removed_again(
    settings: Settings, job: str, s3_server
) -> None:
    """An upload that completes just as the floors pass its step (the coordinator may have
    removed the step's objects already) removes its object again and reports nothing."""
    event = verified_copy(settings, job, 1, mib=1)
    assert flush_one(settings, event, lambda: True, after_upload=True) is None
    assert objects(settings, s3_server) == {}


@pytest.mark.parametrize("kept", [False, True])
def test_a_copy_gone_when_its_upload_starts_fails_only_if_the_step_is_still_kept(
    settings: Settings, job: str, s3_server, kept: bool
) -> None:
    """Retention removed the NVMe copy between the flush's checks and its upload: a step object
    storage no longer keeps (superseded) is skipped, no failure; a step it still keeps is a
    failure ("no longer on NVMe"). CI's chaos test saw the first reported as the second."""
    from tierpipe.errors import ShardFormatError

    event = verified_copy(settings, job, 1, mib=1)
    Path(event.path).unlink()
    floors = Floors(upload=1) if kept else Floors(nvme=3, s3=3, upload=3)

    async def main() -> ShardFlushed | ShardFormatError | None:
        async with Bus(settings) as bus:
            await bus.ensure_job_stream(job)
            store = await JobStore(bus.js, settings).open()
            await store.kv.put(floor_key(job), msgspec.json.encode(floors))
            result: list[ShardFlushed | ShardFormatError | None] = []
            with anyio.CancelScope() as scope:  # (the stage's background work runs until then)
                async with flush_stage.open(settings, bus) as ctx:
                    try:
                        result.append(await flush_stage._upload(ctx, event, Path(event.path)))
                    except ShardFormatError as e:
                        result.append(e)
                    scope.cancel()
            return result[0]

    result = anyio.run(main)
    if kept:
        assert isinstance(result, ShardFormatError) and "no longer on NVMe" in str(result)
    else:
        assert result is None
    assert objects(settings, s3_server) == {}
