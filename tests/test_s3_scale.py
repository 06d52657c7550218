"""Object storage at scale: keys spread over hashed prefixes, and throttling (503 SlowDown)
answered with jittered backoff under a concurrency limit that shrinks and recovers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest
import torch
from botocore.exceptions import ClientError
from structlog.testing import capture_logs

from tierpipe.errors import StorageUnavailableError
from tierpipe.recovery.reindex import reindex
from tierpipe.settings import Settings
from tierpipe.storage.s3.errors import Throttled, translate_errors
from tierpipe.storage.s3.keys import ShardKey, object_key, parse_object_key
from tierpipe.storage.s3.retry import ConcurrencyLimit, full_jitter
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.shardfile import write_shard

pytestmark = pytest.mark.anyio

JOB = "scale"


# --- keys


def test_a_steps_keys_spread_over_many_prefixes() -> None:
    """One step's keys of 1,024 ranks land under more than 200 of the 256 hash prefixes, each
    derivable again from job, step, rank and world alone and read back as that shard."""
    keys = [object_key("ckpt", JOB, 7, rank, 1024) for rank in range(1024)]
    spreads = {key.split("/")[1] for key in keys}
    assert len(spreads) > 200 and all(len(s) == 2 for s in spreads)
    assert (
        keys[5] == f"ckpt/{keys[5].split('/')[1]}/{JOB}/step-000000000007/rank-00005-of-01024.shard"
    )
    assert [parse_object_key("ckpt", k) for k in keys] == [
        ShardKey(JOB, 7, rank, 1024) for rank in range(1024)
    ]
    assert object_key("", JOB, 7, 5, 1024) == keys[5].removeprefix("ckpt/")


def test_a_key_whose_hash_does_not_match_its_job_and_rank_is_no_shard() -> None:
    """A shard key moved under another hash prefix, under another store prefix, or naming a
    rank outside its world is not read as a shard."""
    key = object_key("ckpt", JOB, 3, 1, 4)
    spread = key.split("/")[1]
    moved = key.replace(f"/{spread}/", f"/{int(spread, 16) ^ 1:02x}/")
    assert parse_object_key("ckpt", key) == ShardKey(JOB, 3, 1, 4)
    assert parse_object_key("ckpt", moved) is None
    assert parse_object_key("other", key) is None
    assert parse_object_key("", key) is None
    assert parse_object_key("ckpt", key.replace("-of-00004", "-of-00001")) is None


# --- backoff and the concurrency limit (pure logic)


def test_full_jitter_waits_at_most_a_doubling_cap_bounded_by_the_maximum() -> None:
    """The wait before retry n is uniform in [0, min(cap, base * 2**n)]."""
    caps = [full_jitter(n, base_s=0.5, cap_s=30.0, rand=lambda: 1.0) for n in range(9)]
    assert caps == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert full_jitter(10_000, base_s=0.5, cap_s=30.0, rand=lambda: 1.0) == 30.0
    assert full_jitter(3, base_s=0.5, cap_s=30.0, rand=lambda: 0.0) == 0.0
    waits = [full_jitter(4, base_s=0.5, cap_s=30.0) for _ in range(200)]
    assert all(0 <= w <= 8.0 for w in waits) and len(set(waits)) > 100


def test_limit_halves_once_per_round_and_grows_by_one_per_window() -> None:
    """A throttle halves the limit (floor 1) once for the requests admitted before it; then each
    window of successes as large as the limit adds one slot, up to the maximum."""
    limit = ConcurrencyLimit(8)
    assert limit.throttled(0) and limit.limit == 4
    assert not limit.throttled(0) and limit.limit == 4  # same round: already answered
    assert limit.throttled(1) and limit.throttled(2) and limit.throttled(3) and limit.limit == 1
    grown = []
    for _ in range(1 + 2 + 3 + 4 + 5 + 6 + 7 + 5):
        limit.succeeded()
        grown.append(limit.limit)
    assert grown[0] == 2 and grown[2] == 3 and grown[5] == 4 and limit.limit == 8
    assert not limit.succeeded() and limit.limit == 8  # never above the maximum


async def test_requests_over_a_lowered_limit_wait_for_a_slot() -> None:
    """After a halving to 1 with two requests in flight, a new request waits until both are
    done, not just one."""
    limit = ConcurrencyLimit(2)
    releases = [anyio.Event(), anyio.Event()]
    admitted = anyio.Event()

    async def hold(release: anyio.Event) -> None:
        async with limit.slot():
            await release.wait()

    async def late() -> None:
        async with limit.slot():
            admitted.set()

    async with anyio.create_task_group() as tg:
        for release in releases:
            tg.start_soon(hold, release)
        await anyio.wait_all_tasks_blocked()
        assert limit.throttled(0) and limit.limit == 1 and limit.in_flight == 2
        tg.start_soon(late)
        releases[0].set()
        await anyio.wait_all_tasks_blocked()
        assert not admitted.is_set() and limit.in_flight == 1
        releases[1].set()
        with anyio.fail_after(5):
            await admitted.wait()


@pytest.mark.parametrize(
    ("code", "status"),
    [("SlowDown", 503), ("503", 503), ("RequestLimitExceeded", 400), ("Throttling", 400)],
)
async def test_throttling_replies_are_throttled(code: str, status: int) -> None:
    """503 SlowDown (a HEAD's bare 503 too), RequestLimitExceeded and Throttling are `Throttled`,
    a retryable outage."""
    reply = {
        "Error": {"Code": code, "Message": "slow"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    with pytest.raises(Throttled) as err:
        async with translate_errors("k"):
            raise ClientError(reply, "PutObject")  # type: ignore[arg-type]
    assert isinstance(err.value, StorageUnavailableError)
    internal = {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}
    with pytest.raises(StorageUnavailableError) as other:
        async with translate_errors("k"):
            raise ClientError(internal, "PutObject")  # type: ignore[arg-type]
    assert not isinstance(other.value, Throttled)


# --- against the real store


async def test_reindex_finds_a_jobs_objects_under_every_hash_prefix(settings: Settings) -> None:
    """With the stream's events gone and no NVMe copies, reindex republishes `flushed` for every
    rank's object of a step (spread over many hash prefixes) and skips a copy moved under the
    wrong hash prefix."""
    s = settings.replace(s3_prefix="team/ckpt")
    world, digest = 48, "ab" * 16
    meta = {"tp-header-digest": digest, "tp-node": "uploader", "tp-epoch": "3"}
    async with S3Store(s) as store:
        keys = [store.key(JOB, 2, rank, world) for rank in range(world)]
        assert len({k.split("/")[2] for k in keys}) > 30
        spread = keys[0].split("/")[2]
        misplaced = keys[0].replace(f"/{spread}/", f"/{int(spread, 16) ^ 1:02x}/")
        for key in [*keys, misplaced]:
            await store.client.put_object(Bucket=store.bucket, Key=key, Body=b"x", Metadata=meta)
    seen: list[tuple[int, int]] = []
    done = await reindex(s, JOB, s3=True, progress=lambda *p: seen.append(p))
    assert done.s3 == world and done.nvme == 0
    # (the progress it reported: never backwards, never past what it knew, all done at the end)
    assert seen[-1] == (world + 1, world + 1), seen[-5:]
    assert all(a[0] <= b[0] <= b[1] for a, b in itertools.pairwise(seen)), seen
    assert done.skipped == [f"s3://{s.s3_bucket}/{misplaced}: not a shard of {JOB}"]


class SlowDownProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of the S3 server: the next `throttle` requests
    (on any connection, kept alive or new) are answered 503 SlowDown, which closes their
    connection; the rest pass through. Clients send a request only after reading the previous
    reply (no pipelining), so only requests need framing; replies are piped as they come."""

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.throttle = 0
        self.throttled = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SlowDownProxy]:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield self
        finally:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        upstream: asyncio.StreamWriter | None = None
        pump: asyncio.Task[None] | None = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in lines[1:])
                }
                length = int(headers.get("content-length", "0"))
                if self.throttle > 0:
                    self.throttle -= 1
                    self.throttled += 1
                    # A client that asked to continue sends no body until told to.
                    if headers.get("expect", "").lower() != "100-continue":
                        await reader.readexactly(length)
                    await _slow_down(writer, head_request=lines[0].startswith("HEAD "))
                    return
                if upstream is None:
                    up_reader, upstream = await asyncio.open_connection(*self.upstream)
                    pump = asyncio.create_task(_pipe(up_reader, writer))
                upstream.write(head)
                while length:  # streamed: the body may wait for the server's 100 Continue
                    chunk = await reader.read(min(length, 1 << 16))
                    if not chunk:
                        return
                    upstream.write(chunk)
                    await upstream.drain()
                    length -= len(chunk)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            if pump is not None:
                pump.cancel()
            if upstream is not None:
                upstream.close()
            writer.close()


