"""Reading shard files back: the head, and the one read-and-hash engine verify and restore share.

`open_for_read` bypasses the page cache (O_DIRECT, else the file's cached pages are dropped
first), so a check sees what the device holds, not what a writer left in memory. `read_head`
reads and checks a sealed shard's head.

The engine, `verified_blobs`: a `ReadPlan` says where each read of the data region lands (`plan`
has both layouts: scratch memory reused in a ring for a verify; for a restore, a ring arena for
blobs that only pass through and a buffer of its own for any other). `queue_depth` threads claim
the reads in file order, each as soon as its ring space is free, while the caller's thread feeds
every blob's bytes to a streaming xxh3-128 as they arrive and hands the blob on once its digest
matched. os.preadv and python-xxhash release the GIL, so reads and hashing overlap on separate
cores. `BlobReader` verifies whole files with it; `read_shard` reads one into a `BlobSink`
(O_DIRECT unless the page cache holds the file; its arena unmapped in the background);
`deliver_image` and `check_image` do the same for a shard already in memory, blob by blob.

A verify also checks a sharded tensor's block digests (`BlobEntry.blocks`, which a resharded
restore's ranged reads rely on) against the bytes it read; a restore that reads whole blobs
checks their whole digests only (they cover every byte it uses).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Generator, Iterator

import xxhash

from tierpipe.errors import IntegrityError, ShardFormatError, ShardMissingError
from tierpipe.schemas import ALIGN, BLOCK_BYTES, BLOCK_DIGEST_BYTES, ShardHeader
from tierpipe.storage.aligned import (
    aligned_buffer,
    open_direct,
    pread_into,
    read_direct_unless_cached,
    round_up,
    unmap_later,
)
from tierpipe.storage.layout import ReadPlan, arena_plan, scratch_plan
from tierpipe.storage.resources import translated
from tierpipe.storage.shard import PREFIX_NBYTES, Head, parse_head, parse_prefix
from tierpipe.storage.store import BlobSink

__all__ = (
    "BlobReader",
    "check_blob",
    "check_blocks",
    "check_header",
    "check_image",
    "deliver_image",
    "image_blobs",
    "image_head",
    "open_for_read",
    "read_head",
    "read_head_fd",
    "read_shard",
    "verified_blobs",
)


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


def image_head(image: mmap.mmap, location: str, nbytes: int) -> Head:
    """Read and check the head of a sealed shard image of `nbytes` bytes in memory."""
    need = PREFIX_NBYTES + parse_prefix(image[:PREFIX_NBYTES], location)[0]
    return parse_head(image[:need], location, actual_nbytes=nbytes)


class BlobReader:
    """Checks the data region of open shard files, `queue_depth` reads of `chunk_bytes` ahead.

    The scratch ring they are read into is allocated on first use and reused (fresh memory costs
    page faults on every verify); one file is read at a time.
    """

    def __init__(self, *, chunk_bytes: int, queue_depth: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._queue_depth = queue_depth
        self._ring: mmap.mmap | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None

    def check(self, fd: int, head: Head, path: str) -> None:
        """Hash the data region from `fd` and compare every blob with its header digest.

        Raises:
            IntegrityError: a digest does not match (names the file, the part, both digests).
            ShardFormatError: the data region is truncated.
            ResourceExhaustedError: this process ran out of memory or threads (no verdict).
        """
        with self._lock, translated(path):
            if self._ring is None:
                self._ring = aligned_buffer(self._chunk_bytes * self._queue_depth)
            plan = scratch_plan(head, self._ring, self._chunk_bytes)
            blobs = verified_blobs(fd, head, path, plan, self._queue_depth, blocks=True)
            with contextlib.closing(blobs) as it:
                for _ in it:
                    pass


def read_shard(
    path: str,
    sink: BlobSink,
    *,
    nbytes: int | None = None,
    direct_io: bool | None = None,
    queue_depth: int = 4,
    chunk_bytes: int = 8 << 20,
) -> Head:
    """Read a sealed shard file into `sink` (see `store.BlobSink`), every blob verified first.

    Args:
        nbytes: the file's expected size, if known.
        direct_io: True: O_DIRECT reads (where the filesystem allows); False: through the page
            cache (pages already cached are used, every digest is checked anyway, and the pages
            read stay cached); None: O_DIRECT unless the page cache holds most of the file
            (`aligned.read_direct_unless_cached`). A shard is written with O_DIRECT and verified
            cold, so a restore usually finds it on the device alone: read through the page cache,
            each byte costs a kernel copy and a fresh page-cache page besides the device read.

    Raises:
        ShardMissingError: the file is not there.
        ShardFormatError: truncated, garbled, of another size than `nbytes`, or unreadable.
        IntegrityError: a digest does not match.
        ResourceExhaustedError: this process ran out of memory, mappings, file descriptors or
            threads (no verdict on the file).
    """
    try:
        with translated(path):
            fd = open_direct(path, os.O_RDONLY | os.O_CLOEXEC, direct=direct_io is True)
    except FileNotFoundError as e:
        raise ShardMissingError(path, "file is missing") from e
    try:
        with translated(path):
            size = os.fstat(fd).st_size
            if nbytes is not None and size != nbytes:
                raise ShardFormatError(path, f"{size} bytes on disk, {nbytes} expected")
            if direct_io is None:
                read_direct_unless_cached(fd, size)
            head = read_head_fd(fd, path, size)
            passing = sink.accept(head, path)
            plan = arena_plan(head, passing, queue_depth, chunk_bytes)
            try:
                pinned = sink.pin(plan.ring) if plan.ring is not None else contextlib.nullcontext()
                blobs = verified_blobs(fd, head, path, plan, queue_depth)
                with pinned, contextlib.closing(blobs) as it:
                    for i in it:
                        sink.take(i, plan.view(i), reused=passing[i])
            finally:
                if plan.ring is not None:  # nothing of it is kept: no need to wait for munmap
                    unmap_later(plan.ring)
            sink.finish()
        return head
    except OSError as e:
        raise ShardFormatError(path, f"read failed: {e}") from e
    finally:
        os.close(fd)


def deliver_image(image: mmap.mmap | memoryview, head: Head, location: str, sink: BlobSink) -> None:
    """Hand a sealed shard image in memory (its head already read: `image_head`) to `sink` (see
    `store.BlobSink`), each blob once its digest matched: views of `image`, never reused."""
    sink.accept(head, location)
    with memoryview(image) as view:
        for i, data in image_blobs(view, head, location):
            sink.take(i, data, reused=False)
    sink.finish()


def check_image(image: mmap.mmap, location: str, header_digest: str, nbytes: int) -> None:
    """Check a sealed shard image of `nbytes` in memory: its head, header digest and every blob.

    Raises:
        ShardFormatError: truncated or garbled.
        IntegrityError: a digest does not match.
    """
    head = image_head(image, location, nbytes)
    check_header(head, header_digest, location)
    with memoryview(image) as view:
        for i, data in image_blobs(view, head, location):
            if head.header.blobs[i].blocks:
                hasher = _BlockHasher()
                hasher.update(data)
                check_blocks(location, head.header, i, hasher.digest())


def image_blobs(view: memoryview, head: Head, location: str) -> Iterator[tuple[int, memoryview]]:
    """(index, bytes) of every blob of a sealed image in memory, once its digest matched."""
    for i, b in enumerate(head.header.blobs):
        start = head.data_offset + b.offset
        data = view[start : start + b.nbytes]
        check_blob(location, head.header, i, xxhash.xxh3_128_digest(data))
        yield i, data


def verified_blobs(
    fd: int, head: Head, path: str, plan: ReadPlan, depth: int, *, blocks: bool = False
) -> Generator[int, None, None]:
    """Every blob's index in file order, once all its bytes were read as `plan` lays them out
    (by `depth` threads) and its digest matched (with `blocks`, its block digests too, where it
    has them); empty blobs first. Ring memory of a blob is reused only once the caller resumes
    this generator (close it to stop the readers).

    Raises:
        ShardFormatError: the data region is truncated.
        IntegrityError: a digest does not match.
    """
    blobs = head.header.blobs
    # A blob read in one piece is hashed at once; only one split over reads gets a streaming
    # hasher (~1 KiB each: 200 MiB for 200,000 tensors if every blob had one).
    split: dict[int, tuple[xxhash.xxh3_128, int]] = {}  # blob -> (its hasher, bytes hashed)
    by_block = {i: _BlockHasher() for i, b in enumerate(blobs) if blocks and b.blocks}
    for i, b in enumerate(blobs):  # empty blobs have nothing to read
        if not b.nbytes:
            check_blob(path, head.header, i, xxhash.xxh3_128_digest(b""))
            yield i
    readers = _Readers(fd, plan, depth)
    try:
        for k, r in enumerate(plan.reads):
            if readers.result(k) < r.needed:
                raise ShardFormatError(path, "truncated data region")
            with memoryview(r.buffer) as view:
                for i, at, n in r.pieces:
                    if i in by_block:
                        by_block[i].update(view[at : at + n])
                    if n == blobs[i].nbytes:
                        digest = xxhash.xxh3_128_digest(view[at : at + n])
                    else:
                        hasher, done = split.pop(i) if i in split else (xxhash.xxh3_128(), 0)
                        hasher.update(view[at : at + n])
                        if done + n < blobs[i].nbytes:
                            split[i] = (hasher, done + n)
                            continue
                        digest = hasher.digest()
                    check_blob(path, head.header, i, digest)
                    if i in by_block:
                        check_blocks(path, head.header, i, by_block.pop(i).digest())
                    yield i
            if r.frees:
                readers.release(r.frees)
    finally:
        readers.close()


def check_header(head: Head, header_digest: str, location: str) -> None:
    """Raise IntegrityError unless the shard's header digest is `header_digest` (hex)."""
    actual = head.header_digest.hex()
    if actual != header_digest:
        raise IntegrityError(location, "header", header_digest, actual)


