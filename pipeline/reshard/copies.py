"""One copy of a saved shard, read by byte ranges (`Ranged`): a file on this node's NVMe, a
peer's endpoint, an object. `tierpipe.reshard.reads.Tiers` opens them; `read_parts` checks every
block they give."""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Protocol

import anyio

from tierpipe.errors import ShardFormatError, ShardMissingError
from tierpipe.peer.client import PeerClient
from tierpipe.schemas import ALIGN, BLOCK_BYTES
from tierpipe.storage.aligned import aligned_buffer, close_quietly, pread_into
from tierpipe.storage.aligned import round_up as align_up
from tierpipe.storage.resources import translated
from tierpipe.storage.s3.errors import NotFound
from tierpipe.storage.s3.parts import get_range

if TYPE_CHECKING:
    from tierpipe.storage.s3.store import S3Store

__all__ = ("File", "Object", "Peer", "Ranged")


class Ranged(Protocol):
    """One copy of a shard, read by byte ranges."""

    async def read(self, start: int, buf: mmap.mmap, nbytes: int) -> None:
        """Fill the first `nbytes` of `buf` (page-aligned, at least `nbytes` rounded up to
        `ALIGN` long: an O_DIRECT read may fill the rest) with the copy's bytes from `start`.

        Raises:
            ShardFormatError: the copy is shorter.
            ShardMissingError, UnavailableError: it is not there, or did not answer.
        """


class File:
    """A copy on this node's NVMe: preads in a thread (whole pages from a page boundary, so
    O_DIRECT serves them; else through a bounce buffer)."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    async def read(self, start: int, buf: mmap.mmap, nbytes: int) -> None:
        with translated(self.path):
            got = await anyio.to_thread.run_sync(self._read, start, buf, nbytes)
        if got < nbytes:
            raise ShardFormatError(self.path, f"{got} bytes from {start}, {nbytes} expected")

    def _read(self, start: int, buf: mmap.mmap, nbytes: int) -> int:
        if start % ALIGN == 0:
            with memoryview(buf) as view:
                return pread_into(self.fd, view[: align_up(nbytes)], start, nbytes)
        lo = start // ALIGN * ALIGN
        bounce = aligned_buffer(align_up(start + nbytes - lo))
        try:
            got = max(0, min(nbytes, pread_into(self.fd, bounce, lo) - (start - lo)))
            buf[:got] = bounce[start - lo : start - lo + got]
            return got
        finally:
            close_quietly(bounce)


class Peer:
    def __init__(self, client: PeerClient, url: str) -> None:
        self.client, self.url = client, url

    async def read(self, start: int, buf: mmap.mmap, nbytes: int) -> None:
        with memoryview(buf) as view:
            await self.client.read_range(self.url, start, view[:nbytes])


class Object:
    """An object, by ranged GETs of at most `part_size_bytes`, `part_concurrency` at once."""

    def __init__(self, store: S3Store, location: str) -> None:
        self.store, self.location = store, location
        bucket, _, self.key = location.removeprefix("s3://").partition("/")
        if not location.startswith("s3://") or bucket != store.bucket or not self.key:
            raise ShardMissingError(location, f"not in the configured bucket {store.bucket}")

    async def read(self, start: int, buf: mmap.mmap, nbytes: int) -> None:
        part = max(self.store.settings.part_size_bytes, BLOCK_BYTES)
        lanes = anyio.Semaphore(max(1, self.store.settings.part_concurrency))
        requests = self.store.requests

        async def get(at: int, size: int) -> None:
            """One ranged GET into its place in `buf` (one request to retry)."""
            got = await get_range(requests, self.store.bucket, self.key, start + at, size, buf, at)
            if got != size:
                raise ShardFormatError(
                    self.location, f"{got} bytes from {start + at}, {size} asked"
                )

        async def one(at: int) -> None:
            async with lanes:
                try:
                    await requests(self.key, lambda: get(at, min(part, nbytes - at)))
                except NotFound:
                    raise ShardMissingError(self.location, "no such object") from None

        try:
            async with anyio.create_task_group() as tg:
                for at in range(0, nbytes, part):
                    tg.start_soon(one, at)
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from group
