"""The node advertisement: an agent tells the trainers of its node where its NVMe root, staging
root and object store are, so a trainer that forgot `source .tierpipe/env` still restores from
them; a missing S3 credential is called that, not an unreachable store."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
import structlog
import torch

from tests.conftest import Agent
from tierpipe.bus.client import Bus
from tierpipe.errors import StorageAuthError
from tierpipe.settings import Settings, load_settings
from tierpipe.storage.s3.store import S3Store
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = pytest.mark.slow


def node_record(settings: Settings) -> dict[str, object] | None:
    """The node's record as the agent stored it (None: none)."""

    async def read() -> dict[str, object] | None:
        async with Bus(settings) as bus:
            try:
                kv = await bus.js.key_value(f"{settings.kv_bucket}-nodes")
                entry = await kv.get(settings.node)
            except Exception:
                return None
            return msgspec.json.decode(entry.value)  # type: ignore[no-any-return]

    return anyio.run(read)


def test_an_agent_advertises_its_roots_and_store_without_credentials(
    settings: Settings, agent: Callable[..., Agent]
) -> None:
    """A running agent keeps its node's record: its roots, store location, pid and a recent
    heartbeat, and no secret. It stores it before it says it is ready: a trainer started then
    finds it (CI: a save right after `agent_ready` did not, and took no warning of its own
    settings differing from the agent's)."""
    running = agent().wait_ready()
    record = node_record(settings)
    assert record is not None, "ready before its node's record was stored"
    assert record["nvme_root"] == settings.nvme_root
    assert record["staging_root"] == settings.staging_root
    assert record["s3_endpoint"] == settings.s3_endpoint
    assert record["s3_bucket"] == settings.s3_bucket
    assert running.proc is not None and record["pid"] == running.proc.pid
    assert time.time() - float(record["heartbeat_ts"]) < 30  # type: ignore[arg-type]
    assert settings.s3_secret_access_key not in str(record)
    assert settings.s3_access_key_id not in record.values()


def test_a_trainer_without_the_nodes_settings_restores_from_the_agents_nvme(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer whose settings name no NVMe root, bucket or endpoint (the env not sourced,
    another working directory) saves and restores from where the node's agent keeps them."""
    agent("nvme-write", "verify", "evict").wait_ready()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    bare = load_settings(
        env={},
        nats_url=settings.nats_url,
        node=settings.node,
        kv_bucket=settings.kv_bucket,
        staging_root=settings.staging_root,
    )
    assert bare.nvme_root != settings.nvme_root
    with Checkpointer(job, rank=0, world_size=1, settings=bare) as ckpt:
        ckpt.save(1, {"w": torch.arange(10.0)}).result(timeout=30)
    with Checkpointer(job, rank=0, world_size=1, settings=bare) as ckpt:
        with structlog.testing.capture_logs() as logs:
            restored = ckpt.restore()
        assert ckpt.settings.nvme_root == settings.nvme_root
        assert (ckpt.settings.s3_endpoint, ckpt.settings.s3_bucket) == (
            settings.s3_endpoint,
            settings.s3_bucket,
        )
    assert restored.step == 1 and restored.source.tier == "nvme"
    assert torch.equal(restored.state["w"], torch.arange(10.0))
    adopted = [e for e in logs if e["event"] == "node_settings_adopted"]
    assert adopted and "nvme_root" in adopted[0]["fields"]
    assert not Path("tierpipe-data").exists()  # nothing under the working directory


def test_explicit_settings_that_differ_from_the_agents_are_kept_and_warned_about(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A trainer that sets its NVMe root explicitly keeps it, and is told the agent's differs."""
    agent("nvme-write", "verify").wait_ready()
    mine = settings.replace(nvme_root=str(tmp_path / "my-nvme"))
    with Checkpointer(job, rank=0, world_size=1, settings=mine) as ckpt:
        with structlog.testing.capture_logs() as logs:
            ckpt.save(1, {"w": torch.ones(4)}).wait_staged(timeout=30)
        assert ckpt.settings.nvme_root == mine.nvme_root
    differ = [e for e in logs if e["event"] == "node_settings_differ"]
    assert differ and differ[0]["log_level"] == "warning"
    assert differ[0]["fields"]["nvme_root"] == [mine.nvme_root, settings.nvme_root]


def test_a_missing_s3_credential_is_called_missing_not_unreachable(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With no key in the settings, the environment or a profile, a request to the store fails
    as a missing credential (permanent), not as an outage."""
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bare = settings.replace(s3_access_key_id=None, s3_secret_access_key=None)

    async def head() -> None:
        async with S3Store(bare) as store:
            await store.head("some/key")

    with pytest.raises(StorageAuthError, match="missing credential"):
        anyio.run(head)
