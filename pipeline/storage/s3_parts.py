"""The bytes of a multipart upload's parts: read from the NVMe file, checksummed, paced.

Each part is read with O_DIRECT (the page cache stays clean) into one of a few reused aligned
buffers, and its CRC32C computed (awscrt, ~16 GB/s) in a worker thread: S3 wants it as base64
of the 4 big-endian bytes and verifies it on arrival. The part then goes out as a `PacedBody`,
~1 MiB pieces each let through by the shared `Throttle`. `composite_checksum` is the checksum S3
reports for the whole object, to compare after completion.
"""

from __future__ import annotations

import base64
import contextlib
import mmap
from collections.abc import AsyncIterator
from pathlib import Path

from awscrt import checksums

from tierpipe.errors import RetryableError
from tierpipe.storage.aligned import pread_into
from tierpipe.throttle import Throttle

__all__ = ("PacedBody", "close_buffers", "composite_checksum", "read_part")

#: What one throttle acquisition lets through.
_PIECE = 1 << 20


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
