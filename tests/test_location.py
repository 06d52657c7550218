"""The object store a job's objects are bound to (`tierpipe.control.location`): how locations
compare, and that agents racing to bind a job agree on one."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from tests.test_coordinator import saved
from tierpipe.bus.client import Bus
from tierpipe.control.coordinator import Coordinator
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore
from tierpipe.control.location import (
    bind_location,
    location_of,
    normal_endpoint,
    same_location,
    stored_location,
)
from tierpipe.errors import StoreMismatchError
from tierpipe.schemas.commit import CommitManifest
from tierpipe.schemas.jobstate import JobHead, Keep, StoreLocation
from tierpipe.settings import Settings, load_settings


def test_endpoints_compare_as_urls_and_keep_no_credentials() -> None:
    """Case of scheme and host, a trailing slash and the scheme's default port make no other
    endpoint; another host, port, bucket or prefix does; credentials are never kept."""
    a = StoreLocation(endpoint=normal_endpoint("HTTP://S3.Example.com:80/"), bucket="b", prefix="p")
    assert a.endpoint == "http://s3.example.com"
    assert same_location(
        a, StoreLocation(endpoint="http://s3.example.com/", bucket="b", prefix="/p/")
    )
    assert normal_endpoint("https://key:secret@S3.example.com:443/") == "https://s3.example.com"
    assert normal_endpoint("http://[::1]:8333/") == "http://[::1]:8333"
    assert normal_endpoint(None) == normal_endpoint("") == ""
    for other in (
        msgspec.structs.replace(a, endpoint="http://s3.example.com:8333"),
        msgspec.structs.replace(a, endpoint="https://s3.example.com"),
        msgspec.structs.replace(a, endpoint=""),
        msgspec.structs.replace(a, bucket="c"),
        msgspec.structs.replace(a, prefix="q"),
    ):
        assert not same_location(a, other), other
    assert not same_location(a, "an unreadable location")
    settings = load_settings(env={}, s3_endpoint=None, s3_bucket="b", s3_prefix="team/")
    assert location_of(settings) == StoreLocation(endpoint="", bucket="b", prefix="team")
    assert "AWS" in str(location_of(settings))


def test_agents_racing_to_bind_a_job_agree_on_one_store(settings: Settings, job: str) -> None:
    """Of agents with different buckets binding a job at once, one binds it to its store; each
    other one is refused with both stores named, and the binding stays the first."""
    mine = [settings.replace(s3_bucket=f"bucket-{i}") for i in range(4)]
    bound: list[StoreLocation] = []
    refused: list[StoreMismatchError] = []

    async def bind(s: Settings) -> None:
        async with Bus(s) as bus:
            store = await JobStore(bus.js, s).open()
            try:
                bound.append(await bind_location(store, job))
            except StoreMismatchError as e:
                refused.append(e)

    async def main() -> StoreLocation | str | None:
        async with anyio.create_task_group() as tg:
            for s in mine:
                tg.start_soon(bind, s)
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            again = mine[0].replace(s3_endpoint=(settings.s3_endpoint or "") + "/")
            if bound[0].bucket == "bucket-0":  # (the same store, written another way: agrees)
                assert await bind_location(store, job, location_of(again)) == location_of(again)
            return await stored_location(store, job)

    stored = anyio.run(main)
    (winner,) = bound
    assert stored == winner and len(refused) == len(mine) - 1
    for e in refused:
        assert e.job == job and e.bound == str(winner) and winner.bucket in str(e)
        assert e.here != e.bound and e.here in str(e)


def test_a_garbled_binding_matches_no_store(settings: Settings, job: str) -> None:
    """A `<job>.location` that does not decode matches no agent's store (it refuses)."""

    async def main() -> None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            await store.kv.put(f"{job}.location", b"not json")
            with pytest.raises(StoreMismatchError, match="unreadable"):
                await bind_location(store, job)

    anyio.run(main)


def test_a_coordinator_writes_no_object_of_a_job_bound_to_another_store(
    settings: Settings, job: str
) -> None:
    """A job bound to another store between a coordinator's bid and its first object write:
    it stores nothing, writes no COMMIT and removes no object (`StoreMismatchError`)."""
    touched: list[int] = []

    async def commit(manifest: CommitManifest) -> bool:
        touched.append(manifest.step)
        return True

    async def remove(job: str, step: int, world_size: int, ranks: object) -> None:
        touched.append(-step)

    elsewhere = StoreLocation(endpoint="https://s3.example.com", bucket="team-a")

    async def main() -> JobHead | None:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            coordinator = Coordinator(settings, bus, store, "n", remove, commit=commit)
            await bind_location(store, job, elsewhere)  # (another agent, meanwhile)
            state = JobState(job, Keep(s3_keep_latest_k=1))
            events = [e for t in (1, 2) for r in (0, 1) for e in saved(job, t, r, "n")]
            for seq, event in enumerate(events, 1):
                state.apply(seq, event)
            with pytest.raises(StoreMismatchError) as err:
                await coordinator._store(state, state.take_changes())
            assert err.value.bound == str(elsewhere)
            assert err.value.here == str(location_of(settings))
            return await store.head(job)

    assert anyio.run(main) is None
    assert touched == []
