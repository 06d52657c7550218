"""Job-wide admission budgets: the coordinator divides a job's budget among its active nodes, the
flush stage paces a job's uploads by its node's share, a restore caps its GETs by it."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch

from tests.conftest import Agent, Events, run_cli
from tests.test_retention import digest
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.coordinator import ActiveNodes, Coordinator, divide
from tierpipe.control.kvstate import JobStore
from tierpipe.recovery.load import s3_reads_per_node
from tierpipe.schemas import NodeBatch, ShardFlushed, ShardVerified, ShardWritten
from tierpipe.schemas.jobstate import Budget, Keep, Shares
from tierpipe.settings import Settings
from tierpipe.stages.flush import _follow_shares
from tierpipe.throttle import JobThrottles, Throttle, also_paced_by
from tierpipe.trainer.checkpointer import Checkpointer

MB = 1_000_000
MiB = 1 << 20
GiB = 1 << 30


def written(job: str, step: int, node: str, *, rank: int = 0, epoch: int = 0) -> ShardWritten:
    return ShardWritten(
        job=job, node=node, ts=time.time(), step=step, rank=rank, world_size=4, epoch=epoch,
        path=f"/x/{step}/{rank}", nbytes=4096, header_digest=digest(step, rank), tensors=1,
        seconds=0,
    )  # fmt: skip


def batch(job: str, step: int, node: str, *, epoch: int = 0) -> NodeBatch:
    return NodeBatch(
        job=job, node=node, ts=time.time(), batch="written",
        events=[written(job, step, node, epoch=epoch)],
    )  # fmt: skip


# --- pure logic


def test_active_nodes_are_those_that_reported_one_of_the_two_newest_checkpoints() -> None:
    """A node counts until it misses two checkpoints in a row; a new one counts at once."""
    active = ActiveNodes()
    for step in (1, 2):
        for node in "abcd":
            active.note(batch("j", step, node))
    assert len(active) == 4
    for node in "abc":
        active.note(batch("j", 3, node))
    assert len(active) == 4  # d reported step 2, one of the two newest
    for node in "abc":
        active.note(batch("j", 4, node))
    assert len(active) == 3
    active.note(batch("j", 4, "e"))
    active.note(batch("j", 2, "f"))  # a report of an older checkpoint: not active
    assert len(active) == 4
    active.note(batch("j", 2, "a"))  # (an older report of an active node changes nothing)
    assert len(active) == 4


def test_a_rewound_runs_saves_are_the_newest_checkpoints() -> None:
    """After a rewind (a newer epoch, lower steps) the nodes saving again count as active."""
    active = ActiveNodes()
    for node in "ab":
        active.note(batch("j", 14, node))
        active.note(batch("j", 15, node))
    for step in (11, 12):
        active.note(batch("j", step, "a", epoch=1))
    assert len(active) == 1


def test_a_budget_is_divided_rounding_down_but_never_to_zero() -> None:
    """Parts never add up to more than the budget, and a set budget never becomes "no cap"."""
    shares = divide(Budget(flush_bytes_per_s=100 * MB, restore_gets=10), 3, term=2)
    assert shares == Shares(
        flush_bytes_per_s_per_node=33_333_333, restore_gets_per_node=3, nodes=3, term=2
    )
    assert divide(Budget(restore_gets=10), 40).restore_gets_per_node == 1
    assert divide(Budget(), 4).flush_bytes_per_s_per_node == 0


@pytest.mark.anyio
async def test_a_jobs_share_paces_its_uploads_below_the_nodes_rate() -> None:
    """Inside `also_paced_by(job throttle)` uploads go at the lower of the two rates; a job
    without a share goes at the node's rate."""
    node = Throttle(8 * MiB, burst_bytes=MiB)
    jobs = JobThrottles()
    jobs.set_share("capped", 2 * MiB)

    async def pump(job: str, seconds: float = 1.5) -> float:
        sent = 0
        with also_paced_by(jobs.of(job)), anyio.move_on_after(seconds):
            while True:
                await node.acquire(MiB // 4)
                sent += MiB // 4
        return sent / seconds

    await pump("capped", 1.0)  # (a new bucket lets its 4 MiB burst through at once)
    capped = await pump("capped")
    assert 1.7 * MiB < capped < 2.3 * MiB, capped / MiB
    assert jobs.of("free") is None
    assert await pump("free") > 6 * MiB
    jobs.set_share("capped", 0)  # the budget was lifted
    assert jobs.of("capped") is None


# --- with a real nats-server


def _coordinate(settings: Settings, job: str, body: Callable[[Bus, JobStore], object]) -> None:
    """Run `body` while an in-process coordinator leads `job` (the job has no stored policy,
    so no agent of another test bids for it)."""

    async def remove(job: str, step: int, world: int, ranks: object) -> None:
        pass

    async def main() -> None:
        async with Bus(settings) as bus:
            await bus.ensure_stream(job)
            store = await JobStore(bus.js, settings).open()
            coordinator = Coordinator(settings, bus, await JobStore(bus.js, settings).open(),
                                      "coord", remove)  # fmt: skip
            coordinator.hosts(job, 0)
            async with anyio.create_task_group() as tg:
                tg.start_soon(coordinator.follow, job)
                await body(bus, store)  # type: ignore[misc]
                tg.cancel_scope.cancel()

    anyio.run(main)


async def _report(bus: Bus, job: str, step: int, nodes: str) -> None:
    batches = Batcher(bus)
    for node in nodes:
        batches.add(written(job, step, node, rank="abcd".index(node)))
    await batches.flush()


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 15) -> None:
    """Poll `check` (a KV read) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.05)


async def _shares_become(store: JobStore, job: str, want: Shares, timeout: float = 15) -> None:
    async def check() -> bool:
        return await store.shares(job) == want

    await until(check, f"shares {want}", timeout)


def test_the_coordinator_divides_the_budget_and_redivides_when_a_node_stops(
    settings: Settings, job: str
) -> None:
    """100 MB/s among 4 active nodes is 25 MB/s each; 33.3 once a node missed two checkpoints,
    and a new budget is divided within the coordinator's policy read (5 s)."""
    s = settings.replace(coordinator_flush_s=0.05)

    def share(flush: int, gets: int, nodes: int) -> Shares:
        return Shares(flush_bytes_per_s_per_node=flush, restore_gets_per_node=gets, nodes=nodes,
                      term=1)  # fmt: skip

    async def body(bus: Bus, store: JobStore) -> None:
        for step in (1, 2):
            await _report(bus, job, step, "abcd")
        await _shares_become(store, job, share(25 * MB, 4, 4))
        for step in (3, 4):
            await _report(bus, job, step, "abc")
        await _shares_become(store, job, share(33_333_333, 5, 3))
        await store.set_budget(job, Budget(flush_bytes_per_s=60 * MB))
        await _shares_become(store, job, share(20 * MB, 0, 3), timeout=10)

    async def prepare() -> None:
        async with Bus(s) as bus:
            await (await JobStore(bus.js, s).open()).set_budget(
                job, Budget(flush_bytes_per_s=100 * MB, restore_gets=16)
            )

    anyio.run(prepare)
    _coordinate(s, job, body)


