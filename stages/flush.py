"""Flush stage: `verified` -> upload to object storage, throttled -> `flushed`.

The shard goes up as a checksummed multipart upload streamed from the NVMe file
(`S3Store.upload`); the runner keeps the message alive with heartbeats during long uploads. A store
outage is retryable (nak with growing delay; the NVMe copy stays, since only `flushed` lets
retention remove it); refused credentials are permanent. On start, multipart uploads this node
left behind (a killed worker's) are aborted.

The upload rate is `flush_max_bytes_per_s`, changed at run time by `FlushControl` messages on
`tp.ctl.flush` (every node) or `tp.ctl.flush.<node>`; the newest of those is applied at start too,
so a restarted worker keeps the rate the job asked for.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from pipeline.bus import Bus
from pipeline.errors import RetryableError, ShardFormatError, TierpipeError
from pipeline.names import CONTROL_FLUSH, node_name, shard_relpath
from pipeline.runner import serve
from pipeline.settings import Settings
from pipeline.storage.nvme import NvmeStore
from pipeline.storage.s3 import S3Store
from pipeline.throttle import Throttle
from schemas import FlushControl, ShardFlushed, ShardVerified

__all__ = ["STAGE", "apply_control", "run"]

STAGE = "flush"
log = structlog.get_logger(__name__)
_control_decoder = msgspec.json.Decoder(FlushControl)


def apply_control(throttle: Throttle, control: FlushControl) -> None:
    match control.action:
        case "rate":
            throttle.set_rate(control.rate_bytes_per_s or None)
        case "pause":
            throttle.pause()
        case "resume":
            throttle.resume()
    log.info("flush_control_applied", action=control.action, rate_bytes_per_s=throttle.rate,
             paused=throttle.paused)  # fmt: skip


async def run(
    settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    node = node_name(settings.node)
    throttle = Throttle(settings.flush_max_bytes_per_s or None)
    subjects = [CONTROL_FLUSH, f"{CONTROL_FLUSH}.{node}"]
    with NvmeStore.from_settings(settings) as nvme:
        async with (
            nvme.lock(STAGE, timeout_s=settings.agent_lock_timeout_s),  # one agent per node
            S3Store(settings, throttle=throttle) as s3,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(_abort_orphans, s3, nvme, settings)
            latest = [c for c in [await bus.last_raw(s) for s in subjects] if c is not None]
            for _, data in sorted(latest):  # the newest command wins
                _apply(throttle, data)

            async def on_control(msg: object) -> None:
                _apply(throttle, msg.data)  # type: ignore[attr-defined]

            for subject in subjects:
                await bus.subscribe(subject, on_control)

            async def handle(event: ShardVerified, attempt: int) -> None:
                relpath = shard_relpath(event.job, event.step, event.rank, event.world_size)
                path = nvme.path_for(relpath)
                if Path(event.path) != path:
                    raise ShardFormatError(event.path, f"not this node's shard path {path}")
                if not await anyio.Path(path).exists():
                    raise ShardFormatError(event.path, "no longer on NVMe (evicted unflushed?)")
                done = await s3.upload(
                    path,
                    s3.key_for(relpath),
                    header_digest=event.header_digest,
                    node=node,
                    epoch=event.epoch,
                    step=event.step,
                    rewind_to=event.rewind_to,
                )
                await bus.publish(
                    event.follow(
                        ShardFlushed,
                        node=node,
                        bucket=done.bucket,
                        key=done.key,
                        etag=done.etag,
                        checksum=done.checksum,
                        header_digest=event.header_digest,
                        nbytes=done.nbytes,
                        seconds=round(done.seconds, 6),
                    )
                )
                log.info(
                    "shard_flushed",
                    key=done.key,
                    nbytes=done.nbytes,
                    existed=done.existed,
                    seconds=round(done.seconds, 4),
                    mib_s=round(done.nbytes / 2**20 / max(done.seconds, 1e-9), 1),
                )

            await serve(
                bus,
                settings,
                stage=STAGE,
                node=node,
                kinds=("verified",),
                handler=handle,
                task_status=task_status,
            )


async def _abort_orphans(s3: S3Store, nvme: NvmeStore, settings: Settings) -> None:
    """Abort uploads a killed worker of this node left behind; keep trying through an outage
    (uploads go on meanwhile: each one aborts earlier attempts at its own key anyway)."""
    delay = settings.retry_base_s
    while True:
        try:
            await s3.abort_orphans(
                lambda key: _owned(nvme, s3, key), max_age_s=settings.orphan_upload_max_age_s
            )
            return
        except RetryableError as e:
            log.warning("orphan_sweep_deferred", error=str(e), retry_s=delay)
        except TierpipeError as e:
            log.error("orphan_sweep_failed", error=str(e))
            return
        await anyio.sleep(delay)
        delay = min(delay * 2, settings.retry_max_s)


def _apply(throttle: Throttle, data: bytes) -> None:
    try:
        apply_control(throttle, _control_decoder.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        log.warning("flush_control_rejected", error=str(e), body=data[:200])


def _owned(nvme: NvmeStore, s3: S3Store, key: str) -> bool:
    """An upload is this node's if the shard it uploads lives on this node's NVMe."""
    relpath = key[len(s3.prefix) + 1 :] if s3.prefix else key
    try:
        return nvme.path_for(PurePosixPath(relpath)).exists()
    except ValueError:
        return False
