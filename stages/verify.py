"""Verify stage: `written` -> re-read from the device, check size and every digest -> `verified`.

Reads bypass the page cache (O_DIRECT, else the cache is dropped first) so the check sees what
the device holds, not what was just written. A mismatch publishes `failed` naming the file, the
part and both digests. If the staging copy still holds the shard, the shard is rewritten from
staging once (the writer sets the corrupt file aside) and checked again. Holds the node's verify
lock.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus

from tierpipe.bus import Bus
from tierpipe.errors import IntegrityError, ShardFormatError, TierpipeError
from tierpipe.names import node_name, shard_relpath
from tierpipe.runner import serve
from tierpipe.schemas import ShardVerified, ShardWritten, StageFailed
from tierpipe.settings import Settings
from tierpipe.staging import open_staged
from tierpipe.storage.nvme import NvmeStore, VerifyResult

__all__ = ["STAGE", "run"]

STAGE = "verify"
log = structlog.get_logger(__name__)


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)
    async with AsyncExitStack() as stack:
        store = stack.enter_context(NvmeStore.from_settings(settings))
        await stack.enter_async_context(store.lock(STAGE, timeout_s=settings.agent_lock_timeout_s))
        await anyio.to_thread.run_sync(store.sweep_temp, STAGE)  # a killed rewrite's

        async def handle(event: ShardWritten, attempt: int) -> None:
            final = store.path_for(
                shard_relpath(event.job, event.step, event.rank, event.world_size)
            )
            if Path(event.path) != final:
                raise ShardFormatError(event.path, f"not this node's shard path {final}")
            rewritten = False
            try:
                result = await anyio.to_thread.run_sync(_verify, store, final, event)
            except (IntegrityError, ShardFormatError) as corrupt:
                result = await anyio.to_thread.run_sync(
                    _rewrite, store, settings.staging_root, final, event
                )
                if result is None:
                    raise
                rewritten = True
                await bus.publish(
                    event.follow(
                        StageFailed,
                        node=node,
                        stage=STAGE,
                        error=type(corrupt).__name__,
                        message=f"{corrupt}; rewritten from the staging copy and verified",
                        retryable=True,
                        attempt=attempt,
                    )
                )
                log.warning("shard_rewritten", path=str(final), error=str(corrupt))
            await bus.publish(
                event.follow(
                    ShardVerified,
                    node=node,
                    path=result.path,
                    nbytes=result.nbytes,
                    header_digest=result.header_digest,
                    seconds=round(result.seconds, 6),
                    rewritten=rewritten,
                    origin=event.origin,
                )
            )
            log.info(
                "shard_verified",
                path=result.path,
                nbytes=result.nbytes,
                rewritten=rewritten,
                seconds=round(result.seconds, 4),
                mib_s=round(result.nbytes / 2**20 / max(result.seconds, 1e-9), 1),
            )

        await serve(
            bus,
            settings,
            stage=STAGE,
            node=node,
            kinds=("written",),
            handler=handle,
            task_status=task_status,
        )


def _verify(store: NvmeStore, final: Path, event: ShardWritten) -> VerifyResult:
    return store.verify(final, header_digest=event.header_digest, nbytes=event.nbytes)


def _rewrite(
    store: NvmeStore, staging_root: str, final: Path, event: ShardWritten
) -> VerifyResult | None:
    """Rewrite a corrupt shard from its staging copy once; None if there is no staging copy."""
    try:
        image = open_staged(staging_root, event.job, event.rank, event.step, event.world_size)
    except TierpipeError:
        return None
    if image is None:
        return None
    try:
        # The writer finds the file there corrupt and sets it aside (one kept for forensics).
        with image.view() as view:
            written = store.write_image(
                view, image.head, final, check=image.check, rewind_to=event.rewind_to
            )
    finally:
        image.close()
    return store.verify(final, header_digest=written.header_digest, nbytes=written.nbytes)
