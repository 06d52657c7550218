"""A restore never returns wrong bytes and never races retention (issue #8, items 2, 3, 4, 9,
10 and 20, and the fault "S3 hung during a restore")."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.conftest import Agent, Events
from tests.oracle_catalog import Catalog
from tests.oracle_plan import plan_recovery
from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.coordinator import RestorePins
from tierpipe.control.jobstate import JobState
from tierpipe.dev import S3Server
from tierpipe.errors import IntegrityError, NoCheckpointError, ShardMissingError
from tierpipe.names import shard_relpath
from tierpipe.recovery.load import Expected, load_into
from tierpipe.schemas import (
    Event,
    RecoveryPlanned,
    RestoreReport,
    ShardEvicted,
    ShardFlushed,
    ShardVerified,
    ShardWritten,
    StageFailed,
)
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.shardfile import write_shard
from tierpipe.storage.staging import NodeSlots
from tierpipe.trainer.checkpointer import Checkpointer

# --- events for pure-logic tests

NODE = "n0"


def digest(step: int, rank: int = 0) -> str:
    return f"{step:016x}{rank:016x}"


def ident(step: int, rank: int = 0, world: int = 1, node: str = NODE) -> dict[str, Any]:
    return dict(job="j", node=node, ts=0.0, step=step, rank=rank, world_size=world)


def path_of(step: int, rank: int = 0, world: int = 1) -> str:
    return f"/nvme/{shard_relpath('j', step, rank, world)}"


def written(step: int, rank: int = 0, world: int = 1) -> ShardWritten:
    return ShardWritten(
        **ident(step, rank, world),
        path=path_of(step, rank, world),
        nbytes=8192,
        header_digest=digest(step, rank),
        tensors=1,
        seconds=0,
    )


def verified(step: int, rank: int = 0, world: int = 1) -> ShardVerified:
    return ShardVerified(
        **ident(step, rank, world),
        path=path_of(step, rank, world),
        nbytes=8192,
        header_digest=digest(step, rank),
        seconds=0,
    )


def flushed(step: int, rank: int = 0, world: int = 1, **kw: Any) -> ShardFlushed:
    return ShardFlushed(
        **ident(step, rank, world),
        bucket="b",
        key=str(shard_relpath("j", step, rank, world)),
        etag="e",
        checksum="c",
        header_digest=digest(step, rank),
        nbytes=8192,
        seconds=0,
        **kw,
    )


def saved(step: int, rank: int = 0, world: int = 1) -> list[Event]:
    return [written(step, rank, world), verified(step, rank, world), flushed(step, rank, world)]


def fold(*events: Event) -> Catalog:
    catalog = Catalog()
    for e in events:
        catalog.apply(e)
    return catalog


def plan(catalog: Catalog, **kw: Any) -> Any:
    return plan_recovery(catalog, "j", world_size=1, alive={NODE}, rank_nodes={0: NODE}, **kw)


def restore_failed(step: int, tier: str, error: str, *, retryable: bool) -> StageFailed:
    return StageFailed(
        **{k: v for k, v in ident(step).items()},
        stage="restore",
        error=error,
        message=f"{error} on {tier}",
        retryable=retryable,
        attempt=1,
        tier=tier,  # type: ignore[arg-type]
    )


# --- item 2: the NVMe load path checks identity and header digest


def test_load_into_refuses_another_steps_file_before_touching_targets(tmp_path: Path) -> None:
    """A valid shard of step 2 read where step 3 is expected raises IntegrityError naming both
    identities, and no byte reaches the target."""
    path = tmp_path / "step3.shard"
    write_shard(path, {"w": torch.full((1000,), 2.0)}, job="j", step=2)
    target = torch.zeros(1000)
    with pytest.raises(IntegrityError) as caught:
        load_into(str(path), {"w": target}, expected=Expected("j", 3, 0, 1, "0" * 32))
    assert "step 3" in caught.value.expected and "step 2" in caught.value.actual
    assert torch.equal(target, torch.zeros(1000))


def test_load_into_refuses_a_header_digest_other_than_the_catalogs(tmp_path: Path) -> None:
    """Right identity, other save (header digest differs from the catalog's): IntegrityError."""
    path = tmp_path / "s.shard"
    actual = write_shard(path, {"w": torch.ones(10)}, job="j", step=3)
    with pytest.raises(IntegrityError, match="header") as caught:
        load_into(str(path), expected=Expected("j", 3, 0, 1, "f" * 32))
    assert (caught.value.expected, caught.value.actual) == ("f" * 32, actual)
    assert torch.equal(
        load_into(str(path), expected=Expected("j", 3, 0, 1, actual)).state["w"], torch.ones(10)
    )


def test_a_missing_file_is_missing_not_garbled(tmp_path: Path) -> None:
    """A shard file that is gone raises ShardMissingError (its copy is not corrupt)."""
    with pytest.raises(ShardMissingError):
        load_into(str(tmp_path / "gone.shard"))


# --- item 3: load_state_dict is skipped only for provable aliases


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))


