"""The resharding planner: which parts of which saved shards a rank's new local shards need.

Pure (no I/O). A DTensor's local shard is, per tensor dimension, a list of global indices in
local order; `box_of` computes it from the global shape, the mesh shape, a coordinate and the
placements (`R`, `S<d>`, `SS<d>:<split_factor>`, as `tierpipe.schemas.ShardedEntry` stores them),
by the same rules as torch's `compute_local_shape_and_global_offset` (`torch.chunk` sizes, uneven
shards shorter at the end, `_StridedShard`'s split-then-shard order). Indices are kept as runs
(`(global start, length)`), so a `Shard` dimension is one run and a `_StridedShard` one a few.

`overlaps` intersects the target's box with the saved boxes (one holder per distinct box:
replicated shards are read once, from the holder `pick` prefers); each `Piece` says, per
dimension, which local positions of the source go to which local positions of the target.
`Piece.byte_span` is the part of the source's row-major local shard to read (the hull of the
piece); `blocks` widens spans to whole `BLOCK_BYTES` blocks and merges them per blob, so a reader
makes few large requests and checks every block's digest. `copy_piece` copies a piece from the
bytes read into the target's local tensor with torch views (a slice per dimension where the
piece is one run, an index where it is several), never element by element in Python.

A saved plain tensor whose shape is the target's global shape is the whole tensor (`full_box`);
a plain target whose shape is the saved global shape takes the whole tensor (a single-process
restore of a sharded checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from tierpipe.errors import LayoutMismatchError
from tierpipe.schemas import BLOCK_BYTES
from tierpipe.storage.sharding import parse_placement as stored_placement
from tierpipe.tree import placement_text

__all__ = (
    "Box",
    "Piece",
    "Span",
    "blocks",
    "box_of",
    "coordinate_of",
    "copy_piece",
    "full_box",
    "overlaps",
    "parse_placement",
    "placements_of",
)

#: One dimension of a local shard: runs of (global start, length), in local order.
Runs = tuple[tuple[int, int], ...]
#: Local positions along one dimension: runs of (local start, length), in order.
Pick = tuple[tuple[int, int], ...]


def parse_placement(text: str, ndim: int) -> tuple[str, int, int]:
    """("R" | "S" | "SS", tensor dim, split factor) of a stored placement
    (`tierpipe.storage.sharding.parse_placement`, checked against an `ndim`-d tensor).

    Raises:
        LayoutMismatchError: not a placement this build reads, or a dim out of range.
    """
    try:
        kind, dim, split = stored_placement(text)
    except ValueError as e:
        raise LayoutMismatchError(f"placement {text!r} is not one a restore can reshard") from e
    if kind != "R" and not 0 <= dim < ndim:
        raise LayoutMismatchError(f"placement {text!r} does not fit a {ndim}-d tensor")
    return kind, dim, split


def placements_of(placements: Iterable[object]) -> tuple[str, ...]:
    """torch placements as stored strings (`Partial` refused: it is no value yet)."""
    out = []
    for p in placements:
        if (text := placement_text(p)) is None:
            raise LayoutMismatchError(f"placement {p!r} cannot be resharded (not a value)")
        out.append(text)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Box:
    """A local shard's place in its global tensor: per dimension, runs of global indices."""

    dims: tuple[Runs, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(n for _, n in runs) for runs in self.dims)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first global index of each dimension (what DCP and `ShardedEntry` record)."""
        return tuple(runs[0][0] if runs else 0 for runs in self.dims)


def full_box(shape: Sequence[int]) -> Box:
    """The whole tensor of `shape` as one box (a plain tensor, a full target)."""
    return Box(tuple(((0, n),) if n else () for n in shape))


def coordinate_of(position: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh coordinate of the rank at flat `position` of a row-major mesh."""
    coord = []
    for n in reversed(mesh_shape):
        position, c = divmod(position, n)
        coord.append(c)
    return tuple(reversed(coord))


