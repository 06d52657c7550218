"""The receiving end of one replica copy: the bytes read, written and checked as they arrive.

`receive` runs two worker threads over a small pool of buffers: one reads the file (a blocking
`read_into`, e.g. `http.client`'s `readinto`, straight into a buffer), the other writes each
buffer at its place in the replica's temp file and checks it on the way (`Landing`): the head
first (its prefix, its header digest against the prefix and against the `verified` event's, its
layout against the expected size, the shard's identity), then every blob's xxh3-128 digest as
its bytes pass (`storage.shard` and `storage.reader`'s checks; the NVMe writer hashes the same
way while it writes). A wrong byte fails the copy as soon as its blob ends, and the read is
aborted. The writer also asks the device to start writing every 16 MiB, so the fsync at the end
finds little left to do. `replicas.Replicas.land` places the file once all of it passed.
"""

from __future__ import annotations

import ctypes
import os
import queue
from collections.abc import Callable

import anyio
import xxhash

from tierpipe.errors import IntegrityError, ShardFormatError, TierpipeError, leaves
from tierpipe.schemas import ShardIdentity
from tierpipe.storage.reader import check_blob, check_header
from tierpipe.storage.shard import PREFIX_NBYTES, Head, parse_head, parse_prefix

__all__ = ("Landing", "ReadInto", "receive")

#: Received bytes are read into buffers of this size, and written a buffer at a time (1 MiB
#: measured faster than 4 MiB: the writer starts sooner and the bytes are still in cache).
_BUFFER_BYTES = 1 << 20
#: Buffers per copy (being read into, waiting, being written): the memory one copy holds.
_BUFFERS = 8
#: A blocking read into a buffer: the bytes read, 0 at the end.
ReadInto = Callable[[memoryview], int]
#: The device is asked to start writing what was written every this many bytes, so the fsync
#: at the end finds little left to write (the device works while bytes still arrive).
_WRITEBACK_BYTES = 16 << 20


class Landing:
    """One replica being received, in the writer thread: writes each batch where it belongs
    and checks the head, then every blob's digest, on the bytes as they pass."""

    def __init__(
        self, fd: int, where: str, nbytes: int, header_digest: str, identity: ShardIdentity | None
    ) -> None:
        self.fd, self.where, self.nbytes = fd, where, nbytes
        self.header_digest, self.identity = header_digest, identity
        self.written = self._flushed = 0
        self.head: Head | None = None
        self._start = bytearray()  # (the bytes before the head could be parsed)
        self._blob = 0  # the blob being hashed
        self._hasher = xxhash.xxh3_128()

    def feed(self, batch: list[memoryview]) -> None:
        """Write `batch` next, and check what it completes."""
        at = self.written
        self.written += _pwritev(self.fd, batch, at)
        if self.written - self._flushed >= _WRITEBACK_BYTES:
            _start_writeback(self.fd, self._flushed, self.written - self._flushed)
            self._flushed = self.written
        for chunk in batch:
            self._check(chunk, at)
            at += len(chunk)

    def finish(self) -> None:
        """Raise unless every byte came and every digest was checked."""
        if self.written != self.nbytes:
            raise ShardFormatError(self.where, f"{self.written} bytes received, "
                                   f"{self.nbytes} expected")  # fmt: skip
        if self.head is None or self._blob != len(self.head.header.blobs):
            raise ShardFormatError(self.where, "the file ended before its last blob")

    def _check(self, chunk: memoryview, at: int) -> None:
        if self.head is None:
            self._start += chunk
            if (head := self._parse()) is None:
                return
            self.head = head
            chunk, at, self._start = memoryview(bytes(self._start)), 0, bytearray()
        self._hash(chunk, at, self.head)

    def _parse(self) -> Head | None:
        """The head, once the bytes received hold it (checked against the event's)."""
        if len(self._start) < PREFIX_NBYTES:
            return None
        with memoryview(self._start) as start:  # (released: the bytearray may grow again)
            header_nbytes, file_nbytes, _, _ = parse_prefix(start, self.where)
            if file_nbytes != self.nbytes:  # (before a large header is gathered in memory)
                raise ShardFormatError(self.where, f"the head says {file_nbytes} bytes, "
                                       f"{self.nbytes} expected")  # fmt: skip
            if len(start) < PREFIX_NBYTES + header_nbytes:
                return None
            head = parse_head(start, self.where, actual_nbytes=self.nbytes)
        check_header(head, self.header_digest, self.where)
        if self.identity is not None:
            _check_identity(head, self.identity, self.where)
        return head

    def _hash(self, view: memoryview, at: int, head: Head) -> None:
        """Hash the blob bytes in `view` (the file's bytes from `at`); check each blob it ends.
        (Blobs lie in order without overlaps: `parse_head` checked the layout.)"""
        end = at + len(view)
        blobs = head.header.blobs
        while self._blob < len(blobs):
            lo = head.data_offset + blobs[self._blob].offset
            hi = lo + blobs[self._blob].nbytes
            if (s := max(lo, at)) < (e := min(hi, end)):
                self._hasher.update(view[s - at : e - at])
            if hi > end:
                return
            check_blob(self.where, head.header, self._blob, self._hasher.digest())
            self._hasher.reset()
            self._blob += 1


