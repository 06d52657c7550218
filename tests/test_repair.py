"""Repairs of an NVMe copy (a restore's write-back, verify's rewrite of it) within the server's
duplicate window: each is a new fact, ends verified, and gives its staging slot back (issue 20,
item 3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.conftest import Agent, Events, make_staged
from tests.test_recovery import flip, restore_all, save_steps
from tierpipe.bus.client import Bus
from tierpipe.names import msg_id, shard_relpath, shard_subject
from tierpipe.runner import serve
from tierpipe.schemas import ShardVerified, ShardWritten, StageFailed
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.staging import markers, rank_dir

pytestmark = pytest.mark.slow


def written(staged_ts: float, *, origin: str = "restore") -> ShardWritten:
    repair = {"staged_ts": staged_ts} if staged_ts else {}
    return ShardWritten(
        job="j1", node="n1", ts=time.time(), step=5, rank=0, world_size=1, path="/x",
        nbytes=4096, header_digest="a" * 32, tensors=1, seconds=0.1,
        origin=origin,  # type: ignore[arg-type]
        **repair,  # type: ignore[arg-type]
    )  # fmt: skip


def test_two_repairs_of_one_copy_have_their_own_message_ids() -> None:
    """A copy written again from a new staging is a new fact; the same staging, delivered
    again, is not."""
    first, second = written(100.0), written(160.0)
    assert msg_id(first) != msg_id(second)
    assert msg_id(first) == msg_id(written(100.0))
    # What follows a copy carries its staging: verified is unique per repair too.
    v1, v2 = (w.follow(ShardVerified, node="n1", path="/x", nbytes=4096, header_digest="a" * 32,
                       seconds=0.1, origin="restore", staged_ts=w.staged_ts)
              for w in (first, second))  # fmt: skip
    assert msg_id(v1) != msg_id(v2)
    # A copy that no staging wrote (reindex, prefetch) keeps the id it always had.
    assert msg_id(written(0.0, origin="save")) == "j1/5/0/written/n1/0/aaaaaaaaaaaa"


def test_a_second_repair_within_the_duplicate_window_ends_verified_and_frees_its_slot(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """The NVMe copy corrupted twice, each time restored from object storage within the
    duplicate window: both write-backs end verified, and no staging slot stays marked."""
    agent()
    save_steps(settings, job, 1, [5], events)
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, 5, 0, 1)
    since = 0.0
    for _ in range(2):
        flip(str(path))
        ((restored, _),) = restore_all(settings, job, 1)
        assert restored.step == 5 and restored.source.tier == "s3"
        failed = events.wait_for(
            lambda e, t=since: isinstance(e, StageFailed) and e.stage == "restore" and e.ts > t,
            kind="failed",
        )
        events.wait_for(
            lambda e, t=failed.ts: isinstance(e, ShardVerified) and e.step == 5 and e.ts > t,
            kind="verified",
        )
        since = failed.ts
    slots = rank_dir(settings.staging_root, job, 0)
    deadline = time.monotonic() + 30
    while markers(slots) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert markers(slots) == []
    head = read_head(path)
    with NvmeStore.from_settings(settings) as nvme:
        nvme.verify_file(path, header_digest=head.header_digest.hex(), nbytes=head.file_nbytes)


def test_an_output_the_server_drops_as_a_duplicate_fails_the_message_for_good(
    settings: Settings, job: str, events: Events
) -> None:
    """A stage output (`written`) the server drops as a duplicate on the message's first
    delivery is reported as a permanent failure (the evict stage then frees the save's slot),
    not acked as done: nothing downstream would ever see it."""
    staged = make_staged(job, settings.node or "")
    out = written(0.0, origin="save")
    out = ShardWritten(**{**{f: getattr(out, f) for f in out.__struct_fields__},
                          "job": job, "node": settings.node, "step": staged.step})  # fmt: skip

    async def main() -> None:
        async with Bus(settings) as bus:
            await bus.ensure_job_stream(job)
            await bus.publish(out)  # an earlier event with the same id, within the window
            reported = anyio.Event()

            async def on_failed(msg: object) -> None:
                reported.set()

            async def handler(event: object, attempt: int) -> ShardWritten:
                return out

            await bus.subscribe(shard_subject(job, "failed", out.node, "*"), on_failed)
            await bus.publish(staged)
            async with anyio.create_task_group() as tg:
                await tg.start(
                    lambda task_status: serve(
                        bus, settings, stage="nvme-write", node=out.node, kinds=("staged",),
                        handler=handler, task_status=task_status,
                    )
                )  # fmt: skip
                with anyio.move_on_after(20):
                    await reported.wait()
                tg.cancel_scope.cancel()

    Path(settings.staging_root, job).mkdir(parents=True, exist_ok=True)
    anyio.run(main)
    (failed,) = [e for e in events.all("failed") if isinstance(e, StageFailed)]
    assert failed.stage == "nvme-write" and not failed.retryable
    assert failed.error == "DuplicateEventError" and msg_id(out) in failed.message
