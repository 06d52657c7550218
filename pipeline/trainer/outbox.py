"""The trainer's outbox: each save's `staged` event, published off the training loop.

`save()` hands the event of a copied save here; the bus thread publishes the events one at a
time, in the order they came (an agent sees a rank's saves in step order). A publish that NATS
does not acknowledge (down, stalled, electing a leader) is tried again with a growing pause
until the save's window closes (`save_retry_s`; one try of `publish_timeout_s` for a save that
raises): the bytes wait in shared memory meanwhile, and a later success means the checkpoint
still completes. Every try publishes the same event, so the same `Nats-Msg-Id`: the stream keeps
one copy whichever tries landed. The outcome goes to the save's `done` callback, on the bus
thread: the event, or the error that ended the window.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import anyio
import structlog

from tierpipe.bus.portal import BusPortal
from tierpipe.errors import BusUnavailableError, ConfigError, TierpipeError
from tierpipe.schemas import ShardStaged

__all__ = ("Outbox", "Outcome")

log = structlog.get_logger(__name__)

#: What a save's publish came to: its event (published) or the error that ended its window.
Outcome = ShardStaged | BaseException
#: The pauses between tries grow to this.
_MAX_PAUSE_S = 5.0


class Outbox:
    """One Checkpointer's `staged` events on their way to the stream (see the module docstring)."""

    def __init__(self, portal: BusPortal, *, publish_timeout_s: float) -> None:
        self._portal = portal
        self._publish_timeout_s = publish_timeout_s
        self._order: anyio.Lock | None = None  # (made on the bus thread's loop)
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Outcome]] = set()
        #: Why the publish under way failed last ("": none failed), for the waits' warnings.
        self.trouble = ""

    def put(
        self, event: ShardStaged, *, window_s: float, done: Callable[[Outcome], None]
    ) -> concurrent.futures.Future[Outcome]:
        """Publish `event` after the events put before it, trying until `window_s` from now
        (at least once); `done` gets the outcome on the bus thread, before the future."""
        deadline = time.monotonic() + window_s
        future = self._portal.portal.start_task_soon(self._send, event, deadline, done)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._settled)
        return future

    def _settled(self, future: concurrent.futures.Future[Outcome]) -> None:
        with self._lock:
            self._pending.discard(future)

    def pending(self) -> int:
        """Saves whose `staged` event is not settled yet."""
        with self._lock:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event put so far is settled (published or given up); False if
        `timeout` passed first."""
        with self._lock:
            pending = list(self._pending)
        _, left = concurrent.futures.wait(pending, timeout)
        return not left

    async def _send(
        self, event: ShardStaged, deadline: float, done: Callable[[Outcome], None]
    ) -> Outcome:
        if self._order is None:
            self._order = anyio.Lock()
        async with self._order:  # (FIFO: in the order `put` was called)
            outcome = await self._publish(event, deadline)
            done(outcome)
        return outcome

    async def _publish(self, event: ShardStaged, deadline: float) -> Outcome:
        bus = self._portal.bus
        tried = False
        pause = 0.25
        while True:
            left = deadline - time.monotonic()
            try:
                published = await bus.publish(
                    event, timeout=max(0.5, min(self._publish_timeout_s, left))
                )
            except (BusUnavailableError, TimeoutError) as e:
                tried = True
                self.trouble = f"NATS did not take the `staged` event of step {event.step}: {e}"
                if time.monotonic() + pause >= deadline:
                    return e
                if pause == 0.25:  # (once per save: the outcome is logged either way)
                    log.warning(
                        "staged_publish_retrying", job=event.job, step=event.step,
                        rank=event.rank, error=str(e), for_s=round(deadline - time.monotonic(), 1),
                    )  # fmt: skip
                await anyio.sleep(pause)
                pause = min(pause * 2, _MAX_PAUSE_S)
                continue
            except TierpipeError as e:  # refused (permissions, a bad stream): no retry helps
                self.trouble = ""
                return e
            self.trouble = ""
            if published.duplicate and not tried:
                return ConfigError(
                    f"step {event.step} of rank {event.rank} was already staged moments ago "
                    "(duplicate event); this save is void"
                )
            return event  # (a duplicate after a try of ours: that try landed)
