"""Resharding on load: the planner, block-checked ranged reads, and restores into another world."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
import xxhash
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tests.conftest import Agent, Events, gloo_ranks
from tierpipe.bus.client import Bus
from tierpipe.dev import S3Server
from tierpipe.errors import LayoutMismatchError, ShardMissingError, StorageUnavailableError
from tierpipe.names import shard_relpath
from tierpipe.peer.server import PeerServer
from tierpipe.recovery.load import Expected
from tierpipe.reshard.assemble import assemble, value_rank_of
from tierpipe.reshard.buffers import Budget, ReadBuffer
from tierpipe.reshard.layout import (
    Box,
    Span,
    blocks,
    box_of,
    coordinate_of,
    copy_piece,
    full_box,
    overlaps,
    parse_placement,
)
from tierpipe.reshard.reads import Origin, Tally, Tiers, read_parts
from tierpipe.schemas import (
    ALIGN,
    BLOCK_BYTES,
    BlobEntry,
    MeshEntry,
    ShardedEntry,
    ShardFlushed,
    SourceRef,
    StageFailed,
)
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3.keys import object_key
from tierpipe.storage.shard import encode_head, file_nbytes, parse_head
from tierpipe.storage.sharding import local_box
from tierpipe.trainer.checkpointer import Checkpointer

MB = BLOCK_BYTES


# --- the planner


def torch_placements(texts: Sequence[str]) -> list[Any]:
    out: list[Any] = []
    for t in texts:
        kind, d, split = parse_placement(t, 8)
        out.append(
            Replicate()
            if kind == "R"
            else Shard(d)
            if kind == "S"
            else _StridedShard(d, split_factor=split)
        )
    return out


def torch_local(
    g: torch.Tensor, mesh: Sequence[int], coord: Sequence[int], texts: Sequence[str]
) -> torch.Tensor:
    """The local shard of `g` at `coord`, split the way DTensor splits it (left to right)."""
    t = g
    for p, k, c in zip(torch_placements(texts), mesh, coord, strict=True):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, k, with_padding=False)
        t = shards[c]
    return t.contiguous()


def local_of(g: torch.Tensor, box: Box) -> torch.Tensor:
    t = g
    for d, runs in enumerate(box.dims):
        idx = (
            torch.cat([torch.arange(a, a + n) for a, n in runs])
            if runs
            else torch.empty(0, dtype=torch.long)
        )
        t = t.index_select(d, idx)
    return t


LAYOUTS = [
    ((10, 6), (4,), ("S0",)),
    ((10, 6), (4,), ("S1",)),
    ((7, 5), (3,), ("S0",)),
    ((3, 5), (4,), ("S0",)),  # (a rank with nothing)
    ((9, 7), (2, 2), ("S0", "S1")),
    ((9, 7), (2, 2), ("S0", "S0")),
    ((9, 7), (2, 2), ("R", "S1")),
    ((8, 6), (2, 2), ("SS0:2", "S0")),
    ((11, 6), (2, 2), ("SS0:2", "S0")),
    ((6,), (2,), ("R",)),
    ((13, 3, 4), (2, 3), ("S2", "S0")),
]


@pytest.mark.parametrize(("shape", "mesh", "placements"), LAYOUTS)
def test_boxes_are_the_shards_torch_makes(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...]
) -> None:
    """Every mesh position's box holds exactly the elements DTensor puts there, and its shape
    and first offsets are torch's `compute_local_shape_and_global_offset`."""
    g = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    for pos in range(int(torch.tensor(mesh).prod())):
        coord = coordinate_of(pos, mesh)
        box = box_of(shape, mesh, coord, placements)
        assert torch.equal(local_of(g, box), torch_local(g, mesh, coord, placements)), coord
        want_shape, want_offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), torch_placements(placements)
        )
        assert box.shape == tuple(want_shape)
        if box.shape and all(box.shape):
            assert box.offsets == tuple(want_offsets)


