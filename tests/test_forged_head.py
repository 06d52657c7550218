"""A job head in KV that the rest of the job state does not back (forged by a holder of KV write
permission, say) is not reported as the newest step: `latest_step()` and `tierpipe plan` check a
head's steps against their records and rank digests (issue 20, item 7)."""

from __future__ import annotations

import json

import anyio
import msgspec

from tests.conftest import run_cli
from tests.test_coordinator import publish, saved
from tierpipe import Checkpointer
from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore, head_key, step_key
from tierpipe.schemas.jobstate import JobHead, StepRecord, encode_record
from tierpipe.settings import Settings

FORGED = 999


def saved_steps(settings: Settings, job: str, steps: list[int]) -> None:
    """Steps 1..n of a 2-rank job, verified on this node and flushed (events only)."""
    node = settings.node or ""
    publish(settings, [e for t in steps for r in (0, 1) for e in saved(job, t, r, node)])


def forge(settings: Settings, job: str, *, record: bool = False) -> None:
    """Write step `FORGED` into the job's head (and, with `record`, a complete record of it),
    as a holder of KV write permission can: no digests, no copy anywhere."""

    async def main() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            head = await store.head(job)
            assert head is not None
            forged = msgspec.structs.replace(
                head,
                nvme_steps=[*head.nvme_steps, FORGED],
                s3_steps=[*head.s3_steps, FORGED],
                steps=[*head.steps, FORGED],
            )
            await store.kv.put(head_key(job), msgspec.json.encode(forged))
            if record:
                rec = StepRecord(step=FORGED, world_size=2, nvme=b"\x03", s3=b"\x03")
                await store.kv.put(step_key(job, FORGED), encode_record(rec))

    anyio.run(main)


def stored_head(settings: Settings, job: str) -> JobHead | None:
    async def main() -> JobHead | None:
        async with Bus(settings) as bus:
            return await (await JobStore(bus.js, settings).open()).head(job)

    return anyio.run(main)


def test_latest_step_does_not_believe_a_forged_head(settings: Settings, job: str) -> None:
    """A head naming a step with no record behind it: `latest_step()` and `all_steps()` report
    the newest step the job state confirms."""
    saved_steps(settings, job, [1, 2])
    with Checkpointer(job, rank=0, world_size=2, settings=settings) as ckpt:
        assert ckpt.latest_step() == 2  # (folded by the rank itself: no agent runs)
        forge(settings, job)
        head = stored_head(settings, job)
        assert head is not None and head.nvme_steps[-1] == FORGED
        assert ckpt.latest_step() == 2
        assert ckpt.all_steps() == [1, 2]


def test_plan_does_not_believe_a_forged_head_and_record(settings: Settings, job: str) -> None:
    """A forged head and a complete record of its step, with no rank digests: `tierpipe plan`
    plans the newest confirmed step and shows the forged one as unconfirmed."""
    saved_steps(settings, job, [1, 2])
    with Checkpointer(job, rank=0, world_size=2, settings=settings) as ckpt:
        assert ckpt.latest_step() == 2  # (the job state folded)
    forge(settings, job, record=True)

    out = run_cli(settings, "plan", "--job", job)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("restore step 2 "), out.stdout
    assert f"step {FORGED} unconfirmed" in out.stdout, out.stdout

    out = run_cli(settings, "plan", "--job", job, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["step"] == 2 and str(FORGED) in plan["unconfirmed"], plan

    out = run_cli(settings, "plan", "--job", job, "--step", str(FORGED))
    assert out.returncode != 0 and "unconfirmed" in out.stderr, (out.stdout, out.stderr)


def test_ls_and_status_show_a_forged_step_as_unconfirmed(settings: Settings, job: str) -> None:
    """`tierpipe ls` and `tierpipe status` report the newest step the job state confirms and
    name the head's forged one as unconfirmed."""
    saved_steps(settings, job, [1, 2])
    with Checkpointer(job, rank=0, world_size=2, settings=settings) as ckpt:
        assert ckpt.latest_step() == 2  # (the job state folded)
    forge(settings, job, record=True)

    out = run_cli(settings, "ls", "--json")
    assert out.returncode == 0, out.stderr
    (row,) = [r for r in map(json.loads, out.stdout.splitlines()) if r["job"] == job]
    assert (row["newest_nvme"], row["newest_s3"]) == (2, 2), row
    assert str(FORGED) in row["unconfirmed"], row

    out = run_cli(settings, "status", "--job", job)
    assert out.returncode == 0, out.stderr
    assert f"NVMe 2 ({FORGED} unconfirmed)" in out.stdout, out.stdout
    assert f"step {FORGED} unconfirmed: " in out.stdout, out.stdout
