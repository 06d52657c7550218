"""The stage runner: the one place that owns delivery semantics for every stage.

A stage is a module of `tierpipe.stages` (or any object) with `STAGE`, its name; `KINDS`, the
event kinds it consumes on this node; optionally `open(settings, bus)`, an async context manager
that opens the stage's resources and yields its context (None without it); and `handle(ctx,
event, attempt)`, which commits the side effects of one event and returns the event(s) to
publish, or None. For every job this node takes part in (its directory under the staging or
NVMe root: `local_jobs`), the runner binds the stage's durable consumer on that job's stream
and, for every message:

- publishes what the handler returned, in order, then acks: side effects, then events, then
  the ack, so a redelivery only republishes (deduplicated by `Nats-Msg-Id`);
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
- writes one canonical log line per message, `message_handled` (stage, job, step, rank,
  outcome, attempt, seconds, the kinds published, plus whatever the handler bound with
  `structlog.contextvars.bind_contextvars`), at debug when the message led to nothing;
- when its stream or consumer disappears (deleted, or lost by the server), creates them again,
  says so once, and goes on (`tierpipe.bus.consumer`);
- on SIGTERM/SIGINT stops fetching and lets in-flight work finish for up to `drain_timeout_s`
  (an outage being waited out is handed back at once).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from nats.aio.msg import Msg

from tierpipe import metrics
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import Drain, StageConsumer, backoff, quietly, text
from tierpipe.control.advert import advertise
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    DuplicateEventError,
    PermanentError,
    RetryableError,
    TierpipeError,
    UnavailableError,
)
from tierpipe.faults import maybe_die
from tierpipe.log import register_secrets, settings_secrets, unit_of_work
from tierpipe.metrics import METRICS
from tierpipe.names import (
    consumer_name,
    event_subject,
    filter_subject,
    local_jobs,
    msg_id,
    node_name,
    validate_token,
)
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

__all__ = ("Handler", "Output", "Stage", "run_agent", "run_stage", "serve")

log = structlog.get_logger(__name__)
_IGNORED = anyio.TASK_STATUS_IGNORED

#: What a handler returns: the events to publish before the ack, in order.
Output: TypeAlias = Event | Sequence[Event] | None
Handler = Callable[[Any, int], Awaitable[Output]]


class Stage(Protocol):
    """A stage as the runner sees it (the modules of `tierpipe.stages`); `open` is optional."""

    # Module constants; read-only properties here, so a module's own tuple type matches.
    @property
    def STAGE(self) -> str: ...
    @property
    def KINDS(self) -> tuple[str, ...]: ...

    # ctx and event are whatever the stage's own `open` yields and `KINDS` name.
    def handle(self, ctx: Any, event: Any, attempt: int, /) -> Awaitable[Output]: ...


#: Outputs another stage must act on (verify on `written`; evict, which frees the save's
#: staging slot, and flush on `verified`): one the server drops as a duplicate on the first
#: delivery of a message of its own (not a batch) was never seen by anyone, so the message
#: fails for good instead (a `DuplicateEventError`, whose `failed` event frees the slot).
_HANDED_ON = (ShardWritten, ShardVerified)
#: During an outage, a retryable `failed` event is published at most this often per message.
OUTAGE_REPORT_EVERY_S = 60.0
#: How one message ended, with the fields of its canonical log line.
_Outcome: TypeAlias = tuple[str, dict[str, Any]]
#: The level of the canonical line, by outcome.
_LEVELS = {
    "done": logging.INFO,
    "retrying": logging.WARNING,
    "handed_back": logging.WARNING,
    "abandoned_on_stop": logging.WARNING,
    "terminated": logging.ERROR,
}


_drain: contextvars.ContextVar[Drain | None] = contextvars.ContextVar(
    "tierpipe_drain", default=None
)


async def run_stage(
    stage: Stage, settings: Settings, bus: Bus, *, task_status: TaskStatus[None] = _IGNORED
) -> None:
    """Open `stage`'s resources and serve its events on this node, forever."""
    opener = getattr(stage, "open", None)
    async with opener(settings, bus) if opener is not None else nullcontext() as ctx:
        await serve(
            bus,
            settings,
            stage=stage.STAGE,
            node=node_name(settings.node),
            kinds=stage.KINDS,
            handler=functools.partial(stage.handle, ctx),
            task_status=task_status,
        )


