"""Verify stage: `written` -> re-read from the device, check size and every digest -> `verified`.

Reads bypass the page cache (O_DIRECT, else the cache is dropped first) so the check sees what
the device holds, not what was just written. A mismatch publishes `failed` naming the file, the
part and both digests. If the staging copy still holds the shard, the shard is rewritten from
staging once (the writer sets the corrupt file aside) and checked again. Holds the node's verify
lock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from tierpipe.bus.client import Bus
from tierpipe.errors import IntegrityError, ShardFormatError, TierpipeError
from tierpipe.log import bind_io
from tierpipe.names import node_name
from tierpipe.schemas import Event, ShardVerified, ShardWritten, StageFailed
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.staged_image import open_staged
from tierpipe.storage.store import VerifyResult

__all__ = ("KINDS", "STAGE", "Verify", "handle", "open")

STAGE = "verify"
KINDS = ("written",)
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Verify:
    settings: Settings
    node: str
    store: NvmeStore


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[Verify]:
    """Hold the node's verify lock (sweeping the temp files of a killed rewrite)."""
    with NvmeStore.from_settings(settings) as store:
        async with store.lock(STAGE, timeout_s=settings.agent_lock_timeout_s):
            yield Verify(settings, node_name(settings.node), store)


async def handle(ctx: Verify, event: ShardWritten, attempt: int) -> list[Event]:
    """Check the shard as the device holds it; `verified`, preceded by a retryable `failed`
    naming the corruption when the shard had to be rewritten from staging."""
    final = ctx.store.locate(event.job, event.step, event.rank, event.world_size)
    if Path(event.path) != Path(final):
        raise ShardFormatError(event.path, f"not this node's shard path {final}")
    out: list[Event] = []
    result: VerifyResult | None
    try:
        result = await ctx.store.verify(
            final, header_digest=event.header_digest, nbytes=event.nbytes
        )
    except (IntegrityError, ShardFormatError) as corrupt:
        result = await _rewrite(ctx, final, event)
        if result is None:
            raise
        log.warning("shard_rewritten", path=final, error=str(corrupt))
        out.append(
            event.follow(
                StageFailed,
                node=ctx.node,
                stage=STAGE,
                error=type(corrupt).__name__,
                message=f"{corrupt}; rewritten from the staging copy and verified",
                retryable=True,
                attempt=attempt,
            )
        )
    bind_io(result.nbytes, result.seconds, path=result.location, rewritten=bool(out))
    verified = event.follow(
        ShardVerified,
        node=ctx.node,
        path=result.location,
        nbytes=result.nbytes,
        header_digest=result.header_digest,
        seconds=round(result.seconds, 6),
        rewritten=bool(out),
        origin=event.origin,
        staged_ts=event.staged_ts,
        layout=event.layout,
    )
    return [*out, verified]


async def _rewrite(ctx: Verify, final: str, event: ShardWritten) -> VerifyResult | None:
    """Rewrite a corrupt shard from its staging copy once; None if there is no staging copy."""
    staging = ctx.settings.staging_root
    try:
        image = await anyio.to_thread.run_sync(
            open_staged, staging, event.job, event.rank, event.step, event.world_size
        )
    except TierpipeError:
        return None
    if image is None:
        return None
    try:
        # The writer finds the file there corrupt and sets it aside (one kept for forensics).
        written = await ctx.store.write(image, final, rewind_to=event.rewind_to)
    finally:
        with anyio.CancelScope(shield=True):  # unmapping a large slot takes tens of ms
            await anyio.to_thread.run_sync(image.close)
    return await ctx.store.verify(final, header_digest=written.header_digest, nbytes=written.nbytes)
