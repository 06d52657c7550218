"""A bytes-per-second throttle for uploads: a token bucket that can be re-rated and paused live.

Uploads call `await throttle.acquire(n)` before sending each small piece (about 1 MiB), so the
flush trickles at the configured rate instead of bursting a whole part at line speed. The bucket
holds at most `burst_bytes` of credit; a request larger than that simply waits longer. Rate
changes and pauses take effect for requests already waiting.

A job with a job-wide budget (`tierpipe flush rate --job`) is paced by its own throttle as well
as the node's: `also_paced_by(job_throttle)` around its upload makes every `acquire` in it (and in
the tasks it starts) wait on both, so the upload goes at the lower of the two rates and a pause
of the node's throttle still holds it.

Why not aiolimiter: it cannot change its rate or pause while tasks wait, and refuses requests
larger than its capacity; both are needed here (`tp.ctl.flush` re-rates and pauses at run time).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar

import anyio

__all__ = ("JobThrottles", "Throttle", "also_paced_by")

#: A second throttle that every `acquire` in this context waits on too (`also_paced_by`).
_ALSO: ContextVar[Throttle | None] = ContextVar("tierpipe_also_paced_by", default=None)


@contextlib.contextmanager
def also_paced_by(throttle: Throttle | None) -> Iterator[None]:
    """Within this block (and the tasks started in it), every throttle's `acquire` also waits
    on `throttle` (None: nothing more)."""
    token = _ALSO.set(throttle)
    try:
        yield
    finally:
        _ALSO.reset(token)


class Throttle:
    """Token bucket in bytes/s, shared by every upload of one process.

    Args:
        rate_bytes_per_s: sustained rate; None or 0 means unlimited.
        burst_bytes: credit an idle bucket may accumulate (how far it may run ahead).
    """

    def __init__(self, rate_bytes_per_s: float | None, *, burst_bytes: int = 4 << 20) -> None:
        if burst_bytes <= 0:
            raise ValueError(f"burst_bytes must be positive (got {burst_bytes})")
        self.burst_bytes = burst_bytes
        self._rate = self._check(rate_bytes_per_s)
        self._tokens = float(burst_bytes)
        self._stamp: float | None = None
        self._paused = False
        self._changed = anyio.Event()
        self._lock = anyio.Lock()
        #: Time uploads spent waiting for the rate (or a pause) so far.
        self.waited_s = 0.0

    @property
    def rate(self) -> float | None:
        """Current rate in bytes/s (None: unlimited)."""
        return self._rate

    @property
    def paused(self) -> bool:
        return self._paused

    def set_rate(self, rate_bytes_per_s: float | None) -> None:
        """Change the rate; waiting uploads continue at the new rate at once."""
        self._refill()
        self._rate = self._check(rate_bytes_per_s)
        self._wake()

    def pause(self) -> None:
        """Hold every upload before its next piece until `resume()`."""
        self._paused = True
        self._wake()

    def resume(self) -> None:
        self._paused = False
        self._refill()
        self._wake()

    async def acquire(self, nbytes: int) -> None:
        """Wait until `nbytes` may be sent (first come, first served), and until the throttle
        of `also_paced_by` lets them through too."""
        await self._take(nbytes)
        also = _ALSO.get()
        if also is not None and also is not self:
            await also._take(nbytes)

    async def _take(self, nbytes: int) -> None:
        t0 = anyio.current_time()
        try:
            await self._take_now(nbytes)
        finally:
            self.waited_s += anyio.current_time() - t0

    async def _take_now(self, nbytes: int) -> None:
        async with self._lock:
            while True:
                changed = self._changed
                if self._paused:
                    await changed.wait()
                    continue
                self._refill()
                if self._rate is None or self._tokens >= min(nbytes, self.burst_bytes):
                    # Going into debt for requests above the burst keeps the long-run rate
                    # exact while letting any size through.
                    self._tokens -= nbytes if self._rate is not None else 0
                    return
                wait = (min(nbytes, self.burst_bytes) - self._tokens) / self._rate
                with anyio.move_on_after(wait):
                    await changed.wait()

    def _refill(self) -> None:
        now = anyio.current_time()
        if self._stamp is not None and self._rate is not None and not self._paused:
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @staticmethod
    def _check(rate: float | None) -> float | None:
        if rate is None or rate == 0:
            return None
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate must be a positive number of bytes/s or 0/None (got {rate})")
        return float(rate)


class JobThrottles:
    """One throttle per job that has a job-wide flush budget, at this node's share of it
    (`tierpipe.schemas.jobstate.Shares`); a job without one has none (the node's rate alone)."""

    def __init__(self) -> None:
        self._throttles: dict[str, Throttle] = {}

    def set_share(self, job: str, rate_bytes_per_s: int) -> None:
        """This node's share of `job`'s budget is now `rate_bytes_per_s` (0: no job cap);
        uploads of the job already waiting go on at the new rate."""
        if not rate_bytes_per_s:
            self._throttles.pop(job, None)
        elif (throttle := self._throttles.get(job)) is not None:
            throttle.set_rate(rate_bytes_per_s)
        else:
            self._throttles[job] = Throttle(rate_bytes_per_s)

    def of(self, job: str) -> Throttle | None:
        """The job's own throttle, or None if it has no job-wide budget."""
        return self._throttles.get(job)
