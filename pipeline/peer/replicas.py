"""The replicas a node holds for its partners: files under `<nvme_root>/.peer/`, one per shard.

A replica is the same sealed file as the verified copy it was made from, at the shard's own key
below the `.peer` folder (`.peer/<job>/step-<step>/rank-<rank>-of-<world>.shard`, built by
`names.shard_relpath` from validated parts, so no request names a path). The folder's name is
no job name (`names.job_dirs` skips it), so the node's own copies, their retention and their
jobs never see replicas.

`land` writes one into a temp file beside the final path (preallocated: a full disk fails before
the first byte) while it arrives, and checks it on the bytes received as they pass (`landing`:
one thread reads, another writes, so receiving and writing overlap): the head, the header
digest against the `verified` event's, the shard's identity, then every blob's xxh3-128 digest.
A wrong byte fails the copy as soon as its blob ends. Once every byte came and every digest
matched, the file is fsynced, renamed into place and the directory fsynced. So a final replica
is complete, its every digest checked on the bytes received, and durable, or absent; one that
fails any check is removed and never published. It is not re-read from the device before it is
placed (that re-read cost as much as the copy itself): a restore checks every digest again as
it reads the replica back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from tierpipe.errors import TierpipeError
from tierpipe.names import job_dirs, shard_relpath
from tierpipe.peer.landing import Landing, ReadInto, receive
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
        read_into: ReadInto,
        final: Path,
        *,
        nbytes: int,
        header_digest: str,
        identity: ShardIdentity | None = None,
        abort: Callable[[], None] = lambda: None,
    ) -> Landed:
        """Write the `nbytes` bytes `read_into` reads as the replica at `final`, durably,
        checking every digest on the way, and place it once all passed and its header names the
        shard `identity` names (if given) (see the module docstring).

        Args:
            read_into: a blocking read into a buffer (the bytes read; 0 at the end), called in
                a worker thread (e.g. `http.client.HTTPResponse.readinto`); it raises the
                project's errors.
            abort: makes a `read_into` blocked in another thread return (e.g. shuts its
                socket down); called when the copy fails or is cancelled.

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
                landing = Landing(fd, str(final), nbytes, header_digest, identity)
                await receive(read_into, landing, abort)
                await anyio.to_thread.run_sync(os.fsync, fd)
            except OSError as e:
                raise io_error(e, str(final), nbytes, self.nvme.reserve_bytes) from e
            finally:
                os.close(fd)
            await anyio.to_thread.run_sync(_place, tmp, final)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(unlink_quietly, tmp)
            raise
        return Landed(final, nbytes, time.perf_counter() - t0, False)

    async def remove(self, replica: Replica) -> bool:
        """Remove `replica` durably, if it still holds that save."""
        return await self.nvme.delete(replica.path, header_digest=replica.header_digest)


def _place(tmp: Path, final: Path) -> None:
    """Rename the verified temp file into place (over an older replica of the shard: a newer
    save supersedes it) and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)
