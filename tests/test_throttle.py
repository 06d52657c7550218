"""The upload throttle: rate accuracy, live re-rating, pause and resume."""

from __future__ import annotations

import anyio
import pytest

from tierpipe.throttle import Throttle

pytestmark = pytest.mark.anyio
MiB = 1 << 20


async def pump(throttle: Throttle, seconds: float) -> int:
    sent = 0
    with anyio.move_on_after(seconds):
        while True:
            await throttle.acquire(MiB)
            sent += MiB
    return sent


async def test_rate_is_accurate() -> None:
    """Sustained throughput matches the rate within 10% (two uploaders sharing it)."""
    throttle = Throttle(8 * MiB, burst_bytes=MiB)
    async with anyio.create_task_group() as tg:
        results: list[int] = []

        async def run() -> None:
            results.append(await pump(throttle, 2.0))

        tg.start_soon(run)
        tg.start_soon(run)
    rate = sum(results) / 2.0
    assert abs(rate - 8 * MiB) / (8 * MiB) < 0.10, rate / MiB


async def test_rate_change_applies_to_waiting_uploads() -> None:
    """A request stuck behind a slow rate finishes promptly once the rate is raised."""
    throttle = Throttle(MiB, burst_bytes=MiB)
    await throttle.acquire(MiB)  # drain the burst
    t0 = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(throttle.acquire, 4 * MiB)  # would take ~1 s at 1 MiB/s
        await anyio.sleep(0.1)
        throttle.set_rate(1000 * MiB)
    assert anyio.current_time() - t0 < 0.5


async def test_pause_holds_and_resume_releases() -> None:
    """While paused nothing passes; resume lets the waiting upload through."""
    throttle = Throttle(None)
    throttle.pause()
    done = anyio.Event()

    async def upload() -> None:
        await throttle.acquire(MiB)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(upload)
        await anyio.sleep(0.3)
        assert not done.is_set()
        throttle.resume()
        with anyio.fail_after(1):
            await done.wait()


def test_bad_rates_are_rejected() -> None:
    """Negative or infinite rates are errors; 0 and None mean unlimited."""
    with pytest.raises(ValueError, match="rate"):
        Throttle(-1)
    with pytest.raises(ValueError, match="rate"):
        Throttle(float("inf"))
    assert Throttle(0).rate is None