def reshard(
    g: torch.Tensor,
    old: tuple[tuple[int, ...], tuple[str, ...]],
    new: tuple[tuple[int, ...], tuple[str, ...]],
    *,
    windowed: bool = False,
) -> None:
    """Fill every new local shard from the old ones through the planner and compare."""
    (old_mesh, old_pl), (new_mesh, new_pl) = old, new
    n_old = int(torch.tensor(old_mesh).prod())
    sources = [
        (r, box_of(g.shape, old_mesh, coordinate_of(r, old_mesh), old_pl)) for r in range(n_old)
    ]
    saved = {r: local_of(g, b) for r, b in sources}
    for pos in range(int(torch.tensor(new_mesh).prod())):
        target = box_of(g.shape, new_mesh, coordinate_of(pos, new_mesh), new_pl)
        into = torch.full(target.shape, -1, dtype=g.dtype)
        for piece in overlaps(
            target, sources, pick=lambda holders, pos=pos: holders[pos % len(holders)]
        ):
            local = saved[piece.source]
            raw = local.view(-1).view(torch.uint8)
            start = 0
            if windowed:  # only the blocks the piece needs, as a reader hands them
                (span,) = blocks([(0, *piece.byte_span(local.shape, g.element_size()))])
                start, stop = span.byte_range(raw.numel())
                raw = raw[start:stop]
            copy_piece(piece, raw, start, local.shape, into)
        assert torch.equal(into, torch_local(g, new_mesh, coordinate_of(pos, new_mesh), new_pl)), (
            pos
        )


@pytest.mark.parametrize(
    ("shape", "old", "new"),
    [
        ((10, 6), ((4,), ("S0",)), ((2,), ("S0",))),
        ((10, 6), ((4,), ("S0",)), ((3,), ("S1",))),
        ((9, 7), ((2, 2), ("S0", "S1")), ((2,), ("S1",))),
        ((9, 7), ((2, 2), ("S0", "S1")), ((8,), ("S0",))),
        ((9, 7), ((2, 2), ("R", "S1")), ((2, 2), ("S1", "S0"))),
        ((11, 6), ((2, 2), ("SS0:2", "S0")), ((3,), ("S0",))),
        ((11, 6), ((4,), ("S0",)), ((2, 2), ("SS0:2", "S0"))),
        ((6,), ((2,), ("R",)), ((4,), ("S0",))),
        ((5, 4), ((1,), ("R",)), ((2, 2), ("S1", "S0"))),
        ((3, 5), ((4,), ("S0",)), ((2,), ("S0",))),
    ],
)
def test_any_layout_reshards_into_any_other(shape: tuple[int, ...], old: Any, new: Any) -> None:
    """Uneven shards, Shard(0)/Shard(1), 2-D meshes, replicated and strided placements: each
    new local shard is filled exactly from the saved ones."""
    g = torch.randn(shape)
    reshard(g, old, new)


def test_a_plain_full_tensor_is_one_piece_at_offset_zero() -> None:
    """A saved plain tensor of the global shape fills every target from its one holder."""
    g = torch.arange(60.0).view(10, 6)
    target = box_of(g.shape, (4,), (2,), ("S0",))
    (piece,) = overlaps(target, [(0, full_box(g.shape))])
    into = torch.empty(target.shape)
    copy_piece(piece, g.view(-1).view(torch.uint8), 0, g.shape, into)
    assert torch.equal(into, g[6:9]) and piece.source == 0


def test_disjoint_shards_give_no_piece_and_gaps_are_refused() -> None:
    """A source that does not meet the target gives no piece; sources that leave part of it
    uncovered are a layout no rule covers."""
    shape = (8, 4)
    target = box_of(shape, (2,), (0,), ("S0",))  # rows 0-3
    sources = [(r, box_of(shape, (4,), (r,), ("S0",))) for r in range(4)]
    assert sorted(p.source for p in overlaps(target, sources)) == [0, 1]
    with pytest.raises(LayoutMismatchError, match="cover 8 of the 16"):
        overlaps(target, sources[1:])
    empty = box_of((3, 4), (4,), (3,), ("S0",))
    assert empty.shape == (0, 4) and overlaps(empty, [(0, full_box((3, 4)))]) == []


