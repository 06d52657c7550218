"""COMMIT manifests: written once a step is complete in object storage, never overwritten,
removed with the step, and enough for reindex to rebuild a job whose stream and KV are lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from tests.conftest import Agent, Events
from tests.test_coordinator import saved
from tests.test_recovery import restore_all, save_steps
from tests.test_retention import digest
from tierpipe.bus.client import Bus
from tierpipe.control.coordinator import Coordinator
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import StorageUnavailableError
from tierpipe.names import stream_name
from tierpipe.recovery import survey
from tierpipe.schemas import Event
from tierpipe.schemas.commit import CommitManifest, decode_commit, encode_commit
from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, Keep, RankDigests
from tierpipe.settings import Settings, load_settings
from tierpipe.storage.s3.commit import commit_key, put_commit, read_commit, read_commits
from tierpipe.storage.s3.store import S3Store


def manifest(world: int, *, step: int = 3, epoch: int = 0, job: str = "j") -> CommitManifest:
    return CommitManifest(
        job=job, step=step, world_size=world, epoch=epoch,
        digests=b"".join(bytes.fromhex(digest(step, r)) for r in range(world)),
        sizes=b"".join((4096 + r).to_bytes(8, "little") for r in range(world)),
        by="node-a", ts=time.time(),
    )  # fmt: skip


# --- the manifest and the fold (pure)


@pytest.mark.parametrize(("world", "most"), [(8, 400), (80_000, 2_000_000)])
def test_manifest_round_trips_in_24_bytes_a_rank(world: int, most: int) -> None:
    """A manifest decodes to itself, each rank's digest and size intact, in about 24 bytes a
    rank (284 bytes at 8 ranks, 1.92 MB at 80,000)."""
    m = manifest(world)
    data = encode_commit(m)
    assert len(data) < most and len(data) < 24 * world + 200
    back = decode_commit(data)
    assert back == m and back.of(world - 1) == (digest(3, world - 1), 4096 + world - 1)


def test_manifest_refuses_a_rank_without_a_digest() -> None:
    """A manifest is made only of a complete step (every rank has a digest and a size), and
    read only by a version that knows its format."""
    chunk = RankDigests(step=1, first=0, digests=bytes(32), sizes=(5).to_bytes(8, "little") * 2)
    CommitManifest.from_chunks("j", 1, 2, 0, [chunk])
    hole = RankDigests(
        step=1, first=0, digests=bytes(32), sizes=bytes(8) + (5).to_bytes(8, "little")
    )
    with pytest.raises(ValueError, match="rank 0"):
        CommitManifest.from_chunks("j", 1, 2, 0, [hole])
    with pytest.raises(msgspec.ValidationError, match="version 2"):
        decode_commit(encode_commit(msgspec.structs.replace(manifest(2), version=2)))


def test_fold_says_committed_once_a_step_is_complete_in_object_storage() -> None:
    """`committed` names a step when its last rank's object is confirmed, and not again when
    a coordinator takes over from the stored state."""
    state = JobState("j", Keep())
    seq = 0
    for event in saved("j", 1, 0, "n"):
        seq += 1
        state.apply(seq, event)
    assert state.take_changes().committed == set()
    for event in saved("j", 1, 1, "n"):
        seq += 1
        state.apply(seq, event)
    changes = state.take_changes()
    assert changes.committed == {1}
    again = JobState("j", Keep(), head=state.head(), floors=state.floors(),
                     records=state.records())  # fmt: skip
    assert again.take_changes().committed == set()
    # Its digests make the manifest the coordinator writes.
    chunks = [state.rank_digests(1, c) for c in range(-(-2 // RANKS_PER_CHUNK))]
    m = CommitManifest.from_chunks("j", 1, 2, 0, [c for c in chunks if c is not None])
    assert m.of(1) == (digest(1, 1), 4096)


class _Quiet:
    """Stands in for the KV writer and the bus: the coordinator's commits are all this test
    looks at."""

    async def write(self, state: JobState, changes: object) -> None:
        pass

    async def value(self, key: str) -> bytes | None:
        return None  # (no object store bound yet: the coordinator binds its own)

    async def create(self, key: str, value: bytes) -> bool:
        return True

    async def publish(self, event: Event, *, id_suffix: str = "") -> None:
        pass


def test_a_commit_the_store_refuses_is_written_at_the_next_flush() -> None:
    """A COMMIT that fails (store down) stays pending and is written at the next flush; one
    whose step retention removes first is never written."""
    tried: list[int] = []

    async def commit(m: CommitManifest) -> bool:
        tried.append(m.step)
        if len(tried) == 1:
            raise StorageUnavailableError("store down")
        return True

    async def remove(job: str, step: int, world_size: int, ranks: object) -> None:
        pass

    async def main() -> None:
        quiet: Any = _Quiet()
        coord = Coordinator(load_settings(env={}), quiet, quiet, "n", remove, commit=commit)
        state = JobState("j", Keep())
        for seq, event in enumerate([*saved("j", 1, 0, "n"), *saved("j", 1, 1, "n")], 1):
            state.apply(seq, event)
        await coord._store(state, state.take_changes())
        assert tried == [1] and list(coord._commits) == [("j", 1)]
        await coord._store(state, state.take_changes())
        assert tried == [1, 1] and not coord._commits
        for seq, event in enumerate([*saved("j", 2, 0, "n"), *saved("j", 2, 1, "n")], 100):
            state.apply(seq, event)
        changes = state.take_changes()
        changes.s3_removed[2] = state.record(2)  # type: ignore[assignment]
        await coord._store(state, changes)
        assert tried == [1, 1]

    anyio.run(main)


def test_an_object_confirmed_after_its_steps_removal_is_removed_and_announced() -> None:
    """Retention removes step 1 (every rank's object, its COMMIT) while rank 1's upload is on
    its way, announcing rank 0 alone; rank 1's late `flushed` gets its object removed (rank 1
    alone, no COMMIT: gone already) and announced. Before: it was neither (an object uploaded
    after the removal stayed in the bucket, and `test_flush` missed an announcement)."""
    removed: list[tuple[int, object]] = []
    published: list[Event] = []

    async def remove(job: str, step: int, world_size: int, ranks: object) -> None:
        removed.append((step, None if ranks is None else list(ranks)))  # type: ignore[call-overload]

    class Recording(_Quiet):
        async def publish(self, event: Event, *, id_suffix: str = "") -> None:
            published.append(event)

    def evicted() -> list[tuple[int, int]]:
        got = [(e.step, e.rank) for b in published for e in getattr(b, "events", [])]
        published.clear()
        return got

    async def main() -> None:
        bus: Any = Recording()
        coord = Coordinator(load_settings(env={}), bus, bus, "n", remove)
        state = JobState("j", Keep(nvme_keep_latest_k=10, s3_keep_latest_k=1))
        late = saved("j", 1, 1, "n")
        events = [*saved("j", 1, 0, "n"), *late[:2], *saved("j", 2, 0, "n"), *saved("j", 2, 1, "n")]
        for seq, event in enumerate(events, 1):
            state.apply(seq, event)
        await coord._store(state, state.take_changes())
        assert removed == [(1, None)] and evicted() == [(1, 0)]
        state.apply(100, late[2])
        await coord._store(state, state.take_changes())
        assert removed == [(1, None), (1, [1])] and evicted() == [(1, 1)]
        assert not coord._removals
        # A restart folding the state to read it removes nothing: the late object is left to
        # `tierpipe gc` (logged deferred), never announced, and the fold's write goes on.
        reader = Coordinator(load_settings(env={}), bus, bus, "n", survey._no_removal)
        state.apply(101, saved("j", 1, 1, "n")[2])  # (as a re-delivery of the same object)
        changes = state.take_changes()
        changes.s3_late[1] = state.record(1)  # type: ignore[assignment]
        await reader._store(state, changes)
        assert list(reader._removals) == [("j", 1)] and evicted() == []

    anyio.run(main)


def lose_state_and_reindex(
    settings: Settings, job: str, tmp_path: Path, events: Events | None = None
) -> str:
    """Lose `job`'s stream and the whole job-state bucket, then run `tierpipe reindex` on
    another node (no NVMe copies there); its stdout."""

    async def lose_everything() -> None:
        async with Bus(settings) as bus:
            await bus.js.purge_stream(stream_name(settings.stream, job), subject=f"tp.{job}.>")
            await bus.js.delete_key_value(settings.kv_bucket)

    anyio.run(lose_everything)
    if events is not None:
        assert events.all() == []
    env = {**os.environ, **settings.as_env()}
    elsewhere = {**env, "TIERPIPE_NODE": "reindexer", "TIERPIPE_NVME_ROOT": str(tmp_path / "x")}
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "reindex", "--job", job],
        env=elsewhere, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# --- object storage


def test_commit_is_created_once_and_replaced_only_by_a_newer_timeline(settings: Settings) -> None:
    """A second create of a step's COMMIT leaves the first in place; only a newer epoch's
    manifest of the step replaces it."""

    async def main() -> None:
        async with S3Store(settings) as store:
            first = manifest(4, job="jj", epoch=1)
            assert await put_commit(store, first)
            other = msgspec.structs.replace(first, digests=bytes(64), by="node-b")
            assert not await put_commit(store, other)
            assert await read_commit(store, "jj", 3) == first
            assert not await put_commit(store, msgspec.structs.replace(other, epoch=0))
            newer = msgspec.structs.replace(other, epoch=2)
            assert await put_commit(store, newer)
            assert await read_commits(store, "jj") == [newer]
            assert commit_key(store.prefix, "jj", 3).endswith("commit/jj/step-000000000003/COMMIT")

    anyio.run(main)


# --- with a real agent


def commit_of(settings: Settings, job: str, step: int) -> CommitManifest | None:
    async def main() -> CommitManifest | None:
        async with S3Store(settings) as store:
            return await read_commit(store, job, step)

    return anyio.run(main)


def wait_until(what: str, check: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


@pytest.mark.slow
def test_lost_stream_and_kv_are_rebuilt_from_commit_manifests(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """The coordinator commits each step complete in object storage with the job state's
    digests; after the stream and the KV bucket are both lost, `tierpipe reindex` run on a node
    without the NVMe copies rebuilds the job state from the manifests, and a restart restores
    the newest committed step bitwise from object storage."""
    a = agent()
    saved_state = save_steps(settings, job, 2, [1, 2], events)
    found = wait_until("COMMIT of step 2", lambda: commit_of(settings, job, 2))
    assert isinstance(found, CommitManifest)

    async def kv_digests() -> list[tuple[str, int] | None]:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            return [await store.rank_digest(job, 2, r) for r in range(2)]

    assert found.world_size == 2 and found.job == job and found.step == 2
    assert [found.of(r) for r in range(2)] == anyio.run(kv_digests)
    a.stop()

    out = lose_state_and_reindex(settings, job, tmp_path, events)
    assert "republished 0 NVMe shards and 4 objects" in out, out

    async def head() -> object:
        async with Bus(settings) as bus:
            return await (await JobStore(bus.js, settings).open()).head(job)

    rebuilt = anyio.run(head)
    assert rebuilt is not None and rebuilt.s3_steps == [1, 2], rebuilt  # type: ignore[attr-defined]
    for rank, (restored, target) in enumerate(restore_all(settings, job, 2)):
        assert restored.step == 2 and restored.source.tier == "s3", restored
        for k, v in saved_state[(2, rank)].items():
            assert torch.equal(target.state_dict()[k], v), k


@pytest.mark.slow
def test_retention_removes_a_steps_commit_with_its_objects(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, s3_server
) -> None:
    """When retention removes a step's objects, its COMMIT goes too; the kept step's stays."""
    import boto3

    s = settings.replace(s3_keep_latest_k=1, nvme_keep_latest_k=2)
    agent(settings=s)
    save_steps(s, job, 1, [1], events)
    wait_until("COMMIT of step 1", lambda: commit_of(s, job, 1))
    save_steps(s, job, 1, [2, 3], events)
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    key = S3Store(s).key(job, 1, 0, 1)

    def gone() -> bool:
        listed = s3.list_objects_v2(Bucket=s.s3_bucket, Prefix=key)
        return not listed.get("Contents")

    wait_until("step 1's object removed", gone)
    assert commit_of(s, job, 1) is None
    assert wait_until("COMMIT of step 3", lambda: commit_of(s, job, 3))
