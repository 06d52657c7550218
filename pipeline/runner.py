"""The stage runner: with its per-job worker, the one place that owns delivery semantics for
every stage.

A stage is a module of `tierpipe.stages` (or any object) with `STAGE`, its name; `KINDS`, the
event kinds it consumes on this node; optionally `open(settings, bus)`, an async context manager
that opens the stage's resources and yields its context (None without it); and `handle(ctx,
event, attempt)`, which commits the side effects of one event and returns the event(s) to
publish, or None. For every job this node takes part in (its directory under the staging or
NVMe root: `local_jobs`), the runner binds the stage's durable consumer on that job's stream
and hands its messages to a `tierpipe.worker.JobWorker`, which owns the per-message delivery
semantics (ack after publish, heartbeats, retries in place through an outage, failure reports,
one canonical log line per message). Also, the runner:

- when its stream or consumer disappears (deleted, or lost by the server), creates them again,
  says so once, and goes on (`tierpipe.bus.consumer`);
- where the agent runs the replicate stage, starts the node's peer endpoint first
  (`tierpipe.peer.server`) and advertises its URL in the node's record;
- on SIGTERM/SIGINT stops fetching and lets in-flight work finish for up to `drain_timeout_s`
  (an outage being waited out is handed back at once).
"""

from __future__ import annotations

import contextvars
import functools
import signal
from collections.abc import Awaitable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import TaskStatus

from tierpipe import metrics
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import Drain, text
from tierpipe.control.advert import advertise
from tierpipe.control.kvstate import JobStore
from tierpipe.control.risk import watch as watch_risk
from tierpipe.errors import TierpipeError
from tierpipe.log import register_secrets, settings_secrets
from tierpipe.metrics import METRICS
from tierpipe.names import consumer_name, local_jobs, node_name
from tierpipe.peer.server import endpoint_url
from tierpipe.peer.server import serve as serve_peer
from tierpipe.settings import Settings
from tierpipe.worker import Handler, JobWorker, Output

__all__ = ("JOB_SCAN_S", "Stage", "run_agent", "run_stage", "serve")

log = structlog.get_logger(__name__)
_IGNORED = anyio.TASK_STATUS_IGNORED


class Stage(Protocol):
    """A stage as the runner sees it (the modules of `tierpipe.stages`); `open` is optional."""

    # Module constants; read-only properties here, so a module's own tuple type matches.
    @property
    def STAGE(self) -> str: ...
    @property
    def KINDS(self) -> tuple[str, ...]: ...

    # ctx is whatever the stage's own `open` yields; event, one of the kinds `KINDS` names (each
    # stage's handler takes its own kinds only, so a narrower type than `Event` here).
    def handle(self, ctx: Any, event: Any, attempt: int, /) -> Awaitable[Output]: ...


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
                    worker = JobWorker(bus, settings, stage, node, kinds, handler, drain,
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
            tg.start_soon(watch_risk, settings, bus, JobStore(bus.js, settings).bind(), node)
            # The peer endpoint serves this node's copies and takes partners' replicas
            # (`tierpipe.peer.server`), where the agent replicates.
            peer_url = ""
            if any(s.STAGE == "replicate" for s in stages):
                peer_url = await tg.start(functools.partial(serve_peer, node=node), settings, bus)
                endpoint_url.set(peer_url)
            for stage in stages:
                await tg.start(run_stage, stage, settings, bus)
            # The node's trainers learn from its record that an agent serves them, and where
            # it keeps their copies (`tierpipe.control.advert`): stored before it is ready.
            await tg.start(
                functools.partial(
                    advertise, node=node, stages=[s.STAGE for s in stages], peer_url=peer_url
                ),
                settings,
                bus,
            )
            log.info("agent_ready", node=node, stages=len(stages))
            async for signum in signals:
                log.info("agent_stopping", signal=signal.Signals(signum).name)
                drain.begin()
                tg.cancel_scope.cancel()
                break
    log.info("agent_stopped", node=node)