def test_a_job_without_a_budget_gets_no_shares_key(settings: Settings, job: str) -> None:
    """No budget, no write: the coordinator stores no shares for a job that has none."""
    s = settings.replace(coordinator_flush_s=0.05)

    async def body(bus: Bus, store: JobStore) -> None:
        await _report(bus, job, 1, "ab")

        async def folded() -> bool:
            head = await store.head(job)
            return head is not None and head.seq > 0

        await until(folded, "the coordinator to fold the batches")
        assert await store.shares(job) == Shares()

    _coordinate(s, job, body)


async def _budget(settings: Settings, job: str, set_to: Budget | None = None) -> Budget:
    """The job's stored budget, after registering the job (and storing `set_to`)."""
    async with Bus(settings) as bus:
        store = await JobStore(bus.js, settings).open()
        await store.register(job, Keep())
        if set_to is not None:
            await store.set_budget(job, set_to)
        return await store.budget(job)


def test_flush_rate_with_job_stores_the_jobs_budget(settings: Settings, job: str) -> None:
    """`tierpipe flush rate 80MiB --job J` sets J's flush budget, keeping its GET budget."""
    anyio.run(_budget, settings, job, Budget(restore_gets=32))
    done = run_cli(settings, "flush", "rate", "80MiB", "--job", job)
    assert done.returncode == 0, done.stderr
    assert anyio.run(_budget, settings, job) == Budget(flush_bytes_per_s=80 * MiB, restore_gets=32)


