"""How the S3 store meets a busy store: retries with jittered backoff, and a concurrency limit
that adapts to throttling.

S3 sustains a bounded request rate per key prefix and answers above it with HTTP 503 `SlowDown`
(other stores: `RequestLimitExceeded`, `Throttling`, 429). Every request of an `S3Store` goes
through its `Requests`: it takes a slot of the store's `ConcurrencyLimit`, sends the request,
and on a throttling reply halves the limit (AIMD: one halving per round of requests, floor 1;
after a window of successes, one more slot, up to `s3_max_concurrent_requests`) and tries again
after a "full jitter" wait: random between 0 and `retry_base_s * 2**n`, capped at `retry_max_s`,
at most `s3_throttle_retries` times. Random waits keep thousands of uploaders that were throttled
together from coming back together. Any other outage (a dropped connection, a 500) is retried
once after a short jittered wait; beyond that it is the stage's business (nak, retry later).

botocore's own retries are off (`total_max_attempts=1` in `S3Store`): its standard mode retries
`SlowDown` too, on its own schedule and blind to the limit, so a throttle would be answered by
two policies at once and the limit would see only the replies that survived botocore's retry.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
import structlog

from tierpipe.errors import StorageUnavailableError
from tierpipe.settings import Settings
from tierpipe.storage.s3.client import S3Client
from tierpipe.storage.s3.errors import Throttled, translate_errors

__all__ = ("ConcurrencyLimit", "Requests", "full_jitter")

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Beyond this the exponential cap has long reached any sane `retry_max_s`.
_MAX_EXPONENT = 32


def full_jitter(
    attempt: int, *, base_s: float, cap_s: float, rand: Callable[[], float] = random.random
) -> float:
    """The wait before retry `attempt` (0 for the first): uniform between 0 and
    `min(cap_s, base_s * 2**attempt)` ("full jitter")."""
    return float(rand() * min(cap_s, base_s * 2 ** min(attempt, _MAX_EXPONENT)))


class ConcurrencyLimit:
    """How many requests may be in flight: additive increase, multiplicative decrease.

    `throttled` halves the limit (floor 1), but only once per round: a request admitted before
    the last halving that comes back throttled was sent at the old rate, and halving again for
    it would collapse the limit to 1 on one burst of replies (as TCP halves once per window, not
    once per lost packet). `succeeded` adds one slot after as many successes as the limit (one
    window), up to `maximum`. Requests over a lowered limit finish; new ones wait.
    """

    def __init__(self, maximum: int) -> None:
        if maximum < 1:
            raise ValueError(f"maximum must be at least 1 (got {maximum})")
        self.maximum = maximum
        self.limit = maximum
        self.in_flight = 0
        self._round = 0
        self._successes = 0
        self._changed = anyio.Event()

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[int]:
        """Hold one slot (waiting while the limit is reached); yields the round it was taken in,
        for `throttled`."""
        while self.in_flight >= self.limit:
            await self._changed.wait()
        self.in_flight += 1
        try:
            yield self._round
        finally:
            self.in_flight -= 1
            self._wake()

    def throttled(self, admitted: int) -> bool:
        """A request admitted in round `admitted` was throttled: halve the limit unless that
        round was already answered. Returns whether the limit was lowered."""
        if admitted != self._round:
            return False
        self._round += 1
        self._successes = 0
        self.limit = max(1, self.limit // 2)
        return True

    def succeeded(self) -> bool:
        """A request succeeded. Returns whether the limit was raised."""
        if self.limit >= self.maximum:
            return False
        self._successes += 1
        if self._successes < self.limit:
            return False
        self._successes = 0
        self.limit += 1
        self._wake()
        return True

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class Requests:
    """Every request of one S3 store: admitted by its limit, retried as the module says."""

    def __init__(self, client: S3Client, limit: ConcurrencyLimit, settings: Settings) -> None:
        #: The store's aioboto3 S3 client.
        self.client = client
        self.limit = limit
        self._base_s = settings.retry_base_s
        self._cap_s = settings.retry_max_s
        self._throttle_retries = settings.s3_throttle_retries

    async def __call__(self, key: str, request: Callable[[], Awaitable[T]]) -> T:
        """Run `request` (one S3 request, its reply body read too) with botocore's exceptions
        translated (see `errors`); `key` names it in errors and logs.

        Raises:
            StorageUnavailableError: still throttled after `s3_throttle_retries` retries, or
                an outage that outlived one retry.
            Whatever else `translate_errors` or `request` raise, at once.
        """
        throttled = transient = 0
        while True:
            async with self.limit.slot() as admitted:
                try:
                    async with translate_errors(key):
                        result = await request()
                except Throttled as e:
                    self.limit.throttled(admitted)
                    if throttled >= self._throttle_retries:
                        raise
                    error: StorageUnavailableError = e
                    wait = full_jitter(throttled, base_s=self._base_s, cap_s=self._cap_s)
                    throttled += 1
                except StorageUnavailableError as e:
                    if transient >= 1:
                        raise
                    error, transient = e, transient + 1
                    wait = full_jitter(0, base_s=self._base_s, cap_s=self._cap_s)
                else:
                    self.limit.succeeded()
                    return result
            if isinstance(error, Throttled):
                log.warning("s3_throttled", key=key, attempt=throttled, wait_s=round(wait, 3),
                            limit=self.limit.limit, error=str(error))  # fmt: skip
            else:
                log.info("s3_request_retried", key=key, wait_s=round(wait, 3), error=str(error))
            await anyio.sleep(wait)
