"""The stage runner: the one place that owns delivery semantics for every stage.

A stage supplies a handler `async (event, attempt) -> None` that commits its side effects and
publishes its output event. The runner pulls from the stage's durable consumer and:

- acks after the handler returns (side effects are committed before the ack);
- sends `in_progress()` heartbeats while the handler runs, so long work is not redelivered;
- on `UnavailableError` (an outage of NATS or the object store) keeps the message and retries
  the handler in place with capped, jittered backoff for as long as the outage lasts, reporting
  a retryable `failed` event on the first try and then at most once a minute;
- on another `RetryableError` publishes a retryable `failed` event and naks with a growing
  delay, until `max_deliver` attempts, then gives up as below;
- on `PermanentError` publishes a `failed` event and terminates the message;
- on any other exception (a bug, or input nobody foresaw) logs `handler_crashed` with the
  traceback, terminates the message with a `failed` event, and goes on: no message content can
  stop a worker;
- terminates and reports a message it cannot decode (or of an unknown schema version);
- when its stream or consumer disappears (deleted, or lost by the server), creates them again,
  says so once, and goes on;
- on SIGTERM/SIGINT stops fetching and lets in-flight work finish for up to `drain_timeout_s`
  (an outage being waited out is handed back at once).
"""

from __future__ import annotations

import contextvars
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from structlog.contextvars import bound_contextvars

from tierpipe.bus import Bus
from tierpipe.errors import (
    PermanentError,
    RetryableError,
    TierpipeError,
    UnavailableError,
)
from tierpipe.log import register_secrets, settings_secrets
from tierpipe.names import SUBJECT_ROOT, consumer_name, filter_subject, validate_token
from tierpipe.schemas import Event, ShardEvent, StageFailed, decode_event
from tierpipe.settings import Settings

__all__ = ["Handler", "StageFn", "run_agent", "serve"]

log = structlog.get_logger(__name__)

Handler = Callable[[Any, int], Awaitable[None]]
StageFn = Callable[..., Awaitable[None]]

#: During an outage, a retryable `failed` event is published at most this often per message.
OUTAGE_REPORT_EVERY_S = 60.0


class _Drain:
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


_drain: contextvars.ContextVar[_Drain | None] = contextvars.ContextVar(
    "tierpipe_drain", default=None
)


