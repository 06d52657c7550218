"""The stage runner's delivery semantics against a real JetStream consumer."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import nats.js.errors
import pytest

from tests.conftest import Events, make_staged
from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import Drain
from tierpipe.errors import (
    BusUnavailableError,
    PermanentError,
    RetryableError,
    StorageUnavailableError,
)
from tierpipe.names import stream_name
from tierpipe.runner import _drain, serve
from tierpipe.schemas import ShardStaged, StageFailed
from tierpipe.settings import Settings

pytestmark = pytest.mark.anyio


def staged(settings: Settings, job: str, step: int) -> ShardStaged:
    return make_staged(job, settings.node or "", step)


def here(settings: Settings, job: str) -> None:
    """Make `job`'s staging folder, as its trainer on this node does: the runner serves the
    jobs it finds on the node (`local_jobs`)."""
    Path(settings.staging_root, job).mkdir(parents=True, exist_ok=True)


async def run_stage(settings: Settings, handler, seconds: float, *events: ShardStaged) -> None:
    here(settings, events[0].job)
    async with Bus(settings) as bus:
        await bus.ensure_stream(events[0].job)
        for e in events:
            await bus.publish(e)
        with anyio.move_on_after(seconds):
            await serve(
                bus,
                settings,
                stage="test",
                node=settings.node or "",
                kinds=("staged",),
                handler=handler,
            )


async def test_retryable_errors_back_off_then_succeed(
    settings: Settings, job: str, events: Events
) -> None:
    """A retryable failure is retried with a growing delay; each attempt is reported."""
    times: list[float] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        times.append(time.monotonic())
        if attempt < 4:
            raise RetryableError(f"transient #{attempt}")

    s = settings.replace(retry_base_s=0.2, retry_max_s=10.0)
    await run_stage(s, handler, 4.0, staged(s, job, 1))
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= 0.18 and gaps[1] >= 0.38 and gaps[2] >= 0.78 and gaps[2] > gaps[0]
    failed = await anyio.to_thread.run_sync(events.all, "failed")
    assert [f.attempt for f in failed] == [1, 2, 3] and all(f.retryable for f in failed)


async def test_permanent_error_terminates_with_one_failed_event(
    settings: Settings, job: str, events: Events
) -> None:
    """A permanent failure is reported once and the message is not redelivered."""
    calls: list[int] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(attempt)
        raise PermanentError("bad input")

    await run_stage(settings.replace(ack_wait_s=1.0), handler, 3.0, staged(settings, job, 2))
    assert calls == [1]
    (failed,) = await anyio.to_thread.run_sync(events.all, "failed")
    assert (
        isinstance(failed, StageFailed) and not failed.retryable and failed.message == "bad input"
    )
    assert (failed.stage, failed.step, failed.error) == ("test", 2, "PermanentError")


async def test_attempts_are_bounded_by_max_deliver(
    settings: Settings, job: str, events: Events
) -> None:
    """A retryable error that never clears is given up after max_deliver attempts, with a
    final report."""
    calls: list[int] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(attempt)
        raise RetryableError("disk still full")

    s = settings.replace(max_deliver=3, retry_base_s=0.05)
    await run_stage(s, handler, 3.0, staged(s, job, 3))
    assert calls == [1, 2, 3]
    failed = await anyio.to_thread.run_sync(events.all, "failed")
    assert [f.retryable for f in failed] == [True, True, False]
    assert "gave up after 3 attempts" in failed[-1].message


async def test_unexpected_error_is_terminated_and_the_worker_goes_on(
    settings: Settings, job: str, events: Events
) -> None:
    """An exception no stage raises on purpose terms its message with one permanent `failed`
    event, and the next message is still handled."""
    calls: list[int] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(event.step)
        if event.step == 1:
            raise KeyError("a bug")

    await run_stage(settings, handler, 3.0, staged(settings, job, 1), staged(settings, job, 2))
    assert calls == [1, 2]
    (failed,) = await anyio.to_thread.run_sync(events.all, "failed")
    assert (failed.step, failed.error, failed.retryable) == (1, "KeyError", False)


async def test_a_failing_non_shard_event_is_reported_not_fatal(
    settings: Settings, job: str, events: Events
) -> None:
    """A handler failing on a `failed` event (no shard identity to follow) gets that message
    termed with a `failed` event naming the input's identity; serve() keeps running."""
    seen: list[str] = []

    async def handler(event: StageFailed, attempt: int) -> None:
        seen.append(event.stage)
        raise PermanentError("cannot handle this failure")

    forged = StageFailed(
        job=job, node=settings.node or "", ts=time.time(), stage="nvme-write", error="X",
        message="forged", retryable=False, attempt=1, step=5, rank=0, world_size=1,
    )  # fmt: skip
    here(settings, job)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        await bus.publish(forged)
        with anyio.move_on_after(2.5):
            await serve(
                bus,
                settings,
                stage="test",
                node=settings.node or "",
                kinds=("failed",),
                handler=handler,
            )
    mine = [
        f
        for f in await anyio.to_thread.run_sync(events.all, "failed")
        if isinstance(f, StageFailed) and f.stage == "test"
    ]
    assert seen.count("nvme-write") == 1  # termed, not redelivered
    (report,) = mine
    assert (report.step, report.rank, report.retryable) == (5, 0, False)
    assert report.message == "cannot handle this failure"


