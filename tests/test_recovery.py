"""Restores end to end: plan from the stream, NVMe or S3 per rank, fallback, all ranks agree."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.control.bitmap import ranks_of
from tierpipe.errors import NoCheckpointError, RestoreTimeoutError, WorldSizeMismatchError
from tierpipe.names import shard_relpath, stream_name
from tierpipe.schemas import RecoveryPlanned, ShardFlushed, StageFailed
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head
from tierpipe.storage.s3.store import S3Store
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def save_steps(settings: Settings, job: str, world: int, steps: list[int], events: Events) -> dict:
    """Save `steps` from `world` ranks; return {(step, rank): model state} as saved."""
    saved = {}
    ckpts = [Checkpointer(job, rank=r, world_size=world, settings=settings) for r in range(world)]
    try:
        for step in steps:
            for r, c in enumerate(ckpts):
                m = model(step * 10 + r)
                saved[(step, r)] = {k: v.clone() for k, v in m.state_dict().items()}
                c.save(step, {"model": m, "step": step})
        for c in ckpts:
            c.wait_until_finished(timeout=60)
    finally:
        for c in ckpts:
            c.close()
    last = steps[-1]
    for r in range(world):
        events.wait_for(
            lambda e, r=r: isinstance(e, ShardFlushed) and e.step == last and e.rank == r,
            kind="flushed",
        )
    return saved


def start_job(settings: Settings, job: str, world: int) -> None:
    """Make `job` (of `world` ranks) with a save of rank 0 that no agent takes: the job has
    state, and nothing restorable."""
    with Checkpointer(job, rank=0, world_size=world, settings=settings) as c:
        c.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)


def restore_all(settings: Settings, job: str, world: int, **kw: object) -> list:
    """Every rank restores concurrently (as after a restart); returns their results."""

    def one(rank: int) -> object:
        with Checkpointer(job, rank=rank, world_size=world, settings=settings) as c:
            target = model(999)
            restored = c.restore({"model": target}, **kw)  # type: ignore[arg-type]
            return restored, target

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def flip(path: str) -> None:
    head = read_head(path)
    with open(path, "r+b") as f:
        f.seek(head.data_offset + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))


def test_restore_newest_step_from_nvme_in_place(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Two ranks restore the newest step from their node's NVMe into live models, bitwise."""
    agent()
    saved = save_steps(settings, job, 2, [1, 2, 3], events)
    for rank, (restored, target) in enumerate(restore_all(settings, job, 2)):
        assert restored.step == 3 and restored.source.tier == "nvme" and restored.rounds == 1
        for k, v in saved[(3, rank)].items():
            assert torch.equal(target.state_dict()[k], v), k
        assert restored.state["step"] == 3


