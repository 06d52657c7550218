"""The node-local NVMe tier: seal staged images into shard files, and verify them from the device.

Writes go to `.<name>.<stage>.<pid>-<instance>.tmp` beside the final path (the instance is a random
token per process: a restarted container reuses PIDs), preallocated with `posix_fallocate` (a full
disk fails before any byte is written), written with large aligned O_DIRECT writes at queue depth
> 1 while another thread hashes the same source bytes, fsynced, hard-linked into place (never
over an existing file) and the directory fsynced. So a final file is either absent or complete,
and a valid final file is never replaced by another save unless that save supersedes it (a
rewound run's newer timeline); an unreadable or corrupt one is set aside as `.<name>.corrupt`.
Verification re-reads with O_DIRECT (or drops the page cache first where O_DIRECT is not
supported) and hashes while reading. All blocking work runs in this store's thread pool;
python-xxhash and os.pread/pwrite release the GIL, so hashing and I/O overlap on separate cores.

Each agent stage holds `<root>/.agent-<stage>.lock` (flock) for its whole life: one agent per
node name and NVMe root (`NvmeStore.lock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import anyio
import structlog
import xxhash

from tierpipe.errors import (
    AgentLockedError,
    IntegrityError,
    NoSpaceError,
    RetryableError,
    ShardFormatError,
    StorageConflictError,
)
from tierpipe.faults import maybe_die
from tierpipe.schemas import ALIGN, ShardHeader
from tierpipe.settings import Settings
from tierpipe.shard import (
    PREFIX_NBYTES,
    Head,
    encode_head,
    parse_head,
    parse_prefix,
    seal_header,
)

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

#: `.<name>.<stage>.<pid>-<instance>.tmp`; `.<name>.<pid>.tmp` from older versions.
_TMP = re.compile(
    r"^\..+?(?:\.(?P<stage>[a-z-]+)\.(?P<pid>\d+)-(?P<inst>[0-9a-f]+)|\.(?P<old>\d+))\.tmp$"
)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: This process's instance token in temp names: a PID alone is reused by the next container.
INSTANCE = secrets.token_hex(6)
#: A poll interval while another agent holds a stage lock (no event to wait on: flock has none).
_LOCK_POLL_S = 0.1

_Verdict = Literal["absent", "same", "corrupt", "superseded", "conflict"]


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
        fault_point: str = "",
    ) -> None:
        if chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN} (got {chunk_bytes})")
        self.root = Path(root).absolute()
        self.direct_io = direct_io and bool(_O_DIRECT)
        self.chunk_bytes = chunk_bytes
        self.queue_depth = queue_depth
        self.reserve_bytes = reserve_bytes
        self.fault_point = fault_point
        #: The stage whose temp files this store writes (set by `lock`).
        self.stage = "writer"
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
            fault_point=settings.fault_point,
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

    def sweep_temp(self, stage: str | None = None) -> list[str]:
        """Remove temp files left by writers that died mid-write. Returns what was removed.

        Call it holding `stage`'s lock: then a temp of `stage` from another instance is dead for
        sure (one live holder per stage), even when its PID is ours (a restarted container).
        Temps of other stages go only once their PID is dead.
        """
        stage = stage or self.stage
        removed = []
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                m = _TMP.match(name)
                if m is None:
                    continue
                if m["old"] is not None:
                    dead = not _pid_alive(int(m["old"]))
                elif m["stage"] == stage:
                    dead = m["inst"] != INSTANCE
                else:
                    dead = not _pid_alive(int(m["pid"]))
                if dead:
                    path = os.path.join(dirpath, name)
                    try:
                        os.unlink(path)
                        removed.append(path)
                    except FileNotFoundError:
                        pass
        if removed:
            log.info("temp_files_swept", count=len(removed), root=str(self.root), stage=stage)
        return removed

    # --- one agent per node

    @contextlib.asynccontextmanager
    async def lock(self, stage: str, *, timeout_s: float) -> AsyncIterator[None]:
        """Hold `<root>/.agent-<stage>.lock` exclusively while the block runs.

        The holder writes "pid, host, start time" into the file. While another process holds
        it, this logs `agent_lock_busy` once and polls for up to `timeout_s` (a rolling
        update's old agent may still be draining).

        Raises:
            AgentLockedError: still held by another process after `timeout_s`.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".agent-{stage}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            deadline = time.monotonic() + timeout_s
            logged = False
            while not _try_flock(fd):
                holder = _read_holder(fd)
                if time.monotonic() >= deadline:
                    raise AgentLockedError(str(path), holder)
                if not logged:
                    log.warning(
                        "agent_lock_busy",
                        path=str(path),
                        holder=holder,
                        timeout_s=timeout_s,
                    )
                    logged = True
                await anyio.sleep(_LOCK_POLL_S)
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            holder = f"pid {os.getpid()}, host {socket.gethostname()}, started {started}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode() + b"\n", 0)
            self.stage = stage
            log.info("agent_lock_acquired", path=str(path), holder=holder)
            yield
        finally:
            os.close(fd)  # drops the flock

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
        verdict, found = self._judge(final, head.header, rewind_to)
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
        _makedirs_durable(final.parent)
        tmp = final.with_name(f".{final.name}.{self.stage}.{os.getpid()}-{INSTANCE}.tmp")
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
                maybe_die("nvme-write:mid-write", self.fault_point)
            writes = [self._pool.submit(_pwrite_all, fd, data, off) for off, data in chunks[1:]]
            _wait_all([*writes, hashing])
            if check is not None:
                check()  # every byte read from the source is still this save's
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
        maybe_die("nvme-write:after-fsync", self.fault_point)
        try:
            existing = self._place(tmp, final, header, rewind_to)
        except BaseException as e:
            _unlink_quietly(tmp)
            if isinstance(e, OSError):
                raise _io_error(e, str(final), head.file_nbytes, self.reserve_bytes) from e
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

    def _place(
        self, tmp: Path, final: Path, header: ShardHeader, rewind_to: int | None
    ) -> str | None:
        """Link the complete temp file to `final`, never over a valid file (see `write_image`).

        Returns:
            None once placed; the header digest of `final` if it already held this very save.
        """
        for _ in range(3):
            try:
                os.link(tmp, final)  # EEXIST instead of replacing: unlike rename
            except FileExistsError:
                verdict, found = self._judge(final, header, rewind_to)
                if verdict == "same":
                    _unlink_quietly(tmp)
                    return found
                if verdict == "conflict":
                    raise StorageConflictError(str(final), found) from None
                if verdict == "corrupt":
                    self._set_aside(final, found)
                elif verdict == "superseded":
                    self._drop_superseded(final, found)
                continue
            maybe_die("nvme-write:after-link", self.fault_point)
            os.unlink(tmp)
            _fsync_dir(final.parent)
            return None
        raise RetryableError(f"{final} kept changing while it was being placed")

    def _judge(
        self, final: Path, header: ShardHeader, rewind_to: int | None
    ) -> tuple[_Verdict, str]:
        """What `final` holds compared with the save `header` describes, and the header digest
        (for `same`) or the reason (otherwise). A file is judged valid only once it passed a
        full verification against its own header."""
        try:
            fd = open_for_read(final, direct_io=self.direct_io)
        except FileNotFoundError:
            return "absent", ""
        try:
            try:
                found = read_head_fd(fd, str(final), os.fstat(fd).st_size)
                self._check_blobs(fd, found, str(final))
            except (ShardFormatError, IntegrityError) as e:
                return "corrupt", str(e)
        except OSError as e:
            raise RetryableError(f"cannot read {final}: {e}") from e
        finally:
            os.close(fd)
        old = found.header
        if _identity(old) != _identity(header):
            return "corrupt", (
                f"holds {old.job} step {old.step} rank {old.rank} of {old.world_size}, "
                "not the shard of this path"
            )
        if _same_save(old, header):
            return "same", found.header_digest.hex()
        if old.epoch < header.epoch and rewind_to is not None and header.step > rewind_to:
            return "superseded", (
                f"epoch {old.epoch} is superseded by epoch {header.epoch}, "
                f"which rewound to step {rewind_to}"
            )
        return "conflict", (
            f"holds another valid save of this shard (created {old.created}, epoch {old.epoch}); "
            f"the new save (created {header.created}, epoch {header.epoch}, rewind_to "
            f"{rewind_to}) does not supersede it, and a valid shard file is never replaced"
        )

    def _set_aside(self, final: Path, reason: str) -> None:
        aside = final.with_name(f".{final.name}.corrupt")
        os.replace(final, aside)  # one kept for forensics: an older one is overwritten
        _fsync_dir(final.parent)
        log.warning("corrupt_shard_set_aside", path=str(final), kept=str(aside), reason=reason)

    def _drop_superseded(self, final: Path, reason: str) -> None:
        os.unlink(final)
        _fsync_dir(final.parent)
        log.warning("superseded_shard_replaced", path=str(final), reason=reason)

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
            self._check_blobs(fd, head, str(path))
        except OSError as e:
            raise RetryableError(f"cannot read {path}: {e}") from e
        finally:
            os.close(fd)
        return VerifyResult(str(path), size, header_digest, time.perf_counter() - t0)

    def _check_blobs(self, fd: int, head: Head, path: str) -> None:
        """Hash the data region from the device and compare every blob with its header digest.

        Raises:
            IntegrityError: a digest does not match (names the file, the part, both digests).
            ShardFormatError: the data region is truncated.
        """
        digests = self._hash_file(fd, head, path)
        names = _blob_names(head.header)
        for i, (blob, got) in enumerate(zip(head.header.blobs, digests, strict=True)):
            if blob.digest != got:
                raise IntegrityError(path, names[i], blob.digest.hex(), got.hex())

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


def _identity(h: ShardHeader) -> tuple[str, int, int, int]:
    return (h.job, h.step, h.rank, h.world_size)


def _same_save(old: ShardHeader, new: ShardHeader) -> bool:
    """Whether two headers describe the same save (identity, creation time and layout)."""
    return (
        _identity(old) == _identity(new)
        and (old.created, old.epoch, old.tree, old.tensors)
        == (new.created, new.epoch, new.tree, new.tensors)
        and [(b.offset, b.nbytes) for b in old.blobs] == [(b.offset, b.nbytes) for b in new.blobs]
    )


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_holder(fd: int) -> str:
    """Who holds a stage lock, as the holder wrote it ("unknown" before it wrote)."""
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown holder"


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
