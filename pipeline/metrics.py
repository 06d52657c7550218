"""An agent's Prometheus metrics (`/metrics`) and health (`/healthz`), on loopback by default.

What is counted where it happens: each message a stage handled (`observe_message`, by the
runner), each event the process published (`observe_event`, by `Bus.publish`: bytes and seconds
per tier, failures, evictions); what is read when scraped: the newest complete steps of the
node's jobs (from their state in KV), how far each tier trails the newest save and the steps
at risk if a node were lost (`tierpipe.control.risk`: of the jobs this agent coordinates), the
staging slots holding a shard, the flush rate and the
time uploads waited for it (`watch_throttle`, by the flush stage). One registry per process, not
prometheus_client's global one.

`serve(settings, bus, store)` answers on `metrics_host:metrics_port` (0: any free port, logged
as `metrics_serving`; -1: off) until cancelled. A port that is taken is logged and the agent goes
on without metrics: checkpoints matter more than their statistics.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, cast

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tierpipe.control.risk import TIER_KINDS, Risk, coordinated, read_risk
from tierpipe.names import local_jobs, node_name
from tierpipe.schemas import (
    Event,
    NodeBatch,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    StageFailed,
)
from tierpipe.settings import Settings
from tierpipe.storage.staging import markers
from tierpipe.throttle import Throttle

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus
    from tierpipe.control.kvstate import JobStore

__all__ = ("METRICS", "Metrics", "serve")

log = structlog.get_logger(__name__)

#: How long a client may take to send its request's head.
_REQUEST_TIMEOUT_S = 10
#: The longest request head read (asyncio's stream limit, as before).
_MAX_REQUEST_BYTES = 1 << 16


class Metrics:
    """The process's metrics."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.stage_seconds = Histogram(
            "tierpipe_stage_seconds", "Time a stage spent on one message, by outcome",
            ["stage", "outcome"], registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )  # fmt: skip
        self.tier_bytes = Counter(
            "tierpipe_tier_bytes", "Shard bytes moved, by tier and operation",
            ["tier", "op"], registry=r,
        )  # fmt: skip
        self.tier_seconds = Counter(
            "tierpipe_tier_seconds", "Time spent moving shard bytes, by tier and operation",
            ["tier", "op"], registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "tierpipe_failures", "Failures reported, by stage, error and whether retryable",
            ["stage", "error", "retryable"], registry=r,
        )  # fmt: skip
        self.evictions = Counter(
            "tierpipe_evictions", "Copies removed, by tier and reason", ["tier", "reason"],
            registry=r,
        )  # fmt: skip
        self.newest_step = Gauge(
            "tierpipe_newest_complete_step",
            "Newest step complete on a tier (every rank verified there), by job",
            ["job", "tier"], registry=r,
        )  # fmt: skip
        self.newest_saved = Gauge(
            "tierpipe_newest_saved_step", "Newest step a rank saved (verified), by job",
            ["job"], registry=r,
        )  # fmt: skip
        self.tier_lag_steps = Gauge(
            "tierpipe_tier_lag_steps",
            "Steps a tier's newest complete step trails the newest saved step, by job and tier",
            ["job", "tier"], registry=r,
        )  # fmt: skip
        self.tier_lag_seconds = Gauge(
            "tierpipe_tier_lag_seconds",
            "Seconds a tier's newest copy trails the newest save, by job and tier",
            ["job", "tier"], registry=r,
        )  # fmt: skip
        self.at_risk = Gauge(
            "tierpipe_steps_at_risk",
            "Steps lost if a node were lost now (newest saved less the newest step that "
            "survives any one node's loss), by job",
            ["job"], registry=r,
        )  # fmt: skip
        self.slots_in_use = Gauge(
            "tierpipe_staging_slots_in_use", "Staging slots holding a shard not yet released",
            registry=r,
        )  # fmt: skip
        self.flush_rate = Gauge(
            "tierpipe_flush_rate_bytes_per_second", "This node's upload rate (0: unlimited)",
            registry=r,
        )  # fmt: skip
        self.flush_paused = Gauge("tierpipe_flush_paused", "1 while uploads are paused", registry=r)
        self.throttle_wait = Gauge(
            "tierpipe_flush_throttle_wait_seconds",
            "Time uploads waited for this node's rate so far", registry=r,
        )  # fmt: skip
        self._throttle: Throttle | None = None

    def observe_message(self, stage: str, outcome: str, seconds: float) -> None:
        self.stage_seconds.labels(stage, outcome).observe(seconds)

    def observe_event(self, event: Event) -> None:
        """Count what a published event says was done (a node's batch repeats its events'
        facts, so it counts for nothing)."""
        if isinstance(event, NodeBatch):
            return
        if isinstance(event, ShardWritten):
            self._moved("nvme", "write", event.nbytes, event.seconds)
        elif isinstance(event, ShardVerified):
            self._moved("nvme", "verify", event.nbytes, event.seconds)
        elif isinstance(event, ShardFlushed):
            self._moved("s3", "upload", event.nbytes, event.seconds)
        elif isinstance(event, ShardEvicted):
            self.evictions.labels(event.tier, event.reason.split(" ")[0]).inc()
        elif isinstance(event, StageFailed):
            self.failures.labels(event.stage, event.error, str(event.retryable).lower()).inc()

    def _moved(self, tier: str, op: str, nbytes: int, seconds: float) -> None:
        self.tier_bytes.labels(tier, op).inc(nbytes)
        self.tier_seconds.labels(tier, op).inc(max(seconds, 0.0))

    def watch_throttle(self, throttle: Throttle) -> None:
        """Report this node's upload throttle (the flush stage's)."""
        self._throttle = throttle

    async def refresh(
        self, settings: Settings, store: JobStore | None, bus: Bus | None = None
    ) -> None:
        """Read what is scraped as it is now (the tiers' lag and the steps at risk: with `bus`,
        the job's newest events)."""
        self.slots_in_use.set(_slots_in_use(Path(settings.staging_root)))
        if (t := self._throttle) is not None:
            self.flush_rate.set(t.rate or 0)
            self.flush_paused.set(1 if t.paused else 0)
            self.throttle_wait.set(t.waited_s)
        if store is None:
            return
        for job in sorted(local_jobs(settings.staging_root, settings.nvme_root)):
            head = await store.head(job)
            if head is None:
                continue
            peer = head.peer_steps[-1] if head.peer_steps else None
            for tier, step in (("nvme", head.newest_nvme), ("peer", peer), ("s3", head.newest_s3)):
                if step is not None:
                    self.newest_step.labels(job, tier).set(step)
            if bus is not None and await coordinated(store, job, node_name(settings.node)):
                self._risk(await read_risk(bus, store, job, head=head))
            else:
                self._no_risk(job)

    def _risk(self, risk: Risk) -> None:
        """Set the gauges of a job's exposure (a lag not known yet is left out)."""
        self._no_risk(risk.job)
        if risk.saved is None:
            return
        self.newest_saved.labels(risk.job).set(risk.saved)
        self.at_risk.labels(risk.job).set(risk.at_risk)
        for t in risk.tiers:
            if t.lag_steps is not None:
                self.tier_lag_steps.labels(risk.job, t.tier).set(t.lag_steps)
            if t.lag_s is not None:
                self.tier_lag_seconds.labels(risk.job, t.tier).set(t.lag_s)

    def _no_risk(self, job: str) -> None:
        """Drop the gauges of a job's exposure (another agent coordinates it: its own say)."""
        for gauge, labels in (
            (self.newest_saved, [(job,)]), (self.at_risk, [(job,)]),
            (self.tier_lag_steps, [(job, t) for t, _ in TIER_KINDS]),
            (self.tier_lag_seconds, [(job, t) for t, _ in TIER_KINDS]),
        ):  # fmt: skip
            for values in labels:
                with contextlib.suppress(KeyError):
                    gauge.remove(*values)


