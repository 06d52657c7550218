"""The replicas a node holds for its partners: files under `<nvme_root>/.peer/`, one per shard.

A replica is the same sealed file as the verified copy it was made from, at the shard's own key
below the `.peer` folder (`.peer/<job>/step-<step>/rank-<rank>-of-<world>.shard`, built by
`names.shard_relpath` from validated parts, so no request names a path). The folder's name is
no job name (`names.job_dirs` skips it), so the node's own copies, their retention and their
jobs never see replicas.

`land` writes one as the NVMe writer writes a shard: into a temp file beside the final path
(preallocated: a full disk fails before the first byte), fsynced; then re-read from the device
and every digest checked (`NvmeStore.verify_file`) before it is renamed into place and the
directory fsynced. So a final replica is complete and verified, or absent; one that fails any
check is removed and never published.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio

from tierpipe.errors import IntegrityError, ShardFormatError, TierpipeError
from tierpipe.names import job_dirs, shard_relpath
from tierpipe.schemas import ShardIdentity
from tierpipe.settings import Settings
from tierpipe.storage.durable import (
    fallocate,
    fsync_dir,
    io_error,
    makedirs_durable,
    unlink_quietly,
)
from tierpipe.storage.lock import temp_path
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head

__all__ = ("FOLDER", "Landed", "Replica", "Replicas")

#: The folder of replicas under the NVMe root.
FOLDER = ".peer"
#: The temp files of replicas being received (`storage.lock.temp_path`).
TEMP_STAGE = "replicate"
#: Received bytes are written in batches of about this size (one thread hop each).
_BATCH_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica held here."""

    job: str
    step: int
    rank: int
    world_size: int
    epoch: int
    header_digest: str
    nbytes: int
    path: Path


@dataclass(frozen=True, slots=True)
class Landed:
    """A replica written and verified (or found already there: `existed`)."""

    path: Path
    nbytes: int
    seconds: float
    existed: bool


class Replicas:
    """The replicas under one NVMe root (their verify and removal go through `nvme`)."""

    def __init__(self, nvme: NvmeStore) -> None:
        self.nvme = nvme
        self.root = nvme.root / FOLDER

    @classmethod
    def from_settings(cls, settings: Settings) -> Replicas:
        return cls(NvmeStore.from_settings(settings))

    def close(self) -> None:
        self.nvme.close()

    def path(self, job: str, step: int, rank: int, world_size: int) -> Path:
        """Where the replica of a shard lies (the parts are validated: no traversal)."""
        return self.root / shard_relpath(job, step, rank, world_size)

    def held(self, job: str) -> list[Replica]:
        """The replicas of `job` held here, oldest step first (unreadable ones skipped)."""
        out = []
        for path in sorted((self.root / job).glob("step-*/rank-*.shard")):
            try:
                head = read_head(path)
            except (OSError, TierpipeError):
                continue
            h = head.header
            if h.job != job or path != self.path(h.job, h.step, h.rank, h.world_size):
                continue  # not at its own key: never a replica of that shard
            digest, nbytes = head.header_digest.hex(), path.stat().st_size
            out.append(Replica(h.job, h.step, h.rank, h.world_size, h.epoch, digest, nbytes, path))
        return out

    def jobs(self) -> list[str]:
        """The jobs with replicas here."""
        return sorted(job_dirs(self.root))

    def digest_at(self, path: Path) -> str | None:
        """The header digest of the sealed file at `path` (None: none, or unreadable)."""
        try:
            return read_head(path).header_digest.hex()
        except (OSError, TierpipeError):
            return None

    async def land(
        self,
        chunks: AsyncIterator[bytes],
        final: Path,
        *,
        nbytes: int,
        header_digest: str,
        identity: ShardIdentity | None = None,
    ) -> Landed:
        """Write the `nbytes` bytes `chunks` yields as the replica at `final`, durably, and
        place it once the device's copy passed every check (see the module docstring) and its
        header names the shard `identity` names (if given).

        Raises:
            NoSpaceError: the NVMe cannot take it (nothing is left behind).
            ShardFormatError: fewer or more bytes came, or the file is garbled.
            IntegrityError: a digest does not match (the received file is removed).
            RetryableError: an I/O error.
        """
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(makedirs_durable, final.parent)
        tmp = temp_path(final, TEMP_STAGE)
        fd = await anyio.to_thread.run_sync(
            lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        )
        try:
            try:
                await anyio.to_thread.run_sync(
                    fallocate, fd, nbytes, final.parent, self.nvme.reserve_bytes
                )
                got = await _write_all(fd, chunks, nbytes, str(final))
                if got != nbytes:
                    raise ShardFormatError(str(final), f"{got} bytes received, {nbytes} expected")
                await anyio.to_thread.run_sync(os.fsync, fd)
            except OSError as e:
                raise io_error(e, str(final), nbytes, self.nvme.reserve_bytes) from e
            finally:
                os.close(fd)
            await self.nvme.verify(tmp, header_digest=header_digest, nbytes=nbytes)
            if identity is not None:
                await anyio.to_thread.run_sync(_check_identity, tmp, identity)
            await anyio.to_thread.run_sync(_place, tmp, final)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(unlink_quietly, tmp)
            raise
        return Landed(final, nbytes, time.perf_counter() - t0, False)

    async def remove(self, replica: Replica) -> bool:
        """Remove `replica` durably, if it still holds that save."""
        return await self.nvme.delete(replica.path, header_digest=replica.header_digest)


async def _write_all(fd: int, chunks: AsyncIterator[bytes], limit: int, where: str) -> int:
    """Write what `chunks` yields at the start of `fd`, in batches; the bytes written (a source
    sending more than `limit` is refused as soon as it does)."""
    batch: list[bytes] = []
    pending = written = 0
    async for chunk in chunks:
        if written + pending + len(chunk) > limit:
            raise ShardFormatError(where, f"more than the {limit} bytes expected")
        batch.append(chunk)
        pending += len(chunk)
        if pending >= _BATCH_BYTES:
            written += await anyio.to_thread.run_sync(_pwritev, fd, batch, written)
            batch, pending = [], 0
    if batch:
        written += await anyio.to_thread.run_sync(_pwritev, fd, batch, written)
    return written


def _pwritev(fd: int, buffers: list[bytes], offset: int) -> int:
    """Write every buffer at `offset` (all of it, through short writes)."""
    total = sum(map(len, buffers))
    done = 0
    views = [memoryview(b) for b in buffers]
    while done < total:
        n = os.pwritev(fd, views, offset + done)
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def _check_identity(path: Path, want: ShardIdentity) -> None:
    h = read_head(path).header
    got = (h.job, h.step, h.rank, h.world_size, h.epoch)
    expected = (want.job, want.step, want.rank, want.world_size, want.epoch)
    if got != expected:
        raise IntegrityError(str(path), "identity (job, step, rank, world, epoch)",
                             str(expected), str(got))  # fmt: skip


def _place(tmp: Path, final: Path) -> None:
    """Rename the verified temp file into place (over an older replica of the shard: a newer
    save supersedes it) and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)