def test_corrupt_nvme_copy_falls_back_to_s3_and_is_written_back(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A flipped byte on NVMe makes that rank read object storage in the same restore; the
    bad copy is reported and the shard comes back to NVMe through the agent."""
    agent()
    saved = save_steps(settings, job, 1, [5], events)
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, 5, 0, 1)
    flip(str(path))
    ((restored, target),) = restore_all(settings, job, 1)
    assert restored.step == 5 and restored.source.tier == "s3"
    for k, v in saved[(5, 0)].items():
        assert torch.equal(target.state_dict()[k], v), k
    failed = events.wait_for(
        lambda e: isinstance(e, StageFailed) and e.stage == "restore", kind="failed"
    )
    assert isinstance(failed, StageFailed) and failed.tier == "nvme" and "tensor" in failed.message
    events.wait_for(
        lambda e: (
            getattr(e, "step", None) == 5
            and type(e).__name__ == "ShardVerified"
            and e.ts > failed.ts
        ),
        kind="verified",
    )
    read_head(path)  # a good copy is back


def test_all_ranks_move_to_an_older_step_when_one_has_no_good_copy(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, s3_server
) -> None:
    """Rank 1's newest shard is bad on NVMe and in S3: every rank restores the step before."""
    import boto3

    agent()
    saved = save_steps(settings, job, 2, [1, 2], events)
    flip(str(Path(settings.nvme_root).absolute() / shard_relpath(job, 2, 1, 2)))
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    key = S3Store(settings).key(job, 2, 1, 2)
    body = bytearray(s3.get_object(Bucket=settings.s3_bucket, Key=key)["Body"].read())
    body[
        read_head(Path(settings.nvme_root).absolute() / shard_relpath(job, 1, 1, 2)).data_offset + 7
    ] ^= 1
    s3.delete_object(Bucket=settings.s3_bucket, Key=key)
    s3.put_object(Bucket=settings.s3_bucket, Key=key, Body=bytes(body))
    results = restore_all(settings, job, 2)
    for rank, (restored, target) in enumerate(results):
        assert restored.step == 1 and restored.rounds == 2, rank
        for k, v in saved[(1, rank)].items():
            assert torch.equal(target.state_dict()[k], v), k


def test_world_size_mismatch_and_nothing_to_restore(
    settings: Settings, job: str, events: Events, agent: Callable[..., Agent]
) -> None:
    """Restoring with another world size, or a job without checkpoints, fails clearly."""
    s = settings.replace(restore_timeout_s=10.0)
    with Checkpointer(job, rank=0, world_size=1, settings=s) as c, pytest.raises(NoCheckpointError):
        c.restore()
    agent()
    save_steps(settings, job, 2, [1], events)
    with Checkpointer(job, rank=0, world_size=1, settings=s) as c:
        assert c.latest_step() == 1 and c.all_steps() == [1]
        t0 = time.monotonic()
        with pytest.raises(WorldSizeMismatchError, match="saved by 2 ranks, this run has 1"):
            c.restore()
        assert time.monotonic() - t0 < 10


def test_purged_stream_is_rebuilt_by_reindex_to_the_same_plan(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """After the stream loses everything, `tierpipe reindex` rebuilds it from the shard files
    and objects: its events fold into a job state (in a fresh KV bucket, as if the state was
    lost too) on which `tierpipe plan` and `tierpipe status` give the same answer as before."""
    import anyio

    from tierpipe.bus.client import Bus
    from tierpipe.control.jobstate import JobState
    from tierpipe.control.kvstate import JobStore
    from tierpipe.schemas.jobstate import Keep

    agent()
    save_steps(settings, job, 1, [1, 2], events)
    env = {**os.environ, **settings.as_env()}

    def cli(env: dict[str, str], *args: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "tierpipe.cli", *args, "--job", job, "--json"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    before = cli(env, "plan")
    assert (before["step"], before["from_nvme"], before["from_s3"]) == (2, 1, 0)
    rank_before = cli(env, "status", "--step", "2", "--rank", "0")
    assert rank_before["nvme"] and rank_before["s3"] and rank_before["header_digest"]

    async def purge() -> None:
        async with Bus(settings) as bus:
            await bus.js.purge_stream(stream_name(settings.stream, job), subject=f"tp.{job}.>")

    anyio.run(purge)
    assert events.all() == []
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "reindex", "--job", job],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "republished 2 NVMe shards and 2 objects" in out.stdout
    # The job state folded from the republished events alone, stored in a bucket of its own.
    rebuilt = settings.replace(kv_bucket=f"{settings.kv_bucket}-rebuilt")
    state = JobState(job, Keep())
    for seq, event in enumerate(events.all(), 1):
        state.apply(seq, event)

    async def store() -> None:
        async with Bus(rebuilt) as bus:
            await (await JobStore(bus.js, rebuilt).open()).write(state, state.take_changes())

    anyio.run(store)
    env_rebuilt = {**os.environ, **rebuilt.as_env()}
    after = cli(env_rebuilt, "plan")
    assert {k: after[k] for k in ("step", "from_nvme", "from_s3", "world_size")} == {
        k: before[k] for k in ("step", "from_nvme", "from_s3", "world_size")
    }
    rank_after = cli(env_rebuilt, "status", "--step", "2", "--rank", "0")
    assert rank_after == rank_before
    # A reindex run from another node keeps each object's uploader (only it removes the
    # object) and the save's epoch, read from the object's metadata.
    elsewhere = {**env, "TIERPIPE_NODE": "reindexer", "TIERPIPE_NVME_ROOT": str(tmp_path / "x")}
    subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "reindex", "--job", job],
        env=elsewhere,
        capture_output=True,
        check=True,
    )
    flushed = [e for e in events.all("flushed") if isinstance(e, ShardFlushed)]
    assert flushed and {e.node for e in flushed} == {settings.node}
    assert all(e.epoch > 0 and e.origin == "reindex" for e in flushed)


