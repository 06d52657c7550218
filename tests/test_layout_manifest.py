"""A sharded save's global layout in its step's manifest (issue 23, item 3): stored once in the
job state and named by the step's record and COMMIT, rebuilt by reindex, and what a resharded
restore plans from without reading a shard header (real agent, NATS, object storage)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.conftest import Agent, Events, gloo_ranks, run_cli
from tests.test_commit import commit_of, lose_state_and_reindex, wait_until
from tests.test_reshard import expected_sums
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore, layout_key
from tierpipe.names import shard_relpath
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
        the stream and the KV are lost, reindex from object storage stores it and names it again;
    `tierpipe rm` removes it with the job."""
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

    lose_state_and_reindex(settings, job, tmp_path)
    rec2, layout2, keys2 = job_state(settings, job, 1)
    assert rec2 is not None and rec2.layout == rec.layout and layout2 == want
    assert layout_key(job, rec.layout) in keys2
    done = run_cli(settings, "rm", "--job", job, "--apply", "--idle-s", "0")
    assert done.returncode == 0, done.stderr
    assert job_state(settings, job, 1)[2] == []  # (the layout went with the job's other keys)


def run_ranks_logged(
    settings: Settings, job: str, world: int, tmp_path: Path, *args: str
) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """`tests/reshard_rank.py` as `world` gloo ranks (as `test_reshard.run_ranks`), logging at
    debug level: each rank's JSON line and its log events."""
    out = []
    for stdout, stderr in gloo_ranks(settings, "tests.reshard_rank", [job, *args], world,
                                     tmp_path, log_level="debug", log_format="json"):  # fmt: skip
        logs = []
        for line in stderr.splitlines():
            try:
                logs.append(json.loads(line))
            except ValueError:
                continue
        out.append((json.loads(stdout.strip().splitlines()[-1]), logs))
    return out


def planned(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if isinstance(e, dict) and e.get("event") == event]


@pytest.mark.slow
@pytest.mark.timeout(600)  # (gloo ranks on a loaded 2-core machine)
def test_a_resharded_restore_plans_from_the_layout_with_no_header_read(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """DTensors saved on a 2x2 mesh: the record names their layout, and restores onto two
    ranks and onto four on a 1-D mesh decide and plan from it with zero shard headers read
    before their reads start, bitwise; with the layout gone from the job state (as for a step
    saved before layouts), the same restore reads the value rank's header first, bitwise too."""
    agent()
    run_ranks_logged(settings, job, 4, tmp_path, "save", "2x2")
    for rank in range(4):
        events.wait_for(
            lambda e, rank=rank: isinstance(e, ShardFlushed) and e.rank == rank, kind="flushed"
        )
    rec, layout, _ = wait_until(  # type: ignore[misc]
        "the record's layout", lambda: (got := job_state(settings, job, 1))[0] and got[1] and got
    )
    assert layout == saved_header_layout(settings, job, 1, 3, 4)
    for world, mesh in ((2, "2"), (4, "4")):
        for result, logs in run_ranks_logged(settings, job, world, tmp_path, "restore", mesh):
            assert result["step"] == 1 and result["sums"] == expected_sums(), result
            (plan,) = planned(logs, "reshard_planned")
            assert (plan["planned_from"], plan["heads_read"]) == ("layout", 0), plan
            assert plan["sources"] >= 2  # (the value rank's reads and the others' at once)
            if world == 4:  # (the same world size: the choice to reshard, from the layout)
                (checked,) = planned(logs, "reshard_checked")
                assert checked["checked_from"] == "layout", checked

    async def forget_layout() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            await store.purge([layout_key(job, rec.layout)])

    anyio.run(forget_layout)
    for result, logs in run_ranks_logged(settings, job, 2, tmp_path, "restore", "2"):
        assert result["step"] == 1 and result["sums"] == expected_sums(), result
        (plan,) = planned(logs, "reshard_planned")
        assert (plan["planned_from"], plan["heads_read"]) == ("header", 1), plan
