"""`tierpipe prefetch`: a standby node pulls another node's shards of the newest step in object
storage onto its own NVMe, verified and reported, so its restore reads NVMe."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.conftest import Agent, Events, run_cli
from tierpipe import Checkpointer
from tierpipe.errors import ResourceExhaustedError
from tierpipe.names import shard_relpath
from tierpipe.recovery.prefetch import prefetch
from tierpipe.schemas import ShardFlushed, ShardVerified
from tierpipe.settings import Settings

pytestmark = pytest.mark.slow


def test_a_standby_node_prefetches_a_nodes_shards_and_restores_from_nvme(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    agent().wait_ready()
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, state).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")

    standby = settings.replace(
        node=f"{settings.node}-standby", nvme_root=str(tmp_path / "standby-nvme")
    )
    out = run_cli(standby, "prefetch", "--job", job, "--node", settings.node or "")
    assert out.returncode == 0, out.stderr
    assert f"step 1 of {job}: fetched ranks [0]" in out.stdout
    path = Path(standby.nvme_root, shard_relpath(job, 1, 0, 1))
    assert path.exists()
    events.wait_for(
        lambda e: isinstance(e, ShardVerified) and e.node == standby.node and e.path == str(path),
        kind="verified",
    )
    again = run_cli(standby, "prefetch", "--job", job, "--node", settings.node or "")
    assert "fetched ranks none" in again.stdout and "(1 already there)" in again.stdout

    # The standby takes the node's place: its restore reads its own NVMe copy.
    with Checkpointer(job, rank=0, world_size=1, settings=standby) as ckpt:
        restored = ckpt.restore({"w": torch.zeros(10_000)})
    assert restored.step == 1 and restored.source.tier == "nvme"
    assert torch.equal(restored.state["w"], state["w"])

    out = run_cli(standby, "prefetch", "--job", job, "--node", "nobody")
    assert out.returncode == 2 and "node 'nobody' has no events" in out.stderr


def test_prefetch_short_of_memory_keeps_the_copy_already_there(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefetch that runs out of memory checking the copy already on its NVMe fails with a
    resource error and leaves that copy in place (not judged bad, not fetched again)."""
    agent().wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.arange(10_000)}).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        assert ckpt.all_steps() == [1]  # (once the job state in KV has the flush)
    standby = settings.replace(
        node=f"{settings.node}-standby", nvme_root=str(tmp_path / "standby-nvme")
    )
    anyio.run(partial(prefetch, standby, job, of_node=settings.node, step=1))
    path = Path(standby.nvme_root, shard_relpath(job, 1, 0, 1))
    before = path.stat()

    def no_memory(nbytes: int) -> Any:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr("tierpipe.storage.reader.aligned_buffer", no_memory)
    with pytest.raises(ResourceExhaustedError, match="memory"):
        anyio.run(partial(prefetch, standby, job, of_node=settings.node, step=1))
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