async def receive(read_into: ReadInto, landing: Landing, abort: Callable[[], None]) -> None:
    """Receive in one worker thread while another writes and checks what came before
    (`landing`), through a small pool of buffers; raise the first failure of either (never a
    group). A cancelled copy aborts the read, so neither thread outlives it."""
    pool = _Pool()

    async def watch() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            pool.stop()
            abort()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            async with anyio.create_task_group() as copy:
                copy.start_soon(anyio.to_thread.run_sync, _read, read_into, pool, landing)
                copy.start_soon(anyio.to_thread.run_sync, _write, pool, landing, abort)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _first(group) from None
    await anyio.to_thread.run_sync(landing.finish)


class _Pool:
    """Buffers between the reading and the writing thread: `free` ones to read into, `full`
    ones to write (None: the end, or a stop)."""

    def __init__(self) -> None:
        self.free: queue.Queue[bytearray | None] = queue.Queue()
        self.full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        for _ in range(_BUFFERS):
            self.free.put(bytearray(_BUFFER_BYTES))

    def stop(self) -> None:
        self.free.put(None)
        self.full.put(None)


def _read(read_into: ReadInto, pool: _Pool, landing: Landing) -> None:
    """Fill buffers from `read_into` until it ends; more than the expected bytes fail."""
    total = 0
    try:
        while (buf := pool.free.get()) is not None:
            with memoryview(buf) as view:
                # (one byte more than expected is asked for: a longer source is caught)
                want = view[: min(len(view), landing.nbytes + 1 - total)]
                n = 0
                while n < len(want) and (got := read_into(want[n:])):
                    n += got
            total += n
            if total > landing.nbytes:
                raise ShardFormatError(landing.where, f"more than the {landing.nbytes} bytes "
                                       "expected")  # fmt: skip
            pool.full.put((buf, n))
            if n < len(want) or not n:
                break
    finally:
        pool.full.put(None)


def _write(pool: _Pool, landing: Landing, abort: Callable[[], None]) -> None:
    """Write and check each buffer filled; a failure stops the reading at once."""
    try:
        while (item := pool.full.get()) is not None:
            buf, n = item
            with memoryview(buf) as view:
                landing.feed([view[:n]])
            pool.free.put(buf)
    except BaseException:
        pool.stop()
        abort()
        raise


def _first(group: BaseExceptionGroup) -> BaseException:
    """The failure that ended a copy: a verdict on the bytes first (the writer's, not the read
    it then aborted, which fails too), then any project error, else the first."""
    found = leaves(group)
    cancelled = anyio.get_cancelled_exc_class()
    kinds: tuple[type[BaseException] | tuple[type[BaseException], ...], ...] = (
        (IntegrityError, ShardFormatError), TierpipeError, OSError, Exception,
    )  # fmt: skip
    for kind in kinds:
        if (first := next((e for e in found if isinstance(e, kind)), None)) is not None:
            return first
    return next((e for e in found if not isinstance(e, cancelled)), found[0])


def _pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
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


def _writeback_call() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # (not Linux: the fsync at the end does it all)
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _writeback_call()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing the range to the device without waiting (`sync_file_range(2)`); a hint
    only: durability is the fsync's, so a failure here is ignored."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _check_identity(head: Head, want: ShardIdentity, where: str) -> None:
    h = head.header
    got = (h.job, h.step, h.rank, h.world_size, h.epoch)
    expected = (want.job, want.step, want.rank, want.world_size, want.epoch)
    if got != expected:
        raise IntegrityError(where, "identity (job, step, rank, world, epoch)",
                             str(expected), str(got))  # fmt: skip