async def _slow_down(writer: asyncio.StreamWriter, *, head_request: bool) -> None:
    body = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )
    body = b"" if head_request else body  # a reply to HEAD has no body
    writer.write(
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    writer.close()


async def test_throttled_upload_and_read_back_off_and_the_limit_recovers(
    settings: Settings, s3_server: object, tmp_path: Path
) -> None:
    """Through a proxy that answers 503 SlowDown, an upload and a ranged read still succeed
    after jittered waits (logged as `s3_throttled`); the store's concurrency limit halves on the
    throttles and grows back to its maximum with the successes that follow."""
    path = tmp_path / "big.shard"
    state = {"w": torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)}
    digest = write_shard(path, state, job=JOB, step=1)
    nbytes = path.stat().st_size
    async with SlowDownProxy(settings.s3_endpoint or "").running() as proxy:
        s = settings.replace(
            s3_endpoint=proxy.endpoint,
            part_size_bytes=5 << 20,
            part_concurrency=4,
            s3_max_concurrent_requests=4,
            retry_base_s=0.05,
            retry_max_s=0.2,
        )
        async with S3Store(s) as store:
            key = store.key(JOB, 1, 0, 1)
            proxy.throttle = 3
            with capture_logs() as upload_logs:
                done = await store.upload(path, key, header_digest=digest)
            assert not done.existed and done.nbytes == nbytes and proxy.throttled == 3
            assert store.limit.limit == 4
            proxy.throttle = 2
            with capture_logs() as read_logs:
                image = await store.download(key, nbytes)
            try:
                assert image[:] == path.read_bytes()
            finally:
                image.close()
            assert proxy.throttled == 5 and store.limit.limit == 4
    throttled = [r for r in upload_logs + read_logs if r["event"] == "s3_throttled"]
    assert len(throttled) == 5 and all(0 <= r["wait_s"] <= 0.2 for r in throttled)
    assert min(r["limit"] for r in throttled) == 1  # three throttles in a row: 4 -> 2 -> 1
    assert {r["limit"] for r in read_logs if r["event"] == "s3_throttled"} <= {1, 2}


async def test_a_store_that_keeps_throttling_fails_as_an_outage(settings: Settings) -> None:
    """A request still throttled after `s3_throttle_retries` retries fails as a retryable
    outage (the stage then retries later), having been sent once plus that many times."""
    async with SlowDownProxy(settings.s3_endpoint or "").running() as proxy:
        s = settings.replace(
            s3_endpoint=proxy.endpoint, s3_throttle_retries=2, retry_base_s=0.01, retry_max_s=0.05
        )
        proxy.throttle = 100
        async with S3Store(s) as store:
            with pytest.raises(StorageUnavailableError, match="throttled"):
                await store.head(store.key(JOB, 1, 0, 1))
        assert proxy.throttled == 3