def test_replicas_are_read_once_from_the_preferred_holder() -> None:
    """Saved ranks holding the same box (replicated on a mesh dim) count once; `pick` chooses."""
    shape = (4, 4)
    sources = [(r, box_of(shape, (2, 2), coordinate_of(r, (2, 2)), ("R", "S0"))) for r in range(4)]
    pieces = overlaps(full_box(shape), sources, pick=max)
    assert sorted(p.source for p in pieces) == [2, 3]


def test_blocks_widen_and_merge_spans_per_blob() -> None:
    """Spans become whole blocks; touching ones merge into one read."""
    spans = [(0, 10, 20), (0, MB - 1, MB + 1), (1, 3 * MB, 3 * MB + 5), (0, 5 * MB, 5 * MB + 1)]
    assert blocks(spans) == [Span(0, 0, 2), Span(0, 5, 6), Span(1, 3, 4)]
    assert blocks(spans, gap=3) == [Span(0, 0, 6), Span(1, 3, 4)]
    assert Span(0, 2, 3).byte_range(2 * MB + 7) == (2 * MB, 2 * MB + 7)


def test_the_value_rule_defaults_to_rank_mod_old_world() -> None:
    """New rank r takes saved rank r % old_world's values unless told otherwise."""
    assert [value_rank_of(None, r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert value_rank_of(0, 5, 4) == 0 and value_rank_of(lambda r: 3 - r, 1, 4) == 2
    with pytest.raises(LayoutMismatchError, match="value_rank gave 4"):
        value_rank_of(4, 0, 4)


def test_a_multi_block_shard_read_in_part_uses_only_its_blocks() -> None:
    """An 8 MiB tensor saved whole, resharded in two: each half reads 4 of its 8 blocks."""
    g = torch.randn(2048, 1024)
    for pos in range(2):
        target = box_of(g.shape, (2,), (pos,), ("S0",))
        (piece,) = overlaps(target, [(0, full_box(g.shape))])
        assert blocks([(0, *piece.byte_span(g.shape, 4))]) == [Span(0, 4 * pos, 4 * pos + 4)]
    reshard(g, ((1,), ("R",)), ((2,), ("S0",)), windowed=True)
    reshard(g, ((4,), ("S0",)), ((2, 2), ("S1", "S0")), windowed=True)


# --- shard files with sharded entries (written here until the trainer writes them)


def write_sharded(
    path: Path,
    state: dict[str, torch.Tensor],
    sharded: dict[str, ShardedEntry],
    *,
    meshes: tuple[MeshEntry, ...] = (),
    job: str,
    step: int,
    rank: int,
    world_size: int,
) -> tuple[str, int]:
    """A sealed shard of `state` (one blob per tensor) whose tensors named in `sharded` carry
    their `ShardedEntry` and block digests. Returns (header digest, size)."""
    plan = plan_state(state, job=job, step=step, rank=rank, world_size=world_size, node="n")
    header = plan.header
    names = [e.path[0] for e in header.tensors]
    datas = [state[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n in names]
    blobs = []
    for e, b, data in zip(header.tensors, header.blobs, datas, strict=True):
        block_digests = b""
        if e.path[0] in sharded:
            block_digests = b"".join(
                xxhash.xxh3_64_digest(data[k : k + MB]) for k in range(0, len(data), MB)
            )
        blobs.append(BlobEntry(b.offset, b.nbytes, xxhash.xxh3_128_digest(data), block_digests))
    entries = tuple(
        msgspec.structs.replace(sharded[n], tensor=i) for i, n in enumerate(names) if n in sharded
    )
    header = msgspec.structs.replace(header, blobs=tuple(blobs), sharded=entries, meshes=meshes)
    head = encode_head(header, sealed=True)
    image = bytearray(file_nbytes(len(head), header.blobs))
    image[: len(head)] = head
    for b, data in zip(header.blobs, datas, strict=True):
        image[len(head) + b.offset : len(head) + b.offset + len(data)] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(image))
    return parse_head(bytes(image), str(path)).header_digest.hex(), len(image)


def saved_world(
    root: Path, g: torch.Tensor, mesh: tuple[int, ...], placements: tuple[str, ...], *, job: str
) -> dict[int, Origin]:
    """`g` saved as a DTensor by every rank of `mesh` (plus a plain value per rank), as files."""
    world = int(torch.tensor(mesh).prod())
    out = {}
    for r in range(world):
        coord = coordinate_of(r, mesh)
        box = box_of(g.shape, mesh, coord, placements)
        offsets, _ = local_box(tuple(g.shape), mesh, coord, placements) or (box.offsets, None)
        entry = ShardedEntry(0, tuple(g.shape), offsets, 0, placements)  # (torch's offsets)
        table = (MeshEntry(mesh, (), tuple(range(world)), coord),)
        path = root / f"rank{r}.shard"
        digest, size = write_sharded(
            path, {"w": local_of(g, box).contiguous(), "r": torch.tensor([r])}, {"w": entry},
            meshes=table, job=job, step=3, rank=r, world_size=world,
        )  # fmt: skip
        ref = SourceRef(
            tier="nvme", node="n", location=str(path), nbytes=size, header_digest=digest
        )
        out[r] = Origin(Expected(job, 3, r, world, digest), size, [ref])
    return out


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def block_offset(path: str, blob: int, block: int) -> int:
    from tierpipe.storage.reader import read_head

    head = read_head(path)
    return head.data_offset + head.header.blobs[blob].offset + block * MB + 17


@pytest.mark.anyio
async def test_a_flipped_byte_in_a_block_read_fails_that_copy_not_one_never_read(
    tmp_path: Path,
) -> None:
    """Blocks are checked before use: a flipped byte in a block the read needs makes it go
    to the next copy; one in a block it never reads changes nothing."""
    g = torch.randn(2048, 1024)  # 8 MiB: 8 blocks saved whole by one rank
    origins = saved_world(tmp_path, g, (1,), ("R",), job="j")
    path = origins[0].copies[0].location
    shutil.copy(path, tmp_path / "copy.shard")  # (the same save, elsewhere)
    good = msgspec.structs.replace(origins[0].copies[0], location=str(tmp_path / "copy.shard"))
    flip(path, block_offset(path, 0, 6))  # (rank 0 of 2 needs blocks 0-3 only)
    settings = Settings(node="n", nvme_root=str(tmp_path))
    for pos, failed in enumerate([0, 1]):
        origin = origins[0]
        if pos == 1:  # the second half needs block 6: the next copy serves it
            origin = Origin(origin.expected, origin.nbytes, [*origin.copies, good])
        box = box_of(g.shape, (2,), (pos,), ("S0",))
        into = torch.empty(box.shape)
        (piece,) = overlaps(box, [(0, full_box(g.shape))])
        tally = Tally()

        def need(head: Any, piece: Any = piece) -> list[Span]:
            return blocks([(0, *piece.byte_span(g.shape, 4))])

        def take(
            head: Any, span: Span, data: memoryview, piece: Any = piece, into: Any = into
        ) -> None:
            raw = torch.frombuffer(data, dtype=torch.uint8)
            copy_piece(piece, raw, span.first * MB, g.shape, into)

        async with Tiers(settings, None, node="n") as tiers:
            await read_parts(tiers, origin, need, take, tally)
        assert torch.equal(into, g[1024 * pos : 1024 * (pos + 1)])
        assert len(tally.failed) == failed and tally.nbytes["nvme"] >= 4 * MB
        if failed:
            assert "block 6" in str(tally.failed[0][2])


@pytest.mark.anyio
async def test_no_good_copy_left_names_each_failure(tmp_path: Path) -> None:
    """A missing file and a swapped one (another rank's) leave no copy: ShardMissingError."""
    g = torch.randn(4, 4)
    origins = saved_world(tmp_path, g, (2,), ("S0",), job="j")
    o = origins[0]
    gone = SourceRef(tier="nvme", node="n", location=str(tmp_path / "nope"), nbytes=o.nbytes,
                     header_digest=o.expected.header_digest)  # fmt: skip
    other = origins[1].copies[0]
    origin = Origin(o.expected, o.nbytes, [gone, other])
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        with pytest.raises(ShardMissingError, match="nvme: ShardMissingError, nvme: Integrity"):
            await read_parts(tiers, origin, lambda h: [], lambda *a: None, Tally())


class _Outage(Tiers):
    """Tiers whose copies are unavailable (a store or peer down for a moment) `outages` times
    each before they open."""

    def __init__(self, settings: Settings, outages: int) -> None:
        super().__init__(settings, None, node="n")
        self.outages, self.opened = outages, 0

    @contextlib.asynccontextmanager
    async def open(self, copy: SourceRef, origin: Origin) -> AsyncIterator[Any]:
        self.opened += 1
        if self.outages:
            self.outages -= 1
            raise StorageUnavailableError(f"{copy.location}: down for a moment")
        async with super().open(copy, origin) as ranged:
            yield ranged


@pytest.mark.anyio
@pytest.mark.parametrize("outages", [1, 2, 3])
async def test_a_copy_unavailable_for_a_moment_is_tried_again(tmp_path: Path, outages: int) -> None:
    """A saved rank's only copy is unavailable (an outage) once or twice, then readable: it is
    read, as the normal restore retries an outage (3 tries); a third outage gives it up. Before:
    one outage dropped the copy, and with no other the step was abandoned for an older one
    (`test_replicated_once`: step 1 from NVMe instead of step 2 from object storage)."""
    g = torch.randn(4, 4)
    origin = saved_world(tmp_path, g, (2,), ("S0",), job="j")[0]
    settings = Settings(node="n", retry_base_s=0.01)
    tally = Tally()
    async with _Outage(settings, outages) as tiers:
        if outages == 3:
            with pytest.raises(ShardMissingError, match="StorageUnavailableError"):
                await read_parts(tiers, origin, lambda h: [], lambda *a: None, tally)
        else:
            head = await read_parts(tiers, origin, lambda h: [], lambda *a: None, tally)
            assert head.header.rank == 0 and tiers.opened == outages + 1
    assert [type(e).__name__ for _, _, e in tally.failed] == ["StorageUnavailableError"] * (
        outages == 3
    )


@pytest.mark.anyio
async def test_assemble_gathers_a_sharded_save_into_a_full_target(tmp_path: Path) -> None:
    """A plain target of the global shape takes every saved shard's part; plain values come
    from the value rank."""
    g = torch.randn(9, 7)
    origins = saved_world(tmp_path, g, (2, 2), ("S0", "S1"), job="j")

    async def origin(r: int) -> Origin:
        return origins[r]

    target = {"w": torch.zeros(9, 7), "r": torch.zeros(1, dtype=torch.int64)}
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        got = await assemble(tiers, origin, target, rank=5, old_world=4)
    assert torch.equal(target["w"], g) and got.state["w"] is not None
    assert int(target["r"]) == 1 and got.value_rank == 1 and got.in_place == 2
    assert sum(got.tally.nbytes.values()) > g.numel() * 4


@pytest.mark.anyio
async def test_a_value_rank_with_an_empty_shard_still_plans(tmp_path: Path) -> None:
    """Uneven sharding leaves the last rank an empty shard, whose offset torch records as the
    dimension's size: a restore whose value rank is that rank plans from its header too."""
    g = torch.randn(3, 5)
    origins = saved_world(tmp_path, g, (4,), ("S0",), job="j")

    async def origin(r: int) -> Origin:
        return origins[r]

    target = {"w": torch.zeros(3, 5), "r": torch.zeros(1, dtype=torch.int64)}
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        got = await assemble(tiers, origin, target, rank=3, old_world=4)
    assert torch.equal(target["w"], g) and int(target["r"]) == 3 and got.value_rank == 3


# --- restores into another world, end to end (a real agent, NATS, object storage; gloo ranks)


def run_ranks(
    settings: Settings, job: str, world: int, tmp_path: Path, *args: str
) -> list[dict[str, Any]]:
    """`tests/reshard_rank.py` as `world` processes of one gloo group; their JSON lines."""
    ranks = gloo_ranks(settings, "tests.reshard_rank", [job, *args], world, tmp_path)
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in ranks]


def expected_sums() -> dict[str, str]:
    from tests.reshard_rank import global_state, sha

    return {k: sha(v) for k, v in global_state().items()}


@pytest.mark.slow
@pytest.mark.timeout(480)  # (gloo ranks on a loaded 2-core machine)
def test_a_single_process_checkpoint_loads_into_a_sharded_model(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    events: Events,
    tmp_path: Path,
    s3_server: S3Server,
) -> None:
    """Plain tensors saved by one process are the whole of the DTensors two ranks restore
    into, each reading its part from NVMe, bitwise; plain values come from saved rank 0. With
    the newest step corrupt on NVMe and in object storage, the bad copies are reported and
    both ranks restore the step before, in a second round."""
    import boto3

    from tests.reshard_rank import global_state

    agent()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        for step in (1, 2):
            c.save(step, {"model": global_state(), "r": 0})
        c.wait_until_finished(timeout=60)
    events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.step == 2, kind="flushed")
    want = expected_sums()
    for r in run_ranks(settings, job, 2, tmp_path, "restore", "2"):
        assert (r["step"], r["tier"], r["agreement"], r["r"], r["rounds"]) == (
            2, "nvme", "torch.distributed", 0, 1
        ), r  # fmt: skip
        assert r["sums"] == want
    path = Path(settings.nvme_root).absolute() / shard_relpath(job, 2, 0, 1)
    at = block_offset(str(path), 0, 1)
    flip(str(path), at)
    s3 = boto3.client("s3", **s3_server.client_kwargs())
    key = object_key(settings.s3_prefix.strip("/"), job, 2, 0, 1)
    body = bytearray(s3.get_object(Bucket=settings.s3_bucket, Key=key)["Body"].read())
    body[at] ^= 1
    s3.delete_object(Bucket=settings.s3_bucket, Key=key)
    s3.put_object(Bucket=settings.s3_bucket, Key=key, Body=bytes(body))
    for r in run_ranks(settings, job, 2, tmp_path, "restore", "2"):
        assert (r["step"], r["rounds"], r["sums"]) == (1, 2, want), r
    for tier in ("nvme", "s3"):
        events.wait_for(
            lambda e, tier=tier: isinstance(e, StageFailed) and (e.step, e.tier) == (2, tier),
            kind="failed",
        )


