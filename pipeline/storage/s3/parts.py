"""An object's bytes, part by part: uploads streamed from the NVMe file, ranged downloads.

`upload_parts` sends a file's parts, a few at a time. Each part is read with O_DIRECT (the page
cache stays clean) into one of a few reused aligned buffers, and its CRC32C computed (awscrt,
~16 GB/s) in a worker thread: S3 wants it as base64 of the 4 big-endian bytes and verifies it on
arrival. The part then goes out as a `PacedBody`, ~1 MiB pieces each let through by the shared
`Throttle`. `composite_checksum` is the checksum S3 reports for the whole object, to compare
after completion. `download_parts` fetches an object with parallel ranged GETs into one
page-aligned buffer. Each request goes through the store's `Requests` (`retry`).
"""

from __future__ import annotations

import base64
import contextlib
import mmap
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from pathlib import Path

import anyio
from awscrt import checksums

from tierpipe.errors import RetryableError, ShardMissingError, StorageUnavailableError
from tierpipe.schemas import ALIGN
from tierpipe.storage.aligned import aligned_buffer, open_direct, pread_into, round_up
from tierpipe.storage.resources import translated
from tierpipe.storage.s3.errors import NotFound, download_error, first_error
from tierpipe.storage.s3.retry import Requests
from tierpipe.throttle import Throttle

__all__ = (
    "Hold",
    "PacedBody",
    "close_buffers",
    "composite_checksum",
    "download_parts",
    "get_range",
    "read_part",
    "upload_parts",
)

#: What one throttle acquisition lets through.
_PIECE = 1 << 20

#: A context manager factory taken around each ranged GET (the per-node cap on concurrent reads
#: during a restart), entered in a worker thread.
Hold = Callable[[], AbstractContextManager[object]]


def read_part(fd: int, buf: mmap.mmap, offset: int, size: int, path: Path) -> str:
    """Read one part into `buf` (page-aligned, a multiple of 4 KiB, as O_DIRECT wants) and
    return its CRC32C as S3 expects it: base64 of the 4 big-endian bytes.

    Raises:
        RetryableError: the file ends before `offset + size`.
    """
    with memoryview(buf) as view:
        got = pread_into(fd, view, offset, size)
        if got < size:
            raise RetryableError(f"{path} ended at {offset + got}, expected {offset + size}")
        return base64.b64encode(checksums.crc32c(view[:size]).to_bytes(4, "big")).decode()


def composite_checksum(part_crcs: list[bytes]) -> str:
    """S3's checksum of a multipart object: CRC32C of the parts' CRC32Cs, `-<part count>`."""
    whole = checksums.crc32c(b"".join(part_crcs)).to_bytes(4, "big")
    return f"{base64.b64encode(whole).decode()}-{len(part_crcs)}"


def close_buffers(buffers: list[mmap.mmap]) -> None:
    """Unmap the part buffers; call it in a worker thread (unmapping large buffers is slow)."""
    for buf in buffers:
        with contextlib.suppress(BufferError):  # a view still held by a failed request
            buf.close()


class PacedBody:
    """A part's bytes as an async stream of ~1 MiB pieces, each let through by the throttle.

    `read` exists only so botocore accepts it as a streaming body; aiohttp iterates it. It can be
    iterated again from the start, so botocore's own retries resend the whole part.
    """

    def __init__(self, data: memoryview, throttle: Throttle) -> None:
        self._data = data
        self._throttle = throttle

    def read(self, *_: object) -> bytes:
        raise NotImplementedError("a paced body is streamed by iterating it")

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def tell(self) -> int:
        return 0

    def __aiter__(self) -> AsyncIterator[memoryview]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[memoryview]:
        for start in range(0, len(self._data), _PIECE):
            piece = self._data[start : start + _PIECE]
            await self._throttle.acquire(len(piece))
            yield piece