def roundtrip(saved_module: torch.nn.Module, fresh: torch.nn.Module, tmp_path: Path) -> None:
    write_shard(tmp_path / "m.shard", {"model": saved_module}, job="j", step=1)
    load_into(str(tmp_path / "m.shard"), {"model": fresh})


def test_state_dict_hook_that_clones_still_restores_the_module(tmp_path: Path) -> None:
    """With a state-dict hook that returns clones, the live module still gets the saved weights."""

    def clone(module: Any, state: dict, prefix: str, meta: Any) -> None:
        for k in list(state):
            state[k] = state[k].clone()

    source, fresh = net(0), net(1)
    fresh.register_state_dict_post_hook(clone)
    roundtrip(source, fresh, tmp_path)
    for (name, a), b in zip(source.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_state_dict_hook_that_casts_still_restores_the_module(tmp_path: Path) -> None:
    """A hook that casts the state to bf16 (as saved): the live fp32 module gets those values."""

    def cast(module: Any, state: dict, prefix: str, meta: Any) -> None:
        for k in list(state):
            if state[k].is_floating_point():
                state[k] = state[k].to(torch.bfloat16)

    source, fresh = net(0), net(1)
    source.register_state_dict_post_hook(cast)
    fresh.register_state_dict_post_hook(cast)
    roundtrip(source, fresh, tmp_path)
    live = dict(fresh.named_parameters())
    for name, want in source.state_dict().items():
        if name in live:
            assert live[name].dtype == torch.float32
            assert torch.equal(live[name].detach().to(torch.bfloat16), want), name


class Counted(torch.nn.Module):
    """A layer with tensor extra state (`get_extra_state` returns a new tensor every time)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = 0

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.seen])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.seen = int(state[0])


def test_tensor_extra_state_reaches_the_module(tmp_path: Path) -> None:
    """Extra state held outside the module's tensors is restored through load_state_dict."""
    source, fresh = Counted(), Counted()
    source.seen = 41
    roundtrip(source, fresh, tmp_path)
    assert fresh.seen == 41 and torch.equal(fresh.lin.weight, source.lin.weight)


def test_plain_module_is_restored_in_place_without_load_state_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain module's tensors are the live ones: copied in place, load_state_dict skipped."""
    source, fresh = net(0), net(1)
    calls = []
    monkeypatch.setattr(fresh, "load_state_dict", lambda *a, **k: calls.append(a))
    before = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    roundtrip(source, fresh, tmp_path)
    assert calls == []
    for name, want in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], want), name
        assert fresh.state_dict()[name].data_ptr() == before[name]


# --- item 4: a planned step must be backed by evidence


def test_forged_verified_and_flushed_events_make_nothing_restorable() -> None:
    """A `verified` with no `written`, and a `flushed` matching no verified NVMe copy, count for
    nothing: the real newest step is planned, and the forged step's rejection says why."""
    forged_flushed = flushed(999)
    catalog = fold(*saved(5), verified(999), forged_flushed)
    assert catalog.complete_steps("j", ("nvme", "s3")) == [5]
    chosen = plan(catalog)
    assert chosen.step == 5
    assert "without a matching `written`" in chosen.rejected[999]
    assert "matches no verified NVMe copy" in chosen.rejected[999]


