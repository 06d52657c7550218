"""`tierpipe gc` and `tierpipe rm` against real agents, nats-server and SeaweedFS (issue 20,
items 6 and 13): orphans are found on a dry run and removed with --apply, kept steps never; a
job is deleted whole, and not while it is in use unless forced."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
import torch

from tests.conftest import Agent, Events, run_cli
from tests.test_resilience import wait_until
from tierpipe.names import shard_relpath
from tierpipe.retention.gc import unkept
from tierpipe.schemas import ShardEvicted, ShardFlushed
from tierpipe.schemas.jobstate import Floors, JobHead, StepRecord
from tierpipe.settings import Settings
from tierpipe.storage.s3.commit import commit_key
from tierpipe.storage.s3.keys import object_key, parse_object_key
from tierpipe.storage.shardfile import write_shard
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


@pytest.fixture
def s3(s3_server) -> object:
    return boto3.client("s3", **s3_server.client_kwargs())


def keys(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def shard_steps(settings: Settings, listed: list[str]) -> list[int]:
    return sorted({s.step for k in listed if (s := parse_object_key(settings.s3_prefix, k))})


def nvme_steps(settings: Settings, job: str) -> list[int]:
    return sorted(
        int(d.name[5:]) for d in (Path(settings.nvme_root) / job).glob("step-*")
        if any(d.glob("*.shard"))
    )  # fmt: skip


@pytest.fixture
def retained(settings: Settings, job: str, agent: Callable[..., Agent], s3) -> Settings:
    """Steps 1-4 saved with 2 kept on each tier, retention settled (3 and 4 left on both), the
    agent stopped: what is on the tiers now changes only by what the test does."""
    policy = settings.replace(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    a = agent(settings=policy).wait_ready(60)
    events = Events(policy, job)
    with Checkpointer(job, rank=0, world_size=1, settings=policy) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.full((1024,), float(step))})
            # (each in object storage before the next: each is the job's upload target in turn)
            events.wait_for(
                lambda e, t=step: isinstance(e, ShardFlushed) and e.step == t, kind="flushed"
            )
        ckpt.wait_until_finished(timeout=60)
    wait_until(
        lambda: nvme_steps(policy, job) == [3, 4]
        and shard_steps(policy, keys(s3, policy.s3_bucket)) == [3, 4],
        60, "retention to settle",
    )  # fmt: skip
    assert a.stop(signal.SIGTERM) == 0
    return policy


def plant_orphans(settings: Settings, job: str, s3, tmp_path: Path) -> list[str]:
    """Step 1's object, COMMIT and NVMe file, as a re-drive after retention leaves them; and a
    key under the job's folder that is no shard. Returns the orphans' locations."""
    node = settings.node or ""
    nvme_file = Path(settings.nvme_root).absolute() / shard_relpath(job, 1, 0, 1)
    digest = write_shard(nvme_file, {"w": torch.ones(1024)}, job=job, step=1, node=node)
    os.utime(nvme_file, (time.time() - 3600,) * 2)
    key = object_key(settings.s3_prefix, job, 1, 0, 1)
    meta = {"tp-header-digest": digest, "tp-node": node, "tp-epoch": "0"}
    s3.put_object(Bucket=settings.s3_bucket, Key=key, Body=nvme_file.read_bytes(), Metadata=meta)
    commit = commit_key(settings.s3_prefix, job, 1)
    s3.put_object(Bucket=settings.s3_bucket, Key=commit, Body=b"{}")
    junk = key.rsplit("/", 2)[0] + "/notes.txt"
    s3.put_object(Bucket=settings.s3_bucket, Key=junk, Body=b"mine")
    bucket = settings.s3_bucket
    return [str(nvme_file), f"s3://{bucket}/{key}", f"s3://{bucket}/{commit}"]


def test_gc_lists_orphans_on_a_dry_run_and_removes_only_them_with_apply(
    retained: Settings, job: str, s3, events: Events, tmp_path: Path
) -> None:
    """Objects, a COMMIT and an NVMe file of a step retention dropped are listed (with why) and
    left alone by `tierpipe gc`, then removed by `--apply`; the kept steps 3 and 4 and a key
    that is no shard stay."""
    orphans = plant_orphans(retained, job, s3, tmp_path)
    before = keys(s3, retained.s3_bucket)
    dry = run_cli(retained, "gc", "--job", job, "--min-age-s", "0")
    assert dry.returncode == 0, dry.stderr
    for location in orphans:
        assert f"would remove {location}" in dry.stdout, dry.stdout
    assert "below the object-storage floor" in dry.stdout
    assert "would remove 3 objects and files" in dry.stdout
    assert keys(s3, retained.s3_bucket) == before and Path(orphans[0]).exists()
    done = run_cli(retained, "gc", "--job", job, "--min-age-s", "0", "--apply", "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(r["location"] for r in rows[:-1]) == sorted(orphans)
    assert rows[-1]["count"] == 3 and rows[-1]["applied"]
    left = keys(s3, retained.s3_bucket)
    assert shard_steps(retained, left) == [3, 4] and not Path(orphans[0]).exists()
    assert commit_key(retained.s3_prefix, job, 1) not in left
    assert any(k.endswith("/notes.txt") for k in left)
    assert nvme_steps(retained, job) == [3, 4]
    gone = [e for e in events.all("evicted") if isinstance(e, ShardEvicted) and e.step == 1
            and e.reason.startswith("gc:")]  # fmt: skip
    assert sorted(e.tier for e in gone) == ["nvme", "s3"]


def test_gc_leaves_what_is_younger_than_the_minimum_age(
    retained: Settings, job: str, s3, tmp_path: Path
) -> None:
    """An object of a dropped step uploaded a moment ago (a save the job state may not have
    folded yet) is left alone under the default minimum age."""
    orphans = plant_orphans(retained, job, s3, tmp_path)
    done = run_cli(retained, "gc", "--job", job, "--apply")
    assert done.returncode == 0, done.stderr
    assert f"left alone {orphans[1]}: younger than the minimum age" in done.stdout
    assert orphans[1].removeprefix(f"s3://{retained.s3_bucket}/") in keys(s3, retained.s3_bucket)


def test_gc_refuses_a_job_without_state(settings: Settings, job: str) -> None:
    """With no job state to judge by, gc removes nothing (exit status 1) and says how to
    rebuild it."""
    done = run_cli(settings, "gc", "--job", job, "--apply")
    assert done.returncode == 1
    assert "has no state in KV" in done.stderr and "tierpipe reindex" in done.stderr


def test_rm_counts_on_a_dry_run_refuses_a_recent_job_and_deletes_it_whole(
    retained: Settings, job: str, s3, tmp_path: Path
) -> None:
    """`tierpipe rm` counts the job's parts and deletes nothing; with --apply it refuses a job
    whose newest event is recent; once idle (here: --idle-s 0) it deletes the stream, every
    job-state key, every object under the job and this node's NVMe and staging folders."""
    plant_orphans(retained, job, s3, tmp_path)
    dry = run_cli(retained, "rm", "--job", job, "--json")
    assert dry.returncode == 0, dry.stderr
    (counts,) = [json.loads(line) for line in dry.stdout.splitlines()]
    assert counts["objects"] >= 5 and counts["kv_keys"] >= 4 and counts["stream_messages"] > 0
    assert counts["nvme_files"] == 3 and not counts["applied"]
    assert any("newest event" in why for why in counts["busy"])
    refused = run_cli(retained, "rm", "--job", job, "--apply")
    assert refused.returncode == 1 and "looks in use" in refused.stderr
    assert len(keys(s3, retained.s3_bucket)) == counts["objects"]
    done = run_cli(retained, "rm", "--job", job, "--apply", "--idle-s", "0")
    assert done.returncode == 0, done.stderr
    assert keys(s3, retained.s3_bucket) == []
    assert not (Path(retained.nvme_root) / job).exists()
    assert not (Path(retained.staging_root) / job).exists()
    after = run_cli(retained, "rm", "--job", job, "--json")  # (nothing of it left anywhere)
    assert (after.returncode, after.stdout) == (1, ""), after.stderr
    assert f"unknown job '{job}'" in after.stderr
    assert run_cli(retained, "status", "--job", job).returncode != 0