async def upload_parts(
    requests: Requests,
    bucket: str,
    key: str,
    upload_id: str,
    path: Path,
    nbytes: int,
    *,
    part_size_bytes: int,
    concurrency: int,
    throttle: Throttle,
) -> list[tuple[int, str, str]]:
    """Send the file at `path` as the parts of multipart upload `upload_id`, at most
    `concurrency` at a time, through the store's `requests`.

    Returns:
        (part number, ETag, CRC32C) of every part, in order, for the completion.

    Raises:
        RetryableError: the file cannot be opened or is shorter than `nbytes`.
        StorageUnavailableError, StorageAuthError: as `translate_errors` says (the first one).
    """
    part = part_size_bytes
    count = max(1, -(-nbytes // part))
    results: list[tuple[int, str, str]] = [(0, "", "")] * count
    # One aligned buffer per part in flight, reused part after part: a fresh 64 MiB mapping
    # per part costs page faults on every read and a slow unmap on the event loop.
    buffers = [
        aligned_buffer(round_up(min(part, nbytes)) or ALIGN) for _ in range(min(concurrency, count))
    ]
    free = list(buffers)
    limiter = anyio.Semaphore(len(buffers))
    try:
        fd = open_direct(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise RetryableError(f"cannot open {path}: {e}") from e

    async def one(index: int) -> None:
        async with limiter:
            offset = index * part
            size = min(part, nbytes - offset)
            buf = free.pop()
            try:
                crc = await anyio.to_thread.run_sync(read_part, fd, buf, offset, size, path)
                with memoryview(buf) as view:
                    r = await requests(
                        key,
                        lambda: requests.client.upload_part(
                            Bucket=bucket,
                            Key=key,
                            UploadId=upload_id,
                            PartNumber=index + 1,
                            Body=PacedBody(view[:size], throttle),  # a fresh one per attempt
                            ContentLength=size,
                            ChecksumCRC32C=crc,
                        ),
                    )
                results[index] = (index + 1, r["ETag"].strip('"'), r.get("ChecksumCRC32C", crc))
            finally:
                free.append(buf)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
    except BaseExceptionGroup as group:
        raise first_error(group) from group
    finally:
        os.close(fd)
        await anyio.to_thread.run_sync(close_buffers, buffers)
    return results


async def get_range(
    requests: Requests, bucket: str, key: str, start: int, size: int, buf: mmap.mmap, at: int
) -> int:
    """One ranged GET of `size` bytes of object `key` from byte `start`, its body written into
    `buf` from `at` as it arrives; the bytes it got (the caller judges a short read).

    Raises:
        StorageUnavailableError: the body ran past `size`.
    """
    r = await requests.client.get_object(
        Bucket=bucket, Key=key, Range=f"bytes={start}-{start + size - 1}"
    )
    got = 0
    async for chunk in r["Body"].iter_chunks(1 << 20):
        if got + len(chunk) > size:
            raise StorageUnavailableError(f"s3://{bucket}/{key}: long read at {start}")
        buf[at + got : at + got + len(chunk)] = chunk
        got += len(chunk)
    return got


async def download_parts(
    requests: Requests,
    bucket: str,
    key: str,
    nbytes: int,
    *,
    part_size_bytes: int,
    concurrency: int,
    hold: Hold | None = None,
) -> mmap.mmap:
    """Fetch object `key` with ranged GETs of `part_size_bytes`, at most `concurrency` at a time,
    into a page-aligned buffer, through the store's `requests`.

    Args:
        hold: a context manager factory taken around each GET; entered in a worker thread.

    Raises:
        ShardMissingError: there is no object at `key`.
        StorageUnavailableError: the store failed or the object is shorter than `nbytes`.
        StorageAuthError: the store refused the request (credentials, permissions).
        ResourceExhaustedError: this process ran out of memory or threads.
    """
    location = f"s3://{bucket}/{key}"
    part = part_size_bytes
    with translated(location):
        buf = aligned_buffer(max(nbytes, 1))
    limiter = anyio.Semaphore(concurrency)

    async def get(offset: int, size: int) -> None:
        """One ranged GET into its place in `buf`, body and all (one request to retry)."""
        if await get_range(requests, bucket, key, offset, size, buf, offset) != size:
            raise StorageUnavailableError(f"{location}: short read at {offset}")

    async def one(offset: int) -> None:
        size = min(part, nbytes - offset)
        async with limiter:
            guard = hold() if hold is not None else contextlib.nullcontext()
            await anyio.to_thread.run_sync(guard.__enter__)
            try:
                await requests(key, lambda: get(offset, size))
            except NotFound:
                raise ShardMissingError(location, "no such object") from None
            finally:
                guard.__exit__(None, None, None)

    try:
        async with anyio.create_task_group() as tg:
            for offset in range(0, nbytes, part):
                tg.start_soon(one, offset)
    except BaseExceptionGroup as group:
        buf.close()
        raise download_error(group, location) from group
    return buf