async def serve(
    bus: Bus,
    settings: Settings,
    *,
    stage: str,
    node: str,
    kinds: tuple[str, ...],
    handler: Handler,
    every_node: bool = False,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run `handler` for every event of `kinds` published on `node` (or on any node with
    `every_node`), forever, on the stage's durable consumer for this node."""
    durable = consumer_name(stage, node)
    filters = [filter_subject(k, node="*" if every_node else node) for k in kinds]
    await bus.ensure_consumer(durable, filters)
    consumer = _Consumer(bus, settings, stage, durable, filters, await bus.pull(durable))
    drain = _drain.get() or _Drain(settings.drain_timeout_s)
    log.info("stage_started", stage=stage, node=node, consumer=durable)
    task_status.started()
    worker = _Worker(bus, settings, stage, node, kinds, handler, drain)
    while not drain.stopping:
        for msg in await consumer.fetch(drain):
            await worker.process(msg)


class _Consumer:
    """The stage's pull subscription, rebuilt when its consumer or the whole stream is gone."""

    def __init__(
        self, bus: Bus, settings: Settings, stage: str, durable: str, filters: list[str], sub: Any
    ) -> None:
        self.bus, self.settings, self.stage = bus, settings, stage
        self.durable, self.filters, self.sub = durable, filters, sub
        self.failures = 0

    async def fetch(self, drain: _Drain) -> list[Any]:
        """The next message, or none (after a failure has been dealt with)."""
        try:
            msgs = await self.bus.fetch(self.sub, batch=1, timeout=1.0)
        except Exception as e:  # whatever it is, the stage must go on fetching
            await self._recover(e, drain)
            return []
        if self.failures:
            log.info("fetch_recovered", stage=self.stage, failures=self.failures)
            self.failures = 0
        return msgs

    async def _recover(self, error: Exception, drain: _Drain) -> None:
        self.failures += 1
        if self.failures == 1:  # once per run of failures: an outage must not flood the log
            log.warning("fetch_failed", stage=self.stage, error=_text(error))
        try:
            # A pull from a consumer that no longer exists fails at once, every time: find out
            # whether that is why, rather than waiting for an outage that is not there.
            gone = await self.bus.missing(self.durable)
            if gone is not None:
                await self._recreate(gone)
                return
        except Exception as e:  # an outage, most likely: wait and fetch again
            log.debug("consumer_check_failed", stage=self.stage, error=_text(e))
        # Fetching is cheap: retry soon after an outage ends, whatever retry_max_s says.
        await drain.sleep(_backoff(self.settings, self.failures, cap_s=5.0))

    async def _recreate(self, gone: str) -> None:
        if gone == "stream":
            await self.bus.ensure_stream()
        await self.bus.ensure_consumer(self.durable, self.filters)
        old, self.sub = self.sub, await self.bus.pull(self.durable)
        await _quietly(old.unsubscribe())
        # One line per recreation (at warning: events published meanwhile may be lost).
        if gone == "stream":
            log.warning("stream_recreated", stage=self.stage, stream=self.settings.stream)
        else:
            log.warning("consumer_recreated", stage=self.stage, consumer=self.durable)
        self.failures = 0


class _Worker:
    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        stage: str,
        node: str,
        kinds: tuple[str, ...],
        handler: Handler,
        drain: _Drain,
    ) -> None:
        self.bus, self.settings, self.stage, self.node = bus, settings, stage, node
        self.kinds, self.handler, self.drain = kinds, handler, drain

    async def process(self, msg: Any) -> None:
        """Handle one message to its end (ack, nak or term); never raises, whatever the
        message holds or the handler does."""
        try:
            await self._process(msg)
        except Exception as e:  # the runner's own last line of defence
            log.error("message_processing_crashed", subject=msg.subject, exc_info=e)
            await _quietly(msg.term())

    async def _process(self, msg: Any) -> None:
        meta = msg.metadata
        attempt, seq = meta.num_delivered, meta.sequence.stream
        try:
            event = decode_event(msg.data)
            self._check_subject(event, msg.subject)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            await self._poison(msg, seq, attempt, e)
            return
        ctx: dict[str, Any] = {"stage": self.stage, "job": event.job}
        if isinstance(event, ShardEvent):
            ctx.update(step=event.step, rank=event.rank)
        with bound_contextvars(**ctx):
            with self.drain.work() as scope:
                await self._handle(msg, event, seq, attempt)
            if scope.cancelled_caught:
                # The drain deadline passed mid-work: hand the message back for prompt redelivery.
                log.warning("work_abandoned_on_stop", attempt=attempt)
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await _quietly(msg.nak())

    async def _handle(self, msg: Any, event: Event, seq: int, attempt: int) -> None:
        t0 = time.perf_counter()
        tries = attempt
        error = await self._run(msg, event, tries)
        outage = 0
        reported = -OUTAGE_REPORT_EVERY_S
        while isinstance(error, UnavailableError):
            # An outage: keep the message and try again in place, for as long as it lasts.
            if self.drain.stopping:
                log.warning("outage_handed_back", attempt=tries, error=_text(error))
                await _quietly(msg.nak())
                return
            outage += 1
            if time.monotonic() - reported >= OUTAGE_REPORT_EVERY_S:
                reported = time.monotonic()
                log.warning("outage_retrying", error=type(error).__name__,
                            message=_text(error), attempt=tries)  # fmt: skip
                if not self._own_report(event):
                    await self._report(
                        self._failure(msg, event, seq, tries, error, _text(error), retryable=True)
                    )
            await self._idle(msg, _backoff(self.settings, outage))
            if self.drain.stopping:
                continue  # handed back above
            tries += 1
            error = await self._run(msg, event, tries)
        if error is None:
            await _quietly(msg.ack())
            log.debug("message_acked", attempt=tries, seconds=round(time.perf_counter() - t0, 4))
        elif isinstance(error, PermanentError):
            await self._fail(msg, event, seq, attempt, tries, error, retryable=False)
        elif isinstance(error, RetryableError):
            await self._fail(msg, event, seq, attempt, tries, error, retryable=True)
        else:
            # Not an error any stage raises on purpose: a bug, or input nobody foresaw.
            # Retrying cannot help; report it and keep serving the other messages.
            log.error("handler_crashed", attempt=tries, exc_info=error)
            await self._fail(msg, event, seq, attempt, tries, error, retryable=False)

    async def _run(self, msg: Any, event: Event, tries: int) -> BaseException | None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, msg)
            try:
                await self.handler(event, tries)
            except Exception as e:
                return _unwrap(e)
            finally:
                tg.cancel_scope.cancel()
        return None

    async def _idle(self, msg: Any, seconds: float) -> None:
        """Wait between tries, keeping the message ours; wake up when the drain begins."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, msg)
            await self.drain.sleep(seconds)
            tg.cancel_scope.cancel()

    async def _heartbeat(self, msg: Any) -> None:
        while True:
            await anyio.sleep(self.settings.ack_wait_s / 3)
            await _quietly(msg.in_progress())

    async def _fail(
        self,
        msg: Any,
        event: Event,
        seq: int,
        attempt: int,
        tries: int,
        e: BaseException,
        *,
        retryable: bool,
    ) -> None:
        final = not retryable or attempt >= self.settings.max_deliver
        text = _text(e)
        if retryable and final:
            text = f"gave up after {attempt} attempts: {text}"
        if self._own_report(event):
            # Failing on this stage's own failure report: reporting that would feed itself.
            log.error("own_failure_unprocessed", error=type(e).__name__, message=text)
            await _quietly(msg.term())
            return
        await self._report(self._failure(msg, event, seq, tries, e, text, retryable=not final))
        if final:
            log.error("message_terminated", error=type(e).__name__, message=text, attempt=tries)
            await _quietly(msg.term())
        else:
            delay = _backoff(self.settings, attempt, jitter=False)
            log.warning(
                "message_retried",
                error=type(e).__name__,
                message=text,
                attempt=tries,
                delay_s=delay,
            )
            await _quietly(msg.nak(delay=delay))

    def _own_report(self, event: Event) -> bool:
        """Whether `event` is a failure this stage of this node reported (evict reads them)."""
        return (
            isinstance(event, StageFailed) and event.stage == self.stage and event.node == self.node
        )

    def _failure(
        self,
        msg: Any,
        event: Event,
        seq: int,
        tries: int,
        e: BaseException,
        text: str,
        *,
        retryable: bool,
    ) -> StageFailed:
        """The `failed` event for any input, with the identity fields the input has."""
        fields: dict[str, Any] = {
            "stage": self.stage,
            "error": type(e).__name__,
            "message": text,  # Bus.publish masks secrets in it
            "retryable": retryable,
            "attempt": max(1, tries),
            "subject": msg.subject,
            "stream_seq": seq,
        }
        if isinstance(event, ShardEvent):
            return event.follow(StageFailed, node=self.node, **fields)
        return StageFailed(
            job=event.job,
            node=self.node,
            ts=time.time(),
            step=getattr(event, "step", None),
            rank=getattr(event, "rank", None),
            world_size=getattr(event, "world_size", None),
            epoch=getattr(event, "epoch", 0),
            **fields,
        )

    async def _poison(self, msg: Any, seq: int, attempt: int, e: Exception) -> None:
        tokens = msg.subject.split(".")
        try:
            job = validate_token("job", tokens[1])
        except (IndexError, TierpipeError):
            job = "_unknown"
        text = f"undecodable message on {msg.subject} (stream seq {seq}): {e}"
        log.error("message_poisoned", subject=msg.subject, stream_seq=seq, error=str(e))
        await self._report(
            StageFailed(
                job=job,
                node=self.node,
                ts=time.time(),
                stage=self.stage,
                error=type(e).__name__,
                message=text,
                retryable=False,
                attempt=max(1, attempt),
                subject=msg.subject,
                stream_seq=seq,
            )
        )
        await _quietly(msg.term())

    async def _report(self, failure: StageFailed) -> None:
        """Publish a failure; a report that cannot be published is logged, never raised."""
        try:
            await self.bus.publish(failure)
        except Exception as e:
            log.error("failure_not_published", error=_text(e), failure=failure.message)

    def _check_subject(self, event: Event, subject: str) -> None:
        kind = type(event).__struct_config__.tag
        if kind not in self.kinds:
            raise ValueError(f"a {kind!r} event where {'/'.join(self.kinds)} was expected")
        rank = getattr(event, "rank", None)
        expected = f"{SUBJECT_ROOT}.{event.job}.{kind}.{event.node}.{'_' if rank is None else rank}"
        if subject != expected:
            raise ValueError(f"event body names {expected}")


def _backoff(
    settings: Settings, n: int, *, cap_s: float | None = None, jitter: bool = True
) -> float:
    """The delay before try `n + 1`: `retry_base_s` doubling per try up to `retry_max_s`
    (and `cap_s`); with jitter, a random 50-100 % of it, so workers that failed together do not
    retry in lockstep."""
    cap = settings.retry_max_s if cap_s is None else min(cap_s, settings.retry_max_s)
    delay = min(cap, settings.retry_base_s * 2 ** min(max(n - 1, 0), 32))
    return delay * random.uniform(0.5, 1.0) if jitter else delay  # noqa: S311 (not crypto)


def _unwrap(e: Exception) -> BaseException:
    """A task group's error: its only leaf (what the handler would have raised itself)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        inner = e.exceptions[0]
        if not isinstance(inner, Exception):
            break
        e = inner
    return e


def _text(e: BaseException) -> str:
    return str(e) or type(e).__name__


async def _quietly(op: Awaitable[Any]) -> None:
    """Acks, naks and heartbeats are best effort: a lost one means a redelivery, which the
    stages' idempotence absorbs."""
    try:
        await op
    except Exception as e:
        log.warning("ack_failed", error=str(e) or type(e).__name__)


async def run_agent(settings: Settings, stages: list[StageFn], *, node: str) -> None:
    """Run stages in this process until SIGTERM/SIGINT, then drain and return."""
    register_secrets(settings_secrets(settings))
    drain = _Drain(settings.drain_timeout_s)
    _drain.set(drain)
    async with Bus(settings, name=f"tierpipe-agent-{node}", connect_wait_s=60.0) as bus:
        await bus.ensure_stream()
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                for stage in stages:
                    await tg.start(stage, settings, bus)
                log.info("agent_ready", node=node, stages=len(stages))
                async for signum in signals:
                    log.info("agent_stopping", signal=signal.Signals(signum).name)
                    drain.begin()
                    tg.cancel_scope.cancel()
                    break
    log.info("agent_stopped", node=node)