def check_blob(path: str, header: ShardHeader, i: int, actual: bytes) -> None:
    """Raise unless blob `i`'s digest is `actual`.

    Raises:
        IntegrityError: names the blob's first tensor (or the blob), and both digests.
    """
    expected = header.blobs[i].digest
    if actual != expected:
        name = next(
            ("tensor " + "/".join(map(str, e.path)) for e in header.tensors if e.blob == i),
            f"blob {i}",
        )
        raise IntegrityError(path, name, expected.hex(), actual.hex())


def check_blocks(path: str, header: ShardHeader, i: int, actual: bytes) -> None:
    """Raise unless blob `i`'s block digests are `actual`.

    Raises:
        IntegrityError: names the blob's tensor and the first block that differs.
    """
    expected = header.blobs[i].blocks
    if actual == expected:
        return
    size = BLOCK_DIGEST_BYTES
    at = range(0, len(expected), size)
    k = next((k for k in at if expected[k : k + size] != actual[k : k + size]), len(expected))
    name = next(("tensor " + "/".join(map(str, e.path)) for e in header.tensors if e.blob == i), "")
    raise IntegrityError(
        path,
        f"{name or f'blob {i}'} block {k // size}",
        expected[k : k + size].hex(),
        actual[k : k + size].hex(),
    )


