"""The node-local NVMe tier: seal staged images into shard files, and verify them from the device.

Writes go to `.<name>.<pid>.tmp` beside the final path, preallocated with `posix_fallocate` (a full
disk fails before any byte is written), written with large aligned O_DIRECT writes at queue depth
> 1 while another thread hashes the same source bytes, fsynced, renamed into place and the
directory fsynced. So a final file is either absent or complete. Verification re-reads with
O_DIRECT (or drops the page cache first where O_DIRECT is not supported) and hashes while reading.
All blocking work runs in this store's thread pool; python-xxhash and os.pread/pwrite release the
GIL, so hashing and I/O overlap on separate cores.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog
import xxhash

from pipeline.errors import IntegrityError, NoSpaceError, RetryableError, ShardFormatError
from pipeline.settings import Settings
from pipeline.shard import (
    PREFIX_NBYTES,
    Head,
    encode_head,
    parse_head,
    parse_prefix,
    seal_header,
)
from schemas import ALIGN, ShardHeader

__all__ = [
    "NvmeStore",
    "VerifyResult",
    "WriteResult",
    "open_for_read",
    "read_head",
    "read_head_fd",
    "seal_image",
]

log = structlog.get_logger(__name__)

_TMP = re.compile(r"^\..+\.(\d+)\.tmp$")
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: str
    nbytes: int
    header_digest: str
    tensors: int
    seconds: float
    #: The final file was already there with this very save (a redelivered event).
    existed: bool


@dataclass(frozen=True, slots=True)
class VerifyResult:
    path: str
    nbytes: int
    header_digest: str
    seconds: float


class NvmeStore:
    """Shard files under one root directory on node-local storage."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        direct_io: bool = True,
        chunk_bytes: int = 8 << 20,
        queue_depth: int = 4,
        reserve_bytes: int = 0,
    ) -> None:
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN} (got {chunk_bytes})")
        self.root = Path(root).absolute()
        self.direct_io = direct_io and bool(_O_DIRECT)
        self.chunk_bytes = chunk_bytes
        self.queue_depth = queue_depth
        self.reserve_bytes = reserve_bytes
        # One extra thread: the hasher runs beside `queue_depth` concurrent reads or writes.
        self._pool = ThreadPoolExecutor(queue_depth + 1, thread_name_prefix="tierpipe-io")
        # Aligned read buffers, allocated once: fresh memory costs page faults on every verify.
        self._read_bufs: list[mmap.mmap] = []
        self._read_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> NvmeStore:
        """The node's NVMe store as the settings describe it."""
        return cls(
            settings.nvme_root,
            direct_io=settings.direct_io,
            chunk_bytes=settings.io_chunk_bytes,
            queue_depth=settings.io_queue_depth,
            reserve_bytes=settings.nvme_reserve_bytes,
        )

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for buf in self._read_bufs:
            buf.close()
        self._read_bufs.clear()

    def path_for(self, relpath: PurePosixPath) -> Path:
        """The absolute path of a shard key (keys come from `names.shard_relpath`)."""
        if relpath.is_absolute() or ".." in relpath.parts:
            raise ValueError(f"unsafe shard key {relpath}")
        return self.root.joinpath(relpath)

    def remove(self, path: Path) -> bool:
        """Delete a shard file durably (and its step directory once empty). False if absent."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        _fsync_dir(path.parent)
        with contextlib.suppress(OSError):  # not empty: other ranks still there
            path.parent.rmdir()
            _fsync_dir(path.parent.parent)
        return True

    def free_bytes(self) -> int:
        """Free bytes for unprivileged writers on the NVMe filesystem."""
        directory = self.root
        while not directory.exists():
            directory = directory.parent
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize

    def sweep_temp(self) -> list[str]:
        """Remove temp files left by writers that died mid-write. Returns what was removed."""
        removed = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                m = _TMP.match(name)
                if m and not _pid_alive(int(m.group(1))):
                    path = os.path.join(dirpath, name)
                    try:
                        os.unlink(path)
                        removed.append(path)
                    except FileNotFoundError:
                        pass
        if removed:
            log.info("temp_files_swept", count=len(removed), root=str(self.root))
        return removed

    # --- write

    def write_image(
        self, image: memoryview, head: Head, final: Path, *, force: bool = False
    ) -> WriteResult:
        """Seal a staged (unsealed) image into `final`, atomically and durably.

        Idempotent: if `final` already holds this very save, nothing is written (unless
        `force`: the file there is known to be bad).

        Raises:
            NoSpaceError: the filesystem cannot take the file (nothing final is created).
            RetryableError: an I/O error while writing (the temp file is removed).
        """
        t0 = time.perf_counter()
        existing = None if force else self._existing(final, head.header)
        if existing is not None:
            return WriteResult(
                str(final),
                head.file_nbytes,
                existing,
                len(head.header.tensors),
                time.perf_counter() - t0,
                True,
            )
        if len(image) < head.file_nbytes:
            raise ShardFormatError(
                "<staging image>", f"{len(image)} bytes, header says {head.file_nbytes}"
            )
        self._check_space(head.file_nbytes)
        _makedirs_durable(final.parent)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        fd = self._create(tmp)
        try:
            _fallocate(fd, head.file_nbytes, final.parent, self.reserve_bytes)
            hashing = self._pool.submit(_blob_digests, image, head)
            chunks = [
                (off, image[off : min(off + self.chunk_bytes, head.file_nbytes)])
                for off in range(head.data_offset, head.file_nbytes, self.chunk_bytes)
            ]
            if chunks:  # alone first: it settles whether O_DIRECT works for this buffer
                _pwrite_all(fd, chunks[0][1], chunks[0][0], may_fall_back=True)
            writes = [self._pool.submit(_pwrite_all, fd, data, off) for off, data in chunks[1:]]
            _wait_all([*writes, hashing])
            header = seal_header(head.header, hashing.result())
            sealed = encode_head(header, sealed=True)
            if len(sealed) != head.data_offset:  # digests are fixed-size, so this cannot move
                raise AssertionError("sealed head changed size")
            _pwrite_all(fd, _aligned_copy(sealed), 0, may_fall_back=True)
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            _unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise _io_error(e, str(final), head.file_nbytes, self.reserve_bytes) from e
            raise
        os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        digest = xxhash.xxh3_128_hexdigest(
            sealed[PREFIX_NBYTES : PREFIX_NBYTES + len(head.header_bytes)]
        )
        return WriteResult(
            str(final),
            head.file_nbytes,
            digest,
            len(header.tensors),
            time.perf_counter() - t0,
            False,
        )

    def _existing(self, final: Path, header: ShardHeader) -> str | None:
        """Header digest of `final` if it holds this very save (same identity, time and layout)."""
        try:
            head = read_head(final, direct_io=False)
        except FileNotFoundError:
            return None
        except (ShardFormatError, IntegrityError) as e:
            log.warning("existing_shard_replaced", path=str(final), error=str(e))
            return None
        old = head.header
        same = (
            old.job,
            old.step,
            old.rank,
            old.world_size,
            old.created,
            old.tree,
            old.tensors,
        ) == (
            header.job,
            header.step,
            header.rank,
            header.world_size,
            header.created,
            header.tree,
            header.tensors,
        ) and [(b.offset, b.nbytes) for b in old.blobs] == [
            (b.offset, b.nbytes) for b in header.blobs
        ]
        if not same:
            log.warning("existing_shard_replaced", path=str(final), reason="different save")
            return None
        return head.header_digest.hex()

    def _check_space(self, nbytes: int) -> None:
        free = self.free_bytes()
        if free - nbytes < self.reserve_bytes:
            raise NoSpaceError(str(self.root), nbytes, free, self.reserve_bytes)

    def _create(self, path: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if self.direct_io:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT
                    raise
        return os.open(path, flags, 0o644)

    # --- verify

    def verify(self, path: Path, *, header_digest: str, nbytes: int) -> VerifyResult:
        """Re-read `path` from the device and check its size, header digest and every blob digest.

        Raises:
            ShardFormatError: missing, truncated or garbled.
            IntegrityError: a digest does not match (names the file, the part, both digests).
        """
        t0 = time.perf_counter()
        try:
            fd = open_for_read(path, direct_io=self.direct_io)
        except FileNotFoundError as e:
            raise ShardFormatError(str(path), "file is missing") from e
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ShardFormatError(str(path), f"{size} bytes on disk, {nbytes} written")
            head = read_head_fd(fd, str(path), size)
            actual = head.header_digest.hex()
            if actual != header_digest:
                raise IntegrityError(str(path), "header", header_digest, actual)
            digests = self._hash_file(fd, head, str(path))
        except OSError as e:
            raise RetryableError(f"cannot read {path}: {e}") from e
        finally:
            os.close(fd)
        names = _blob_names(head.header)
        for i, (blob, got) in enumerate(zip(head.header.blobs, digests, strict=True)):
            if blob.digest != got:
                raise IntegrityError(str(path), names[i], blob.digest.hex(), got.hex())
        return VerifyResult(str(path), size, header_digest, time.perf_counter() - t0)

    def _hash_file(self, fd: int, head: Head, path: str) -> list[bytes]:
        """Read the data region at queue depth `queue_depth` and hash it in order, overlapped."""
        chunk = self.chunk_bytes
        offsets = list(range(head.data_offset, head.file_nbytes, chunk))
        with self._read_lock:
            if not self._read_bufs:
                self._read_bufs = [mmap.mmap(-1, chunk) for _ in range(self.queue_depth)]
            bufs = self._read_bufs[: max(1, min(self.queue_depth, len(offsets)))]
            return self._hash_with(fd, head, path, offsets, bufs)

    def _hash_with(
        self, fd: int, head: Head, path: str, offsets: list[int], bufs: list[mmap.mmap]
    ) -> list[bytes]:
        hasher = _BlobHasher(head)
        pending: dict[int, Future[int]] = {}
        try:
            for i in range(min(len(bufs), len(offsets))):
                pending[i] = self._pool.submit(
                    _pread_into, fd, bufs[i], offsets[i], head.file_nbytes
                )
            for i, off in enumerate(offsets):
                n = pending.pop(i).result()
                buf = bufs[i % len(bufs)]
                with memoryview(buf) as mv:
                    hasher.feed(off - head.data_offset, mv[:n])
                if i + len(bufs) < len(offsets):
                    j = i + len(bufs)
                    pending[j] = self._pool.submit(
                        _pread_into, fd, buf, offsets[j], head.file_nbytes
                    )
        finally:
            for f in pending.values():
                f.cancel()
                if not f.cancelled():
                    f.exception()
        if hasher.missing():
            raise ShardFormatError(path, "truncated data region")
        return hasher.digests()


def seal_image(image: memoryview, path: str) -> WriteResult:
    """Seal one staged image into `path` with default I/O settings (standalone writer)."""
    head = parse_head(image, "<image>", sealed=False)
    final = Path(path).absolute()
    with NvmeStore(final.parent) as store:
        return store.write_image(image, head, final)


def open_for_read(path: str | os.PathLike[str], *, direct_io: bool = True) -> int:
    """Open a shard for a cold read: O_DIRECT where supported, else with its cache dropped."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    if direct_io and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT
                raise
    fd = os.open(path, flags)
    # No O_DIRECT: evict cached pages so the read comes from the device.
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


