"""An agent's `/metrics` and `/healthz`, scraped from a live agent after a save."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe import Checkpointer
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings

pytestmark = pytest.mark.slow


def port_of(agent: Agent, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in agent.log().splitlines():
            if '"metrics_serving"' in line:
                return int(json.loads(line)["port"])
        time.sleep(0.05)
    raise AssertionError(f"no metrics_serving in:\n{agent.log()}")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels}` of a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
    return 0.0


def test_a_live_agent_serves_metrics_and_health(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """After a save reached object storage the agent's `/metrics` shows the stages' latency,
    the bytes per tier, the job's newest complete steps, the flush rate and slots in use;
    `/healthz` answers 200 with NATS connected; on loopback only."""
    s = settings.replace(flush_max_bytes_per_s=64 << 20)
    a = agent(settings=s).wait_ready()
    base = f"http://127.0.0.1:{port_of(a)}"
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        ckpt.save(1, {"w": torch.ones(1 << 16)}).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")

    deadline = time.monotonic() + 20
    while True:
        status, text = get(f"{base}/metrics")
        assert status == 200
        if value(text, "tierpipe_newest_complete_step", job=job, tier="s3") == 1:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.2)
    assert value(text, "tierpipe_stage_seconds_count", stage="nvme-write", outcome="done") >= 1
    assert value(text, "tierpipe_stage_seconds_count", stage="flush", outcome="done") >= 1
    written = value(text, "tierpipe_tier_bytes_total", tier="nvme", op="write")
    assert (
        written >= 4 << 16
        and value(text, "tierpipe_tier_bytes_total", tier="s3", op="upload") == written
    )
    assert value(text, "tierpipe_newest_complete_step", job=job, tier="nvme") == 1
    assert value(text, "tierpipe_flush_rate_bytes_per_second") == 64 << 20
    assert (
        "tierpipe_staging_slots_in_use" in text and "tierpipe_flush_throttle_wait_seconds" in text
    )

    status, body = get(f"{base}/healthz")
    assert status == 200 and json.loads(body)["nats"] == "connected"
    assert get(f"{base}/nope")[0] == 404
    host = next(json.loads(x)["host"] for x in a.log().splitlines() if "metrics_serving" in x)
    assert host == "127.0.0.1"
