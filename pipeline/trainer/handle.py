"""`SaveHandle`: what `Checkpointer.save()` returns, the fate of one save as its events arrive.

`Saves` keeps a Checkpointer's saves that are under way by step: it hands each handle this
rank's progress events (`staged`, `written`, `verified`, `failed`) as the bus client receives
them, looks up the events a waiting handle may have missed across a reconnect, counts the saves
(`SaveStats`) and logs how each ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import structlog

from tierpipe.bus.consumer import Msg
from tierpipe.errors import ShardFailedError, TierpipeError
from tierpipe.schemas import Event, ShardEvent, ShardStaged, StageFailed, decode_event

__all__ = ("Milestone", "SaveHandle", "SaveStats", "Saves")

log = structlog.get_logger(__name__)

Milestone = Literal["staged", "written", "verified"]
_ORDER: dict[str, int] = {"staged": 0, "written": 1, "verified": 2}
#: How often a waiting handle asks its owner for events missed while disconnected.
_POLL_S = 1.0


@dataclass(slots=True)
class SaveStats:
    """Counters of this Checkpointer's saves."""

    #: Saves copied into a staging slot.
    staged: int = 0
    #: Saves skipped for want of a free slot (`slot_policy = "skip"`).
    skipped: int = 0
    #: Saves that failed (their handles say why).
    failed: int = 0
    #: The last staged save's seconds from `save()` to its copy done (a blocking save's stall).
    last_stall_s: float = 0.0


