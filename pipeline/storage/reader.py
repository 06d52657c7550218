"""Reading shard files back from the device: the head, and every blob's digest.

`open_for_read` bypasses the page cache (O_DIRECT, else the file's cached pages are dropped
first), so a check sees what the device holds, not what a writer left in memory. `read_head`
reads and checks a sealed shard's head. `BlobReader` streams the data region at queue depth
into reused aligned buffers and feeds it, in file order, to one streaming xxh3-128 per blob:
reads run in the store's worker threads while the caller's thread hashes (python-xxhash and
os.preadv release the GIL, so they overlap on separate cores).
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Executor, Future

import xxhash

from tierpipe.errors import IntegrityError, ShardFormatError
from tierpipe.schemas import ALIGN, ShardHeader
from tierpipe.shard import PREFIX_NBYTES, Head, parse_head, parse_prefix
from tierpipe.storage.aligned import aligned_buffer, open_direct, pread_into, round_up

__all__ = ("BlobReader", "open_for_read", "read_head", "read_head_fd")


def open_for_read(path: str | os.PathLike[str], *, direct_io: bool = True) -> int:
    """Open a shard for a cold read: O_DIRECT where supported, else with its cache dropped."""
    return open_direct(path, os.O_RDONLY | os.O_CLOEXEC, direct=direct_io, drop_cache=True)


def read_head(path: str | os.PathLike[str], *, direct_io: bool = False) -> Head:
    """Read and check the head of a sealed shard file."""
    fd = open_direct(path, os.O_RDONLY | os.O_CLOEXEC, direct=direct_io)
    try:
        return read_head_fd(fd, os.fspath(path), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def read_head_fd(fd: int, path: str, size: int) -> Head:
    """Read and check the head of an open sealed shard file of `size` bytes."""
    head = _read_start(fd, ALIGN, size)  # the prefix and usually the whole header
    need = PREFIX_NBYTES + parse_prefix(head, path)[0]
    if need > len(head):
        head = _read_start(fd, round_up(need), size)
    return parse_head(head[:need], path, actual_nbytes=size)


class BlobReader:
    """Hashes the data region of open shard files from the device, `queue_depth` reads ahead.

    Its `queue_depth` aligned buffers of `chunk_bytes` are allocated on first use and reused
    (fresh memory costs page faults on every verify); one file is read at a time.
    """

    def __init__(self, pool: Executor, *, chunk_bytes: int, queue_depth: int) -> None:
        self._pool = pool
        self._chunk_bytes = chunk_bytes
        self._queue_depth = queue_depth
        self._bufs: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        for buf in self._bufs:
            buf.close()
        self._bufs.clear()

    def check(self, fd: int, head: Head, path: str) -> None:
        """Hash the data region from the device and compare every blob with its header digest.

        Raises:
            IntegrityError: a digest does not match (names the file, the part, both digests).
            ShardFormatError: the data region is truncated.
        """
        digests = self.digests(fd, head, path)
        names = _blob_names(head.header)
        for i, (blob, got) in enumerate(zip(head.header.blobs, digests, strict=True)):
            if blob.digest != got:
                raise IntegrityError(path, names[i], blob.digest.hex(), got.hex())

    def digests(self, fd: int, head: Head, path: str) -> list[bytes]:
        """Every blob's xxh3-128 digest, as read from `fd`.

        Raises:
            ShardFormatError: the data region is truncated.
        """
        chunk = self._chunk_bytes
        offsets = list(range(head.data_offset, head.file_nbytes, chunk))
        with self._lock:
            if not self._bufs:
                self._bufs = [aligned_buffer(chunk) for _ in range(self._queue_depth)]
            bufs = self._bufs[: max(1, min(self._queue_depth, len(offsets)))]
            return self._hash(fd, head, path, offsets, bufs)

    def _hash(
        self, fd: int, head: Head, path: str, offsets: list[int], bufs: list[mmap.mmap]
    ) -> list[bytes]:
        """Read `offsets` into `bufs` round-robin ahead of the hasher, and hash in order."""
        hasher = _BlobHasher(head)
        pending: dict[int, Future[int]] = {}
        try:
            for i in range(min(len(bufs), len(offsets))):
                pending[i] = self._pool.submit(
                    _read_chunk, fd, bufs[i], offsets[i], head.file_nbytes
                )
            for i, off in enumerate(offsets):
                n = pending.pop(i).result()
                buf = bufs[i % len(bufs)]
                with memoryview(buf) as mv:
                    hasher.feed(off - head.data_offset, mv[:n])
                if i + len(bufs) < len(offsets):
                    j = i + len(bufs)
                    pending[j] = self._pool.submit(
                        _read_chunk, fd, buf, offsets[j], head.file_nbytes
                    )
        finally:
            for f in pending.values():
                f.cancel()
                if not f.cancelled():
                    f.exception()
        if hasher.missing():
            raise ShardFormatError(path, "truncated data region")
        return hasher.digests()


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


def _blob_names(header: ShardHeader) -> list[str]:
    names = [f"blob {i}" for i in range(len(header.blobs))]
    for e in reversed(header.tensors):
        names[e.blob] = "tensor " + "/".join(map(str, e.path))
    return names


def _read_start(fd: int, nbytes: int, size: int) -> bytes:
    """The first `nbytes` of the file (fewer if it is shorter), through an aligned buffer."""
    buf = aligned_buffer(nbytes)
    try:
        return buf[: _read_chunk(fd, buf, 0, size)]
    finally:
        buf.close()


def _read_chunk(fd: int, buf: mmap.mmap, offset: int, size: int) -> int:
    """Fill `buf` from `offset`, stopping at `size` (the file's); returns the byte count read."""
    with memoryview(buf) as mv:
        return pread_into(fd, mv[: max(0, min(len(buf), size - offset))], offset)
