"""Standalone shard writers: a sealed shard file from a state or a staged image, no agent needed.

Training code saves through `Checkpointer.save()` and the agent's stages; tests, tools and
benchmarks that need a real shard file on disk call `write_shard`. The file is written exactly
as the nvme-write stage writes it (`NvmeStore.write_image`): aligned O_DIRECT writes, fsync,
placed with a link and the directory fsynced. Importing this module imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tierpipe.state import plan_state
from tierpipe.storage.aligned import aligned_buffer
from tierpipe.storage.nvme import NvmeStore, WriteResult
from tierpipe.storage.shard import parse_head

__all__ = ("seal_image", "write_shard")


def write_shard(
    path: str | os.PathLike[str],
    state: Any,
    *,
    job: str,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    node: str = "local",
    epoch: int = 0,
) -> str:
    """Write `state` as a sealed shard file (fsynced, atomically linked into place).

    This is the standalone writer (tests, tools); training code uses `Checkpointer.save()`.

    Returns:
        The header digest as hex.
    """
    plan = plan_state(
        state, job=job, step=step, rank=rank, world_size=world_size, node=node, epoch=epoch
    )
    buf = aligned_buffer(plan.nbytes)  # page-aligned, so the writer can use O_DIRECT
    buf[: len(plan.head)] = plan.head
    plan.copy_into(plan.destinations(torch.frombuffer(buf, dtype=torch.uint8)))
    with memoryview(buf) as view:
        return seal_image(view, os.fspath(path)).header_digest


def seal_image(image: memoryview, path: str) -> WriteResult:
    """Seal one staged image into `path` with default I/O settings (standalone writer)."""
    head = parse_head(image, "<image>", sealed=False)
    final = Path(path).absolute()
    with NvmeStore(final.parent) as store:
        return store.write_image(image, head, final)