def _slots_in_use(staging: Path) -> int:
    """Staging slots holding an unreleased step (`tierpipe.storage.staging`'s markers)."""
    return sum(len(markers(d)) for d in staging.glob("*/rank-*"))


#: The process's metrics (agents serve them; a trainer's are never scraped).
METRICS = Metrics()


async def serve(settings: Settings, bus: Bus, store: JobStore | None = None) -> None:
    """Answer `/metrics` and `/healthz` until cancelled (see the module docstring)."""
    if settings.metrics_port < 0:
        return

    async def answer(client: SocketStream) -> None:
        try:
            with anyio.fail_after(_REQUEST_TIMEOUT_S):
                request = await BufferedByteReceiveStream(client).receive_until(
                    b"\r\n\r\n", _MAX_REQUEST_BYTES
                )
            method, path, *_ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method != "GET":
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                await METRICS.refresh(settings, store, bus)
                status, ctype, body = (
                    "200 OK",
                    CONTENT_TYPE_LATEST,
                    generate_latest(METRICS.registry),
                )
            elif path == "/healthz":
                up = bus.nc is not None and bus.nc.is_connected
                status = "200 OK" if up else "503 Service Unavailable"
                ctype, body = "application/json", json.dumps({
                    "status": "ok" if up else "nats disconnected",
                    "nats": "connected" if up else "disconnected", "ts": time.time(),
                }).encode()  # fmt: skip
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"/metrics or /healthz\n"
            # (`send` returns once the bytes are with the kernel, so closing loses none)
            await client.send(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
        except Exception as e:  # a bad request must not stop the server
            log.debug("metrics_request_failed", error=str(e) or type(e).__name__)
        finally:
            await client.aclose()

    try:
        # ("": every interface, as `asyncio.start_server` took it)
        listener = await anyio.create_tcp_listener(
            local_host=settings.metrics_host or None, local_port=settings.metrics_port, backlog=100
        )
    except OSError as e:
        log.warning(
            "metrics_unavailable", host=settings.metrics_host, port=settings.metrics_port,
            error=str(e), hint="set metrics_port (0: any free port, -1: off)",
        )  # fmt: skip
        return
    port = listener.extra(SocketAttribute.local_port)  # noqa: S610 (anyio's, not Django's)
    log.info("metrics_serving", host=settings.metrics_host, port=port)
    # (a listener per address of `metrics_host`, each a `SocketListener`: anyio makes them so)
    sockets = [cast(SocketListener, one) for one in listener.listeners]
    async with listener, anyio.create_task_group() as tg:
        for one in sockets:
            tg.start_soon(_accept, one, answer, tg)


async def _accept(
    listener: SocketListener,
    answer: Callable[[SocketStream], Coroutine[object, object, None]],
    tg: TaskGroup,
) -> None:
    """Hand each connection to `answer` in `tg`, until cancelled. A failed accept (out of file
    descriptors, a connection reset before it was taken) stops only that connection: the
    listener goes on (after a second, unless the client just went away), as asyncio's server
    did, where anyio's `serve` would end and take the agent with it."""
    while True:
        try:
            client = await listener.accept()
        except ConnectionAbortedError:
            continue
        except OSError as e:
            log.warning("metrics_accept_failed", error=str(e) or type(e).__name__)
            await anyio.sleep(1)
            continue
        tg.start_soon(answer, client)