class _BlockHasher:
    """The xxh3-64 of each `BLOCK_BYTES` block of one blob, fed in pieces of any size."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current block hashed so far
        self._digests: list[bytes] = []

    def update(self, data: memoryview) -> None:
        at = 0
        while at < len(data):
            take = min(BLOCK_BYTES - self._filled, len(data) - at)
            if not self._filled and take == BLOCK_BYTES:
                self._digests.append(xxhash.xxh3_64_digest(data[at : at + take]))
            else:
                self._hasher.update(data[at : at + take])
                self._filled += take
                if self._filled == BLOCK_BYTES:
                    self._digests.append(self._hasher.digest())
                    self._hasher.reset()
                    self._filled = 0
            at += take

    def digest(self) -> bytes:
        tail = [self._hasher.digest()] if self._filled else []
        return b"".join(self._digests + tail)


class _Readers:
    """`depth` threads that claim a plan's reads in file order, each as soon as its ring space
    is free (never waiting for the consumer otherwise), and publish their results."""

    def __init__(self, fd: int, plan: ReadPlan, depth: int) -> None:
        self._fd, self._reads, self._size = fd, plan.reads, plan.ring_bytes
        self._cond = threading.Condition()
        self._next = 0  # the next read to claim
        self._released = 0  # virtual ring position below which the consumer is done
        self._results: dict[int, int | BaseException] = {}
        self._stop = False
        self._threads: list[threading.Thread] = []
        for n in range(min(depth, len(self._reads))):
            t = threading.Thread(target=self._work, name=f"tierpipe-read-{n}", daemon=True)
            try:
                t.start()
            except BaseException:  # (e.g. no thread left to start): stop the ones started
                self.close()
                raise
            self._threads.append(t)

    def result(self, k: int) -> int:
        """Bytes read `k` got (waits for it); re-raises its error."""
        with self._cond:
            while k not in self._results:
                self._cond.wait()
            got = self._results.pop(k)
        if isinstance(got, BaseException):
            raise got
        return got

    def release(self, upto: int) -> None:
        with self._cond:
            self._released = upto
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stop
                    and self._next < len(self._reads)
                    and (self._reads[self._next].vend - self._size > self._released)
                ):
                    self._cond.wait()
                if self._stop or self._next >= len(self._reads):
                    return
                k, self._next = self._next, self._next + 1
            r = self._reads[k]
            got: int | BaseException
            try:
                with memoryview(r.buffer) as view:
                    end = r.buffer_offset + r.length
                    got = pread_into(self._fd, view[r.buffer_offset : end], r.file_offset)
            except BaseException as e:  # handed to the consumer
                got = e
            with self._cond:
                self._results[k] = got
                self._cond.notify_all()


def _read_start(fd: int, nbytes: int, size: int) -> bytes:
    """The first `nbytes` of the file (fewer if it is shorter), through an aligned buffer."""
    buf = aligned_buffer(nbytes)
    try:
        with memoryview(buf) as mv:
            return buf[: pread_into(fd, mv[: max(0, min(nbytes, size))], 0)]
    finally:
        buf.close()