def test_rm_refuses_a_job_whose_coordinator_holds_its_lease_unless_forced(
    settings: Settings, job: str, agent: Callable[..., Agent], s3
) -> None:
    """While an agent coordinates the job (its lease is live), rm --apply deletes nothing and
    names the holder; --force deletes it anyway."""
    a = agent().wait_ready(60)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.ones(1024)})
        ckpt.wait_until_finished(timeout=60)
    wait_until(lambda: bool(keys(s3, settings.s3_bucket)), 60, "the upload")
    wait_until(lambda: "lease_acquired" in a.log(), 60, "the coordinator")
    refused = run_cli(settings, "rm", "--job", job, "--apply", "--idle-s", "0")
    assert refused.returncode == 1, refused.stdout
    assert "holds its coordinator lease" in refused.stderr and settings.node in refused.stderr
    assert keys(s3, settings.s3_bucket) != []
    forced = run_cli(settings, "rm", "--job", job, "--apply", "--force", "--idle-s", "0")
    assert forced.returncode == 0, forced.stderr
    assert keys(s3, settings.s3_bucket) == []


@pytest.mark.parametrize(
    ("step", "tier", "rec", "why"),
    [
        (9, "s3", None, ""),  # newer than any step the job state knows: in flight
        (6, "s3", None, ""),  # kept by the floors (a restore reads it)
        (2, "s3", None, "below the object-storage floor"),
        (5, "s3", None, "no record in the job state"),
        (2, "s3", StepRecord(step=2, world_size=1), ""),  # left there by a rule (the period)
        (
            2,
            "s3",
            StepRecord(step=2, world_size=1, s3_removed=True),
            "below the object-storage floor",
        ),
        (7, "nvme", None, ""),  # at the NVMe floor
        (5, "nvme", None, ""),  # object storage keeps it: the copy waits for its upload
        (2, "nvme", None, "below both floors"),
    ],
)
def test_what_gc_finds_unkept(step: int, tier: str, rec: StepRecord | None, why: str) -> None:
    """gc's judgement of one step on one tier, from the head, the floors and the record."""
    head = JobHead(job="j", steps=[1, 2, 5, 6, 7, 8], nvme_steps=[7, 8], s3_steps=[5, 8])
    floors = Floors(nvme=7, s3=3, keep=[6])
    assert unkept(step, tier, head, floors, rec) == why  # type: ignore[arg-type]
