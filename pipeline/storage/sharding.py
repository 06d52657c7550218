"""The global layout of a sharded tensor: placements, and the box a rank's shard is.

A DTensor's local shard is saved with its placements as strings (`ShardedEntry.placements`:
`R`, `S<d>`, `SS<d>:<split_factor>`). `local_box` works out from them alone, torch's rules
reimplemented on index runs, where the shard of a mesh coordinate lies in the global tensor: the
writer refuses a layout whose shard is not one box, and the reader checks a header's offsets
against it. `replica_writer` names the one rank that stores a replicated shard's bytes (the
lowest global rank holding that box), from the layout alone, so every rank and every later
reader agree on it without talking; `declare_replicated` makes the plain tensors under a save's
declared keys such replicas (over a 1-D mesh of the world). Pure arithmetic: no torch.

Stored once per job, how a replica survives a node loss: the writer's shard file holds its bytes,
and that file goes through the peer tier (a partner node's NVMe) and object storage like every
shard; a step is complete only when every rank's shard is, so a step whose writer's shard was
lost on every tier is never chosen (the restore takes an older one). The trade-off: NVMe holds a
replicated value once per job, not once per node, so a holder on another node reads it on restore
from the writer node's peer endpoint, a partner's replica or object storage (the resharding path,
`tierpipe.reshard`: ranged reads, every block checked).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Container

from tierpipe.errors import LayoutMismatchError
from tierpipe.schemas import MeshEntry, ShardedEntry, ShardHeader

__all__ = (
    "declare_replicated",
    "local_box",
    "parse_placement",
    "position",
    "replica_writer",
    "stored_elsewhere",
    "stores_bytes",
)

#: A placement as `ShardedEntry.placements` spells it.
_PLACEMENT = re.compile(r"R|S([0-9]{1,4})|SS([0-9]{1,4}):([1-9][0-9]{0,8})")


def parse_placement(text: str) -> tuple[str, int, int]:
    """("R", 0, 1), ("S", dim, 1) or ("SS", dim, split_factor) from a placement string.

    Raises:
        ValueError: not a placement `ShardedEntry` allows.
    """
    m = _PLACEMENT.fullmatch(text)
    if m is None:
        raise ValueError(f"bad placement {text!r}")
    if text == "R":
        return "R", 0, 1
    if m.group(1) is not None:
        return "S", int(m.group(1)), 1
    return "SS", int(m.group(2)), int(m.group(3))


def local_box(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[str, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Where the shard of the rank at `coordinate` lies in the global tensor, as (offsets,
    shape), or None where it is not one box (strided placements can scatter it).

    DTensor's rules: mesh dimensions shard in order, left to right; `S<d>` splits what is left
    of tensor dim d as `torch.chunk` does (chunks of ceil(n / k), the last ones shorter or
    empty); `SS<d>:<f>` first splits it into f chunks, splits each of those the same way, and
    keeps this rank's piece of each. An empty shard's offset is the dimension's size (as
    `compute_local_shape_and_global_offset` gives it).

    Raises:
        ValueError: the placements do not fit the shapes (a bad placement string, a tensor dim
            out of range, lengths that differ).
    """
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError("mesh shape, coordinate and placements differ in length")
    ranks = math.prod(mesh_shape)
    # Per tensor dim: the global indices this shard holds, as runs [start, end) in order.
    runs = [[(0, n)] for n in global_shape]
    for size, at, text in zip(mesh_shape, coordinate, placements, strict=True):
        kind, dim, factor = parse_placement(text)
        if kind == "R":
            continue
        if dim >= len(global_shape):
            raise ValueError(f"placement {text} of a {len(global_shape)}-dim tensor")
        if factor > ranks:  # torch's: the product of other mesh dims' sizes
            raise ValueError(f"placement {text} on a mesh of {ranks} ranks")
        held = runs[dim]
        n = _length(held)
        pieces = (
            [_chunk(held, factor, j) for j in range(min(factor, n))] if kind == "SS" else [held]
        )
        runs[dim] = [r for piece in pieces for r in _chunk(piece, size, at)]
    offsets, shape = [], []
    for n, held in zip(global_shape, runs, strict=True):
        merged: list[tuple[int, int]] = []
        for start, end in held:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            elif end > start:
                merged.append((start, end))
        if len(merged) > 1:
            return None
        start, end = merged[0] if merged else (n, n)
        offsets.append(start)
        shape.append(end - start)
    return tuple(offsets), tuple(shape)


def _length(runs: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in runs)