@pytest.mark.anyio
async def test_ranged_reads_from_a_peer_then_object_storage_when_its_block_is_bad(
    settings: Settings, job: str, s3_server: S3Server, tmp_path: Path
) -> None:
    """A peer's endpoint serves the blocks by ranged GETs; once a block it serves is corrupt,
    the same blocks come from the object by ranged GETs, each checked."""
    import boto3

    g = torch.randn(2048, 1024)
    peer = settings.replace(node=f"{settings.node}-p", nvme_root=str(tmp_path / "peer"))
    path = Path(NvmeStore.from_settings(peer).locate(job, 3, 0, 1))
    (o,) = saved_world(tmp_path, g, (1,), ("R",), job=job).values()
    path.parent.mkdir(parents=True)
    shutil.copy(o.copies[0].location, path)
    key = object_key(settings.s3_prefix.strip("/"), job, 3, 0, 1)
    boto3.client("s3", **s3_server.client_kwargs()).put_object(
        Bucket=settings.s3_bucket, Key=key, Body=await anyio.Path(path).read_bytes()
    )
    ref = o.copies[0]
    copies = [
        msgspec.structs.replace(ref, tier="peer", node=peer.node, location=str(path)),
        msgspec.structs.replace(
            ref, tier="s3", node="", location=f"s3://{settings.s3_bucket}/{key}"
        ),
    ]
    origin = Origin(o.expected, o.nbytes, copies)
    box = box_of(g.shape, (2,), (1,), ("S0",))
    (piece,) = overlaps(box, [(0, full_box(g.shape))])

    def need(head: Any) -> list[Span]:
        return blocks([(0, *piece.byte_span(g.shape, 4))])

    async with Bus(peer) as bus, PeerServer(peer, bus, node=peer.node or "") as server:
        for flipped, tier in ((False, "peer"), (True, "s3")):
            if flipped:
                flip(str(path), block_offset(str(path), 0, 5))
            into = torch.empty(box.shape)
            tally = Tally()

            def take(head: Any, span: Span, data: memoryview, into: Any = into) -> None:
                copy_piece(
                    piece, torch.frombuffer(data, dtype=torch.uint8), span.first * MB, g.shape, into
                )

            async with Tiers(
                settings, None, node="n", endpoints={peer.node or "": server.url}
            ) as tiers:
                await read_parts(tiers, origin, need, take, tally)
            assert torch.equal(into, g[1024:]) and tally.nbytes[tier] >= 4 * MB
            assert len(tally.failed) == flipped


