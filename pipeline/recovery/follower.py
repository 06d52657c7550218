"""The restore protocol's follower: a rank other than 0 taking rank 0's plans.

Plans come live from a core NATS subscription to the plan subject, opened before anything the
rank publishes (`Plans`: no JetStream consumer per rank, as a job's ranks may be tens of
thousands), and a rank catches up on one published before it (or lost in a reconnect) with a
direct get of the newest stored plan when none came for `restore_plan_poll_s` (backing off).
`follow` loads each new plan that counts (`counts`) and returns at the final plan of the one it
loaded. Which plan counts: see `tierpipe.recovery.agree`.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.errors import BusUnavailableError, RestoreTimeoutError
from tierpipe.recovery.load import Loaded
from tierpipe.recovery.plan import Source
from tierpipe.schemas import RecoveryPlanned, RestoreReport, decode_event
from tierpipe.settings import Settings
from tierpipe.waits import Reminder

__all__ = ("ANONYMOUS", "Follower", "Plans", "decode_plan", "follow")

log = structlog.get_logger(__name__)

#: The restart id when neither torchelastic nor the caller names one: ranks then match up by
#: stream order (a report counts only if published after this rank's `ready`).
ANONYMOUS = "anonymous"

#: The catch-up reads of a rank waiting for a plan back off to this many `restore_plan_poll_s`.
_POLL_BACKOFF = 8

#: This rank's shard of a plan from its first good source (None if none), and its report.
Load = tuple[tuple[Source, Loaded] | None, RestoreReport]


class Follower(Protocol):
    """What `follow` needs of the rank's restore (`tierpipe.recovery.agree.Restorer`)."""

    job: str
    restart: str
    world_size: int
    settings: Settings
    #: The node's ranks this rank surveys for (none unless it is the local leader).
    group: range

    @property
    def deadline(self) -> float: ...
    async def load_planned(self, plan: RecoveryPlanned, round_: int) -> Load: ...
    def still_waiting(self, reminder: Reminder, waiting_for: str) -> None: ...


class _Data(Protocol):
    """A message as a core subscription delivers it: its payload is what a plan needs."""

    @property
    def data(self) -> bytes: ...


class Plans:
    """Rank 0's plans for one rank: live from a core NATS subscription to the plan subject, and
    the newest stored one on demand (`newest`, a direct get)."""

    def __init__(self, bus: Bus, subject: str) -> None:
        self._bus, self._subject = bus, subject
        self._queue: deque[RecoveryPlanned] = deque()
        self._arrived = anyio.Event()
        self._unsubscribe: Callable[[], Awaitable[None]] | None = None

    async def __aenter__(self) -> Plans:
        sub = await self._bus.subscribe(self._subject, self._on_msg)
        self._unsubscribe = sub.unsubscribe
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):  # a closed connection has no subscription left
            if self._unsubscribe is not None:
                await self._unsubscribe()

    async def _on_msg(self, msg: _Data) -> None:
        plan = decode_plan(msg.data)
        if plan is not None:
            self._queue.append(plan)
            self._arrived.set()

    async def next(self, timeout: float) -> RecoveryPlanned | None:
        """The next plan that arrived (None: none within `timeout` seconds)."""
        if not self._queue and timeout > 0:
            self._arrived = anyio.Event()  # (an anyio Event is not cleared: a fresh one)
            with anyio.move_on_after(timeout):
                await self._arrived.wait()
        return self._queue.popleft() if self._queue else None

    async def newest(self) -> tuple[int, RecoveryPlanned] | None:
        """(stream seq, plan) of the newest stored plan, or None (none, or no answer: the
        subscription may still bring it, and the next catch-up asks again)."""
        try:
            found = await self._bus.last_raw(self._subject)
        except BusUnavailableError as e:
            log.warning("restore_plan_catch_up_failed", subject=self._subject, error=str(e))
            return None
        plan = None if found is None else decode_plan(found[1])
        return None if found is None or plan is None else (found[0], plan)


def decode_plan(data: bytes) -> RecoveryPlanned | None:
    """The plan in `data` (None: not one, or garbled)."""
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        event = decode_event(data)
        if isinstance(event, RecoveryPlanned):
            return event
    return None


async def follow(
    r: Follower,
    plans: Plans,
    since: int,
    poll_s: float,
    raise_error: Callable[[RecoveryPlanned], None],
) -> tuple[RecoveryPlanned, tuple[Source, Loaded]]:
    """Take rank 0's plans (see `tierpipe.recovery.agree` for which count), load each new one,
    and return at the final plan of the one loaded, with this rank's shard. `since`: the stream
    seq of this rank's `ready` (0: it sent none); `raise_error`: raises what rank 0 met.

    Raises:
        RestoreTimeoutError: no (final) plan came before the restore's deadline.
    """
    held: RecoveryPlanned | None = None  # the plan this rank loaded
    mine = None
    jitter = random.random()  # noqa: S311 (spreading reads, not secrets)
    first = poll_s * (1.0 if r.group else 1.0 + jitter)
    poll_at, every = time.monotonic() + first, poll_s
    reminder = Reminder(r.settings.wait_warning_s)
    while True:
        live = await plans.next(min(poll_at, r.deadline, reminder.next_at) - time.monotonic())
        got: tuple[RecoveryPlanned, int | None] | None = None
        if live is not None:
            got = (live, None)
        elif reminder.due():
            r.still_waiting(reminder, "rank 0's plan" if held is None else "rank 0's word")
        elif time.monotonic() >= r.deadline:
            raise RestoreTimeoutError(
                r.job, r.restart, r.settings.restore_timeout_s, "no plan from rank 0"
            )
        elif time.monotonic() >= poll_at:
            # (backing off: a long restore of many ranks is not also a stream of reads)
            every = min(every * 2, poll_s * _POLL_BACKOFF)
            poll_at = time.monotonic() + every
            stored = await plans.newest()
            if stored is not None:
                got = (stored[1], stored[0])
        if got is None or not counts(r, *got, since=since, held=held):
            continue
        plan = got[0]
        if plan.error:
            raise_error(plan)
        key = (plan.round, plan.step)
        if plan.final:
            if held is not None and mine is not None and key == (held.round, held.step):
                return plan, mine
            continue  # (an older restart's, or one this rank did not load: not its answer)
        if held is not None and key == (held.round, held.step):
            continue  # (the same plan again: live and stored)
        held = plan
        mine, _ = await r.load_planned(plan, plan.round)


def counts(
    r: Follower,
    plan: RecoveryPlanned,
    seq: int | None,
    *,
    since: int,
    held: RecoveryPlanned | None,
) -> bool:
    """Whether `plan` (stream seq `seq`; None: it came on the subscription) is one of this
    restart's this rank must act on."""
    if plan.restart != r.restart or plan.world_size != r.world_size:
        return False
    if seq is None:
        return True
    if r.group:
        return seq > since
    if held is not None:
        return plan.round >= held.round
    return r.restart != ANONYMOUS or not plan.final
