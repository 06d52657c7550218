"""Durable file-system steps of the NVMe writer: what makes a placed shard survive a crash.

A file's own fsync is not enough: the directory entries that name it (and every directory
created for it) are fsynced too, so after a power loss a final file is either absent or
complete. Space is preallocated before the first byte is written, and a full disk or quota
becomes `NoSpaceError` (with the free bytes) instead of a bare OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from tierpipe.errors import NoSpaceError, RetryableError

__all__ = (
    "fallocate",
    "free_bytes",
    "fsync_dir",
    "io_error",
    "makedirs_durable",
    "remove_durable",
    "unlink_quietly",
)


def fallocate(fd: int, nbytes: int, directory: Path, reserve: int) -> None:
    """Reserve `nbytes` for the file, where the filesystem can (a full disk fails here, early).

    Raises:
        NoSpaceError: the filesystem cannot take `nbytes` more.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            st = os.statvfs(directory)
            raise NoSpaceError(str(directory), nbytes, st.f_bavail * st.f_frsize, reserve) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def io_error(e: OSError, path: str, nbytes: int, reserve: int) -> Exception:
    """The project error for an OSError while writing `path`: out of space, else retryable."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        directory = os.path.dirname(path)
        st = os.statvfs(directory)
        return NoSpaceError(directory, nbytes, st.f_bavail * st.f_frsize, reserve)
    return RetryableError(f"I/O error writing {path}: {e}")


def makedirs_durable(path: Path) -> None:
    """Create `path` and its missing parents, fsyncing each new directory's parent."""
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
        fsync_dir(d.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a link, rename or unlink in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove `path` if it is there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_durable(path: Path) -> bool:
    """Unlink `path` durably, and its directory too once empty. False if it was not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    with contextlib.suppress(OSError):  # not empty: other ranks still there
        path.parent.rmdir()
        fsync_dir(path.parent.parent)
    return True


def free_bytes(path: Path) -> int:
    """Free bytes for unprivileged writers on the filesystem that holds (or would hold) `path`."""
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