async def test_outage_is_retried_in_place_beyond_max_deliver(
    settings: Settings, job: str, events: Events
) -> None:
    """An outage is retried in place for as long as it lasts (far beyond max_deliver), reported
    once, never given up; the message is acked when the handler finally succeeds."""
    calls: list[int] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(attempt)
        if len(calls) < 12:
            raise StorageUnavailableError("the store is down")

    s = settings.replace(max_deliver=2, retry_base_s=0.01, retry_max_s=0.05)
    await run_stage(s, handler, 2.5, staged(s, job, 6))
    assert len(calls) == 12 and calls == list(range(1, 13))
    (failed,) = await anyio.to_thread.run_sync(events.all, "failed")
    assert failed.retryable and failed.error == "StorageUnavailableError"

    async def pending() -> tuple[int, int]:
        async with Bus(s) as bus:
            info = await bus.js.consumer_info(stream_name(s.stream, job), f"test_{s.node}")
            return info.num_ack_pending + info.num_pending, info.num_redelivered

    assert await pending() == (0, 0)  # acked, and never handed back for redelivery


async def test_an_outage_is_handed_back_at_once_when_the_worker_stops(
    settings: Settings, job: str
) -> None:
    """A worker waiting out an outage (between tries) hands the message back as soon as it is
    told to stop, without waiting for its backoff or the drain timeout."""
    calls: list[int] = []
    tried = anyio.Event()
    drain = Drain(timeout_s=30.0)
    token = _drain.set(drain)

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(attempt)
        tried.set()
        raise BusUnavailableError("down")

    s = settings.replace(retry_base_s=30.0, retry_max_s=30.0)  # a long wait between tries
    here(s, job)
    try:
        async with Bus(s) as bus:
            await bus.ensure_stream(job)
            await bus.publish(staged(s, job, 8))
            async with anyio.create_task_group() as tg:
                await tg.start(
                    functools.partial(
                        serve, bus, s, stage="test", node=s.node or "", kinds=("staged",),
                        handler=handler,
                    )
                )  # fmt: skip
                with anyio.fail_after(10):
                    await tried.wait()
                t0 = time.monotonic()
                drain.begin()
            assert time.monotonic() - t0 < 3.0
            info = await bus.js.consumer_info(stream_name(s.stream, job), f"test_{s.node}")
            assert info.delivered.stream_seq >= 1 and info.ack_floor.stream_seq == 0  # not acked
    finally:
        _drain.reset(token)
    assert calls == [1]