async def serve(
    bus: Bus,
    settings: Settings,
    *,
    stage: str,
    node: str,
    kinds: tuple[str, ...],
    handler: Handler,
    task_status: TaskStatus[None] = _IGNORED,
) -> None:
    """Run `handler(event, attempt)` for every event of `kinds` published on `node`, forever,
    and publish what it returns: for every job this node takes part in (`local_jobs`, looked
    for again every `JOB_SCAN_S`), on the stage's durable consumer for this node on that job's
    stream. Started once the jobs already here are bound."""
    drain = _drain.get() or Drain(settings.drain_timeout_s)
    served: set[str] = set()
    unbound: dict[str, str] = {}  # (job -> why it could not be bound: said once)
    async with anyio.create_task_group() as tg:

        async def scan() -> None:
            for job in sorted(local_jobs(settings.staging_root, settings.nvme_root) - served):
                try:
                    # (a worker per job: its own batches)
                    worker = _Worker(bus, settings, stage, node, kinds, handler, drain,
                                     Batcher(bus))  # fmt: skip
                    await tg.start(worker.serve, job)
                except TierpipeError as e:  # (an outage: the next scan tries again)
                    if unbound.get(job) != text(e):
                        unbound[job] = text(e)
                        log.warning("job_not_bound", stage=stage, job=job, error=text(e))
                    continue
                served.add(job)
                unbound.pop(job, None)

        await scan()
        durable = consumer_name(stage, node)
        log.info("stage_started", stage=stage, node=node, consumer=durable, jobs=sorted(served))
        task_status.started()
        while not drain.stopping:
            await drain.sleep(JOB_SCAN_S)
            if not drain.stopping:
                await scan()
        # Stopping: wake the workers up from their fetches (work in hand is shielded by the
        # drain and finishes within its timeout).
        tg.cancel_scope.cancel()


#: How often a stage looks for jobs new to this node.
JOB_SCAN_S = 0.5


@dataclass(frozen=True, slots=True)
class _Worker:
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
            name = await self._process_one(msg, event, attempt, settle=True)
            if name == "done":
                self.batcher.ack_later(msg)
            return
        # A node's batch: each of its events in turn; the message is settled once, after all.
        names = []
        for inner in event.events:
            names.append(await self._process_one(msg, inner, attempt, settle=False))
            if names[-1] in ("handed_back", "abandoned_on_stop"):
                return  # (handed back already)
        if "retrying" in names:
            await quietly(msg.nak(delay=backoff(self.settings, attempt, jitter=False)))
        else:  # (done, or failed for good and reported)
            self.batcher.ack_later(msg)
        await self.batcher.flush()

    async def _process_one(self, msg: Msg, event: Event, attempt: int, *, settle: bool) -> str:
        """Handle one event of `msg` to its end; the outcome's name. With `settle`, a failure
        terminates or naks the message itself (else the caller settles it)."""
        unit: dict[str, Any] = {"stage": self.stage, "job": event.job}
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
        return name

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
        fields: dict[str, Any] = {
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


async def run_agent(settings: Settings, stages: Sequence[Stage], *, node: str) -> None:
    """Run stages in this process until SIGTERM/SIGINT, then drain and return."""
    register_secrets(settings_secrets(settings))
    drain = Drain(settings.drain_timeout_s)
    _drain.set(drain)
    bus = Bus(settings, name=f"tierpipe-agent-{node}", connect_wait_s=60.0)
    bus.on_publish = METRICS.observe_event
    async with bus, anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            tg.start_soon(metrics.serve, settings, bus, JobStore(bus.js, settings).bind())
            for stage in stages:
                await tg.start(run_stage, stage, settings, bus)
            log.info("agent_ready", node=node, stages=len(stages))
            # The node's trainers learn from it that an agent serves them, and where it keeps
            # their copies (`tierpipe.control.advert`).
            tg.start_soon(
                functools.partial(advertise, node=node, stages=[s.STAGE for s in stages]),
                settings,
                bus,
            )
            async for signum in signals:
                log.info("agent_stopping", signal=signal.Signals(signum).name)
                drain.begin()
                tg.cancel_scope.cancel()
                break
    log.info("agent_stopped", node=node)
