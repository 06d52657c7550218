"""The agent's peer endpoint: it serves a node's copies only to holders of the token, never a
path a request names, answers ranged GETs, refuses to listen beyond loopback without a token,
and takes a replica only once every digest matched."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import anyio.lowlevel
import pytest
import torch

from tierpipe.bus.client import Bus
from tierpipe.errors import ConfigError, PeerAuthError, ShardFormatError, ShardMissingError
from tierpipe.peer.client import PeerClient, fetch_shard, shard_url
from tierpipe.peer.server import PeerServer, check_bind
from tierpipe.schemas import ShardReplicated, ShardVerified
from tierpipe.settings import Settings
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.shardfile import write_shard

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-peer-token"


def own_copy(settings: Settings, job: str, *, step: int = 3, rank: int = 0, world: int = 2) -> Path:
    """A sealed shard at its place under the node's NVMe root."""
    with NvmeStore.from_settings(settings) as store:
        path = Path(store.locate(job, step, rank, world))
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": step}
    write_shard(path, state, job=job, step=step, rank=rank, world_size=world, node=settings.node)
    return path


def verified(settings: Settings, path: Path) -> ShardVerified:
    """The `verified` event of a copy on `settings`' node."""
    head = read_head(path)
    h = head.header
    return ShardVerified(
        job=h.job, node=settings.node or "", ts=0.0, step=h.step, rank=h.rank,
        world_size=h.world_size, epoch=h.epoch, path=str(path), nbytes=path.stat().st_size,
        header_digest=head.header_digest.hex(), seconds=0.0,
    )  # fmt: skip


