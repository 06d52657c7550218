"""`tierpipe status` and `tierpipe plan` read the job's state in KV: a short per-step summary
whatever the job's size, per-rank detail for one step, and the step a restore would pick."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import anyio
import pytest

from tests.conftest import run_cli
from tierpipe.bus.client import Bus
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore
from tierpipe.names import shard_relpath
from tierpipe.schemas import Event, ShardFlushed, ShardVerified, ShardWritten
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings

WORLD = 1000


def _saves(job: str, step: int, world: int, *, flushed: Iterable[int] = ()) -> list[Event]:
    """Every rank's `written` and `verified` of `step`, and `flushed` for the ranks given."""
    out: list[Event] = []
    up = set(flushed)
    for rank in range(world):
        ident: dict[str, Any] = dict(
            job=job, node=f"n{rank // 8}", ts=time.time(), step=step, rank=rank, world_size=world
        )
        rel = str(shard_relpath(job, step, rank, world))
        where = dict(
            path=f"/nvme/{rel}", nbytes=4096 + rank, header_digest=f"{step:016x}{rank:016x}"
        )
        out += [ShardWritten(**ident, **where, tensors=1, seconds=0.1),
                ShardVerified(**ident, **where, seconds=0.1)]  # fmt: skip
        if rank in up:
            out.append(ShardFlushed(**ident, bucket="b", key=rel, etag="e", checksum="c",
                                    header_digest=where["header_digest"], nbytes=4096 + rank,
                                    seconds=0.1))  # fmt: skip
    return out


def _store_state(settings: Settings, job: str, events: list[Event]) -> None:
    """Fold `events` as the job's coordinator would and write the result to KV (no agent)."""
    keep = Keep(nvme_keep_latest_k=3, s3_keep_latest_k=10)
    state = JobState(job, keep)
    for seq, event in enumerate(events, 1):
        state.apply(seq, event)

    async def write() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            await store.register(job, keep)
            await store.write(state, state.take_changes())

    anyio.run(write)


@pytest.fixture
def big_job(settings: Settings, job: str) -> str:
    """A 1,000-rank job: step 1 complete on both tiers, step 2 on NVMe with half its ranks in
    object storage, step 3 on NVMe but for rank 999."""
    events = _saves(job, 1, WORLD, flushed=range(WORLD)) + _saves(job, 2, WORLD, flushed=range(500))
    events += [e for e in _saves(job, 3, WORLD) if e.rank != WORLD - 1]  # type: ignore[attr-defined]
    _store_state(settings, job, events)
    return job


def test_status_of_a_large_job_is_one_line_per_step(settings: Settings, big_job: str) -> None:
    """`tierpipe status` of a 1,000-rank job prints a header and one line per kept step."""
    out = run_cli(settings, "status", "--job", big_job)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) <= 10, out.stdout
    assert "newest complete step: NVMe 2, object storage 1" in lines[0]
    # what a restore would pick, from the planner `tierpipe plan` (and a restart) use
    plan = json.loads(run_cli(settings, "plan", "--job", big_job, "--json").stdout)
    assert (plan["step"], plan["from_nvme"], plan["from_s3"]) == (2, 1000, 0)
    assert "restore now: step 2: 1000 ranks from NVMe, 0 from object storage" in out.stdout
    rows = {line.split()[0]: line.split()[1:] for line in lines if line[:1].isdigit()}
    assert rows == {
        "1": ["1000", "1000/1000", "1000/1000", "both"],
        "2": ["1000", "1000/1000", "500/1000", "nvme"],
        "3": ["1000", "999/1000", "0/1000", "no"],
    }
    js = [
        json.loads(x)
        for x in run_cli(settings, "status", "--job", big_job, "--json").stdout.split("\n")
        if x
    ]
    assert [(o["step"], o["nvme_ranks"], o["s3_ranks"], o["complete"]) for o in js] == [
        (1, 1000, 1000, "both"), (2, 1000, 500, "nvme"), (3, 999, 0, "no")
    ]  # fmt: skip


def test_status_of_one_step_lists_every_rank(settings: Settings, big_job: str) -> None:
    """`--step N` prints one line per rank of that step; `--rank R --json` that rank's tiers,
    digest, size and locations."""
    out = run_cli(settings, "status", "--job", big_job, "--step", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 + WORLD
    (one,) = [json.loads(x) for x in run_cli(
        settings, "status", "--job", big_job, "--step", "2", "--rank", "700", "--json"
    ).stdout.splitlines()]  # fmt: skip
    rel = str(shard_relpath(big_job, 2, 700, WORLD))
    assert one == {
        "job": big_job, "step": 2, "world_size": WORLD, "rank": 700, "nvme": True, "s3": False,
        "header_digest": f"{2:016x}{700:016x}", "nbytes": 4096 + 700,
        "nvme_path": f"{settings.nvme_root}/{rel}",
        "object_key": f"s3://{settings.s3_bucket}/" + one["object_key"].split("/", 3)[3],
    }  # fmt: skip
    assert one["object_key"].endswith(rel)


def test_plan_picks_the_newest_step_every_rank_has(settings: Settings, big_job: str) -> None:
    """`tierpipe plan` skips a step a rank lacks and counts the ranks per tier; with
    `--nvme-lost` only a step complete in object storage qualifies."""
    out = run_cli(settings, "plan", "--job", big_job, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["step"], plan["from_nvme"], plan["from_s3"]) == (2, WORLD, 0)
    assert plan["rejected"]["3"].startswith("1 of 1000 ranks have no copy (rank 999)")
    assert plan["assumes"] == "nvme_kept"
    lost = json.loads(run_cli(settings, "plan", "--job", big_job, "--nvme-lost", "--json").stdout)
    assert (lost["step"], lost["from_s3"], lost["assumes"]) == (1, WORLD, "nvme_lost")
    text = run_cli(settings, "plan", "--job", big_job).stdout
    assert text.startswith(f"restore step 2 of job {big_job!r} (1000 ranks): 1000 from NVMe, 0")
    assert "still holds its NVMe copy" in text


def test_plan_refuses_alive(settings: Settings, big_job: str) -> None:
    """`--alive` is refused with a message pointing at `--nvme-lost` (the job state does not
    record which node holds a rank's copy)."""
    out = run_cli(settings, "plan", "--job", big_job, "--alive", "a,b")
    assert out.returncode == 2 and "--nvme-lost" in out.stderr, out.stderr


def test_status_of_a_job_without_state_suggests_reindex(settings: Settings, job: str) -> None:
    """A job with no state in KV (and no stream) is not found (exit status 1), and the error
    names the job and `tierpipe reindex`."""
    for command in ("status", "plan"):
        out = run_cli(settings, command, "--job", job)
        assert out.returncode == 1, out.stdout
        assert repr(job) in out.stderr and f"tierpipe reindex --job {job}" in out.stderr


def test_status_says_when_no_step_can_be_restored(settings: Settings, job: str) -> None:
    """A job whose only step lacks a rank: `tierpipe status` says a restore has nothing to pick
    and why, as `tierpipe plan` refuses (one planner answers both)."""
    _store_state(settings, job, [e for e in _saves(job, 1, 4) if e.rank != 3])  # type: ignore[attr-defined]
    out = run_cli(settings, "status", "--job", job)
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("restore now:")]
    assert line.startswith("restore now: none (") and "1 of 4 ranks have no copy" in line, line
    refused = run_cli(settings, "plan", "--job", job)
    assert refused.returncode != 0 and "1 of 4 ranks have no copy" in refused.stderr
