"""Running out of a resource while moving a copy's bytes: never a verdict on the copy.

Reading or writing a shard takes memory (buffers are anonymous mappings, which
`vm.max_map_count` caps per process), file descriptors and threads. When one runs out the OS
answers with an errno (ENOMEM, EMFILE, ENFILE, EAGAIN, ENOBUFS), Python with `MemoryError` or
"can't start new thread", torch with an allocator error. `resource_error` names what ran out as
a `ResourceExhaustedError` (an outage of this process, retried as such, and never evidence
against the copy); `translated` wraps the storage boundary's blocks with it, so a shortage
never surfaces as a garbled, unreadable or corrupt copy.

NVMe space is such a resource too, with someone to ask for more: the evict stage registers its
remover of copies here (`room_maker`), and the nvme-write stage of the same process asks it for
room (`make_room`) before a save waits for space.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from tierpipe.errors import ResourceExhaustedError

__all__ = ("make_room", "resource_error", "room_maker", "translated")

#: Who frees NVMe space in this process, by NVMe root (`room_maker`): given the bytes a write
#: needs, it removes copies and says how many bytes it freed.
RoomMaker = Callable[[int], Awaitable[int]]
_ROOM: dict[Path, RoomMaker] = {}

#: What ran out, by errno.
_ERRNOS = {
    errno.ENOMEM: "memory or memory mappings (ENOMEM; vm.max_map_count caps mappings)",
    errno.EMFILE: "file descriptors (EMFILE; the process limit, ulimit -n)",
    errno.ENFILE: "file descriptors (ENFILE; the system's limit, fs.file-max)",
    errno.EAGAIN: "threads or locked memory (EAGAIN)",
    errno.ENOBUFS: "kernel buffer space (ENOBUFS)",
}


def resource_error(e: BaseException, where: str) -> ResourceExhaustedError | None:
    """`e` as a `ResourceExhaustedError` at `where`, or None if `e` is no resource shortage."""
    if isinstance(e, ResourceExhaustedError):
        return e
    if isinstance(e, OSError) and e.errno in _ERRNOS:
        return ResourceExhaustedError(where, _ERRNOS[e.errno])
    if isinstance(e, MemoryError):
        return ResourceExhaustedError(where, "memory (MemoryError)")
    if isinstance(e, RuntimeError):
        text = str(e)
        if "can't start new thread" in text:
            return ResourceExhaustedError(where, "threads (can't start new thread)")
        if type(e).__name__ == "OutOfMemoryError":  # torch's, for a device
            return ResourceExhaustedError(where, f"device memory ({text.splitlines()[0]})")
        if "can't allocate memory" in text:  # torch's CPU allocator
            return ResourceExhaustedError(where, "memory (torch's CPU allocator)")
    return None


@contextlib.contextmanager
def translated(where: str) -> Iterator[None]:
    """Raise a resource shortage in the block as `ResourceExhaustedError` (cause kept); any
    other exception passes through as it is."""
    try:
        yield
    except (OSError, MemoryError, RuntimeError) as e:
        found = resource_error(e, where)
        if found is None:
            raise
        raise found from e


@contextlib.contextmanager
def room_maker(root: Path, make: RoomMaker) -> Iterator[None]:
    """Have `make` free space under the NVMe `root` for this process's writers in the block."""
    _ROOM[root] = make
    try:
        yield
    finally:
        if _ROOM.get(root) is make:
            del _ROOM[root]


async def make_room(root: Path, nbytes: int) -> int:
    """Ask this process's remover of copies under `root` for room for `nbytes` more: the bytes
    it freed (0: none registered, or nothing it may remove)."""
    make = _ROOM.get(root)
    return 0 if make is None else await make(nbytes)