async def test_long_work_is_not_redelivered(settings: Settings, job: str) -> None:
    """Heartbeats keep a message that takes 3x ack_wait from being redelivered."""
    calls: list[int] = []

    async def handler(event: ShardStaged, attempt: int) -> None:
        calls.append(attempt)
        await anyio.sleep(3.0)

    await run_stage(settings.replace(ack_wait_s=1.0), handler, 5.0, staged(settings, job, 4))
    assert calls == [1]


def test_sigterm_drains_in_flight_work(
    settings: Settings, job: str, tmp_path: Path, events: Events
) -> None:
    """On SIGTERM the worker stops fetching but finishes (and acks) the message in hand."""
    script = tmp_path / "worker.py"
    done = tmp_path / "done"
    script.write_text(
        textwrap.dedent(f"""
        import anyio, sys
        from tierpipe.log import configure_logging
        from tierpipe.runner import run_agent
        from tierpipe.settings import load_settings

        class stage:
            STAGE = "drain"
            KINDS = ("staged",)

            async def handle(ctx, event, attempt):
                print("started", flush=True)
                await anyio.sleep(1.5)
                open({str(done)!r}, "w").write(str(attempt))

        s = load_settings()
        configure_logging(s.log_level, "json")  # logs to stderr; stdout is for the test
        anyio.run(lambda: run_agent(s, [stage], node=s.node))
        print("exited", flush=True)
    """)
    )

    here(settings, job)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        # The script's folder comes first on sys.path: name this checkout's.
        env={**os.environ, **settings.as_env(), "PYTHONPATH": str(Path(__file__).parent.parent)},
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:

        async def publish() -> None:
            async with Bus(settings) as bus:
                await bus.ensure_stream(job)
                await bus.publish(staged(settings, job, 9))

        anyio.run(publish)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert proc.stdout.read().strip() == "exited"
        assert done.read_text() == "1"  # finished, not abandoned
    finally:
        proc.kill()

    async def pending() -> int:
        async with Bus(settings) as bus:
            info = await bus.js.consumer_info(
                stream_name(settings.stream, job), f"drain_{settings.node}"
            )
            return info.num_ack_pending + info.num_pending

    assert anyio.run(pending) == 0  # it was acked before exit


def on_node(root: str, *names: str, file: str = "") -> None:
    """Folders under a node's root (and a plain file), as trainers and agents make them."""
    for name in names:
        Path(root, name).mkdir(parents=True, exist_ok=True)
    if file:
        Path(root, file).write_bytes(b"")


async def test_a_stage_serves_the_jobs_of_its_node_and_only_those(
    settings: Settings, job: str
) -> None:
    """A stage binds a consumer on the stream of each job with a folder under this node's
    staging or NVMe root, also one that appears while it runs, and none on another job's
    stream: thousands of agents never hold consumers for jobs they have nothing of."""
    seen: list[str] = []
    got = {j: anyio.Event() for j in (job, f"{job}-later")}

    async def handler(event: ShardStaged, attempt: int) -> None:
        seen.append(event.job)
        got[event.job].set()

    later, elsewhere = f"{job}-later", f"{job}-elsewhere"
    on_node(settings.staging_root, job)
    on_node(settings.nvme_root, "not a job", file="file-not-dir")  # (no job's: ignored)
    async with Bus(settings) as bus:
        for j in (job, later, elsewhere):
            await bus.ensure_stream(j)
            await bus.publish(staged(settings, j, 1))
        async with anyio.create_task_group() as tg:
            await tg.start(
                functools.partial(
                    serve, bus, settings, stage="test", node=settings.node or "",
                    kinds=("staged",), handler=handler,
                )
            )  # fmt: skip
            with anyio.fail_after(10):
                await got[job].wait()
            on_node(settings.nvme_root, later)  # (a copy of `later` lands on this node)
            with anyio.fail_after(10):
                await got[later].wait()
            await anyio.sleep(1.0)  # (two more scans)
            tg.cancel_scope.cancel()
        assert seen == [job, later]
        stream = stream_name(settings.stream, elsewhere)
        with pytest.raises(nats.js.errors.NotFoundError):
            await bus.js.consumer_info(stream, f"test_{settings.node}")