def box_of(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[str],
) -> Box:
    """The local shard of the mesh position `coordinate` (see the module docstring).

    Raises:
        LayoutMismatchError: placements that do not fit the mesh or the tensor.
    """
    if not (len(mesh_shape) == len(coordinate) == len(placements)):
        raise LayoutMismatchError(
            f"mesh {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and placements "
            f"{tuple(placements)} do not agree"
        )
    dims: list[Runs] = [((0, n),) if n else () for n in global_shape]
    for text, k, c in zip(placements, mesh_shape, coordinate, strict=True):
        kind, d, split = parse_placement(text, len(global_shape))
        if kind == "R":
            continue
        if not 0 <= c < k:
            raise LayoutMismatchError(f"coordinate {tuple(coordinate)} outside mesh {mesh_shape}")
        size = sum(n for _, n in dims[d])
        dims[d] = _select(dims[d], _positions(kind, size, k, c, split))
    return Box(tuple(dims))


def _positions(kind: str, size: int, chunks: int, c: int, split: int) -> list[tuple[int, int]]:
    """Local positions (start, length) mesh coordinate `c` keeps of a dimension of `size`."""
    if kind == "S":
        full = -(-size // chunks)
        start = min(size, full * c)
        return [(start, max(0, min(size, start + full) - start))]
    out = []  # `_StridedShard`: split in `split` chunks first, then each in `chunks`
    first = -(-size // split)
    for j in range(split):
        lo, hi = min(first * j, size), min(first * (j + 1), size)
        n = max(0, hi - lo)
        second = -(-n // chunks)
        a, b = min(second * c, n), min(second * (c + 1), n)
        out.append((lo + a, max(0, b - a)))
    return out


def _select(runs: Runs, picks: Iterable[tuple[int, int]]) -> Runs:
    """The global-index runs at local positions `picks` of `runs`."""
    out: list[tuple[int, int]] = []
    for start, length in picks:
        at = 0
        for g, n in runs:
            lo, hi = max(start, at), min(start + length, at + n)
            if lo < hi:
                _append(out, g + lo - at, hi - lo)
            at += n
    return tuple(out)


def _append(out: list[tuple[int, int]], start: int, length: int) -> None:
    if out and out[-1][0] + out[-1][1] == start:
        out[-1] = (out[-1][0], out[-1][1] + length)
    else:
        out.append((start, length))


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one saved shard that a target needs: per dimension, the source's local
    positions and the target's local positions they go to (same lengths, in order)."""

    #: The saved rank that holds it.
    source: int
    src: tuple[Pick, ...]
    dst: tuple[Pick, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(n for _, n in pick) for pick in self.src)

    def byte_span(self, local_shape: Sequence[int], itemsize: int) -> tuple[int, int]:
        """[start, stop) of the bytes of the source's row-major local shard (of `local_shape`)
        that hold this piece: from its first element to its last."""
        strides = _strides(local_shape)
        first = sum(p[0][0] * s for p, s in zip(self.src, strides, strict=True))
        last = sum((p[-1][0] + p[-1][1] - 1) * s for p, s in zip(self.src, strides, strict=True))
        return first * itemsize, (last + 1) * itemsize


def overlaps(
    target: Box, sources: Sequence[tuple[int, Box]], *, pick: Callable[[list[int]], int] = min
) -> list[Piece]:
    """The pieces of the saved shards (`(saved rank, its box)`) that fill `target`: one holder
    per distinct box (`pick` chooses among the ranks holding the same one: replicas), empty
    overlaps left out.

    Raises:
        LayoutMismatchError: the sources do not cover the target (a saved layout with a gap).
    """
    holders: dict[Box, list[int]] = {}
    for rank, box in sources:
        if len(box.dims) != len(target.dims):
            raise LayoutMismatchError(
                f"a saved shard has {len(box.dims)} dims, the target {len(target.dims)}"
            )
        holders.setdefault(box, []).append(rank)
    pieces, covered = [], 0
    for box, ranks in holders.items():
        src: list[Pick] = []
        dst: list[Pick] = []
        for t_runs, s_runs in zip(target.dims, box.dims, strict=True):
            s_pick, d_pick = _meet(s_runs, t_runs)
            if not s_pick:
                break
            src.append(s_pick)
            dst.append(d_pick)
        else:
            if target.dims:  # (a 0-d tensor: one element, one piece)
                piece = Piece(pick(sorted(ranks)), tuple(src), tuple(dst))
                covered += math.prod(piece.shape)
            else:
                piece = Piece(pick(sorted(ranks)), (), ())
                covered += 1
            pieces.append(piece)
    want = math.prod(target.shape)
    if covered != want:
        raise LayoutMismatchError(
            f"the saved shards cover {covered} of the {want} elements this rank needs"
        )
    return pieces


def _meet(source: Runs, target: Runs) -> tuple[Pick, Pick]:
    """Where the global indices of `source` and `target` meet: the positions in each."""
    src: list[tuple[int, int]] = []
    dst: list[tuple[int, int]] = []
    t_at = 0
    for tg, tn in target:
        s_at = 0
        for sg, sn in source:
            lo, hi = max(tg, sg), min(tg + tn, sg + sn)
            if lo < hi:
                _append(src, s_at + lo - sg, hi - lo)
                _append(dst, t_at + lo - tg, hi - lo)
            s_at += sn
        t_at += tn
    return tuple(src), tuple(dst)


@dataclass(frozen=True, slots=True)
class Span:
    """Whole blocks of one saved blob to read: [first, stop) block indices."""

    blob: int
    first: int
    stop: int

    def byte_range(self, blob_nbytes: int) -> tuple[int, int]:
        """[start, stop) in the blob (the last block may be shorter)."""
        return self.first * BLOCK_BYTES, min(self.stop * BLOCK_BYTES, blob_nbytes)


def blocks(spans: Iterable[tuple[int, int, int]], *, gap: int = 0) -> list[Span]:
    """Byte spans `(blob, start, stop)` widened to whole blocks and merged per blob (spans
    that touch, or are at most `gap` blocks apart, become one), in blob and block order."""
    by_blob: dict[int, list[tuple[int, int]]] = {}
    for blob, start, stop in spans:
        if stop > start:
            by_blob.setdefault(blob, []).append((start // BLOCK_BYTES, -(-stop // BLOCK_BYTES)))
    out: list[Span] = []
    for blob in sorted(by_blob):
        merged: list[list[int]] = []
        for first, stop in sorted(by_blob[blob]):
            if merged and first <= merged[-1][1] + gap:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([first, stop])
        out += [Span(blob, a, b) for a, b in merged]
    return out


def copy_piece(
    piece: Piece,
    data: torch.Tensor,
    data_start: int,
    local_shape: Sequence[int],
    into: torch.Tensor,
) -> None:
    """Copy `piece` into `into` (the target's local tensor) from `data`: the bytes read of the
    source's local shard (uint8), which start at byte `data_start` of it.

    Raises:
        LayoutMismatchError: `data` does not hold the piece (a planning error, never data).
    """
    itemsize = into.element_size()
    start, stop = piece.byte_span(local_shape, itemsize)
    if start < data_start or stop > data_start + data.numel() or data_start % itemsize:
        raise LayoutMismatchError(f"bytes [{start}, {stop}) of a saved shard were not read")
    flat = data.view(into.dtype) if data.numel() % itemsize == 0 else None
    if flat is None:
        flat = data[: data.numel() // itemsize * itemsize].view(into.dtype)
    strides = _strides(local_shape)
    lows = [p[0][0] for p in piece.src]
    hull = [p[-1][0] + p[-1][1] - lo for p, lo in zip(piece.src, lows, strict=True)]
    base = sum(lo * s for lo, s in zip(lows, strides, strict=True)) - data_start // itemsize
    src = flat.as_strided(hull, strides, flat.storage_offset() + base)
    for d, p in enumerate(piece.src):
        src = _take(src, d, p, lows[d])
    if all(len(p) == 1 for p in piece.dst):
        dst = into
        for d, ((a, n),) in enumerate(piece.dst):
            dst = dst.narrow(d, a, n)
        dst.copy_(src)
        return
    index = []
    for d, p in enumerate(piece.dst):
        shape = [1] * len(piece.dst)
        shape[d] = -1
        index.append(_index(p, 0, into.device).view(shape))
    into[tuple(index)] = src.to(into.device)


def _take(t: torch.Tensor, d: int, pick: Pick, low: int) -> torch.Tensor:
    """`t` (whose dimension `d` starts at local position `low`) at `pick` along `d`."""
    if len(pick) == 1:
        a, n = pick[0]
        return t.narrow(d, a - low, n)
    return t.index_select(d, _index(pick, low, t.device))


def _index(pick: Pick, low: int, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(a - low, a - low + n, device=device) for a, n in pick])


def _strides(shape: Sequence[int]) -> list[int]:
    """Row-major element strides (a zero-size dimension counts as 1, as torch's)."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return list(reversed(out))
