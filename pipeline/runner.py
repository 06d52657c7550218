"""The stage runner: the one place that owns delivery semantics for every stage.

A stage supplies a handler `async (event, attempt) -> None` that commits its side effects and
publishes its output event. The runner pulls from the stage's durable consumer and:

- acks after the handler returns (side effects are committed before the ack);
- sends `in_progress()` heartbeats while the handler runs, so long work is not redelivered;
- on `RetryableError` (or an unexpected exception) publishes a retryable `failed` event and naks
  with a growing delay, until `max_deliver` attempts, then gives up as below;
- on `PermanentError` publishes a `failed` event and terminates the message;
- terminates and reports a message it cannot decode, and keeps serving;
- on SIGTERM/SIGINT stops fetching and lets in-flight work finish for up to `drain_timeout_s`.
"""

from __future__ import annotations

import contextvars
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

from pipeline.bus import Bus
from pipeline.errors import PermanentError, RetryableError, TierpipeError
from pipeline.names import SUBJECT_ROOT, consumer_name, filter_subject, validate_token
from pipeline.settings import Settings
from schemas import Event, ShardEvent, StageFailed, decode_event

__all__ = ["Handler", "StageFn", "run_agent", "serve"]

log = structlog.get_logger(__name__)

Handler = Callable[[Any, int], Awaitable[None]]
StageFn = Callable[..., Awaitable[None]]


class _Drain:
    """In-flight work of this process; on stop, each gets `timeout_s` more to finish."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.stopping = False
        self._inflight: set[anyio.CancelScope] = set()

    def begin(self) -> None:
        self.stopping = True
        deadline = anyio.current_time() + self.timeout_s
        for scope in self._inflight:
            scope.deadline = min(scope.deadline, deadline)

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
    sub = await bus.pull(durable)
    drain = _drain.get() or _Drain(settings.drain_timeout_s)
    log.info("stage_started", stage=stage, node=node, consumer=durable)
    task_status.started()
    worker = _Worker(bus, settings, stage, node, kinds, handler, drain)
    while not drain.stopping:
        try:
            msgs = await bus.fetch(sub, batch=1, timeout=1.0)
        except RetryableError as e:
            log.warning("fetch_failed", stage=stage, error=str(e))
            await anyio.sleep(1.0)
            continue
        for msg in msgs:
            await worker.process(msg)


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
        meta = msg.metadata
        attempt, seq = meta.num_delivered, meta.sequence.stream
        try:
            event = decode_event(msg.data)
            self._check_subject(event, msg.subject)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            await self._poison(msg, seq, attempt, e)
            return
        ctx = {"stage": self.stage, "job": event.job}
        if isinstance(event, ShardEvent):
            ctx.update(step=event.step, rank=event.rank)
        with bound_contextvars(**ctx):
            with self.drain.work() as scope:
                t0 = time.perf_counter()
                error = await self._run(msg, event, attempt)
                if error is None:
                    await _quietly(msg.ack())
                    log.debug(
                        "message_acked", attempt=attempt, seconds=round(time.perf_counter() - t0, 4)
                    )
                elif isinstance(error, PermanentError):
                    await self._fail(msg, event, seq, attempt, error, retryable=False)
                else:
                    if not isinstance(error, RetryableError):
                        log.error("handler_crashed", attempt=attempt, exc_info=error)
                    await self._fail(msg, event, seq, attempt, error, retryable=True)
            if scope.cancelled_caught:
                # The drain deadline passed mid-work: hand the message back for prompt redelivery.
                log.warning("work_abandoned_on_stop", attempt=attempt)
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await _quietly(msg.nak())

    async def _run(self, msg: Any, event: Event, attempt: int) -> Exception | None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat, msg)
            try:
                await self.handler(event, attempt)
            except Exception as e:
                return e
            finally:
                tg.cancel_scope.cancel()
        return None

    async def _heartbeat(self, msg: Any) -> None:
        while True:
            await anyio.sleep(self.settings.ack_wait_s / 3)
            await _quietly(msg.in_progress())

    async def _fail(
        self, msg: Any, event: Event, seq: int, attempt: int, e: BaseException, *, retryable: bool
    ) -> None:
        final = not retryable or attempt >= self.settings.max_deliver
        text = str(e) or type(e).__name__
        if retryable and final:
            text = f"gave up after {attempt} attempts: {text}"
        assert isinstance(event, ShardEvent)
        await self._report(
            event.follow(
                StageFailed,
                node=self.node,
                stage=self.stage,
                error=type(e).__name__,
                message=text,
                retryable=not final,
                attempt=attempt,
                subject=msg.subject,
                stream_seq=seq,
            )
        )
        if final:
            log.error("message_terminated", error=type(e).__name__, message=text, attempt=attempt)
            await _quietly(msg.term())
        else:
            delay = min(self.settings.retry_max_s, self.settings.retry_base_s * 2 ** (attempt - 1))
            log.warning(
                "message_retried",
                error=type(e).__name__,
                message=text,
                attempt=attempt,
                delay_s=delay,
            )
            await _quietly(msg.nak(delay=delay))

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
                attempt=attempt,
                subject=msg.subject,
                stream_seq=seq,
            )
        )
        await _quietly(msg.term())

    async def _report(self, failure: StageFailed) -> None:
        try:
            await self.bus.publish(failure)
        except TierpipeError as e:
            log.error("failure_not_published", error=str(e), failure=failure.message)

    def _check_subject(self, event: Event, subject: str) -> None:
        kind = type(event).__struct_config__.tag
        if kind not in self.kinds:
            raise ValueError(f"a {kind!r} event where {'/'.join(self.kinds)} was expected")
        rank = getattr(event, "rank", None)
        expected = f"{SUBJECT_ROOT}.{event.job}.{kind}.{event.node}.{'_' if rank is None else rank}"
        if subject != expected:
            raise ValueError(f"event body names {expected}")


async def _quietly(op: Awaitable[Any]) -> None:
    """Acks, naks and heartbeats are best effort: a lost one means a redelivery, which the
    stages' idempotence absorbs."""
    try:
        await op
    except Exception as e:
        log.warning("ack_failed", error=str(e) or type(e).__name__)


async def run_agent(settings: Settings, stages: list[StageFn], *, node: str) -> None:
    """Run stages in this process until SIGTERM/SIGINT, then drain and return."""
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