def test_budget_sets_what_it_is_given_and_shows_both(settings: Settings, job: str) -> None:
    """`tierpipe budget` sets the GET budget alone, then the flush budget alone, each keeping
    the other, and prints them (`--json`: both budgets and the stored shares)."""
    anyio.run(_budget, settings, job)
    done = run_cli(settings, "budget", "--job", job, "--restore-gets", "64")
    assert done.returncode == 0, done.stderr
    assert "restore 64 GETs" in done.stdout and "flush no cap" in done.stdout
    done = run_cli(settings, "budget", "--job", job, "--flush", "1GiB")
    assert done.returncode == 0, done.stderr
    assert anyio.run(_budget, settings, job) == Budget(flush_bytes_per_s=GiB, restore_gets=64)
    shown = json.loads(run_cli(settings, "budget", "--job", job, "--json").stdout)
    assert shown["budget"] == {"flush_bytes_per_s": GiB, "restore_gets": 64}
    assert shown["shares"]["nodes"] == 0  # (no coordinator ran)


@pytest.mark.parametrize("args", [("--restore-gets", "-1"), ("--flush", "fast")])
def test_budget_refuses_bad_values_and_unknown_jobs(
    settings: Settings, job: str, args: tuple[str, str]
) -> None:
    """A bad value (a usage error, exit status 2), or a job the KV does not know (a typo would
    cap nobody: not found, 1), is an error and stores nothing."""
    done = run_cli(settings, "budget", "--job", job, "--flush", "1MiB")
    assert done.returncode == 1 and "unknown job" in done.stderr
    anyio.run(_budget, settings, job)
    done = run_cli(settings, "budget", "--job", job, *args)
    assert done.returncode == 2 and "tierpipe: error:" in done.stderr
    assert anyio.run(_budget, settings, job) == Budget()


def test_the_flush_stage_follows_the_stored_shares(settings: Settings, job: str) -> None:
    """The flush stage's per-job throttle takes the share as stored, and goes when it is 0."""

    async def main() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            jobs = JobThrottles()
            await store.write_shares(job, Shares(flush_bytes_per_s_per_node=3 * MB, nodes=2))
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follow_shares, settings, bus, jobs)

                async def rated(rate: int | None) -> bool:
                    t = jobs.of(job)
                    return (t.rate if t else None) == rate

                await until(lambda: rated(3 * MB), "the share to be applied")
                await store.write_shares(job, Shares(nodes=2))
                await until(lambda: rated(None), "the job's throttle to go")
                tg.cancel_scope.cancel()

    anyio.run(main)


def test_a_restoring_ranks_get_cap_follows_the_share(settings: Settings, job: str) -> None:
    """A node's concurrent GETs are min(restore_s3_reads_per_node, its share of the job's)."""
    s = settings.replace(restore_s3_reads_per_node=8)

    async def cap(shares: Shares | None) -> int:
        async with Bus(s) as bus:
            if shares is not None:
                await (await JobStore(bus.js, s).open()).write_shares(job, shares)
            return await s3_reads_per_node(s, bus, job)

    assert anyio.run(cap, None) == 8  # no budget
    assert anyio.run(cap, Shares(restore_gets_per_node=3, nodes=10)) == 3
    assert anyio.run(cap, Shares(restore_gets_per_node=20, nodes=2)) == 8  # the node's is lower


# --- with a real agent and SeaweedFS


@pytest.mark.slow
def test_an_agents_upload_rate_follows_the_jobs_share(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A running agent uploads a job's shard at its node's share of the job's budget (2 MiB/s),
    not at its own unlimited rate."""

    async def share() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            await store.set_budget(job, Budget(flush_bytes_per_s=2 * MiB))
            # As the coordinator will divide it once this node reports (stored ahead here, so
            # the upload starts at it).
            await store.write_shares(job, Shares(flush_bytes_per_s_per_node=2 * MiB, nodes=1))

    anyio.run(share)
    a = agent(settings=settings.replace(flush_max_bytes_per_s=0)).wait_ready()
    deadline = time.monotonic() + 10
    while "flush_share_applied" not in a.log():
        assert time.monotonic() < deadline, a.log()
        time.sleep(0.05)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, {"w": torch.randn(3 << 20)})  # 12 MiB: 4 MiB burst + 8 MiB at 2 MiB/s
        events.wait_for(lambda e: isinstance(e, ShardVerified), kind="verified")
        done = events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed", timeout=20)
    assert isinstance(done, ShardFlushed)
    rate = done.nbytes / done.seconds
    # (the bucket starts with a 4 MiB burst: ~12 MiB in ~4 s is 3 MiB/s on average)
    assert 1.5 * MiB < rate < 3.6 * MiB, rate / MiB
