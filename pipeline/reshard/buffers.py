"""The read buffers of a resharded restore: reused from span to span, bounded in bytes.

A restore reads the spans it needs into page-aligned buffers (O_DIRECT wants them; see
`tierpipe.storage.aligned`). Fresh anonymous memory is costly twice on virtual machines, to
fault in and to give back (munmap), so each reader of `tierpipe.reshard.reads` keeps one
`ReadBuffer`, grown when a span needs more and unmapped in a background thread at the end.
Readers run at once (several spans of a copy, several saved ranks), so the bytes their buffers
hold together are bounded by a `Budget` shared by one restore: a reader that needs a buffer
waits until the others have given back enough (one that holds nothing always gets one,
however large: a span larger than the budget is still read, alone).
"""

from __future__ import annotations

import mmap

import anyio

from tierpipe.errors import leaves
from tierpipe.storage.aligned import aligned_buffer, unmap_later

__all__ = ("BUDGET_BYTES", "Budget", "ReadBuffer", "first_error")

#: The bytes of read buffers one restore holds at once, by default.
BUDGET_BYTES = 512 << 20


class Budget:
    """Bytes of buffers held at once, at most `nbytes` (but for a single holder)."""

    def __init__(self, nbytes: int = BUDGET_BYTES) -> None:
        self.nbytes, self.held = nbytes, 0
        self._freed = anyio.Event()

    async def take(self, n: int) -> None:
        """Wait until `n` more bytes fit (or nothing is held), then hold them."""
        while self.held and self.held + n > self.nbytes:
            await self._freed.wait()
        self.held += n

    def give(self, n: int) -> None:
        """Give back `n` bytes: waiting takers look again."""
        self.held -= n
        self._freed.set()
        self._freed = anyio.Event()


class ReadBuffer:
    """One reader's buffer, its bytes held against `budget` while it exists."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.buf: mmap.mmap | None = None

    async def fit(self, nbytes: int) -> mmap.mmap:
        """This buffer, or a new one if it is shorter than `nbytes` (its bytes past the last
        read are stale: the caller uses what it reads)."""
        if self.buf is None or len(self.buf) < nbytes:
            self.close()
            await self.budget.take(nbytes)
            try:
                self.buf = aligned_buffer(nbytes)
            except BaseException:
                self.budget.give(nbytes)
                raise
        return self.buf

    def close(self) -> None:
        """Give the buffer back (unmapped in a background thread: munmap is slow on VMs)."""
        if self.buf is not None:
            buf, self.buf = self.buf, None
            self.budget.give(len(buf))
            unmap_later(buf)


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first exception of a task group's (nested groups opened), a cancellation last."""
    flat = leaves(group)
    cancelled = anyio.get_cancelled_exc_class()
    return next((e for e in flat if not isinstance(e, cancelled)), flat[0])