def _chunk(runs: list[tuple[int, int]], k: int, i: int) -> list[tuple[int, int]]:
    """Part `i` of `runs` (index runs, in order) cut as `torch.chunk` cuts n items into k parts
    (ceil(n / k) each; the parts past the end are empty)."""
    n = _length(runs)
    step = -(-n // k)
    return _take(runs, min(i * step, n), min((i + 1) * step, n))


def _take(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Items `lo` to `hi` (by position) of `runs`."""
    out, pos = [], 0
    for start, end in runs:
        a, b = max(lo, pos), min(hi, pos + end - start)
        if a < b:
            out.append((start + a - pos, start + b - pos))
        pos += end - start
    return out


def replica_writer(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    ranks: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[str, ...],
) -> int | None:
    """The global rank that stores the bytes of the shard at `coordinate` for all its holders:
    the lowest rank (of `ranks`, the mesh's global ranks row-major) whose shard is the same box
    (ranks that differ only on `R` mesh dimensions, or hold the same box for another reason).
    None for an empty shard: it holds nothing, so it is no holder of anything. A shard that is
    not one box is its own writer.

    Raises:
        ValueError: the placements do not fit the shapes, or the ranks the mesh.
    """
    if len(ranks) != math.prod(mesh_shape):
        raise ValueError(f"{len(ranks)} ranks for a mesh of shape {mesh_shape}")
    at = position(coordinate, mesh_shape)
    box = local_box(global_shape, mesh_shape, coordinate, placements)
    if box is not None and not math.prod(box[1]):
        return None
    if box is None:
        return ranks[at]
    if all(p == "R" for p in placements):  # (every rank holds the whole tensor)
        return min(ranks)
    return _writers(global_shape, mesh_shape, ranks, placements)[at]


def position(coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """The row-major position of `coordinate` in a mesh of `mesh_shape` (its rank's index in
    `MeshEntry.ranks`)."""
    at = 0
    for n, c in zip(mesh_shape, coordinate, strict=True):
        at = at * n + c
    return at


def stores_bytes(s: ShardedEntry, m: MeshEntry) -> bool:
    """Whether the shard whose sharded entry is `s` (on its mesh `m`) holds its tensor's bytes:
    it is the writer among the ranks holding that box (`ShardedEntry.writer`), or an older
    file's (every holder stored its own). A holder that is not the writer has an empty blob."""
    return s.writer < 0 or s.writer == m.ranks[position(m.coordinate, m.shape)]


def stored_elsewhere(
    header: ShardHeader, wanted: Container[tuple[str | int, ...]] | None = None
) -> LayoutMismatchError | None:
    """The first tensor of `header` (whose key path is in `wanted`, if given) whose bytes this
    shard does not hold (a replica its writer, another rank, stores), as the error the in-place
    restore raises; None where it holds all. Such a shard is restored through the resharding
    path (`tierpipe.reshard.restore`), which reads the writer's bytes."""
    for s in header.sharded:
        if not stores_bytes(s, header.meshes[s.mesh]):
            e = header.tensors[s.tensor]
            if wanted is not None and e.path not in wanted:
                continue
            return LayoutMismatchError(
                f"{'/'.join(map(str, e.path)) or '<root>'}: rank {header.rank}'s shard holds no "
                f"bytes of it (a replicated value, stored once by rank {s.writer}): restore it "
                "into a DTensor target, or with its top-level key declared replicated "
                "(Checkpointer(..., replicated=...)): the resharding path reads the writer's"
            )  # fmt: skip
    return None


def declare_replicated(
    keys: frozenset[str],
    shapes: list[tuple[int, ...]],
    paths: list[tuple[str | int, ...]],
    sharded: list[ShardedEntry],
    meshes: list[MeshEntry],
    *,
    rank: int,
    world: int,
) -> tuple[list[ShardedEntry], list[MeshEntry]]:
    """`sharded` and `meshes` (a state's, as `tree.encode_tree` gives them) with the plain
    tensors (`shapes`, at key `paths`) under the declared top-level `keys` added as replicated
    over a 1-D mesh of the whole world: rank 0 writes them (an empty one: every rank its own)."""
    taken = {s.tensor for s in sharded}
    mesh = MeshEntry(shape=(world,), dims=(), ranks=tuple(range(world)), coordinate=(rank,))
    index = next((i for i, m in enumerate(meshes) if m == mesh), len(meshes))
    added = [
        ShardedEntry(
            tensor=i,
            global_shape=shape,
            offsets=(0,) * len(shape),
            mesh=index,
            placements=("R",),
            writer=0 if math.prod(shape) else rank,
        )
        for i, (shape, path) in enumerate(zip(shapes, paths, strict=True))
        if i not in taken and path and path[0] in keys
    ]
    if not added:
        return sharded, meshes
    meshes = meshes if index < len(meshes) else [*meshes, mesh]
    return sorted([*sharded, *added], key=lambda s: s.tensor), meshes


@functools.lru_cache(maxsize=256)
def _writers(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    ranks: tuple[int, ...],
    placements: tuple[str, ...],
) -> tuple[int, ...]:
    """Each mesh position's writer (row-major): the lowest rank among those of the same box."""
    boxes = []
    for at in range(len(ranks)):
        coordinate, rest = [], at
        for n in reversed(mesh_shape):
            rest, c = divmod(rest, n)
            coordinate.append(c)
        boxes.append(local_box(global_shape, mesh_shape, tuple(reversed(coordinate)), placements))
    lowest: dict[object, int] = {}
    for box, rank in zip(boxes, ranks, strict=True):
        if box is not None:
            lowest[box] = min(rank, lowest.get(box, rank))
    return tuple(
        rank if box is None else lowest[box] for box, rank in zip(boxes, ranks, strict=True)
    )
