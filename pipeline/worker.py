"""The runner's per-job worker: one stage's consumer on one job's stream, and the delivery
semantics of every message it fetches (`tierpipe.runner` starts one per job of this node). For
every message it:

- publishes what the handler returned, in order, then acks: side effects, then events, then
  the ack, so a redelivery only republishes (deduplicated by `Nats-Msg-Id`);
- sends `in_progress()` heartbeats while the handler runs, so long work is not redelivered;
- on `UnavailableError` (an outage of NATS or the object store) keeps the message and retries
  the handler in place with capped, jittered backoff for as long as the outage lasts, reporting
  a retryable `failed` event on the first try and then at most once a minute;
- on another `RetryableError` publishes a retryable `failed` event and naks with a growing
  delay (no longer than the error's `retry_after_s`, when it names one), until `max_deliver`
  attempts, then gives up as below;
- on `PermanentError` publishes a `failed` event and terminates the message;
- on any other exception (a bug, or input nobody foresaw) logs `handler_crashed` with the
  traceback, terminates the message with a `failed` event, and goes on: no message content can
  stop a worker;
- terminates and reports a message it cannot decode (or of an unknown schema version);
- writes one canonical log line per message, `message_handled` (stage, job, step, rank,
  outcome, attempt, seconds, the kinds published, plus whatever the handler bound with
  `structlog.contextvars.bind_contextvars`), at debug when the message led to nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypedDict

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import Drain, Msg, StageConsumer, backoff, quietly, text
from tierpipe.errors import (
    DuplicateEventError,
    PermanentError,
    RetryableError,
    TierpipeError,
    UnavailableError,
)
from tierpipe.faults import maybe_die
from tierpipe.log import unit_of_work
from tierpipe.metrics import METRICS
from tierpipe.names import consumer_name, event_subject, filter_subject, msg_id, validate_token
from tierpipe.schemas import (
    Event,
    NodeBatch,
    ShardEvent,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
    decode_event,
)
from tierpipe.settings import Settings

__all__ = ("OUTAGE_REPORT_EVERY_S", "Handler", "JobWorker", "Output")

log = structlog.get_logger(__name__)
_IGNORED = anyio.TASK_STATUS_IGNORED

#: What a handler returns: the events to publish before the ack, in order.
Output: TypeAlias = Event | Sequence[Event] | None
#: A stage's handler, its context bound: `handler(event, attempt)`.
Handler: TypeAlias = Callable[[Event, int], Awaitable[Output]]


#: Outputs another stage must act on (verify on `written`; evict, which frees the save's
#: staging slot, and flush on `verified`): one the server drops as a duplicate on the first
#: delivery of a message of its own (not a batch) was never seen by anyone, so the message
#: fails for good instead (a `DuplicateEventError`, whose `failed` event frees the slot).
_HANDED_ON = (ShardWritten, ShardVerified)
#: During an outage, a retryable `failed` event is published at most this often per message.
OUTAGE_REPORT_EVERY_S = 60.0
#: How one message ended, with the fields of its canonical log line.
_Outcome: TypeAlias = tuple[str, dict[str, object]]
#: The level of the canonical line, by outcome.
_LEVELS = {
    "done": logging.INFO,
    "retrying": logging.WARNING,
    "handed_back": logging.WARNING,
    "abandoned_on_stop": logging.WARNING,
    "terminated": logging.ERROR,
}


class _FailureFields(TypedDict, total=False):
    """The fields of a `failed` event that come from the failure, not from its input."""

    stage: str
    error: str
    message: str
    retryable: bool
    attempt: int
    subject: str
    stream_seq: int
    generation: int


@dataclass(frozen=True, slots=True)
class JobWorker:
    """One stage's work for one job on this node: its consumer on the job's stream, and every
    message it delivers handled to its end (ack, nak or term)."""

    bus: Bus
    settings: Settings
    stage: str
    node: str
    kinds: tuple[str, ...]
    handler: Handler
    drain: Drain
    batcher: Batcher

    async def serve(self, job: str, *, task_status: TaskStatus[None] = _IGNORED) -> None:
        """The stage's work for `job`: bind its consumer on the job's stream (started), then
        fetch and handle, until the drain."""
        durable = consumer_name(self.stage, self.node)
        filters = [filter_subject(k, node=self.node, job=job) for k in self.kinds]
        await self.bus.ensure_job_stream(job)
        consumer = await StageConsumer.bind(
            self.bus, self.settings, self.stage, job, durable, filters
        )
        log.info("job_bound", stage=self.stage, job=job, consumer=durable)
        task_status.started()
        while not self.drain.stopping:
            msgs = await consumer.fetch(self.drain)
            if not msgs:
                continue
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.keep_alive, msgs)  # (acks wait for the batches)
                for msg in msgs:
                    await self.process(msg)
                # Out even when the agent is stopping: the work is done, say so and ack it.
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.drain.timeout_s):
                    await self.batcher.flush()
                tg.cancel_scope.cancel()

    async def keep_alive(self, msgs: list[Msg]) -> None:
        """Heartbeats for the messages of one fetch until they are settled (the ones waiting
        their turn, and the ones whose acks wait for their batch)."""
        while True:
            await anyio.sleep(self.settings.ack_wait_s / 3)
            for msg in msgs:
                await quietly(msg.in_progress())

    async def process(self, msg: Msg) -> None:
        """Handle one message to its end (ack, nak or term); never raises, whatever the
        message holds or the handler does."""
        try:
            await self._process(msg)
        except Exception as e:  # the runner's own last line of defence
            log.error("message_processing_crashed", subject=msg.subject, exc_info=e)
            await quietly(msg.term())

    async def _process(self, msg: Msg) -> None:
        meta = msg.metadata
        attempt, seq = meta.num_delivered, meta.sequence.stream
        try:
            event = decode_event(msg.data)
            self._check_subject(event, msg.subject)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            message = f"undecodable message on {msg.subject} (stream seq {seq}): {e}"
            log.error("message_poisoned", subject=msg.subject, stream_seq=seq, error=str(e))
            await self._report(self._failure(msg, None, attempt, e, message, retryable=False))
            await quietly(msg.term())
            return
        if not isinstance(event, NodeBatch):
            name, _ = await self._process_one(msg, event, attempt, settle=True)
            if name == "done":
                self.batcher.ack_later(msg)
            return
        # A node's batch: each of its events in turn; the message is settled once, after all.
        names, delays = [], []
        for inner in event.events:
            name, delay = await self._process_one(msg, inner, attempt, settle=False)
            names.append(name)
            if name in ("handed_back", "abandoned_on_stop"):
                return  # (handed back already)
            if delay is not None:
                delays.append(delay)
        if "retrying" in names:
            await quietly(msg.nak(delay=min(delays, default=backoff(self.settings, attempt,
                                                                    jitter=False))))  # fmt: skip
        else:  # (done, or failed for good and reported)
            self.batcher.ack_later(msg)
        await self.batcher.flush()

    async def _process_one(
        self, msg: Msg, event: Event, attempt: int, *, settle: bool
    ) -> tuple[str, float | None]:
        """Handle one event of `msg` to its end; the outcome's name, and the delay before its
        next try when it is retrying. With `settle`, a failure terminates or naks the message
        itself (else the caller settles it)."""
        unit: dict[str, object] = {"stage": self.stage, "job": event.job}
        if isinstance(event, ShardEvent):
            unit.update(step=event.step, rank=event.rank)
        t0 = time.perf_counter()
        with unit_of_work(**unit):
            outcome: _Outcome = ("abandoned_on_stop", {"attempt": attempt})
            with self.drain.work() as scope:
                outcome = await self._handle(msg, event, attempt, settle=settle)
            if scope.cancelled_caught:
                # The drain deadline passed mid-work: hand the message back for prompt redelivery.
                outcome = ("abandoned_on_stop", {"attempt": attempt})
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await quietly(msg.nak())
            name, fields = outcome
            level = _LEVELS[name]
            if name == "done" and not fields["published"]:
                level = logging.DEBUG  # it led to nothing (evict folding another node's event)
            seconds = round(time.perf_counter() - t0, 4)
            METRICS.observe_message(self.stage, name, seconds)
            log.log(level, "message_handled", outcome=name, seconds=seconds, **fields)
        delay = fields.get("delay_s")
        return name, float(delay) if isinstance(delay, int | float) else None

    async def _handle(self, msg: Msg, event: Event, attempt: int, *, settle: bool) -> _Outcome:
        """Handle `event` to its end; returns the outcome and its fields for the log line
        (success leaves the ack to the caller)."""
        tries = attempt
        published: list[str] = []
        sent: set[str] = set()  # (the ids of this delivery's publishes, over its tries)
        # Seen for the first time: the first delivery of a message of its own (an event of a
        # node's batch may come again in another batch, its outputs published already).
        first = attempt == 1 and settle
        error = await self._run(msg, event, tries, published, sent, first=first)
        outage = 0
        reported = -OUTAGE_REPORT_EVERY_S
        while isinstance(error, UnavailableError):
            # An outage: keep the message and try again in place, for as long as it lasts.
            if self.drain.stopping:
                await quietly(msg.nak())
                return "handed_back", {"attempt": tries, "error": text(error)}
            outage += 1
            if time.monotonic() - reported >= OUTAGE_REPORT_EVERY_S:
                reported = time.monotonic()
                log.warning("outage_retrying", error=type(error).__name__,
                            message=text(error), attempt=tries)  # fmt: skip
                if not self._own_report(event):
                    await self._report(
                        self._failure(msg, event, tries, error, text(error), retryable=True)
                    )
            await self._idle(msg, backoff(self.settings, outage))
            if self.drain.stopping:
                continue  # handed back above
            tries += 1
            error = await self._run(msg, event, tries, published, sent, first=first)
        if error is None:
            return "done", {"attempt": tries, "published": published}
        if not isinstance(error, PermanentError | RetryableError):
            # Not an error any stage raises on purpose: a bug, or input nobody foresaw.
            # Retrying cannot help; report it and keep serving the other messages.
            log.error("handler_crashed", attempt=tries, exc_info=error)
        retryable = isinstance(error, RetryableError) and not isinstance(error, PermanentError)
        return await self._fail(msg, event, attempt, tries, error, retryable=retryable,
                                settle=settle)  # fmt: skip

    async def _run(
        self, msg: Msg, event: Event, tries: int, published: list[str], sent: set[str], *,
        first: bool,
    ) -> BaseException | None:  # fmt: skip
        """One try: the handler, then the events it returned (their kinds go to `published`,
        their ids to `sent`), under heartbeats. `first`: the message's first delivery (an output
        dropped as a duplicate then was not published by an earlier delivery of it)."""
        published.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, msg)
            try:
                for output in _outputs(await self.handler(event, tries)):
                    fresh = (mid := msg_id(output)) not in sent
                    sent.add(mid)
                    done = await self.bus.publish(output)
                    if done.duplicate and first and fresh and isinstance(output, _HANDED_ON):
                        raise DuplicateEventError(str(type(output).__struct_config__.tag), mid)
                    self.batcher.add(output)
                    published.append(str(type(output).__struct_config__.tag))
            except Exception as e:
                return _unwrap(e)
            finally:
                tg.cancel_scope.cancel()
        # For the fault suite: the stage's output is out, the message not yet acked.
        maybe_die(f"{self.stage}:before-ack", self.settings.fault_point)
        return None

    async def _idle(self, msg: Msg, seconds: float) -> None:
        """Wait between tries, keeping the message ours; wake up when the drain begins."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, msg)
            await self.drain.sleep(seconds)
            tg.cancel_scope.cancel()

    async def _heartbeat(self, msg: Msg) -> None:
        while True:
            await anyio.sleep(self.settings.ack_wait_s / 3)
            await quietly(msg.in_progress())

    async def _fail(
        self, msg: Msg, event: Event, attempt: int, tries: int, e: BaseException, *,
        retryable: bool, settle: bool = True,
    ) -> _Outcome:  # fmt: skip
        final = not retryable or attempt >= self.settings.max_deliver
        message = text(e)
        if retryable and final:
            message = f"gave up after {attempt} attempts: {message}"
        fields = {"attempt": tries, "error": type(e).__name__, "message": message}
        if self._own_report(event):
            # Failing on this stage's own failure report: reporting that would feed itself.
            if settle:
                await quietly(msg.term())
            return "terminated", {**fields, "reported": False}
        await self._report(self._failure(msg, event, tries, e, message, retryable=not final))
        if final:
            if settle:
                await quietly(msg.term())
            return "terminated", fields
        delay = backoff(self.settings, attempt, jitter=False)
        if isinstance(e, RetryableError) and e.retry_after_s is not None:
            delay = min(delay, e.retry_after_s)
        if settle:
            await quietly(msg.nak(delay=delay))
        return "retrying", {**fields, "delay_s": delay}

    def _own_report(self, event: Event) -> bool:
        """Whether `event` is a failure this stage of this node reported (evict reads them)."""
        return (
            isinstance(event, StageFailed) and event.stage == self.stage and event.node == self.node
        )

    def _failure(
        self, msg: Msg, event: Event | None, tries: int, e: BaseException, message: str, *,
        retryable: bool,
    ) -> StageFailed:  # fmt: skip
        """The `failed` event for any input (None: undecodable), with the identity fields the
        input has."""
        fields: _FailureFields = {
            "stage": self.stage,
            "error": type(e).__name__,
            "message": message,  # Bus.publish masks secrets in it
            "retryable": retryable,
            "attempt": max(1, tries),
            "subject": msg.subject,
            "stream_seq": msg.metadata.sequence.stream,
        }
        if isinstance(event, ShardStaged):
            fields["generation"] = event.generation
        if isinstance(event, ShardEvent):
            return event.follow(StageFailed, node=self.node, **fields)
        return StageFailed(
            job=_job_of(msg.subject) if event is None else event.job,
            node=self.node,
            ts=time.time(),
            step=getattr(event, "step", None),
            rank=getattr(event, "rank", None),
            world_size=getattr(event, "world_size", None),
            epoch=getattr(event, "epoch", 0),
            **fields,
        )

    async def _report(self, failure: StageFailed) -> None:
        """Publish a failure; a report that cannot be published is logged, never raised."""
        try:
            await self.bus.publish(failure)
        except Exception as e:
            log.error("failure_not_published", error=text(e), failure=failure.message)

    def _check_subject(self, event: Event, subject: str) -> None:
        kind = event.batch if isinstance(event, NodeBatch) else type(event).__struct_config__.tag
        if kind not in self.kinds:
            raise ValueError(f"a {kind!r} event where {'/'.join(self.kinds)} was expected")
        expected = event_subject(event)
        if subject != expected:
            raise ValueError(f"event body names {expected}")


def _job_of(subject: str) -> str:
    """The job a subject names, if it is a valid one (for reporting undecodable messages)."""
    try:
        return validate_token("job", subject.split(".")[1])
    except (IndexError, TierpipeError):
        return "_unknown"


def _outputs(output: Output) -> Sequence[Event]:
    if output is None:
        return ()
    return output if isinstance(output, Sequence) else (output,)


def _unwrap(e: Exception) -> BaseException:
    """A task group's error: its only leaf (what the handler would have raised itself)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        inner = e.exceptions[0]
        if not isinstance(inner, Exception):
            break
        e = inner
    return e
