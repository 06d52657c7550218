"""A job's exposure, visible: `tierpipe ls` and the agent's metrics show each tier's newest step
and how far it trails the newest save (steps, seconds), and the steps a node's loss would cost
now; the agent that coordinates the job warns while those exceed `risk_warn_steps`, and says
when they no longer do."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from tests.conftest import Agent, run_cli
from tests.test_coordinator import publish, wait_for
from tests.test_metrics import value
from tests.test_status_cli import _saves, _store_state
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.control.risk import risk_of, watch
from tierpipe.metrics import Metrics
from tierpipe.schemas import Event, ShardFlushed, ShardVerified
from tierpipe.schemas.jobstate import Floors, JobHead
from tierpipe.settings import Settings

WORLD = 2
#: When the job's newest save (step 6) was verified, and when its newest upload (step 2) was.
SAVED_AGO_S, FLUSHED_AGO_S = 1.0, 31.0


def history(job: str, *, flushed_to: int) -> list[Event]:
    """Steps 1-6 saved by both ranks, steps up to `flushed_to` uploaded by both."""
    return [
        e
        for step in range(1, 7)
        for e in _saves(job, step, WORLD, flushed=range(WORLD) if step <= flushed_to else ())
    ]


def at(event: Event, ts: float) -> Event:
    return msgspec.structs.replace(event, ts=ts)


def job_with_lagging_uploads(settings: Settings, job: str, *, flushed_to: int = 2) -> None:
    """The job's state in KV (steps 1-6 on NVMe, up to `flushed_to` in object storage), and
    the newest `verified` and `flushed` events on its stream with their times."""
    events = history(job, flushed_to=flushed_to)
    _store_state(settings, job, events)
    now = time.time()
    newest_upload = [e for e in events if isinstance(e, ShardFlushed)][-1]
    newest_save = [e for e in events if isinstance(e, ShardVerified)][-1]

    async def publish() -> None:
        async with Bus(settings) as bus:
            await bus.publish(at(newest_upload, now - FLUSHED_AGO_S))
            await bus.publish(at(newest_save, now - SAVED_AGO_S))

    anyio.run(publish)


def test_the_risk_of_a_job_from_its_head_floors_and_newest_events() -> None:
    """Each tier's lag in steps and seconds behind the newest save; the steps at risk are the
    newest saved less the newest step safe from a node's loss (the floors', or the newest
    complete in object storage), every step with none safe."""
    head = JobHead(job="j", world_size=2, nvme_steps=[5, 6], s3_steps=[2], peer_steps=[5])
    verified, flushed, replicated = (
        _saves("j", 6, 2)[1],
        _saves("j", 2, 2, flushed=[0])[2],
        _saves("j", 5, 2)[1],
    )
    newest = {"verified": at(verified, 100.0), "flushed": at(flushed, 70.0),
              "replicated": at(replicated, 98.0)}  # fmt: skip
    risk = risk_of("j", head, Floors(safe=5), newest)
    assert (risk.saved, risk.safe, risk.at_risk) == (6, 5, 1)
    assert [(t.tier, t.newest, t.lag_steps, t.lag_s) for t in risk.tiers] == [
        ("nvme", 6, 0, 0.0), ("peer", 5, 1, 2.0), ("s3", 2, 4, 30.0),
    ]  # fmt: skip
    assert risk_of("j", head, Floors(), newest).at_risk == 4  # (object storage's step 2)
    nothing_safe = JobHead(job="j", world_size=2, nvme_steps=[5, 6])
    assert risk_of("j", nothing_safe, Floors(), newest).at_risk == 7  # (steps 0-6)
    unsaved = risk_of("j", None, None, {})
    assert (unsaved.saved, unsaved.at_risk, unsaved.tier("s3").lag_steps) == (None, 0, None)


def test_ls_shows_each_tier_its_lag_and_the_steps_at_risk(settings: Settings, job: str) -> None:
    """`tierpipe ls` (table and JSON): the newest saved step, each tier's newest step with its
    lag (steps, seconds), none on the peer tier, and the steps at risk."""
    job_with_lagging_uploads(settings, job)
    out = run_cli(settings, "ls")
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.split()[:9] == ["JOB", "WORLD", "SAVED", "NVME", "PEER", "S3", "AT", "RISK",
                                  "KEPT"]  # fmt: skip
    (row,) = [line for line in lines if line.split()[0] == job]
    assert "2 (-4, 30s)" in row and "- (-7)" in row, row
    assert row.split()[1:4] == ["2", "6", "6"]  # world, saved, NVMe

    out = run_cli(settings, "ls", "--json")
    (found,) = [x for x in map(json.loads, out.stdout.splitlines()) if x["job"] == job]
    assert (found["newest_saved"], found["steps_at_risk"], found["safe"]) == (6, 4, 2)
    assert found["newest_peer"] is None and found["tiers"]["peer"]["lag_steps"] == 7
    s3 = found["tiers"]["s3"]
    assert (s3["newest"], s3["lag_steps"]) == (2, 4)
    assert abs(s3["lag_s"] - (FLUSHED_AGO_S - SAVED_AGO_S)) < 1
    assert found["tiers"]["nvme"] == {"newest": 6, "lag_steps": 0, "lag_s": 0.0}


def test_metrics_show_each_tier_its_lag_and_the_steps_at_risk(settings: Settings, job: str) -> None:
    """The coordinating agent's metrics: each tier's newest step, lag (steps, seconds) and the
    steps at risk, by job; an agent that does not coordinate the job shows none of it."""
    job_with_lagging_uploads(settings, job)
    Path(settings.nvme_root, job).mkdir(parents=True)  # (a job of this node)
    metrics = Metrics()

    async def scrape(node: str) -> str:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            lease = await store.acquire(job, node, 30)
            assert lease is not None
            try:
                await metrics.refresh(settings, store, bus)
            finally:
                await store.release(job, lease)
            return generate_latest(metrics.registry).decode()

    text = anyio.run(scrape, settings.node or "")
    assert value(text, "tierpipe_newest_saved_step", job=job) == 6
    assert value(text, "tierpipe_steps_at_risk", job=job) == 4
    assert value(text, "tierpipe_newest_complete_step", job=job, tier="nvme") == 6
    assert value(text, "tierpipe_newest_complete_step", job=job, tier="s3") == 2
    assert value(text, "tierpipe_tier_lag_steps", job=job, tier="s3") == 4
    assert value(text, "tierpipe_tier_lag_steps", job=job, tier="nvme") == 0
    assert value(text, "tierpipe_tier_lag_steps", job=job, tier="peer") == 7
    assert abs(value(text, "tierpipe_tier_lag_seconds", job=job, tier="s3") - 30) < 1

    text = anyio.run(scrape, "another-node")
    assert f'tierpipe_steps_at_risk{{job="{job}"}}' not in text


def test_the_agent_warns_while_too_many_steps_are_at_risk(settings: Settings, job: str) -> None:
    """More steps at risk than `risk_warn_steps`: one warning (not one per look), and an info
    once the uploads catch up."""
    s = settings.replace(risk_warn_steps=2)
    job_with_lagging_uploads(s, job)
    Path(s.nvme_root, job).mkdir(parents=True)
    node = s.node or ""

    async def main() -> list[dict[str, object]]:
        async with Bus(s) as bus:
            store = await JobStore(bus.js, s).open()
            assert await store.acquire(job, node, 60) is not None
            with capture_logs() as logs:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: watch(s, bus, store, node, every_s=0.05))
                    await until(lambda: _named(logs, "steps_at_risk"))
                    await anyio.sleep(0.5)  # (several looks: still one warning)
                    await anyio.to_thread.run_sync(
                        lambda: job_with_lagging_uploads(s, job, flushed_to=6)
                    )
                    await until(lambda: _named(logs, "steps_at_risk_cleared"))
                    tg.cancel_scope.cancel()
            return logs

    logs = anyio.run(main)
    (warned,) = _named(logs, "steps_at_risk")
    assert warned["log_level"] == "warning" and warned["steps_at_risk"] == 4
    assert (warned["newest_s3"], warned["s3_lag_steps"], warned["risk_warn_steps"]) == (2, 4, 2)
    (cleared,) = _named(logs, "steps_at_risk_cleared")
    assert cleared["log_level"] == "info" and cleared["steps_at_risk"] == 0


@pytest.mark.slow
def test_a_running_agent_warns_of_its_jobs_risk(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """An agent started as operators start it warns of a job it coordinates whose saves never
    reached object storage (every step at risk), within a look or two (`RISK_CHECK_S`)."""
    s = settings.replace(risk_warn_steps=1)
    Path(s.nvme_root, job).mkdir(parents=True)
    running = agent("evict", settings=s).wait_ready()
    saves = [msgspec.structs.replace(e, node=s.node) for e in history(job, flushed_to=0)]
    publish(s, saves)
    wait_for("the agent's risk warning", lambda: "steps_at_risk" in running.log(), timeout=45)
    (line,) = [json.loads(x) for x in running.log().splitlines() if '"steps_at_risk"' in x][:1]
    assert line["job"] == job and line["steps_at_risk"] == 7 and line["level"] == "warning"


def _named(logs: list[dict[str, object]], event: str) -> list[dict[str, object]]:
    return [r for r in logs if r["event"] == event]


async def until(check: Callable[[], object], timeout_s: float = 20.0) -> None:
    """Until `check()` holds (the logs are a list: nothing to await)."""
    with anyio.fail_after(timeout_s):
        while True:
            if check():
                return
            await anyio.sleep(0.05)
