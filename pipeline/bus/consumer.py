"""How messages reach a stage's worker, and how the worker stops taking them.

The durable pull consumers on a job's stream: created or updated (`ensure_consumer`), bound
(`pull`), read (`fetch`) and told apart from an outage when gone (`missing`), with nats-py's
exceptions raised as `BusError` / `BusUnavailableError`. `StageConsumer` is the stage's own:
bound at start, rebuilt when it or its stream is gone. `Drain` tracks the process's in-flight
work, so a stop lets it finish in time. Plus what the runner and the consumer share: the retry
delay (`backoff`) and best-effort acks (`quietly`). A stage has one consumer per job it serves on
this node, each on its job's stream, under the same durable name.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg  # the bus's message type (re-exported: `Msg`)
from nats.js import JetStreamContext, api

from tierpipe.bus.client import Bus
from tierpipe.bus.errors import UNAVAILABLE, text, translate
from tierpipe.bus.history import STREAM_NOT_FOUND
from tierpipe.errors import BusUnavailableError
from tierpipe.names import stream_name
from tierpipe.settings import Settings

__all__ = (
    "Backlog",
    "Drain",
    "Missing",
    "Msg",
    "StageConsumer",
    "backlogs",
    "backoff",
    "ensure_consumer",
    "fetch",
    "missing",
    "pull",
    "quietly",
    "text",
)

log = structlog.get_logger(__name__)

#: The JetStream API's error code for a consumer that does not exist.
_CONSUMER_NOT_FOUND = 10014
#: What `missing` found gone.
Missing = Literal["stream", "consumer"]


async def ensure_consumer(bus: Bus, job: str, durable: str, filters: list[str]) -> None:
    """Create or update a durable pull consumer on `job`'s stream, explicit acks (idempotent)."""
    s = bus.settings
    config = api.ConsumerConfig(
        name=durable,
        durable_name=durable,
        filter_subjects=filters if len(filters) > 1 else None,
        filter_subject=filters[0] if len(filters) == 1 else None,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=s.ack_wait_s,
        max_deliver=s.max_deliver,
        max_ack_pending=s.max_ack_pending,
    )
    with translate(f"consumer {durable}"):
        await bus.js.add_consumer(stream_name(s.stream, job), config)


async def missing(bus: Bus, job: str, durable: str) -> Missing | None:
    """What of `job`'s stream and `durable` is gone: "stream" (and with it every consumer),
    "consumer", or None when both exist.

    Raises:
        BusUnavailableError: JetStream did not answer (an outage says nothing about them).
    """
    with translate(f"consumer {durable}"):
        try:
            await bus.js.consumer_info(stream_name(bus.settings.stream, job), durable)
        except nats.js.errors.NotFoundError as e:
            if e.err_code == STREAM_NOT_FOUND:
                return "stream"
            if e.err_code == _CONSUMER_NOT_FOUND:
                return "consumer"
            raise  # another "not found": a refusal (BusError)
    return None


@dataclass(frozen=True, slots=True, order=True)
class Backlog:
    """What `nats consumer info` shows of a durable consumer's backlog."""

    #: Its name: `<stage>_<node>` for a stage's (`tierpipe.names.consumer_name`).
    durable: str
    #: Messages its filter matches that it has not been delivered yet.
    pending: int
    #: Delivered and not acknowledged yet.
    ack_pending: int
    #: Delivered more than once and not acknowledged yet.
    redelivered: int


async def backlogs(bus: Bus, job: str) -> list[Backlog]:
    """The backlog of each durable consumer on `job`'s stream, by name (none: it has no
    stream). A JetStream API request per 256 consumers: for operators' tools.

    Raises:
        BusUnavailableError: JetStream did not answer.
    """
    stream = stream_name(bus.settings.stream, job)
    found: list[api.ConsumerInfo] = []
    with translate(f"consumers of {stream}", keep=(nats.js.errors.NotFoundError,)):
        try:
            while page := await bus.js.consumers_info(stream, offset=len(found) or None):
                found += page
        except nats.js.errors.NotFoundError:
            return []
    return sorted(
        Backlog(name, c.num_pending or 0, c.num_ack_pending or 0, c.num_redelivered or 0)
        for c in found
        if (name := c.config.durable_name if c.config else None)  # (not a reader's ephemeral)
    )


async def pull(bus: Bus, job: str, durable: str) -> JetStreamContext.PullSubscription:
    """A pull subscription bound to an existing durable consumer of `job`'s stream."""
    stream = stream_name(bus.settings.stream, job)
    return await bus.js.pull_subscribe_bind(durable=durable, stream=stream)


#: Messages a stage fetches at once: what it reports in one `NodeBatch` (the ranks of a node
#: saving a step publish their `staged` events together).
FETCH_BATCH = 16
#: How long a fetch waits for a message. A long poll: a message that arrives meanwhile is handed
#: over at once, so this sets only what an idle consumer costs the server (a pull request per
#: wait), not latency. An agent has a consumer per stage for every job on its node.
FETCH_WAIT_S = 5.0
#: How long a fetch that has its first message waits for the rest of its batch (events a node
#: published together arrive within it): what a lone message's hand-over costs at most.
MORE_WAIT_S = 0.005