class SaveHandle:
    """The fate of one `save()`: reads like a `concurrent.futures.Future` whose result is the
    `verified` event, plus `wait(milestone)` and `wait_staged()`.

    Not a `Future` subclass: it passes through milestones before its result, its waits look up
    events missed across a reconnect (a `Future`'s own waits, and `concurrent.futures.wait()`,
    would block past them), and a save cannot be cancelled.
    """

    def __init__(
        self,
        step: int,
        *,
        catch_up: Callable[[SaveHandle], None] | None = None,
        skipped: bool = False,
    ) -> None:
        #: The step this save is of.
        self.step = step
        #: The save was skipped: no staging slot was free (`slot_policy = "skip"`).
        self.skipped = skipped
        self._catch_up = catch_up
        self._cond = threading.Condition()
        self._events: dict[str, Event] = {}
        self._error: BaseException | None = None
        self._staged = threading.Event()
        if skipped:
            self._staged.set()

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "failed"
            if self._error
            else max(self._events, key=_ORDER.__getitem__, default="copying")
        )
        return f"<SaveHandle step={self.step} {state}>"

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the copy is complete and `staged` is published (overlapped mode).

        Raises:
            TimeoutError: not staged within `timeout`.
            TierpipeError: the copy or the publish failed.
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"step {self.step} not staged within {timeout} s")
        with self._cond:
            if self._error is not None and "staged" not in self._events:
                raise self._error

    def wait(self, until: Milestone = "verified", timeout: float | None = None) -> Event | None:
        """Block until the shard reached `until` (`staged`, `written` or `verified`).

        Returns:
            The event that proved it (None for a skipped save).

        Raises:
            TimeoutError: not reached within `timeout`.
            ShardFailedError: a stage failed permanently for this shard.
        """
        if until not in _ORDER:
            raise ValueError(f"until must be one of {list(_ORDER)} (got {until!r})")
        if self.skipped:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        want = _ORDER[until]
        while True:
            with self._cond:
                reached = [k for k in self._events if _ORDER[k] >= want]
                if reached:
                    return self._events[min(reached, key=_ORDER.__getitem__)]
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"step {self.step} not {until} within {timeout} s")
                self._cond.wait(_POLL_S if left is None else min(left, _POLL_S))
            if self._catch_up is not None and "staged" in self._events:
                self._catch_up(self)  # events missed while disconnected

    def done(self) -> bool:
        """Whether the save is over: verified, failed or skipped."""
        with self._cond:
            return self.skipped or self._error is not None or "verified" in self._events

    def result(self, timeout: float | None = None) -> Event | None:
        """The `verified` event (None for a skipped save); raises what made the save fail."""
        return self.wait("verified", timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What made the save fail, once it is over (None: verified or skipped).

        Raises:
            TimeoutError: the save is not over within `timeout` seconds.
        """
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def _on_event(self, event: Event) -> None:
        with self._cond:
            if isinstance(event, StageFailed):
                if not event.retryable and self._error is None:
                    self._error = ShardFailedError(event.stage, event.error, event.message)
            else:
                kind = type(event).__struct_config__.tag
                if kind in _ORDER:
                    self._events.setdefault(kind, event)
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._staged.set()


class Saves:
    """A Checkpointer's saves under way, by step.

    Args:
        job, rank, epoch: whose saves (events of other epochs are another run's).
        newest: the newest event of this rank on this node of a kind (`verified`, ...), looked
            up on the stream; raises `TierpipeError` or `TimeoutError` when it cannot.
    """

    def __init__(
        self, *, job: str, rank: int, epoch: int, newest: Callable[[str], Event | None]
    ) -> None:
        self.job = job
        self.rank = rank
        self.epoch = epoch
        self.stats = SaveStats()
        self._newest = newest
        self._lock = threading.Lock()
        self._handles: dict[int, SaveHandle] = {}
        #: step -> the agent's newest retryable failure report of that save (NVMe full, an
        #: outage), until the save ends: what a wait for its slot names.
        self._troubles: dict[int, StageFailed] = {}

    def start(self, step: int) -> SaveHandle:
        """The handle of a save whose copy begins."""
        handle = SaveHandle(step, catch_up=self.catch_up)
        with self._lock:
            self._handles[step] = handle
        return handle

    def skipped(self, step: int, busy_steps: list[int]) -> SaveHandle:
        """The handle of a save skipped for want of a free slot (policy `skip`)."""
        self.stats.skipped += 1
        log.warning(
            "save_skipped",
            job=self.job,
            step=step,
            rank=self.rank,
            reason="no free staging slot",
            busy_steps=busy_steps,
        )
        return SaveHandle(step, skipped=True)

    def staged(self, handle: SaveHandle, event: ShardStaged) -> None:
        """`handle`'s `staged` event is published."""
        handle._on_event(event)
        handle._staged.set()
        self.stats.staged += 1
        self.stats.last_stall_s = event.stall_s
        log.debug(
            "shard_staged",
            job=self.job,
            step=handle.step,
            rank=self.rank,
            nbytes=event.nbytes,
            stall_s=event.stall_s,
            blocking=event.blocking,
        )

    def failed(self, handle: SaveHandle, error: BaseException) -> None:
        """`handle`'s save is void: its copy or its `staged` event failed."""
        self.stats.failed += 1
        log.error(
            "save_failed",
            job=self.job,
            step=handle.step,
            rank=self.rank,
            error=str(error) or type(error).__name__,
            error_type=type(error).__name__,
        )
        handle._fail(error)
        with self._lock:
            self._handles.pop(handle.step, None)

    async def on_msg(self, msg: Msg) -> None:
        """The bus client's callback for this rank's events on this node."""
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.route(event)

    def route(self, event: Event) -> None:
        """Hand a progress event of this rank to its save's handle (if it is one of ours)."""
        if not isinstance(event, ShardEvent | StageFailed) or event.step is None:
            return  # (restore reports and plans concern no save)
        if event.epoch != self.epoch:
            return  # another run's save of the same step (a write-back, an older epoch)
        step = event.step
        with self._lock:
            handle = self._handles.get(step)
            if _terminal(event):
                self._troubles.pop(step, None)
                if handle is not None:
                    self._handles.pop(step, None)
            elif isinstance(event, StageFailed) and len(self._troubles) < 64:
                self._troubles[step] = event  # (retryable: the agent keeps trying)
        if handle is not None:
            handle._on_event(event)

    def catch_up(self, handle: SaveHandle) -> None:
        """Look up the newest events of this rank directly (after a reconnect gap)."""
        for kind in ("verified", "written", "failed"):
            try:
                event = self._newest(kind)
            except (TierpipeError, TimeoutError):
                return
            if (
                isinstance(event, ShardEvent | StageFailed)
                and event.step == handle.step
                and event.epoch == self.epoch
            ):
                handle._on_event(event)

    def troubles(self) -> dict[int, StageFailed]:
        """step -> the agent's newest retryable failure report of a save not over yet."""
        with self._lock:
            return dict(self._troubles)

    def pending(self) -> list[SaveHandle]:
        """The handles of the saves neither verified nor failed yet."""
        with self._lock:
            return list(self._handles.values())


def _terminal(event: Event) -> bool:
    return type(event).__struct_config__.tag == "verified" or (
        isinstance(event, StageFailed) and not event.retryable
    )
