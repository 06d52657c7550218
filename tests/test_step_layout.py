"""A save's global layout: the same for every rank, named by its digest, and every saved
rank's sharded entries and boxes back from it (pure: headers built here)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import torch
from structlog.testing import capture_logs
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tests.test_reshard import saved_world, torch_placements
from tierpipe.errors import LayoutMismatchError
from tierpipe.reshard.assemble import assemble
from tierpipe.reshard.layout import coordinate_of
from tierpipe.reshard.reads import Origin, Tiers
from tierpipe.reshard.steplayout import boxes, layout_digest, layout_of, skeleton
from tierpipe.schemas import MeshEntry, ShardedEntry, ShardHeader
from tierpipe.schemas.layout import LAYOUT_DIGEST_PATTERN, decode_layout, encode_layout
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.reader import read_head

MESH = (2, 2)
#: Key -> (global shape, placements) on the 2x2 mesh: sharded twice, replicated on one mesh
#: dimension (ranks that differ on it hold the same box: one writes it), strided.
TENSORS = {
    "w": ((9, 7), ("S0", "S1")),
    "b": ((5,), ("R", "S0")),
    "s": ((8, 6), ("SS0:2", "S0")),
}


def header_2x2(rank: int, *, once: bool = True) -> ShardHeader:
    """Saved `rank`'s header of a 2x2-mesh DTensor save (plus a plain value), its offsets and
    local shapes torch's, each box's writer the lowest rank holding it (found here by brute
    force)."""
    coord = coordinate_of(rank, MESH)
    local, entries = {}, {}
    for key, (shape, placements) in TENSORS.items():
        got = {}
        for r in range(4):
            s, o = _compute_local_shape_and_global_offset(
                shape, MESH, list(coordinate_of(r, MESH)), torch_placements(placements)
            )
            got[r] = (tuple(s), tuple(o))
        lshape, offsets = got[rank]
        writer = min(r for r in range(4) if got[r] == got[rank]) if all(lshape) else rank
        local[key] = torch.zeros(lshape)
        entries[key] = ShardedEntry(0, shape, offsets, 0, placements, writer if once else -1)
    state = {**local, "step": torch.tensor([rank])}
    header = plan_state(state, job="j", step=1, rank=rank, world_size=4, node=f"n{rank}").header
    index = {e.path[0]: i for i, e in enumerate(header.tensors)}
    sharded = tuple(
        sorted(
            (msgspec.structs.replace(e, tensor=index[k]) for k, e in entries.items()),
            key=lambda s: s.tensor,
        )
    )
    mesh = MeshEntry(MESH, ("dp", "tp"), (0, 1, 2, 3), coord)
    return msgspec.structs.replace(header, sharded=sharded, meshes=(mesh,))


def test_every_rank_of_a_save_gives_the_same_layout_and_digest() -> None:
    """The layout drops what is rank-specific: the four ranks' headers give one value, which
    round-trips through its encoding, and one 16-hex-digit digest."""
    layouts = [layout_of(header_2x2(r)) for r in range(4)]
    assert all(x == layouts[0] for x in layouts)
    layout = layouts[0]
    assert {t.path for t in layout.tensors} == {("w",), ("b",), ("s",)}
    assert len(layout.meshes) == 1 and layout.meshes[0].ranks == (0, 1, 2, 3)
    assert decode_layout(encode_layout(layout)) == layout
    digest = layout_digest(layout)
    assert re.fullmatch(LAYOUT_DIGEST_PATTERN, digest) and len(digest) == 16
    assert all(layout_digest(x) == digest for x in layouts)


def test_another_layout_has_another_digest() -> None:
    """A change of placements, of dtype or of the replica rule is another layout."""
    base = layout_of(header_2x2(0))
    other = layout_of(header_2x2(0, once=False))
    t = base.tensors[0]
    moved = msgspec.structs.replace(
        base, tensors=(msgspec.structs.replace(t, placements=("S1", "S0")), *base.tensors[1:])
    )
    digests = {layout_digest(x) for x in (base, other, moved)}
    assert len(digests) == 3


def test_a_plain_save_has_the_empty_layout() -> None:
    """A state without DTensors has a layout with nothing in it (still named)."""
    header = plan_state({"a": torch.ones(3)}, job="j", step=1, rank=0, world_size=1,
                        node="n").header  # fmt: skip
    layout = layout_of(header)
    assert layout.tensors == () and layout.meshes == ()


@pytest.mark.parametrize("once", [True, False])
def test_any_saved_ranks_sharded_entries_follow_from_the_layout(once: bool) -> None:
    """`skeleton` gives back each rank's sharded entries, mesh and local shapes exactly as
    that rank's header holds them (writers included), from one rank's layout."""
    layout = layout_of(header_2x2(3, once=once))
    for rank in range(4):
        real = header_2x2(rank, once=once)
        got = skeleton(layout, job="j", step=1, rank=rank, world_size=4)
        assert got.meshes == real.meshes
        for s, g in zip(real.sharded, got.sharded, strict=True):
            e, ge = real.tensors[s.tensor], got.tensors[g.tensor]
            assert (ge.path, ge.dtype, ge.shape) == (e.path, e.dtype, e.shape)
            assert msgspec.structs.replace(g, tensor=s.tensor) == s


def test_every_saved_ranks_box_follows_from_the_layout() -> None:
    """`boxes` gives each saved rank's box: its offsets and shape are the ones in its header."""
    layout = layout_of(header_2x2(0))
    for i, t in enumerate(layout.tensors):
        for rank, box in boxes(layout, i):
            real = header_2x2(rank)
            s = next(s for s in real.sharded if real.tensors[s.tensor].path == t.path)
            shape = real.tensors[s.tensor].shape
            assert box.shape == shape
            if all(shape):
                assert box.offsets == s.offsets