async def fetch(
    sub: JetStreamContext.PullSubscription, *, batch: int = 1, timeout: float = 1.0
) -> list[Msg]:
    """Up to `batch` messages from a pull subscription; [] when none arrive in `timeout`.

    The wait is a pull for one message, which returns as it arrives; the rest of the batch is
    what comes within `MORE_WAIT_S` after it. (A pull for several is not waited on: when the
    server answers its first request at once with a status, say 408 "Requests Pending" while an
    earlier pull of the subscription still waits, nats-py goes on with a long pull for the whole
    batch and holds what it got until `timeout` is over: a message waited up to `FETCH_WAIT_S`.)
    """
    first = await _pull(sub, 1, timeout)
    if not first or batch <= 1:
        return first
    try:
        return first + await _pull(sub, batch - 1, MORE_WAIT_S)
    except BusUnavailableError:
        return first  # (handled now; the next fetch meets the outage)


async def _pull(sub: JetStreamContext.PullSubscription, batch: int, timeout: float) -> list[Msg]:
    try:
        return await sub.fetch(batch, timeout=timeout)
    except (nats.errors.TimeoutError, TimeoutError):  # (nats-py ends some idle pulls with the
        return []  # builtin one: nothing came, no failure)
    except UNAVAILABLE as e:
        raise BusUnavailableError(f"fetch: {text(e)}") from e
    except nats.errors.Error as e:
        raise BusUnavailableError(f"fetch: {text(e)}") from e


class StageConsumer:
    """The stage's pull subscription on one job's stream, rebuilt when its consumer or the
    stream is gone."""

    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        stage: str,
        job: str,
        durable: str,
        filters: list[str],
        sub: JetStreamContext.PullSubscription,
    ) -> None:
        self.bus, self.settings, self.stage, self.job = bus, settings, stage, job
        self.durable, self.filters, self.sub = durable, filters, sub
        self.failures = 0

    @classmethod
    async def bind(
        cls, bus: Bus, settings: Settings, stage: str, job: str, durable: str, filters: list[str]
    ) -> StageConsumer:
        """Create (or update) the durable consumer on `job`'s stream and subscribe to it."""
        await ensure_consumer(bus, job, durable, filters)
        sub = await pull(bus, job, durable)
        return cls(bus, settings, stage, job, durable, filters, sub)

    async def fetch(self, drain: Drain) -> list[Msg]:
        """The next messages (up to `FETCH_BATCH`, whatever is there), or none (after a
        failure has been dealt with)."""
        try:
            msgs = await fetch(self.sub, batch=FETCH_BATCH, timeout=FETCH_WAIT_S)
        except Exception as e:  # whatever it is, the stage must go on fetching
            await self._recover(e, drain)
            return []
        if self.failures:
            log.info("fetch_recovered", stage=self.stage, failures=self.failures)
            self.failures = 0
        return msgs

    async def _recover(self, error: Exception, drain: Drain) -> None:
        self.failures += 1
        if self.failures == 1:  # once per run of failures: an outage must not flood the log
            log.warning("fetch_failed", stage=self.stage, error=text(error))
        try:
            # A pull from a consumer that no longer exists fails at once, every time: find out
            # whether that is why, rather than waiting for an outage that is not there.
            gone = await missing(self.bus, self.job, self.durable)
            if gone is not None:
                await self._recreate(gone)
                return
        except Exception as e:  # an outage, most likely: wait and fetch again
            log.debug("consumer_check_failed", stage=self.stage, error=text(e))
        # Fetching is cheap: retry soon after an outage ends, whatever retry_max_s says.
        await drain.sleep(backoff(self.settings, self.failures, cap_s=5.0))

    async def _recreate(self, gone: Missing) -> None:
        if gone == "stream":
            await self.bus.ensure_stream(self.job)
        await ensure_consumer(self.bus, self.job, self.durable, self.filters)
        old, self.sub = self.sub, await pull(self.bus, self.job, self.durable)
        await quietly(old.unsubscribe())
        # One line per recreation (at warning: events published meanwhile may be lost).
        if gone == "stream":
            stream = stream_name(self.settings.stream, self.job)
            log.warning("stream_recreated", stage=self.stage, stream=stream)
        else:
            log.warning("consumer_recreated", stage=self.stage, consumer=self.durable)
        self.failures = 0


class Drain:
    """In-flight work of this process; on stop, each gets `timeout_s` more to finish."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stopping = False
        self.stopped = anyio.Event()
        self._inflight: set[anyio.CancelScope] = set()

    def begin(self) -> None:
        self.stopping = True
        self.stopped.set()
        deadline = anyio.current_time() + self.timeout_s
        for scope in self._inflight:
            scope.deadline = min(scope.deadline, deadline)

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake up when the drain begins."""
        with anyio.move_on_after(seconds):
            await self.stopped.wait()

    @contextmanager
    def work(self) -> Iterator[anyio.CancelScope]:
        # Shielded: cancelling the worker does not interrupt a half-done write; the deadline
        # set by begin() bounds how long it may still take.
        scope = anyio.CancelScope(shield=True)
        if self.stopping:
            scope.deadline = anyio.current_time() + self.timeout_s
        self._inflight.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._inflight.discard(scope)


def backoff(
    settings: Settings, n: int, *, cap_s: float | None = None, jitter: bool = True
) -> float:
    """The delay before try `n + 1`: `retry_base_s` doubling per try up to `retry_max_s`
    (and `cap_s`); with jitter, a random 50-100 % of it, so workers that failed together do not
    retry in lockstep."""
    cap = settings.retry_max_s if cap_s is None else min(cap_s, settings.retry_max_s)
    delay = min(cap, settings.retry_base_s * 2 ** min(max(n - 1, 0), 32))
    return delay * random.uniform(0.5, 1.0) if jitter else delay  # noqa: S311 (not crypto)


async def quietly(op: Awaitable[object]) -> None:
    """Acks, naks and heartbeats are best effort: a lost one means a redelivery, which the
    stages' idempotence absorbs."""
    try:
        await op
    except Exception as e:
        log.warning("ack_failed", error=text(e))
