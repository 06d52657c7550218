"""The global layout of a sharded tensor: placements, and the box a rank's shard is.

A DTensor's local shard is saved with its placements as strings (`ShardedEntry.placements`:
`R`, `S<d>`, `SS<d>:<split_factor>`). `local_box` works out from them alone, torch's rules
reimplemented on index runs, where the shard of a mesh coordinate lies in the global tensor: the
writer refuses a layout whose shard is not one box, and the reader checks a header's offsets
against it. Pure arithmetic: no torch.
"""

from __future__ import annotations

import re

__all__ = ("local_box", "parse_placement")

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
    # Per tensor dim: the global indices this shard holds, as runs [start, end) in order.
    runs = [[(0, n)] for n in global_shape]
    for size, at, text in zip(mesh_shape, coordinate, placements, strict=True):
        kind, dim, factor = parse_placement(text)
        if kind == "R":
            continue
        if dim >= len(global_shape):
            raise ValueError(f"placement {text} of a {len(global_shape)}-dim tensor")
        held = runs[dim]
        pieces = _chunks(held, factor) if kind == "SS" else [held]
        runs[dim] = [r for piece in pieces for r in _chunks(piece, size)[at]]
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


def _chunks(runs: list[tuple[int, int]], k: int) -> list[list[tuple[int, int]]]:
    """`runs` (index runs, in order) cut as `torch.chunk` cuts n items into k parts."""
    n = sum(end - start for start, end in runs)
    step = -(-n // k) if n else 0
    return [_take(runs, min(i * step, n), min((i + 1) * step, n)) for i in range(k)]


def _take(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Items `lo` to `hi` (by position) of `runs`."""
    out, pos = [], 0
    for start, end in runs:
        a, b = max(lo, pos), min(hi, pos + end - start)
        if a < b:
            out.append((start + a - pos, start + b - pos))
        pos += end - start
    return out