def test_verified_must_match_the_written_copy() -> None:
    """A `verified` whose digest, size or path differs from the node's `written` is ignored."""
    other = ShardVerified(
        **ident(3), path=path_of(3), nbytes=8192, header_digest="e" * 32, seconds=0
    )
    assert fold(written(3), other).complete_steps("j", ("nvme",)) == []
    assert fold(written(3), verified(3)).complete_steps("j", ("nvme",)) == [3]


def test_reindexed_objects_stand_on_their_own() -> None:
    """A `flushed` republished by reindex (no NVMe copy left anywhere) counts."""
    catalog = fold(flushed(7, origin="reindex"))
    assert catalog.complete_steps("j", ("s3",)) == [7]
    assert plan(catalog).sources[0][0].tier == "s3"


# --- item 9: "unreachable" is not "corrupt"


@pytest.mark.parametrize(
    "error", ["StorageUnavailableError", "StorageAuthError", "ShardMissingError", "RestoreTimeout"]
)
def test_unreachable_refused_or_missing_copies_are_not_corrupt(error: str) -> None:
    """A restore that could not read a copy (even one reported as permanent by an older client)
    does not make it corrupt: the next plan still uses it."""
    catalog = fold(*saved(4), restore_failed(4, "s3", error, retryable=False))
    assert [s.tier for s in plan(catalog).sources[0]] == ["nvme", "s3"]


def test_digest_mismatch_marks_corrupt_and_a_later_good_check_clears_it() -> None:
    """Evidence marks the copy corrupt (the plan says so and hints reindex); a later successful
    restore load of it, or a fresh `flushed`, clears the mark."""
    bad = restore_failed(4, "s3", "IntegrityError", retryable=False)
    catalog = fold(*saved(4), bad)
    chosen = plan(catalog)
    assert [s.tier for s in chosen.sources[0]] == ["nvme"]
    assert any("marked corrupt" in n and "tierpipe reindex --job j" in n for n in chosen.notes)
    assert "tierpipe reindex" in chosen.describe()
    loaded = RestoreReport(
        job="j", node=NODE, ts=0.0, restart="r", rank=0, world_size=1, phase="loaded",
        round=1, step=4, tier="s3",
    )  # fmt: skip
    catalog.apply(loaded)
    assert [s.tier for s in plan(catalog).sources[0]] == ["nvme", "s3"]
    catalog.apply(bad)
    catalog.apply(flushed(4, origin="reindex"))
    assert [s.tier for s in plan(catalog).sources[0]] == ["nvme", "s3"]


def test_rejected_step_names_the_corrupt_copy_and_the_reindex_hint() -> None:
    """When no copy of a step is left, its rejection reason names the corrupt mark and hints
    `tierpipe reindex`."""
    catalog = fold(
        *saved(2),
        *saved(4),
        restore_failed(4, "s3", "IntegrityError", retryable=False),
        restore_failed(4, "nvme", "IntegrityError", retryable=False),
    )
    chosen = plan(catalog)
    assert chosen.step == 2
    assert "marked corrupt (restore: IntegrityError" in chosen.rejected[4]
    assert "tierpipe reindex --job j" in chosen.rejected[4]


# --- item 20: a step that was never saved


def test_never_saved_step_says_so_and_lists_the_newest() -> None:
    """`restore(step=12345)` of a step never saved names it and lists the newest saved steps."""
    catalog = fold(*saved(2), *saved(4), *saved(6))
    with pytest.raises(NoCheckpointError) as caught:
        plan(catalog, step=12345)
    assert str(caught.value) == (
        "step 12345 of job 'j' was never saved; the newest complete steps are 6, 4, 2"
    )


# --- item 10: retention keeps what an in-progress restore reads