def test_a_rank_outside_the_saved_mesh_is_refused() -> None:
    """Asking for a rank the save had not is a LayoutMismatchError, not a guess."""
    with pytest.raises(LayoutMismatchError, match="rank 7"):
        skeleton(layout_of(header_2x2(0)), job="j", step=1, rank=7, world_size=8)


# --- assemble planned from the layout (shard files here, no servers)


@pytest.mark.anyio
@pytest.mark.parametrize("with_layout", [True, False])
async def test_assemble_plans_from_the_layout_before_any_header_read(
    tmp_path: Path, with_layout: bool
) -> None:
    """With the step's layout, assemble plans before reading any header and starts every
    saved rank's reads at once; without it, after the value rank's header; the same bytes."""
    g = torch.randn(9, 7)
    origins = saved_world(tmp_path, g, (2, 2), ("S0", "S1"), job="j")
    layout = layout_of(read_head(origins[0].copies[0].location).header)

    async def origin(r: int) -> Origin:
        return origins[r]

    target = {"w": torch.zeros(9, 7), "r": torch.zeros(1, dtype=torch.int64)}
    with capture_logs() as logs:
        async with Tiers(Settings(node="n"), None, node="n") as tiers:
            got = await assemble(tiers, origin, target, rank=5, old_world=4,
                                 layout=layout if with_layout else None)  # fmt: skip
    assert torch.equal(target["w"], g) and int(target["r"]) == 1
    (plan,) = [e for e in logs if e["event"] == "reshard_planned"]
    want = ("layout", 0, 4) if with_layout else ("header", 1, 1)
    assert (plan["planned_from"], plan["heads_read"], plan["sources"]) == want
    assert got.tally.heads == 4


@pytest.mark.anyio
async def test_a_header_that_does_not_hold_the_planned_layout_is_refused(tmp_path: Path) -> None:
    """A layout its shards do not hold (a record that names another one) is a
    LayoutMismatchError naming the layout, never bytes copied by the wrong plan."""
    g = torch.randn(9, 7)
    origins = saved_world(tmp_path, g, (2, 2), ("S0", "S1"), job="j")
    saved = layout_of(read_head(origins[0].copies[0].location).header)
    t = saved.tensors[0]
    other = msgspec.structs.replace(
        saved, tensors=(msgspec.structs.replace(t, placements=("S1", "S0")),)
    )

    async def origin(r: int) -> Origin:
        return origins[r]

    target = {"w": torch.zeros(9, 7)}
    async with Tiers(Settings(node="n"), None, node="n") as tiers:
        with pytest.raises(LayoutMismatchError, match=layout_digest(other)):
            await assemble(tiers, origin, target, rank=0, old_world=4, layout=other)
