"""The storage contract (`tierpipe.storage.store.ShardStore`) as both tiers keep it: the NVMe
store on a real directory and the object store on the session's real SeaweedFS, driven through
the same protocol methods only."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tierpipe.errors import IntegrityError, ShardFormatError, ShardMissingError
from tierpipe.names import node_name
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3.store import S3Store
from tierpipe.storage.shard import Head, parse_head
from tierpipe.storage.shardfile import write_shard
from tierpipe.storage.store import SealedFile, ShardStore

pytestmark = pytest.mark.anyio

JOB = "contract"
STATE = {"a": torch.arange(70_000, dtype=torch.int32), "b": torch.ones(3, 5), "c": torch.empty(0)}


@dataclass
class _Staged:
    """A staged image in memory, as `StagedImage` offers it to the NVMe store."""

    mm: mmap.mmap
    head: Head
    checks: int = 0

    def view(self) -> memoryview:
        return memoryview(self.mm)

    def check(self) -> None:
        self.checks += 1


def _staged(step: int) -> _Staged:
    plan = plan_state(STATE, job=JOB, step=step, rank=0, world_size=1, node="n")
    mm = mmap.mmap(-1, plan.nbytes)
    mm[: len(plan.head)] = plan.head
    plan.copy_into(plan.destinations(torch.frombuffer(mm, dtype=torch.uint8)))
    return _Staged(mm, parse_head(memoryview(mm), "<staged>", sealed=False))


class _Recorder:
    """A `BlobSink` that keeps a copy of every blob it is handed, in order."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.taken: list[tuple[int, bytes]] = []
        self.pinned = self.finished = 0

    def accept(self, head: Head, location: str) -> Sequence[bool]:
        if self.refuse:
            raise IntegrityError(location, "identity", "another shard", "this one")
        return [i % 2 == 0 for i in range(len(head.header.blobs))]  # some pass through

    @contextlib.contextmanager
    def pin(self, ring: mmap.mmap) -> Iterator[None]:
        self.pinned += 1
        yield

    def take(self, index: int, data: memoryview, *, reused: bool) -> None:
        self.taken.append((index, bytes(data)))

    def finish(self) -> None:
        self.finished += 1


def _blobs(image: bytes | mmap.mmap, head: Head) -> list[tuple[int, bytes]]:
    """Every blob of a shard image, as the image holds it."""
    at = head.data_offset
    return [
        (i, image[at + b.offset : at + b.offset + b.nbytes])
        for i, b in enumerate(head.header.blobs)
    ]


def _flip_a_bit(raw: bytes) -> bytes:
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01  # inside tensor a, which fills most of the file
    return bytes(flipped)


async def _keeps_the_contract(
    store: ShardStore[Any],
    source: Any,
    location: str,
    blobs: list[tuple[int, bytes]],
    corrupt: Callable[[], Awaitable[None]],
) -> str:
    """Write, write again, read into a sink, verify, delete: the same calls on either tier.
    Returns the header digest read back."""
    first = await store.write(source, location)
    again = await store.write(source, location)
    assert first.location == again.location == location
    assert not first.existed and again.existed and first.nbytes == again.nbytes

    sink = _Recorder()
    back = await store.read_into(location, sink, nbytes=first.nbytes)
    assert sorted(sink.taken) == sorted(blobs) and sink.finished == 1
    assert sink.pinned == (back.image is None)  # NVMe reads passing blobs into a pinned arena
    if back.image is not None:
        back.image.close()
    refusing = _Recorder(refuse=True)
    with pytest.raises(IntegrityError, match="identity"):
        await store.read_into(location, refusing, nbytes=first.nbytes)
    assert refusing.taken == [] and not refusing.finished

    digest = back.head.header_digest.hex()
    ok = await store.verify(location, header_digest=digest, nbytes=first.nbytes)
    assert (ok.location, ok.nbytes, ok.header_digest) == (location, first.nbytes, digest)
    with pytest.raises(IntegrityError, match="header"):
        await store.verify(location, header_digest="0" * 32, nbytes=first.nbytes)
    with pytest.raises(ShardFormatError):
        await store.verify(location, header_digest=digest, nbytes=first.nbytes + 4096)

    await corrupt()
    with pytest.raises(IntegrityError, match="tensor a"):
        await store.verify(location, header_digest=digest, nbytes=first.nbytes)
    with pytest.raises(IntegrityError, match="tensor a"):
        await store.read_into(location, _Recorder(), nbytes=first.nbytes)

    assert not await store.delete(location, header_digest="0" * 32)  # another save: stays
    assert await store.delete(location, header_digest=digest)
    assert await store.delete(location, header_digest=digest)  # gone already
    with pytest.raises(ShardMissingError):
        await store.read_into(location, _Recorder(), nbytes=first.nbytes)
    return digest


def test_both_stores_are_shard_stores(tmp_path: Path, settings: Settings) -> None:
    """NvmeStore and S3Store both have every method of the contract (mypy checks the types:
    `tierpipe.storage.store`)."""
    with NvmeStore(tmp_path) as nvme:
        assert isinstance(nvme, ShardStore)
    assert isinstance(S3Store(settings), ShardStore)
    assert not isinstance(object(), ShardStore)


async def test_nvme_store_keeps_the_contract(tmp_path: Path) -> None:
    """The NVMe store writes a staged image, verifies and reads the file back, and deletes it."""
    staged = _staged(step=1)
    with NvmeStore(tmp_path, queue_depth=2, chunk_bytes=8192) as store:
        location = store.locate(JOB, 1, 0, 1)
        assert location == str(tmp_path / JOB / "step-000000000001" / "rank-00000-of-00001.shard")

        async def corrupt() -> None:
            path = anyio.Path(location)
            await path.write_bytes(_flip_a_bit(await path.read_bytes()))

        blobs = _blobs(staged.mm, staged.head)
        await _keeps_the_contract(store, staged, location, blobs, corrupt)
    assert staged.checks == 1  # once, after the copy that was placed


async def test_s3_store_keeps_the_contract(tmp_path: Path, settings: Settings) -> None:
    """The object store uploads a sealed file, verifies and reads the object back, and deletes
    only this node's object of that save."""
    path = tmp_path / "sealed.shard"
    digest = write_shard(path, STATE, job=JOB, step=2)
    raw = path.read_bytes()
    async with S3Store(settings) as store:
        location = store.locate(JOB, 2, 0, 1)
        key = store.key(JOB, 2, 0, 1)
        assert key.endswith(f"/{JOB}/step-000000000002/rank-00000-of-00001.shard")
        assert location == f"s3://{settings.s3_bucket}/{key}"

        async def corrupt() -> None:  # the same object, one bit flipped
            await store.remove(key)
            meta = {
                "tp-header-digest": digest,
                "tp-node": node_name(settings.node),
                "tp-epoch": "0",
            }
            await store.client.put_object(
                Bucket=store.bucket, Key=key, Body=_flip_a_bit(raw), Metadata=meta
            )

        source = SealedFile(path, digest, epoch=0, step=2)
        blobs = _blobs(raw, parse_head(raw, str(path)))
        assert await _keeps_the_contract(store, source, location, blobs, corrupt) == digest
        with pytest.raises(ShardMissingError, match="configured bucket"):
            await store.read_into("s3://elsewhere/k", _Recorder(), nbytes=1)
