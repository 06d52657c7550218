"""Aligned and direct file I/O: the one copy of the loops every tier's byte mover uses.

O_DIRECT moves bytes between the device and user memory without the page cache, so a verify
sees what is on the device and a writer or uploader leaves the cache clean. It wants buffers,
offsets and lengths aligned to the device's block size: `aligned_buffer` gives page-aligned
memory (an anonymous mmap), `round_up` sizes it, and `pread_into` asks for the rest of the
buffer it was given, so an aligned buffer keeps every request aligned. A filesystem without
O_DIRECT (tmpfs, some overlays) refuses the flag with EINVAL; `open_direct` then opens buffered,
and `pwrite_all` can switch a file to buffered writes when O_DIRECT refuses one buffer.
`read_direct_unless_cached` lets a read that may use either pick: O_DIRECT for a file the page
cache does not hold (the usual shard: written with O_DIRECT, verified cold), buffered for one it
does (`cached_share` asks the kernel with mincore, which reads nothing). Fresh anonymous memory
is costly to give back on virtual machines (munmap of a 210 MiB restore arena: 0.25-0.4 s on the
reference VM): `unmap_later` gives a buffer back in a background thread.
os.pread/pwrite release the GIL, so these loops run in worker threads beside the event loop.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import threading

import structlog

from tierpipe.schemas import ALIGN

__all__ = (
    "O_DIRECT",
    "aligned_buffer",
    "aligned_copy",
    "cached_share",
    "close_quietly",
    "open_direct",
    "pread_into",
    "pwrite_all",
    "read_direct_unless_cached",
    "round_up",
    "unmap_later",
)

log = structlog.get_logger(__name__)

#: The O_DIRECT flag, or 0 where the platform has none (then every open is buffered).
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def round_up(n: int, align: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `align` (4 KiB: the page and O_DIRECT granularity)."""
    return -(-n // align) * align


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeroed, page-aligned anonymous memory (a private mmap), fit for O_DIRECT;
    from `HUGE_MIN_BYTES` on, in transparent huge pages where the kernel has them for the
    asking (`madvise` mode).

    First touching fresh memory costs a page fault per page: 96 MiB measured 0.088 s as a
    shared mapping (what `mmap.mmap(-1, n)` gives: shmem-backed), 0.052 s private, 0.008 s
    private in huge pages (2 MiB each) on the reference VM; giving it back is cheaper alike.

    Raises:
        ValueError: `nbytes` is 0 or negative (mmap cannot map nothing).
    """
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_MIN_BYTES and _MADV_HUGEPAGE is not None:
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except OSError:  # (a kernel without transparent huge pages: small pages, as asked)
            pass
    return buf


#: Buffers from this size on ask for transparent huge pages.
HUGE_MIN_BYTES = 4 << 20
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def aligned_copy(data: bytes) -> mmap.mmap:
    """A page-aligned copy of `data` (small things, e.g. a sealed head, written with O_DIRECT)."""
    buf = aligned_buffer(len(data))
    buf[:] = data
    return buf


def close_quietly(buf: mmap.mmap) -> None:
    """Unmap `buf`, unless a view of it is still exported (then the GC unmaps it later)."""
    try:
        buf.close()
    except BufferError:
        pass


def unmap_later(buf: mmap.mmap) -> None:
    """Unmap `buf` in a background thread (munmap releases the GIL), unless a view of it is
    still exported (then the GC unmaps it later): the caller does not wait for the pages to be
    freed. Without a thread to be had, it is unmapped here."""
    try:
        threading.Thread(
            target=close_quietly, args=(buf,), name="tierpipe-unmap", daemon=True
        ).start()
    except RuntimeError:
        close_quietly(buf)


def open_direct(
    path: str | os.PathLike[str],
    flags: int,
    mode: int = 0o644,
    *,
    direct: bool = True,
    drop_cache: bool = False,
) -> int:
    """Open `path` with O_DIRECT where the platform and the filesystem allow it.

    Args:
        flags: the `os.open` flags, without O_DIRECT.
        mode: permissions of a file that `flags` creates.
        direct: try O_DIRECT at all (False: a buffered open, e.g. `direct_io = false`).
        drop_cache: a file opened without O_DIRECT gets its cached pages dropped
            (`posix_fadvise(DONTNEED)`), so a read that follows comes from the device.

    Returns:
        The file descriptor.

    Raises:
        OSError: the open failed for any other reason than the filesystem refusing O_DIRECT
            (EINVAL), e.g. FileNotFoundError.
    """
    if direct and O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, mode)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: the filesystem has no O_DIRECT
                raise
    fd = os.open(path, flags, mode)
    if drop_cache:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            raise
    return fd


def read_direct_unless_cached(fd: int, size: int) -> bool:
    """Switch `fd` (opened buffered, for reading) to O_DIRECT unless the page cache holds at
    least half of its first `size` bytes; True if it now reads O_DIRECT.

    A cold read through the page cache costs a kernel copy and a fresh page-cache page for
    every 4 KiB (on virtual machines whose page faults are slow that doubled the read of a
    2 GiB shard); pages already cached are the fastest copy there is. A filesystem without
    O_DIRECT (EINVAL) keeps the descriptor buffered.
    """
    if not O_DIRECT or cached_share(fd, size) >= 0.5:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def cached_share(fd: int, size: int, *, samples: int = 64) -> float:
    """The share of `samples` pages, spread evenly over the first `size` bytes of file `fd`, that
    the page cache holds: mincore(2) on a read-only mapping of the file, which faults nothing in
    and reads nothing. 0.0 where the platform cannot tell (no mincore, the mapping refused)."""
    libc = _libc()
    if libc is None or size <= 0:
        return 0.0
    page = mmap.PAGESIZE
    pages = -(-size // page)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return 0.0
    try:
        vec = ctypes.create_string_buffer(1)
        picks = sorted({k * pages // samples for k in range(min(samples, pages))})
        held = 0
        for p in picks:
            if libc.mincore(ctypes.c_void_p(addr + p * page), page, vec) != 0:
                return 0.0
            held += vec.raw[0] & 1
        return held / len(picks)
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's mmap, mincore and munmap, typed; None where there is none to load."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore, mmap_, munmap = libc.mincore, libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None

    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]  # fmt: skip
    mincore.restype = ctypes.c_int
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    munmap.restype = ctypes.c_int
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def pread_into(fd: int, buf: mmap.mmap | memoryview, offset: int, need: int | None = None) -> int:
    """Read from file offset `offset` into the writable buffer `buf` until it is full (or
    `need` bytes are in) or the file ends.

    Each request asks for all the rest of `buf`: pass a slice to bound the read, and keep it
    aligned for O_DIRECT.

    Returns:
        The byte count read (short only at the end of the file).
    """
    got = 0
    with memoryview(buf) as view:
        # An error's traceback keeps this frame: were it to hold the caller's view (a slice of
        # a buffer), the caller could not close that buffer, and its `BufferError` would mask
        # the error itself. `view` is released on the way out.
        del buf
        want = len(view) if need is None else need
        while got < want:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
    return got


def pwrite_all(
    fd: int, data: memoryview | bytes | mmap.mmap, offset: int, *, may_fall_back: bool = False
) -> None:
    """Write all of `data` at file offset `offset`.

    Args:
        may_fall_back: an O_DIRECT refusal (EINVAL) of this buffer or filesystem switches the
            file to buffered writes (fsync still makes them durable) and writes on. Only for a
            write issued alone: concurrent writes must not see the file's flags change.
    """
    view = memoryview(data)
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if not may_fall_back or e.errno != errno.EINVAL or not flags & O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
            log.debug("direct_io_unavailable", fd=fd, hint="writing buffered, fsync still applies")
            continue
        view, offset = view[n:], offset + n
