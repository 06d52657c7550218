"""A replica is checked on the bytes received, as they arrive (`Replicas.land`): a copy whose
bytes are the verified file's lands whole and durable; a wrong byte anywhere in a blob, a head of
another save or shard, fewer or more bytes, each fails the copy with the project's error and
leaves no file; a bad blob fails it when that blob ends, without waiting for the rest."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch

from tierpipe.errors import IntegrityError, PeerUnavailableError, ShardFormatError
from tierpipe.peer.landing import ReadInto
from tierpipe.peer.replicas import Replicas
from tierpipe.schemas import ShardIdentity
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.reader import read_head
from tierpipe.storage.shardfile import write_shard

pytestmark = pytest.mark.anyio

BLOB_NUMEL = 256 << 10  # 1 MiB of float32 per tensor


def sealed(tmp_path: Path, *, tensors: int = 5, step: int = 3) -> tuple[Path, str]:
    """A sealed shard of `tensors` 1 MiB tensors (one blob each), and its header digest."""
    path = tmp_path / "src" / f"step-{step}.shard"
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"t{i}": torch.full((BLOB_NUMEL,), float(i)) for i in range(tensors)}
    write_shard(path, state, job="j", step=step, rank=0, world_size=1)
    return path, read_head(path).header_digest.hex()


def corrupt(data: bytearray, path: Path, blob: int, at: int = 777) -> None:
    """Flip a byte `at` bytes into blob `blob` (a source changed after its verify)."""
    head = read_head(path)
    data[head.data_offset + head.header.blobs[blob].offset + at] ^= 0x5A


def pieces(data: bytes | bytearray, size: int = 300_000) -> ReadInto:
    """`data` as a socket delivers it: in pieces that straddle every boundary."""
    source = io.BytesIO(data)
    return lambda view: source.readinto(view[:size])


@dataclass(frozen=True)
class Shard:
    """The shard an event names (`ShardIdentity`)."""

    job: str = "j"
    step: int = 3
    rank: int = 0
    world_size: int = 1
    epoch: int = 0


def identity(step: int = 3) -> ShardIdentity:
    return Shard(step=step)


async def land(tmp_path: Path, read_into: ReadInto, nbytes: int, digest: str,
               want: ShardIdentity | None = None, abort: Callable[[], None] = lambda: None
               ) -> Path:  # fmt: skip
    replicas = Replicas(NvmeStore(tmp_path / "dst", direct_io=False))
    final = replicas.path("j", 3, 0, 1)
    try:
        with anyio.fail_after(30):
            await replicas.land(read_into, final, nbytes=nbytes, header_digest=digest,
                                identity=want, abort=abort)  # fmt: skip
    finally:
        replicas.close()
    return final


def left(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "dst").rglob("*") if p.is_file()]


async def test_the_bytes_of_the_verified_file_land_whole(tmp_path: Path) -> None:
    """Every byte lands at its place, in pieces of any size; the replica is the source's file."""
    path, digest = sealed(tmp_path)
    data = path.read_bytes()
    final = await land(tmp_path, pieces(data), len(data), digest, identity())
    assert final.read_bytes() == data
    assert left(tmp_path) == [final]


@pytest.mark.parametrize("blob", [0, 2, 4])
async def test_a_wrong_byte_in_any_blob_is_refused_and_leaves_nothing(
    tmp_path: Path, blob: int
) -> None:
    """A byte changed in flight in the first, a middle or the last blob: IntegrityError naming
    that tensor; no replica and no temp file remain."""
    path, digest = sealed(tmp_path)
    data = bytearray(path.read_bytes())
    corrupt(data, path, blob)
    with pytest.raises(IntegrityError) as e:
        await land(tmp_path, pieces(data), len(data), digest)
    assert e.value.what == f"tensor t{blob}"
    assert left(tmp_path) == []


async def test_a_bad_blob_is_refused_without_waiting_for_the_rest(tmp_path: Path) -> None:
    """A source that stalls after sending a corrupt middle blob is refused at once (the check
    runs as the bytes arrive, not once the file is complete), with the digest's verdict, not
    the failure of the read it aborted."""
    path, digest = sealed(tmp_path, tensors=8)
    data = bytearray(path.read_bytes())
    corrupt(data, path, 2)

    sent, aborted = pieces(data[: len(data) * 3 // 4]), threading.Event()

    def then_stall(view: memoryview) -> int:
        if n := sent(view):
            return n
        aborted.wait(60)  # (a socket shut down by `abort` fails the read at once)
        raise PeerUnavailableError("source", "connection shut down")

    t0 = time.monotonic()
    with pytest.raises(IntegrityError):
        await land(tmp_path, then_stall, len(data), digest, abort=aborted.set)
    assert time.monotonic() - t0 < 30 and aborted.is_set()
    assert left(tmp_path) == []


async def test_the_head_of_another_save_or_shard_is_refused(tmp_path: Path) -> None:
    """A file whose header digest is not the event's, or whose header names another shard, is
    refused on its head."""
    _, digest = sealed(tmp_path)
    other, other_digest = sealed(tmp_path, step=4)
    data = other.read_bytes()
    with pytest.raises(IntegrityError) as e:
        await land(tmp_path, pieces(data), len(data), digest)
    assert e.value.what == "header"
    with pytest.raises(IntegrityError, match="identity"):
        await land(tmp_path, pieces(data), len(data), other_digest, identity(step=3))
    assert left(tmp_path) == []


async def test_fewer_or_more_bytes_are_refused(tmp_path: Path) -> None:
    """A transfer cut short, or one longer than the event's size, fails the copy."""
    path, digest = sealed(tmp_path)
    data = path.read_bytes()
    with pytest.raises(ShardFormatError):
        await land(tmp_path, pieces(data[:-4096]), len(data), digest)
    with pytest.raises(ShardFormatError):
        await land(tmp_path, pieces(data + bytes(4096)), len(data), digest)
    with pytest.raises(ShardFormatError):  # (the head says another size than the event)
        await land(tmp_path, pieces(data[:-4096]), len(data) - 4096, digest)
    assert left(tmp_path) == []


async def test_garbage_is_refused(tmp_path: Path) -> None:
    """Bytes that are no shard at all are refused on their prefix, and so is a prefix whose
    file size is not the event's (before a header of that size is gathered)."""
    with pytest.raises(ShardFormatError):
        await land(tmp_path, pieces(bytes(1 << 20)), 1 << 20, "0" * 32)
    path, digest = sealed(tmp_path)
    data = path.read_bytes()
    with pytest.raises(ShardFormatError, match="the head says"):
        await land(tmp_path, pieces(data + bytes(4096)), len(data) + 4096, digest)
    assert left(tmp_path) == []


async def test_a_cancelled_copy_stops_its_threads_and_leaves_nothing(tmp_path: Path) -> None:
    """A copy cancelled while its source stalls aborts the blocked read (no thread outlives
    it), raises nothing else and leaves no file."""
    path, digest = sealed(tmp_path)
    data = path.read_bytes()
    sent, aborted = pieces(data[: len(data) // 2]), threading.Event()

    def then_stall(view: memoryview) -> int:
        if n := sent(view):
            return n
        aborted.wait(60)
        return 0

    t0 = time.monotonic()
    with anyio.move_on_after(1) as scope:
        await land(tmp_path, then_stall, len(data), digest, abort=aborted.set)
    assert scope.cancelled_caught and aborted.is_set()
    assert time.monotonic() - t0 < 30
    assert left(tmp_path) == []
