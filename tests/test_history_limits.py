"""History limits never make the catalog claim a copy that was removed.

A shard's `evicted` events come after the `written`/`verified`/`flushed` events that created its
copies, and its `evicted` subject fills up about three times faster (RAM, NVMe and S3 removals).
A per-subject cap (the old `max_msgs_per_subject`) drops old removals while the events that
created those copies remain, so a replay brings deleted copies back to life. Age and size limits
drop the oldest events of the whole stream first: what remains is always a suffix of the
history, and a suffix never holds a copy's creation without its later removal.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from nats.js import api

from tests.oracle_catalog import Catalog
from tierpipe.bus.client import Bus
from tierpipe.dev import NatsServer
from tierpipe.names import SUBJECT_ROOT
from tierpipe.schemas import Event, ShardEvicted, ShardFlushed, ShardVerified, ShardWritten
from tierpipe.settings import Settings

NODE = "n1"


def lifecycle(job: str, steps: int, *, keep_nvme: int = 2, keep_s3: int = 3) -> list[Event]:
    """One rank's events over `steps` saves with retention running, in stream order."""
    out: list[Event] = []
    for step in range(1, steps + 1):
        ident = dict(job=job, node=NODE, ts=time.time(), step=step, rank=0, world_size=1)
        digest = f"{step:032x}"
        path = f"/nvme/{job}/step-{step:012d}/rank-00000-of-00001.shard"
        key = f"{job}/step-{step:012d}/rank-00000-of-00001.shard"
        out += [
            ShardWritten(
                **ident, path=path, nbytes=4096, header_digest=digest, tensors=1, seconds=0.0
            ),
            ShardVerified(**ident, path=path, nbytes=4096, header_digest=digest, seconds=0.0),
            ShardEvicted(**ident, tier="ram", location="/dev/shm/x", reason="nvme copy verified"),
            ShardFlushed(
                **ident,
                bucket="b",
                key=key,
                etag="e",
                checksum="c",
                header_digest=digest,
                nbytes=4096,
                seconds=0.0,
            ),
        ]
        for tier, keep in (("nvme", keep_nvme), ("s3", keep_s3)):
            if step > keep:
                old = step - keep
                out.append(
                    ShardEvicted(
                        job=job,
                        node=NODE,
                        ts=time.time(),
                        step=old,
                        rank=0,
                        world_size=1,
                        tier=tier,  # type: ignore[arg-type]
                        location=f"{tier}:{old}",
                        reason="retention",
                    )
                )
    return out


def claimed(events: list[Event], job: str) -> dict[str, set[int]]:
    catalog = Catalog()
    for e in events:
        catalog.apply(e)
    return {tier: set(catalog.complete_steps(job, (tier,))) for tier in ("nvme", "s3")}


@settings(max_examples=60, deadline=None)
@given(steps=hs.integers(1, 30), cut=hs.integers(0, 200))
def test_a_suffix_of_the_history_never_claims_a_removed_copy(steps: int, cut: int) -> None:
    """Whatever prefix of the stream a limit dropped, every copy the remaining events claim is
    one the whole history says is still there."""
    events = lifecycle("j", steps)
    full = claimed(events, "j")
    part = claimed(events[min(cut, len(events)) :], "j")
    for tier in full:
        assert part[tier] <= full[tier], (tier, part[tier] - full[tier])


@pytest.fixture
def own_server(tmp_path_factory: pytest.TempPathFactory):
    with NatsServer(tmp_path_factory.mktemp("nats-limits")) as server:
        yield server


async def _publish_and_fold(s: Settings, job: str, events: list[Event]) -> dict[str, set[int]]:
    async with Bus(s) as bus:
        for e in events:
            await bus.publish(e)
        return claimed(await bus.history(f"{SUBJECT_ROOT}.{job}.>"), job)


@pytest.mark.anyio
async def test_stream_limits_drop_whole_history_prefixes(own_server: NatsServer) -> None:
    """On a real nats-server: with a per-subject cap (the old configuration) a replay claims
    NVMe copies that were removed long ago; with the stream's size limit it claims exactly the
    copies that exist."""
    events = lifecycle("jcap", 60)
    truth = claimed(events, "jcap")
    assert truth["nvme"] == {59, 60}

    capped = Settings(nats_url=own_server.url, stream="CAPPED")
    async with Bus(capped) as bus:
        await bus.js.add_stream(
            api.StreamConfig(
                name="CAPPED_jcap",
                subjects=[f"{SUBJECT_ROOT}.jcap.>"],
                storage=api.StorageType.FILE,
                max_msgs_per_subject=12,
            )
        )
    old = await _publish_and_fold(capped, "jcap", events)
    assert old["nvme"] - truth["nvme"], "the old per-subject cap should resurrect removed copies"
    async with Bus(capped) as bus:
        await bus.js.delete_stream("CAPPED_jcap")

    limited = Settings(nats_url=own_server.url, stream="LIMITED", stream_max_bytes=48 << 10)
    async with Bus(limited) as bus:
        await bus.ensure_stream("jcap")
        info = await bus.js.stream_info("LIMITED_jcap")
        assert info.config.max_msgs_per_subject == -1
    new = await _publish_and_fold(limited, "jcap", events)
    async with Bus(limited) as bus:
        info = await bus.js.stream_info("LIMITED_jcap")
    assert info.state.first_seq > 1, "the size limit should have dropped old events"
    assert new["nvme"] <= truth["nvme"] and new["s3"] <= truth["s3"]
    assert new["nvme"] == truth["nvme"]  # the newest steps are all still in the stream


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
