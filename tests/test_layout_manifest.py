"""A sharded save's global layout in its step's manifest (issue 23, item 3): stored once in the
job state and named by the step's record and COMMIT, rebuilt by reindex (real agent, NATS,
object storage)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_commit import commit_of, wait_until
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore, layout_key
from tierpipe.names import shard_relpath, stream_name
from tierpipe.reshard.steplayout import layout_digest, layout_of, stored_layout
from tierpipe.schemas import ShardFlushed
from tierpipe.schemas.commit import CommitManifest
from tierpipe.schemas.jobstate import StepRecord
from tierpipe.schemas.layout import StepLayout
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head
from tierpipe.trainer.checkpointer import Checkpointer


def job_state(
    settings: Settings, job: str, step: int
) -> tuple[StepRecord | None, StepLayout | None, list[str]]:
    """The step's record, the layout it names as stored, and the job's KV keys."""

    async def main() -> tuple[StepRecord | None, StepLayout | None, list[str]]:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            rec = await store.record(job, step)
            layout = await stored_layout(store, job, rec.layout) if rec and rec.layout else None
            return rec, layout, await store.keys(job)

    return anyio.run(main)


def saved_header_layout(settings: Settings, job: str, step: int, rank: int, world: int) -> Any:
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, step, rank, world)
    return layout_of(read_head(path).header)


@pytest.mark.slow
def test_a_sharded_saves_layout_is_stored_named_committed_and_reindexed(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """A save with a replicated key (a sharded entry over the world's mesh): its record names
    a layout stored once in KV, the one its shard header gives; its COMMIT carries it; after
    the stream and the KV are lost, reindex from object storage stores it and names it again."""
    a = agent()
    with Checkpointer(job, rank=0, world_size=1, settings=settings, replicated=["emb"]) as c:
        c.save(1, {"emb": torch.arange(12.0).view(3, 4), "w": torch.ones(5)})
        c.wait_until_finished(timeout=60)
    events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 1, kind="flushed")
    want = saved_header_layout(settings, job, 1, 0, 1)
    assert [t.path for t in want.tensors] == [("emb",)]

    def named() -> object:
        rec, layout, keys = job_state(settings, job, 1)
        return rec is not None and rec.layout and (rec, layout, keys)

    rec, layout, keys = wait_until("the record's layout", named)  # type: ignore[misc]
    assert rec.layout == layout_digest(want) and layout == want
    assert layout_key(job, rec.layout) in keys  # (so `tierpipe rm`, which purges these, too)
    found = wait_until("COMMIT of step 1", lambda: commit_of(settings, job, 1))
    assert isinstance(found, CommitManifest) and found.layout == rec.layout
    assert found.layout_data
    a.stop()

    async def lose_everything() -> None:
        async with Bus(settings) as bus:
            await bus.js.purge_stream(stream_name(settings.stream, job), subject=f"tp.{job}.>")
            await bus.js.delete_key_value(settings.kv_bucket)

    anyio.run(lose_everything)
    env = {**os.environ, **settings.as_env()}
    elsewhere = {**env, "TIERPIPE_NODE": "reindexer", "TIERPIPE_NVME_ROOT": str(tmp_path / "x")}
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "reindex", "--job", job],
        env=elsewhere, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rec2, layout2, _ = job_state(settings, job, 1)
    assert rec2 is not None and rec2.layout == rec.layout and layout2 == want
