"""`tierpipe events` and `tierpipe ls`: what operators see without the NATS CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import anyio
import pytest

from tests.conftest import make_staged, run_cli
from tests.test_status_cli import _saves, _store_state
from tierpipe.bus.client import Bus
from tierpipe.cli.parser import parse_since
from tierpipe.errors import ConfigError
from tierpipe.schemas import Event, StageFailed
from tierpipe.settings import Settings


def publish(settings: Settings, *events: Event) -> list[int]:
    async def go() -> list[int]:
        async with Bus(settings) as bus:
            return [(await bus.publish(e)).seq for e in events]

    return anyio.run(go)


def failed(job: str, node: str, step: int, message: str) -> StageFailed:
    return StageFailed(
        job=job, node=node, ts=time.time(), stage="verify", error="IntegrityError",
        message=message, retryable=False, attempt=1, step=step, rank=0, world_size=1,
    )  # fmt: skip


def test_events_show_a_jobs_stream_by_kind_and_age_and_follow_it(
    settings: Settings, job: str
) -> None:
    """Every stored event with its sequence and time, one line each; one kind; only the recent
    ones (`--since`); as JSON; `--follow` prints new ones as they come and stops on Ctrl-C; an
    unknown job is not found (exit status 1)."""
    node = settings.node or ""
    seqs = publish(settings, make_staged(job, node, 1), failed(job, node, 1, "bad digest"))
    out = run_cli(settings, "events", "--job", job)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [int(line.split()[0]) for line in lines] == seqs
    assert lines[0].split()[2:5] == ["staged", "step", "1"] and node in lines[0]
    assert lines[1].split()[2] == "failed" and "bad digest" in lines[1]

    out = run_cli(settings, "events", "--job", job, "--kind", "failed", "--json")
    (only,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert only["seq"] == seqs[1] and only["event"]["message"] == "bad digest"
    assert only["subject"] == f"tp.{job}.failed.{node}.0" and only["time"].endswith("+00:00")

    time.sleep(0.5)
    cutoff = datetime.now(UTC)  # (an absolute time: a CLI that starts slowly sees the same)
    time.sleep(0.5)
    (newest,) = publish(settings, make_staged(job, node, 2))
    out = run_cli(settings, "events", "--job", job, "--since", cutoff.isoformat())
    assert [int(line.split()[0]) for line in out.stdout.splitlines()] == [newest]
    assert parse_since("90s", now=1000.0) == 910.0 and parse_since("2h", now=1e4) == 2800.0
    assert parse_since("1970-01-01T00:01:00") == 60.0  # (no zone: UTC)
    with pytest.raises(ConfigError, match="cannot read a time"):
        parse_since("yesterday")

    follow = subprocess.Popen(
        [sys.executable, "-m", "tierpipe.cli", "events", "--job", job, "--kind", "staged",
         "--follow"],
        env={**settings.as_env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert follow.stdout is not None
        assert int(follow.stdout.readline().split()[0]) == seqs[0]  # (the stored ones first)
        assert int(follow.stdout.readline().split()[0]) == newest
        (later,) = publish(settings, make_staged(job, node, 3))
        assert int(follow.stdout.readline().split()[0]) == later
        follow.send_signal(signal.SIGINT)
        assert follow.wait(10) == 0, follow.stderr.read() if follow.stderr else ""
    finally:
        follow.kill()

    out = run_cli(settings, "events", "--job", f"{job}-nope")
    assert out.returncode == 1 and f"unknown job '{job}-nope'" in out.stderr


def test_ls_lists_every_job_with_its_newest_steps_and_last_error(
    settings: Settings, job: str
) -> None:
    """A line per job: world size, newest saved step, newest step per tier with its lag, steps at
    risk, kept steps, fold lag, its newest failure; a job with events but no state yet is
    listed too."""
    _store_state(settings, job, _saves(job, 1, 4, flushed=range(4)) + _saves(job, 2, 4))
    publish(settings, failed(job, "n0", 2, "header digest mismatch"))
    fresh = f"{job}-fresh"
    publish(settings, make_staged(fresh, "n0", 1))
    out = run_cli(settings, "ls")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    # world, newest saved, NVMe, peer (none: both steps behind), S3 (one behind), at risk
    assert rows[job].split()[1:9] == ["4", "2", "2", "-", "(-3)", "1", "(-1)", "1"]
    assert "verify step 2 rank 0 IntegrityError: header digest mismatch" in rows[job]
    assert "no state" in rows[fresh]

    out = run_cli(settings, "ls", "--json")
    found = {x["job"]: x for x in map(json.loads, out.stdout.splitlines())}
    assert (found[job]["newest_nvme"], found[job]["newest_s3"]) == (2, 1)
    assert found[job]["last_error"]["message"] == "header digest mismatch"
    assert found[fresh]["newest_nvme"] is None and found[fresh]["lag"] >= 0