def test_every_rank_gives_up_at_once_when_rank_0_finds_nothing(
    settings: Settings, job: str
) -> None:
    """With nothing to restore, rank 0 tells the others instead of letting them time out."""
    s = settings.replace(restore_timeout_s=60.0)
    start_job(s, job, 2)  # (a job without any state is refused by every rank at once)
    t0 = time.monotonic()

    def one(rank: int) -> str:
        with Checkpointer(job, rank=rank, world_size=2, settings=s) as c:
            try:
                c.restore()
            except NoCheckpointError as e:
                return str(e)
        return "restored?"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(one, range(2)))
    assert "no checkpoints" in errors[0] and errors[1].startswith("rank 0:")
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_left_alone_times_out_saying_what_it_waited_for(
    settings: Settings, job: str, rank: int
) -> None:
    """A rank whose peers never show up gives up at the restore deadline: rank 0 waiting for
    their reports, another rank for rank 0's plan."""
    s = settings.replace(restore_timeout_s=2.0)
    start_job(s, job, 2)
    t0 = time.monotonic()
    with (
        Checkpointer(job, rank=rank, world_size=2, settings=s) as c,
        pytest.raises(RestoreTimeoutError) as err,
    ):
        c.restore(restart="alone")
    assert 2.0 <= time.monotonic() - t0 < 15
    e = err.value
    assert (e.job, e.restart, e.timeout_s) == (job, "alone", 2.0)
    assert e.waiting_for == ("1 of 2 ranks reported" if rank == 0 else "no plan from rank 0")


def test_ranks_agree_through_torch_distributed_when_initialised(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """Two processes in a gloo group restore: the plan travels by collectives (and is still
    published); rank 1's corrupt NVMe copy falls back to S3 within the same round."""
    agent()
    saved = save_steps(settings, job, 2, [1, 2], events)
    flip(str(Path(settings.nvme_root).absolute() / shard_relpath(job, 2, 1, 2)))
    results = run_gloo_ranks(settings, job, 2, tmp_path)
    for rank, r in enumerate(results):
        assert (r["step"], r["agreement"], r["rounds"]) == (2, "torch.distributed", 1), r
        assert r["tier"] == ("nvme", "s3")[rank]
        for k, v in saved[(2, rank)].items():
            assert r["sums"][k] == hashlib.sha256(v.view(torch.uint8).numpy().tobytes()).hexdigest()
    final = events.wait_for(
        lambda e: isinstance(e, RecoveryPlanned) and e.final and e.step == 2, kind="plan"
    )
    assert isinstance(final, RecoveryPlanned) and ranks_of(final.from_s3) == []  # (planned NVMe)


def test_every_rank_of_a_torch_distributed_job_gets_rank_0s_error(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """Nothing restorable: rank 0's NoCheckpointError reaches the other rank by broadcast."""
    start_job(settings, job, 2)
    results = run_gloo_ranks(settings, job, 2, tmp_path)
    assert [r["error"] for r in results] == ["NoCheckpointError"] * 2
    assert results[1]["message"].startswith("rank 0: ")


def run_gloo_ranks(settings: Settings, job: str, world: int, tmp_path: Path) -> list[dict]:
    """Run `tests/dist_rank.py` as `world` processes of one gloo group; their JSON lines."""
    env = {**os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": "warning"}
    store = tmp_path / "gloo-store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dist_rank", job, str(rank), str(world), str(store)],
            env=env,
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_explicit_step_with_no_good_copy_is_refused_never_swapped(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """restore(step=N) returns step N or raises: when N's copies turn out gone at load time,
    the ranks do not fall back to another step (older or newer) behind the caller's back."""
    agent()
    save_steps(settings, job, 1, [1, 2], events)
    path = Path(settings.nvme_root) / shard_relpath(job, 1, 0, 1)
    path.unlink()  # gone from NVMe after it was verified, and ...

    async def drop_object() -> None:  # ... from object storage after it was flushed
        async with S3Store(settings) as store:
            await store.remove(store.key(job, 1, 0, 1))

    import anyio

    anyio.run(drop_object)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        with pytest.raises(NoCheckpointError, match="step 1"):
            c.restore(step=1)
        assert c.restore().step == 2  # the newest is still fine