def flip(path: Path, *, blob: int = 0) -> None:
    """Flip a byte of the shard's blob `blob` (a copy changed after its verify)."""
    head = read_head(path)
    with open(path, "r+b") as f:
        f.seek(head.data_offset + head.header.blobs[blob].offset + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


@asynccontextmanager
async def endpoint(settings: Settings) -> AsyncIterator[PeerServer]:
    async with Bus(settings) as bus, PeerServer(settings, bus, node=settings.node or "") as s:
        yield s


async def test_a_copy_is_served_whole_and_by_range(settings: Settings, job: str) -> None:
    """A GET returns the node's copy byte for byte; a ranged GET returns that range (206)."""
    path = own_copy(settings, job)
    data = path.read_bytes()
    async with endpoint(settings) as server, PeerClient(token=None) as client:
        url = shard_url(server.url, job, 3, 2, 0)
        async with client.chunks(url) as body:
            got = b"".join([c async for c in body])
        assert got == data
        part = bytearray(10_000)
        await client.read_range(url, 4096 + 123, memoryview(part))
        assert bytes(part) == data[4219 : 4219 + 10_000]
        async with client.session.get(url, headers={"Range": "bytes=10-19"}) as resp:
            assert resp.status == 206
            assert await resp.read() == data[10:20]


async def test_a_save_asked_for_by_digest_is_served_only_if_held(
    settings: Settings, job: str
) -> None:
    """With `digest`, another save of the shard at the same place is no copy of it (404)."""
    path = own_copy(settings, job)
    digest = read_head(path).header_digest.hex()
    async with endpoint(settings) as server, PeerClient(token=None) as client:
        async with client.chunks(shard_url(server.url, job, 3, 2, 0, header_digest=digest)):
            pass
        with pytest.raises(ShardMissingError):
            async with client.chunks(shard_url(server.url, job, 3, 2, 0, header_digest="0" * 32)):
                pass
        with pytest.raises(ShardMissingError):
            async with client.chunks(shard_url(server.url, job, 4, 2, 0)):
                pass


async def test_no_token_or_a_wrong_one_is_refused(settings: Settings, job: str) -> None:
    """With a token set, requests without it or with another one get 401, the right one 200."""
    own_copy(settings, job)
    settings = settings.replace(peer_token=TOKEN)
    async with endpoint(settings) as server:
        url = shard_url(server.url, job, 3, 2, 0)
        async with aiohttp.ClientSession() as plain, plain.get(url) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"] == "Unauthorized"
        for token in (None, "wrong", TOKEN + "x"):
            async with PeerClient(token=token) as client:
                with pytest.raises(PeerAuthError):
                    async with client.chunks(url):
                        pass
        async with PeerClient(token=TOKEN) as client, client.chunks(url) as body:
            assert len(b"".join([c async for c in body])) > 0


@pytest.mark.parametrize(
    "tail",
    [
        "..%2F..%2Fetc/1/1/0",
        "%2E%2E/1/1/0",
        "job.x/1/1/0",
        "{job}/-1/2/0",
        "{job}/3/2/2",
        "{job}/3/2/x",
        "{job}/3/0/0",
    ],
)
async def test_names_that_are_no_shard_are_refused(settings: Settings, job: str, tail: str) -> None:
    """A job that is no token, a path part, a rank outside the world: 400 (or no route at
    all), never a file."""
    own_copy(settings, job)
    async with endpoint(settings) as server, aiohttp.ClientSession() as plain:
        from yarl import URL

        url = URL(server.url + "/v1/shards/" + tail.format(job=job), encoded=True)
        async with plain.get(url) as resp:
            assert resp.status in (400, 404), resp.status
            if resp.status == 404:  # (only an unrouted path: a routed one is checked first)
                assert resp.content_type != "application/octet-stream"
            else:
                assert "error" in await resp.json()


async def test_a_non_loopback_bind_without_a_token_refuses_to_start(settings: Settings) -> None:
    """Binding all interfaces needs a token (ConfigError naming the setting); with one it is
    allowed, and loopback needs none."""
    for host in ("0.0.0.0", "::", "10.1.2.3", "node-a.example"):
        with pytest.raises(ConfigError, match="peer_token"):
            check_bind(settings.replace(peer_bind_host=host))
        async with Bus(settings) as bus:
            with pytest.raises(ConfigError):
                PeerServer(settings.replace(peer_bind_host=host), bus, node="n")
        check_bind(settings.replace(peer_bind_host=host, peer_token=TOKEN))
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        check_bind(settings.replace(peer_bind_host=host))


async def test_a_replica_is_pulled_verified_and_published(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """POST /v1/replicate: the holder pulls the copy from the source, places it under its
    `.peer` folder, publishes `replicated` (holder, source) and answers it; asked again it
    answers again without a copy."""
    source = settings.replace(peer_token=TOKEN)
    holder = source.replace(node=f"{settings.node}-b", nvme_root=str(tmp_path / "nvme-b"))
    path = own_copy(source, job)
    event = verified(source, path)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        async with (
            PeerServer(source, bus, node=source.node or "") as src,
            PeerServer(holder, bus, node=holder.node or "") as dst,
            PeerClient(token=TOKEN) as client,
        ):
            done = await client.replicate(dst.url, event, source_url=src.url)
            again = await client.replicate(dst.url, event, source_url=src.url)
        history = await bus.history(f"tp.{job}.replicated.*.0")
    assert isinstance(done, ShardReplicated)
    assert (done.node, done.source) == (holder.node, source.node)
    assert done.header_digest == event.header_digest and done.nbytes == event.nbytes
    replica = Path(done.path)
    assert replica.is_relative_to(tmp_path / "nvme-b" / ".peer")
    assert same_bytes(replica, path)
    assert again.path == done.path and again.seconds == 0.0
    assert [e.node for e in history] == [holder.node]  # (the second one: a duplicate)


async def test_a_corrupt_transfer_is_refused_and_not_published(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """A source file changed after its verify (a flipped byte in a tensor) is received, fails
    its digest, is removed (nothing at the replica's place, no temp file) and never published
    (422 to the sender: ShardFormatError)."""
    holder = settings.replace(node=f"{settings.node}-b", nvme_root=str(tmp_path / "nvme-b"))
    path = own_copy(settings, job)
    event = verified(settings, path)
    flip(path)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        async with (
            PeerServer(settings, bus, node=settings.node or "") as src,
            PeerServer(holder, bus, node=holder.node or "") as dst,
            PeerClient(token=None) as client,
        ):
            with pytest.raises(ShardFormatError, match="IntegrityError"):
                await client.replicate(dst.url, event, source_url=src.url)
            with pytest.raises(ShardMissingError):  # (the holder serves nothing of it)
                async with client.chunks(shard_url(dst.url, job, 3, 2, 0)):
                    pass
        assert await bus.history(f"tp.{job}.replicated.>") == []
    peer = tmp_path / "nvme-b" / ".peer"
    assert [p for p in peer.rglob("*") if p.is_file()] == []


async def test_fetch_shard_copies_one_file_through_the_endpoint(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """`fetch_shard` (what `bench rpo` times) leaves a verified copy at `dest`."""
    path = own_copy(settings, job)
    event = verified(settings, path)
    dest = tmp_path / "copy" / "x.shard"
    dest.parent.mkdir()
    async with endpoint(settings) as server:
        landed = await fetch_shard(
            server.url, job, 3, 2, 0, dest, nbytes=event.nbytes, header_digest=event.header_digest
        )
    assert landed.nbytes == event.nbytes and same_bytes(dest, path)
    await anyio.lowlevel.checkpoint()


async def test_a_copy_removed_before_its_partner_pulled_it_is_skipped_not_failed(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """Retention (or a newer save) removed the source's copy between its `verified` and the
    replicate stage's turn: the partner finds no such save to pull (404), and the stage acks
    the message with nothing to do; no `failed` event (a race, not a fault: the chaos test's
    node-loss run met it)."""
    import time

    from tierpipe.control.kvstate import JobStore
    from tierpipe.peer.replicas import Replicas
    from tierpipe.stages.replicate import Partner, Replicate

    source = settings.replace(peer_token=TOKEN)
    holder = source.replace(node=f"{settings.node}-b", nvme_root=str(tmp_path / "nvme-b"))
    path = own_copy(source, job)
    event = verified(source, path)
    path.unlink()  # (retention removed it)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        async with (
            PeerServer(source, bus, node=source.node or "") as src,
            PeerServer(holder, bus, node=holder.node or "") as dst,
            PeerClient(token=TOKEN) as client,
        ):
            ctx = Replicate(
                source, bus, source.node or "", src.url, client, Replicas.from_settings(source),
                await JobStore(bus.js, source).open(),
            )  # fmt: skip
            # (the ring, as the node records would give it)
            ctx._partners[job] = (time.monotonic(), [Partner(holder.node or "", dst.url)], 1, [])
            assert await Replicate.handle(ctx, event, 1) is None
            # A partner that cannot be reached (killed a moment ago: its record still looks
            # alive) is stood in for by the next one alive in the ring.
            path = own_copy(source, job, step=5)
            dead = Partner("gone", "http://127.0.0.1:9")  # (nothing listens on the discard port)
            ctx._partners[job] = (
                time.monotonic(),
                [dead, Partner(holder.node or "", dst.url)],
                1,
                [],
            )
            assert await Replicate.handle(ctx, verified(source, path), 1) is None
            with NvmeStore.from_settings(holder) as store:
                assert (Path(store.root) / ".peer" / job / "step-000000000005").is_dir()
            # A copy still there is not skipped: its partner's refusal fails the message.
            ctx._partners[job] = (time.monotonic(), [Partner(holder.node or "", dst.url)], 1, [])
            path = own_copy(source, job, step=6)  # (newer than 5: an older one is skipped)
            event = verified(source, path)
            flip(path)
            with pytest.raises(ShardFormatError):
                await Replicate.handle(ctx, event, 1)
            ctx.replicas.close()


async def test_a_blob_in_the_middle_corrupt_in_flight_is_refused_and_not_published(
    settings: Settings, job: str, tmp_path: Path
) -> None:
    """A source file whose middle tensor changed after its verify (the head and the other
    tensors intact) fails that tensor's digest as the bytes arrive: 422 naming it, no file at
    the holder, nothing published."""
    holder = settings.replace(node=f"{settings.node}-b", nvme_root=str(tmp_path / "nvme-b"))
    with NvmeStore.from_settings(settings) as store:
        path = Path(store.locate(job, 3, 0, 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"t{i}": torch.full((300_000,), float(i)) for i in range(5)}
    write_shard(path, state, job=job, step=3, rank=0, world_size=2, node=settings.node)
    event = verified(settings, path)
    flip(path, blob=2)
    async with Bus(settings) as bus:
        await bus.ensure_stream(job)
        async with (
            PeerServer(settings, bus, node=settings.node or "") as src,
            PeerServer(holder, bus, node=holder.node or "") as dst,
            PeerClient(token=None) as client,
        ):
            with pytest.raises(ShardFormatError, match=r"IntegrityError.*tensor t2"):
                await client.replicate(dst.url, event, source_url=src.url)
        assert await bus.history(f"tp.{job}.replicated.>") == []
    peer = tmp_path / "nvme-b" / ".peer"
    assert [p for p in peer.rglob("*") if p.is_file()] == []