def read_head(path: str | os.PathLike[str], *, direct_io: bool = False) -> Head:
    """Read and check the head of a sealed shard file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct_io else 0))
    try:
        return read_head_fd(fd, os.fspath(path), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def read_head_fd(fd: int, path: str, size: int) -> Head:
    """Read and check the head of an open sealed shard file of `size` bytes."""
    head = _read_start(fd, ALIGN, size)  # the prefix and usually the whole header
    need = PREFIX_NBYTES + parse_prefix(head, path)[0]
    if need > len(head):
        head = _read_start(fd, -(-need // ALIGN) * ALIGN, size)
    return parse_head(head[:need], path, actual_nbytes=size)


def _read_start(fd: int, nbytes: int, size: int) -> bytes:
    """The first `nbytes` of the file (fewer if it is shorter), through an aligned buffer."""
    buf = mmap.mmap(-1, nbytes)
    try:
        return buf[: _pread_into(fd, buf, 0, size)]
    finally:
        buf.close()


class _BlobHasher:
    """Feeds consecutive chunks of the data region to one streaming xxh3-128 per blob."""

    def __init__(self, head: Head) -> None:
        self._blobs = head.header.blobs
        self._hashers = [xxhash.xxh3_128() for _ in self._blobs]
        self._fed = [0] * len(self._blobs)
        self._next = 0

    def feed(self, start: int, data: memoryview) -> None:
        end = start + len(data)
        i = self._next
        while i < len(self._blobs):
            b = self._blobs[i]
            lo, hi = max(b.offset, start), min(b.offset + b.nbytes, end)
            if hi > lo:
                self._hashers[i].update(data[lo - start : hi - start])
                self._fed[i] += hi - lo
            if b.offset + b.nbytes > end:
                break
            i += 1
        self._next = i

    def missing(self) -> bool:
        return any(f != b.nbytes for f, b in zip(self._fed, self._blobs, strict=True))

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self._hashers]


def _blob_digests(image: memoryview, head: Head) -> list[bytes]:
    base = head.data_offset
    return [
        xxhash.xxh3_128_digest(image[base + b.offset : base + b.offset + b.nbytes])
        for b in head.header.blobs
    ]


def _blob_names(header: ShardHeader) -> list[str]:
    names = [f"blob {i}" for i in range(len(header.blobs))]
    for e in reversed(header.tensors):
        names[e.blob] = "tensor " + "/".join(map(str, e.path))
    return names


def _pwrite_all(
    fd: int, data: memoryview | bytes | mmap.mmap, offset: int, *, may_fall_back: bool = False
) -> None:
    """Write all of `data` at `offset`. With `may_fall_back` (only ever for a write issued
    alone), an O_DIRECT refusal of this buffer or filesystem switches the file to buffered I/O."""
    view = memoryview(data)
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if not may_fall_back or e.errno != errno.EINVAL or not flags & _O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
            log.debug("direct_io_unavailable", fd=fd, hint="writing buffered, fsync still applies")
            continue
        view, offset = view[n:], offset + n


def _pread_into(fd: int, buf: mmap.mmap, offset: int, size: int) -> int:
    """Fill `buf` from `offset` (stopping at `size`); returns the byte count read."""
    want = min(len(buf), size - offset)
    got = 0
    with memoryview(buf) as mv:
        while got < want:
            n = os.preadv(fd, [mv[got:want]], offset + got)
            if n == 0:
                break
            got += n
    return got


def _aligned_copy(data: bytes) -> mmap.mmap:
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


def _fallocate(fd: int, nbytes: int, directory: Path, reserve: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            st = os.statvfs(directory)
            raise NoSpaceError(str(directory), nbytes, st.f_bavail * st.f_frsize, reserve) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _wait_all(futures: list[Future]) -> None:
    error: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def _io_error(e: OSError, path: str, nbytes: int, reserve: int) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        directory = os.path.dirname(path)
        st = os.statvfs(directory)
        return NoSpaceError(directory, nbytes, st.f_bavail * st.f_frsize, reserve)
    return RetryableError(f"I/O error writing {path}: {e}")


def _makedirs_durable(path: Path) -> None:
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        _fsync_dir(d.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