@pytest.mark.slow
@pytest.mark.timeout(480)  # (gloo ranks on a loaded 2-core machine)
def test_dtensors_saved_by_four_ranks_restore_on_two(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    """DTensors saved on a 2x2 mesh restore onto two ranks (a 1-D mesh, other placements), and
    onto four on a 1-D mesh: the gathered tensors are bitwise the saved ones; a new rank that
    needs saved ranks 2 and 3, whose NVMe copies are gone, reads their blocks from object
    storage; plain values come from saved rank `r % 4`."""
    agent()
    assert [r["saved"] for r in run_ranks(settings, job, 4, tmp_path, "save", "2x2")] == [
        0,
        1,
        2,
        3,
    ]
    for rank in range(4):
        events.wait_for(
            lambda e, rank=rank: isinstance(e, ShardFlushed) and e.rank == rank, kind="flushed"
        )
    for rank in (2, 3):
        os.remove(Path(settings.nvme_root).absolute() / shard_relpath(job, 1, rank, 4))
    results = run_ranks(settings, job, 2, tmp_path, "restore", "2")
    assert [(r["step"], r["tier"], r["r"]) for r in results] == [(1, "nvme", 0), (1, "s3", 1)]
    assert all(r["sums"] == expected_sums() for r in results)
    # The same world size on another mesh (1-D): the in-place restore cannot, this one does.
    results = run_ranks(settings, job, 4, tmp_path, "restore", "4")
    assert [(r["tier"], r["r"]) for r in results] == [
        ("nvme", 0),
        ("nvme", 1),
        ("s3", 2),
        ("s3", 3),
    ]
    assert all(r["sums"] == expected_sums() for r in results)


@pytest.mark.slow
def test_value_rank_takes_another_ranks_plain_state_into_a_smaller_world(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events
) -> None:
    """A plain state saved by two ranks restores on one when `value_rank` names the saved rank
    to take (no torch.distributed: the rank chooses the step from the job state alone)."""
    agent()
    saved = {r: {"w": torch.full((1000,), float(r)), "r": r} for r in range(2)}
    for r in range(2):
        with Checkpointer(job, rank=r, world_size=2, settings=settings) as c:
            c.save(1, saved[r])
            c.wait_until_finished(timeout=60)
    events.wait_for(lambda e: isinstance(e, ShardFlushed) and e.rank == 1, kind="flushed")
    target = {"w": torch.zeros(1000)}
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        restored = c.restore(target, value_rank=1)
    assert (restored.step, restored.state["r"], restored.source.tier) == (1, 1, "nvme")
    assert torch.equal(target["w"], saved[1]["w"]) and restored.agreement == "nats"


# --- reads at once: the spans of a copy, the saved ranks, the buffers they share


@pytest.mark.anyio
async def test_spans_read_at_once_are_each_taken_once_checked_a_bad_one_from_the_next_copy(
    tmp_path: Path,
) -> None:
    """Three readers of a copy at once: a span reaches `take` whole and checked or not at all.
    A flipped byte in block 4 of the first copy never reaches the target: that span (and
    those not yet taken) come from the second copy; none is taken twice, and the blocks no
    span asks for stay untouched."""
    g = torch.randn(2048, 1024)  # 8 MiB: 8 blocks saved whole by one rank
    (o,) = saved_world(tmp_path, g, (1,), ("R",), job="j").values()
    path = o.copies[0].location
    shutil.copy(path, tmp_path / "copy.shard")
    good = msgspec.structs.replace(o.copies[0], location=str(tmp_path / "copy.shard"))
    flip(path, block_offset(path, 0, 4))
    want = g.view(-1).view(torch.uint8)
    into = torch.zeros_like(want)
    taken: list[Span] = []

    def take(head: Any, span: Span, data: memoryview) -> None:
        raw = torch.frombuffer(data, dtype=torch.uint8)
        assert torch.equal(raw, want[span.first * MB : span.stop * MB])  # (checked bytes only)
        into[span.first * MB : span.stop * MB] = raw
        taken.append(span)

    spans = [Span(0, k, k + 1) for k in (0, 2, 4, 6)]
    tally = Tally()
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        await read_parts(
            tiers, Origin(o.expected, o.nbytes, [*o.copies, good]), lambda h: spans, take,
            tally, depth=3,
        )  # fmt: skip
    assert sorted(taken, key=lambda s: s.first) == spans
    for k in range(8):
        block = into[k * MB : (k + 1) * MB]
        assert torch.equal(block, want[k * MB : (k + 1) * MB] if k % 2 == 0 else 0 * block), k
    assert len(tally.failed) == 1 and "block 4" in str(tally.failed[0][2])


@pytest.mark.anyio
async def test_a_saved_rank_without_a_good_copy_fails_assemble_with_its_own_error(
    tmp_path: Path,
) -> None:
    """The saved ranks are read at once (the value rank's own parts too): one whose only copy
    is gone makes `assemble` raise ShardMissingError naming it, not a group of errors."""
    g = torch.randn(9, 7)
    origins = saved_world(tmp_path, g, (2, 2), ("S0", "S1"), job="j")
    os.remove(origins[2].copies[0].location)

    async def origin(r: int) -> Origin:
        return origins[r]

    target = {"w": torch.zeros(9, 7), "r": torch.zeros(1, dtype=torch.int64)}
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        with pytest.raises(ShardMissingError, match="rank 2 of step 3"):
            await assemble(tiers, origin, target, rank=1, old_world=4)


@pytest.mark.anyio
async def test_a_read_budget_lets_a_lone_holder_through_and_makes_others_wait() -> None:
    """Buffers reused while large enough; past the budget a taker waits until bytes are given
    back, but one holding nothing gets a buffer of any size."""
    budget = Budget(4 * ALIGN)
    big = ReadBuffer(budget)
    buf = await big.fit(8 * ALIGN)  # (alone: more than the budget)
    assert await big.fit(2 * ALIGN) is buf and budget.held == 8 * ALIGN
    small = ReadBuffer(budget)
    got = []

    async def wait_for_room() -> None:
        got.append(await small.fit(ALIGN))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_room)
        await anyio.sleep(0.05)
        assert not got
        big.close()
    assert len(got) == 1 and budget.held == ALIGN
    small.close()
    assert budget.held == 0
