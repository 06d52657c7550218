"""The node-local NVMe tier: seal staged images into shard files, and verify them from the device.

Writes go to a temp file beside the final path (named by stage, PID and process instance:
`lock.temp_path`), preallocated with `posix_fallocate` (a full disk fails before any byte is
written), written with large aligned O_DIRECT writes at queue depth > 1 while another thread hashes
the same source bytes (a sharded tensor's blob per 1 MiB block too), fsynced, hard-linked into
place (never over an existing file) and the directory fsynced. So a final file is either absent or
complete, and a valid final file is never replaced by another save unless that save supersedes it
(a rewound run's newer timeline); an unreadable or corrupt one is set aside as `.<name>.corrupt`
(see `placement`). Verification re-reads with O_DIRECT (or drops the page cache first where
O_DIRECT is not supported) and hashes while reading (`reader.BlobReader`); a restore reads into the
caller's memory with the same engine (`reader.read_shard`). python-xxhash and os.pread/pwrite
release the GIL, so hashing and I/O overlap on separate cores. The `ShardStore` methods (`write`,
`verify`, `read_into`, `delete`) run the blocking ones (`write_image`, `verify_file`, `remove`) in
a worker thread.

Each agent stage holds `<root>/.agent-<stage>.lock` for its whole life: one agent per node name
and NVMe root (`NvmeStore.lock`, see `lock`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import anyio
import structlog
import xxhash

from tierpipe.errors import (
    IntegrityError,
    NoSpaceError,
    RetryableError,
    ShardFormatError,
    StorageConflictError,
)
from tierpipe.faults import maybe_die
from tierpipe.names import shard_relpath
from tierpipe.schemas import ALIGN, BLOCK_BYTES
from tierpipe.settings import Settings
from tierpipe.storage.aligned import O_DIRECT, aligned_copy, open_direct, pwrite_all
from tierpipe.storage.durable import (
    fallocate,
    free_bytes,
    io_error,
    makedirs_durable,
    remove_durable,
    unlink_quietly,
)
from tierpipe.storage.lock import stage_lock, sweep_dead_temps, temp_path
from tierpipe.storage.placement import judge, place
from tierpipe.storage.reader import (
    BlobReader,
    check_header,
    open_for_read,
    read_head,
    read_head_fd,
    read_shard,
)
from tierpipe.storage.resources import translated
from tierpipe.storage.shard import PREFIX_NBYTES, Head, encode_head, seal_header
from tierpipe.storage.store import BlobSink, ReadBack, StagedShard, VerifyResult

__all__ = ("NvmeStore", "WriteResult")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: str
    nbytes: int
    header_digest: str
    tensors: int
    seconds: float
    #: The final file was already there with this very save (a redelivered event).
    existed: bool

    @property
    def location(self) -> str:
        return self.path


class NvmeStore:
    """Shard files under one root directory on node-local storage."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        direct_io: bool = True,
        read_direct_io: bool | None = None,
        chunk_bytes: int = 8 << 20,
        queue_depth: int = 4,
        reserve_bytes: int = 0,
        fault_point: str = "",
    ) -> None:
        """`direct_io`: O_DIRECT writes and verifies; `read_direct_io`: O_DIRECT `read_into`
        (restores) if True, through the page cache if False, O_DIRECT unless the page cache
        holds the file if None (where the filesystem allows either; `reader.read_shard`)."""
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN} (got {chunk_bytes})")
        self.root = Path(root).absolute()
        self.direct_io = direct_io and bool(O_DIRECT)
        self.read_direct_io = read_direct_io
        self.chunk_bytes = chunk_bytes
        self.queue_depth = queue_depth
        self.reserve_bytes = reserve_bytes
        self.fault_point = fault_point
        #: The stage whose temp files this store writes (set by `lock`).
        self.stage = "writer"
        # One extra thread: the hasher runs beside `queue_depth` concurrent writes.
        self._pool = ThreadPoolExecutor(queue_depth + 1, thread_name_prefix="tierpipe-io")
        self._reader = BlobReader(chunk_bytes=chunk_bytes, queue_depth=queue_depth)

    @classmethod
    def from_settings(cls, settings: Settings) -> NvmeStore:
        """The node's NVMe store as the settings describe it."""
        return cls(
            settings.nvme_root,
            direct_io=settings.direct_io,
            read_direct_io=settings.restore_direct_io,
            chunk_bytes=settings.io_chunk_bytes,
            queue_depth=settings.io_queue_depth,
            reserve_bytes=settings.nvme_reserve_bytes,
            fault_point=settings.fault_point,
        )

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._reader.close()

    def path_for(self, relpath: PurePosixPath) -> Path:
        """The absolute path of a shard key (keys come from `names.shard_relpath`)."""
        if relpath.is_absolute() or ".." in relpath.parts:
            raise ValueError(f"unsafe shard key {relpath}")
        return self.root.joinpath(relpath)

    # --- the ShardStore contract (see `store`)

    def locate(self, job: str, step: int, rank: int, world_size: int) -> str:
        return str(self.path_for(shard_relpath(job, step, rank, world_size)))

    async def write(
        self, source: StagedShard, location: str | os.PathLike[str], *, rewind_to: int | None = None
    ) -> WriteResult:
        """`write_image` of a staged image, checked against its slot (`source.check`)."""
        with source.view() as view:
            return await anyio.to_thread.run_sync(
                lambda: self.write_image(
                    view, source.head, Path(location), check=source.check, rewind_to=rewind_to
                )
            )

    async def verify(
        self, location: str | os.PathLike[str], *, header_digest: str, nbytes: int
    ) -> VerifyResult:
        path = Path(location)
        return await anyio.to_thread.run_sync(
            lambda: self.verify_file(path, header_digest=header_digest, nbytes=nbytes)
        )

    async def read_into(self, location: str, sink: BlobSink, *, nbytes: int) -> ReadBack:
        """`reader.read_shard`, O_DIRECT as `read_direct_io` says."""
        t0 = time.perf_counter()
        head = await anyio.to_thread.run_sync(
            lambda: read_shard(location, sink, nbytes=nbytes, direct_io=self.read_direct_io,
                               queue_depth=self.queue_depth, chunk_bytes=self.chunk_bytes)
        )  # fmt: skip
        return ReadBack(head, time.perf_counter() - t0, None)

    async def delete(self, location: str | os.PathLike[str], *, header_digest: str | None) -> bool:
        """`remove` (None: whatever save the file holds); True once the file is gone."""
        path = Path(location)
        removed = await anyio.to_thread.run_sync(
            lambda: self.remove(path, header_digest=header_digest)
        )
        return removed or not await anyio.Path(path).exists()

    def remove(self, path: Path, *, header_digest: str | None = None) -> bool:
        """Delete a shard file durably (and its step directory once empty).

        Args:
            header_digest: remove only if the file still holds this save (a newer save may have
                replaced it since the caller looked); a file whose head cannot be read is no
                valid save and goes regardless.

        Returns:
            False if the file is absent, or holds another save than `header_digest`.
        """
        if header_digest is not None:
            try:
                held = read_head(path).header_digest.hex()
            except FileNotFoundError:
                return False
            except (ShardFormatError, IntegrityError):
                held = header_digest
            if held != header_digest:
                log.warning(
                    "shard_removal_skipped",
                    path=str(path),
                    reason="holds another save",
                    expected=header_digest,
                    actual=held,
                )
                return False
        return remove_durable(path)

    def free_bytes(self) -> int:
        """Free bytes for unprivileged writers on the NVMe filesystem."""
        return free_bytes(self.root)

    def sweep_temp(self, stage: str | None = None) -> list[str]:
        """Remove temp files left by writers that died mid-write. Returns what was removed.

        Call it holding `stage`'s lock: then a temp of `stage` from another instance is dead for
        sure (one live holder per stage), even when its PID is ours (a restarted container).
        Temps of other stages go only once their PID is dead.
        """
        return sweep_dead_temps(self.root, stage or self.stage)

    # --- one agent per node

    @contextlib.asynccontextmanager
    async def lock(self, stage: str, *, timeout_s: float) -> AsyncIterator[None]:
        """Hold `<root>/.agent-<stage>.lock` exclusively while the block runs, and first
        sweep the temp files the stage's earlier instances left (under the lock they are dead
        for sure, whatever their PID).

        The holder writes "pid, host, start time" into the file. While another process holds
        it, this logs `agent_lock_busy` once and polls for up to `timeout_s` (a rolling
        update's old agent may still be draining).

        Raises:
            AgentLockedError: still held by another process after `timeout_s`.
        """
        async with stage_lock(self.root, stage, timeout_s=timeout_s):
            self.stage = stage
            await anyio.to_thread.run_sync(self.sweep_temp, stage)
            yield

    # --- write

    def write_image(
        self,
        image: memoryview,
        head: Head,
        final: Path,
        *,
        check: Callable[[], None] | None = None,
        rewind_to: int | None = None,
    ) -> WriteResult:
        """Seal a staged (unsealed) image into `final`, atomically and durably.

        The file is placed with a hard link, which never replaces anything. If `final` exists:
        this very save there (a redelivery) is left alone and reported (`existed`); an
        unreadable, misplaced or corrupt file is set aside as `.<name>.corrupt`; a valid save
        of an abandoned timeline (older epoch, and this save's run rewound to before this step:
        `rewind_to`) is removed; any other valid save stays and the write fails.

        Args:
            check: called once every byte is copied and hashed, before the file is placed;
                raises if the source changed meanwhile (`StagedImage.check`).
            rewind_to: the save's `ShardStaged.rewind_to`.

        Raises:
            NoSpaceError: the filesystem cannot take the file (nothing final is created).
            RetryableError: an I/O error while writing (the temp file is removed).
            StorageConflictError: `final` holds another valid save this one does not supersede.
            StagingGoneError: (from `check`) the source was reused mid-copy; nothing placed.
        """
        t0 = time.perf_counter()
        verdict, found = judge(
            final, head.header, rewind_to, reader=self._reader, direct_io=self.direct_io
        )
        if verdict == "same":
            return WriteResult(
                str(final),
                head.file_nbytes,
                found,
                len(head.header.tensors),
                time.perf_counter() - t0,
                True,
            )
        if verdict == "conflict":
            raise StorageConflictError(str(final), found)
        if len(image) < head.file_nbytes:
            raise ShardFormatError(
                "<staging image>", f"{len(image)} bytes, header says {head.file_nbytes}"
            )
        self._check_space(head.file_nbytes)
        makedirs_durable(final.parent)
        tmp = temp_path(final, self.stage)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = open_direct(tmp, flags, 0o644, direct=self.direct_io)
        try:
            fallocate(fd, head.file_nbytes, final.parent, self.reserve_bytes)
            hashing = self._pool.submit(_blob_digests, image, head)
            chunks = [
                (off, image[off : min(off + self.chunk_bytes, head.file_nbytes)])
                for off in range(head.data_offset, head.file_nbytes, self.chunk_bytes)
            ]
            if chunks:  # alone first: it settles whether O_DIRECT works for this buffer
                pwrite_all(fd, chunks[0][1], chunks[0][0], may_fall_back=True)
                maybe_die("nvme-write:mid-write", self.fault_point)
            writes = [self._pool.submit(pwrite_all, fd, data, off) for off, data in chunks[1:]]
            _wait_all([*writes, hashing])
            if check is not None:
                check()  # every byte read from the source is still this save's
            header = seal_header(head.header, *hashing.result())
            sealed = encode_head(header, sealed=True)
            if len(sealed) != head.data_offset:  # digests are fixed-size, so this cannot move
                raise AssertionError("sealed head changed size")
            pwrite_all(fd, aligned_copy(sealed), 0, may_fall_back=True)
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise io_error(e, str(final), head.file_nbytes, self.reserve_bytes) from e
            raise
        os.close(fd)
        maybe_die("nvme-write:after-fsync", self.fault_point)
        try:
            existing = place(
                tmp,
                final,
                header,
                rewind_to,
                reader=self._reader,
                direct_io=self.direct_io,
                fault_point=self.fault_point,
            )
        except BaseException as e:
            unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise io_error(e, str(final), head.file_nbytes, self.reserve_bytes) from e
            raise
        digest = existing or xxhash.xxh3_128_hexdigest(
            sealed[PREFIX_NBYTES : PREFIX_NBYTES + len(head.header_bytes)]
        )
        return WriteResult(
            str(final),
            head.file_nbytes,
            digest,
            len(header.tensors),
            time.perf_counter() - t0,
            existing is not None,
        )

    def _check_space(self, nbytes: int) -> None:
        free = self.free_bytes()
        if free - nbytes < self.reserve_bytes:
            raise NoSpaceError(str(self.root), nbytes, free, self.reserve_bytes)

    # --- verify

    def verify_file(self, path: Path, *, header_digest: str, nbytes: int) -> VerifyResult:
        """Re-read `path` from the device and check its size, header digest and every blob digest.

        Raises:
            ShardFormatError: missing, truncated or garbled.
            IntegrityError: a digest does not match (names the file, the part, both digests).
            ResourceExhaustedError: this process ran out of memory, file descriptors or threads
                (no verdict on the file).
        """
        t0 = time.perf_counter()
        try:
            with translated(str(path)):
                fd = open_for_read(path, direct_io=self.direct_io)
        except FileNotFoundError as e:
            raise ShardFormatError(str(path), "file is missing") from e
        try:
            with translated(str(path)):
                size = os.fstat(fd).st_size
                if size != nbytes:
                    raise ShardFormatError(str(path), f"{size} bytes on disk, {nbytes} written")
                head = read_head_fd(fd, str(path), size)
                check_header(head, header_digest, str(path))
                self._reader.check(fd, head, str(path))
        except OSError as e:
            raise RetryableError(f"cannot read {path}: {e}") from e
        finally:
            os.close(fd)
        return VerifyResult(str(path), size, header_digest, time.perf_counter() - t0)


def _blob_digests(image: memoryview, head: Head) -> tuple[list[bytes], list[bytes]]:
    """Every blob's xxh3-128, and the block digests of those that carry them (a sharded
    tensor's: `shard.block_digests`), in one pass: each block is hashed twice while it is
    in cache."""
    base = head.data_offset
    digests, blocks = [], []
    for b in head.header.blobs:
        data = image[base + b.offset : base + b.offset + b.nbytes]
        if not b.blocks:
            digests.append(xxhash.xxh3_128_digest(data))
            blocks.append(b"")
            continue
        whole, per_block = xxhash.xxh3_128(), []
        for at in range(0, b.nbytes, BLOCK_BYTES):
            block = data[at : at + BLOCK_BYTES]
            whole.update(block)
            per_block.append(xxhash.xxh3_64_digest(block))
        digests.append(whole.digest())
        blocks.append(b"".join(per_block))
    return digests, blocks


def _wait_all(futures: list[Future[None] | Future[tuple[list[bytes], list[bytes]]]]) -> None:
    """Wait for every write and the hashing; then raise the first failure, if any."""
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