def test_retention_keeps_a_pinned_step() -> None:
    """A step pinned by a restore keeps its NVMe and S3 copies, though the policy would
    remove them: the floors keep it until the pin goes."""
    keep = Keep(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    pinned, unpinned = JobState("j", keep), JobState("j", keep)
    pinned.pin({2})
    for seq, event in enumerate([e for s in range(1, 7) for e in saved(s)], 1):
        pinned.apply(seq, event)
        unpinned.apply(seq, event)
    floors = unpinned.floors()
    assert floors.nvme > 2 and floors.s3 > 2 and 2 not in floors.keep
    assert 2 not in unpinned.head().steps
    assert 2 in pinned.floors().keep and 2 in pinned.head().steps
    pinned.pin(())
    assert 2 not in pinned.floors().keep and 2 not in pinned.head().steps


def test_restore_pins_hold_until_the_final_plan_or_the_timeout() -> None:
    """A plan pins its step; the final plan (or an error, or plan ts + timeout) releases it; a
    newer round moves the pin."""

    def planned(step: int, ts: float, **kw: Any) -> RecoveryPlanned:
        return RecoveryPlanned(
            job="j", node=NODE, ts=ts, restart="r", round=kw.pop("round", 1), step=step,
            world_size=1, **kw,
        )  # fmt: skip

    pins = RestorePins(timeout_s=60.0)
    pins.note(planned(5, 100.0))
    assert pins.steps("j", now=101.0) == {5} and pins.steps("other", now=101.0) == set()
    assert pins.steps("j", now=161.0) == set()  # timed out
    pins.note(planned(4, 102.0, round=2))
    pins.note(planned(5, 100.0))  # an older plan arriving late changes nothing
    assert pins.steps("j", now=103.0) == {4}
    pins.note(planned(4, 104.0, round=2, final=True))
    assert pins.steps("j", now=105.0) == set()
    pins.note(planned(0, 106.0, error="NoCheckpointError: nothing"))
    assert pins.steps("j", now=107.0) == set()


# --- S3Store.download: project errors only


@pytest.mark.anyio
async def test_download_of_a_missing_object_raises_shard_missing(settings: Settings) -> None:
    """A missing object is ShardMissingError, never a private class or an exception group."""
    async with S3Store(settings) as store:
        with pytest.raises(ShardMissingError, match="no such object"):
            await store.download("nothing/here.shard", 20 << 20)


# --- end to end: real agent processes, nats-server and SeaweedFS


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def states(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def assert_equal(target: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert torch.equal(target.state_dict()[k], v), k


def save(settings: Settings, job: str, steps: list[int], events: Events) -> dict[int, dict]:
    """Save `steps` of rank 0 (world size 1); wait until each is flushed; their states."""
    out = {}
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        for step in steps:
            m = model(step)
            out[step] = states(m)
            c.save(step, {"model": m, "step": step})
        c.wait_until_finished(timeout=60)
    for step in steps:
        events.wait_for(
            lambda e, s=step: isinstance(e, ShardFlushed) and e.step == s, kind="flushed"
        )
    return out


@pytest.fixture
def elsewhere(settings: Settings) -> Iterator[Settings]:
    """Settings of a trainer on another node (a replaced one): it can only read object storage."""
    other = settings.replace(
        node=f"{settings.node}-b",
        staging_root=settings.staging_root + "-b",
        nvme_root=settings.nvme_root + "-b",  # (its own disk: the survey checks local paths)
        restore_timeout_s=30.0,
    )
    yield other
    shutil.rmtree(other.staging_root, ignore_errors=True)


def failures(events: Events, tier: str) -> list[StageFailed]:
    return [
        e
        for e in events.all("failed")
        if isinstance(e, StageFailed) and e.stage == "restore" and e.tier == tier
    ]


@contextlib.contextmanager
def paused(server: S3Server) -> Iterator[None]:
    """The store hung: SIGSTOP now, SIGCONT on the way out whatever happens."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


@pytest.mark.slow
def test_misplaced_nvme_file_never_restores_as_another_step(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Step 2's valid shard copied over step 3's NVMe path (same size): restore(step=3) reads
    step 3 from object storage and reports the NVMe copy, never returning step 2's tensors."""
    agent()
    saved_states = save(settings, job, [2, 3], events)
    root = Path(settings.nvme_root).absolute()
    two, three = root / shard_relpath(job, 2, 0, 1), root / shard_relpath(job, 3, 0, 1)
    assert two.stat().st_size == three.stat().st_size
    shutil.copyfile(two, three)
    target = model(99)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        restored = c.restore({"model": target}, step=3)
    assert (restored.step, restored.source.tier, restored.rounds) == (3, "s3", 1)
    assert_equal(target, saved_states[3])
    (bad,) = failures(events, "nvme")
    assert bad.error == "IntegrityError" and not bad.retryable and "step 2" in bad.message


@pytest.mark.slow
def test_forged_events_move_neither_latest_step_nor_plan_nor_restore(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Schema-valid but bogus `verified` and `flushed` events for step 999 are ignored by
    latest_step(), all_steps(), `tierpipe plan` and restore()."""
    agent()
    saved_states = save(settings, job, [1, 2], events)
    key = str(shard_relpath(job, 999, 0, 1))
    ids = dict(job=job, node=settings.node, ts=time.time(), step=999, rank=0, world_size=1)
    forged: list[Event] = [
        ShardVerified(**ids, path="/x", nbytes=8192, header_digest="a" * 32, seconds=0),
        ShardFlushed(**ids, bucket=settings.s3_bucket, key=key, etag="e", checksum="c",
                     header_digest="a" * 32, nbytes=8192, seconds=0),
    ]  # fmt: skip

    async def publish() -> None:  # as an agent does: per rank, and the node's batch
        async with Bus(settings) as bus:
            batches = Batcher(bus)
            for e in forged:
                await bus.publish(e)
                batches.add(e)
            await batches.flush()

    anyio.run(publish)
    env = {**os.environ, **settings.as_env()}
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "plan", "--job", job],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.startswith("restore step 2 "), out.stderr
    assert "step 999 rejected" in out.stdout
    target = model(99)
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        assert (c.latest_step(), c.all_steps()) == (2, [1, 2])
        restored = c.restore({"model": target})
    assert restored.step == 2 and restored.rounds == 1
    assert_equal(target, saved_states[2])


@pytest.mark.slow
def test_restore_with_s3_down_skips_it_for_this_attempt_only(
    settings: Settings,
    elsewhere: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    s3_server: S3Server,
) -> None:
    """A replaced node restoring while S3 is down fails this attempt (the copy is reported as
    unreachable, not corrupt); once S3 is back, the next restore reads that copy."""
    agent()
    saved_states = save(settings, job, [1], events)
    s3_server.kill()
    try:
        t0 = time.monotonic()
        with (
            Checkpointer(job, rank=0, world_size=1, settings=elsewhere) as c,
            pytest.raises(NoCheckpointError, match="StorageUnavailableError"),
        ):
            c.restore()
        assert time.monotonic() - t0 < elsewhere.restore_timeout_s
    finally:
        s3_server.start()
    assert failures(events, "s3") and all(f.retryable for f in failures(events, "s3"))
    target = model(99)
    with Checkpointer(job, rank=0, world_size=1, settings=elsewhere) as c:
        restored = c.restore({"model": target})
    assert (restored.step, restored.source.tier) == (1, "s3")
    assert_equal(target, saved_states[1])


@pytest.mark.slow
def test_restore_refused_by_s3_hints_at_trainer_credentials_and_keeps_the_copy(
    settings: Settings, elsewhere: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A trainer whose S3 credentials are refused skips the copy for this attempt with a hint
    about trainer credentials; with the right ones, the next restore reads it."""
    agent()
    saved_states = save(settings, job, [1], events)
    refused = elsewhere.replace(s3_secret_access_key="not-the-secret")
    with (
        Checkpointer(job, rank=0, world_size=1, settings=refused) as c,
        pytest.raises(NoCheckpointError, match="StorageAuthError"),
    ):
        c.restore()
    (failed,) = failures(events, "s3")
    assert failed.error == "StorageAuthError" and failed.retryable
    assert "for trainers" in failed.message and "not-the-secret" not in failed.message
    target = model(99)
    with Checkpointer(job, rank=0, world_size=1, settings=elsewhere) as c:
        assert c.restore({"model": target}).source.tier == "s3"
    assert_equal(target, saved_states[1])


@pytest.mark.slow
def test_s3_hung_during_restore_fails_this_attempt_within_the_deadline(
    settings: Settings,
    elsewhere: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    s3_server: S3Server,
) -> None:
    """With the store SIGSTOPped, a restore from it gives up cleanly within its deadline; after
    SIGCONT a restore succeeds from the same copy."""
    agent()
    saved_states = save(settings, job, [1], events)
    hung = elsewhere.replace(s3_read_timeout_s=1.0, restore_timeout_s=20.0)
    with paused(s3_server):
        t0 = time.monotonic()
        with (
            Checkpointer(job, rank=0, world_size=1, settings=hung) as c,
            pytest.raises(NoCheckpointError, match="no good copy left"),
        ):
            c.restore()
        assert time.monotonic() - t0 < hung.restore_timeout_s
    assert all(f.retryable for f in failures(events, "s3"))
    target = model(99)
    with Checkpointer(job, rank=0, world_size=1, settings=hung) as c:
        restored = c.restore({"model": target})
    assert (restored.step, restored.source.tier) == (1, "s3")
    assert_equal(target, saved_states[1])


@pytest.mark.slow
def test_rank_0_plans_from_the_stream_as_it_stands_once_every_rank_reported(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """Rank 0 arrives while rank 1 still saves the newest step: the plan is that newest step,
    not the one complete when rank 0 arrived."""
    agent()
    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        Checkpointer(job, rank=0, world_size=2, settings=settings) as zero,
        Checkpointer(job, rank=1, world_size=2, settings=settings) as one,
    ):
        for c in (zero, one):
            c.save(1, {"model": model(10 + c.rank)}).result(timeout=30)
        newest = model(20)
        zero.save(2, {"model": newest}).result(timeout=30)
        want = states(newest)
        target = model(99)
        leading = pool.submit(zero.restore, {"model": target})
        events.wait_for(
            lambda e: isinstance(e, RestoreReport) and e.phase == "ready", kind="restore"
        )
        one.save(2, {"model": model(21)}).result(timeout=30)
        assert one.restore({"model": model(98)}).step == 2
        restored = leading.result(timeout=30)
    assert (restored.step, restored.rounds) == (2, 1)
    assert_equal(target, want)


@pytest.mark.slow
def test_retention_never_evicts_the_step_a_restore_is_reading(
    settings: Settings,
    elsewhere: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    cpu_hog: None,
) -> None:
    """While saves continue and retention (keep 2 on NVMe and S3) runs under CPU load, the step
    a restore planned keeps every copy until the restore ends, and restores bitwise."""
    keep = settings.replace(nvme_keep_latest_k=2, s3_keep_latest_k=2)
    agent(settings=keep)
    saved_states: dict[int, dict] = {}
    stop = threading.Event()

    def keep_saving() -> None:
        with Checkpointer(job, rank=0, world_size=1, settings=keep) as c:
            for step in range(1, 10_000):
                if stop.is_set():
                    return
                m = model(step)
                saved_states[step] = states(m)
                c.save(step, {"model": m})
                c.wait_until_finished(timeout=30)

    reader = elsewhere.replace(
        nvme_keep_latest_k=2, s3_keep_latest_k=2, restore_timeout_s=90.0,
        restore_s3_reads_per_node=1,
    )  # fmt: skip
    # Hold the node's only object-storage read slot: the restore plans, then waits for it.
    reads = NodeSlots(reader.staging_root, "s3-reads", 1).hold()
    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        Checkpointer(job, rank=0, world_size=1, settings=reader) as c,
    ):
        saver = pool.submit(keep_saving)
        try:
            events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step >= 3, kind="flushed")
            target = model(99)
            reads.__enter__()
            try:
                restoring = pool.submit(c.restore, {"model": target})
                planned = events.wait_for(
                    lambda e: isinstance(e, RecoveryPlanned), kind="plan", timeout=60
                )
                step = planned.step  # type: ignore[union-attr]
                # Retention moved past the planned step: it evicted a newer one from S3.
                events.wait_for(
                    lambda e: isinstance(e, ShardEvicted) and e.tier == "s3" and e.step > step,
                    kind="evicted",
                    timeout=60,
                )
                # (Under load an NVMe copy may go a moment before the plan, its node's evict not
                # yet having heard the restart's hold; the restore then reads another copy. From
                # the plan on no copy of the step goes, and object storage never loses it.)
                gone = [
                    e
                    for e in events.all("evicted")
                    if isinstance(e, ShardEvicted)
                    and e.step == step
                    and e.tier != "ram"
                    and (e.tier == "s3" or e.ts >= planned.ts)
                ]
                assert gone == []
            finally:
                reads.__exit__(None, None, None)
            restored = restoring.result(timeout=60)
        finally:
            stop.set()
            saver.result(timeout=60)
    assert (restored.step, restored.rounds, restored.source.tier) == (step, 1, "s3")
    assert_equal(target, saved_states[step])
