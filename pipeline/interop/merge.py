"""The merge of a step's ranks into one global layout (pure): what each rank adds to a single
checkpoint of the whole step, and the check that the parts make whole tensors.

Ranks are taken in order, 0 first, and the first one to hold a part wins:
- a sharded tensor (a `ShardedEntry`: a DTensor's local shard) becomes one global tensor; each
  rank adds its box (`offsets` + the local shape) as a chunk, and a box already added (the same
  shard held by several ranks: replicated along a mesh dimension) is skipped;
- every other value (a plain tensor, a number, a string) is rank 0's: a value is taken from the
  lowest rank that has its key path, and the other ranks' values under that key are ignored, as
  DCP does with a value that is not a DTensor (it takes it as replicated).

`Merge.check()` then proves that every sharded tensor's chunks tile it: along each dimension the
chunks' extents tile `[0, size)`, and every cell of that grid is present once (torch shards a
DTensor on a grid: an even split, or torch.chunk's, with empty shards on the last ranks).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tierpipe.errors import LayoutMismatchError
from tierpipe.schemas import ShardHeader
from tierpipe.tree import KeyPath

__all__ = (
    "Chunk", "Merge", "Sharded", "check_tiling", "element", "key_name", "leaves", "sharded_by_path",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Chunk:
    """One box of a global tensor: where it starts and its extent, per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def index(self) -> tuple[slice, ...]:
        """The box as an index into the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))


@dataclass(slots=True)
class Sharded:
    """A global tensor as the ranks' shards describe it, and the chunks added so far."""

    path: KeyPath
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    #: Box -> the rank whose shard was taken for it.
    chunks: dict[Chunk, int] = field(default_factory=dict)


@dataclass(slots=True)
class Merge:
    """The global layout of a step, built rank by rank (`add_rank`), checked by `check`."""

    #: Sharded tensors by their key (the key path, or a DCP name: see `add_rank`'s `key`).
    sharded: dict[Hashable, Sharded] = field(default_factory=dict)
    #: Keys of the plain values taken so far.
    plain: set[Hashable] = field(default_factory=set)

    def add_rank(
        self, rank: int, header: ShardHeader, state: Any
    ) -> list[tuple[Sharded, Chunk, torch.Tensor]]:
        """The chunks `rank` adds (with its local shard of each): those no lower rank added.

        Raises:
            LayoutMismatchError: two ranks that disagree on a tensor's global shape or dtype, a
                shard outside its global tensor, or a tensor plain on a lower rank.
        """
        chunks: list[tuple[Sharded, Chunk, torch.Tensor]] = []
        for path, entry in sharded_by_path(header).items():
            local = element(state, path)
            if not isinstance(local, torch.Tensor):
                raise LayoutMismatchError(f"{key_name(path)}: the sharded entry names no tensor")
            chunks.extend(self._chunk(rank, path, entry.global_shape, entry.offsets, local))
        return chunks

    def first(self, rank: int, key: Hashable) -> bool:
        """Whether `rank` is the first to hold the plain value under `key` (it is taken).

        Raises:
            LayoutMismatchError: `key` is a tensor a lower rank holds sharded.
        """
        if key in self.sharded:
            raise LayoutMismatchError(
                f"{key_name(key) if isinstance(key, tuple) else key}: sharded on rank "
                f"{min(self.sharded[key].chunks.values(), default=0)}, plain on rank {rank}"
            )
        if key in self.plain:
            return False
        self.plain.add(key)
        return True

    def _chunk(
        self, rank: int, path: KeyPath, shape: tuple[int, ...], offsets: tuple[int, ...],
        local: torch.Tensor,
    ) -> Iterator[tuple[Sharded, Chunk, torch.Tensor]]:  # fmt: skip
        name = key_name(path)
        if path in self.plain:
            raise LayoutMismatchError(f"{name}: a plain value on a lower rank, sharded on {rank}")
        found = self.sharded.setdefault(path, Sharded(path, tuple(shape), local.dtype))
        if found.global_shape != tuple(shape) or found.dtype != local.dtype:
            raise LayoutMismatchError(
                f"{name}: rank {rank} has global shape {list(shape)} {local.dtype}, a lower rank "
                f"{list(found.global_shape)} {found.dtype}"
            )
        chunk = Chunk(tuple(offsets), tuple(local.shape))
        if len(chunk.offsets) != len(shape) or any(
            o < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, shape, strict=True)
        ):
            raise LayoutMismatchError(
                f"{name}: rank {rank}'s shard {list(chunk.sizes)} at {list(chunk.offsets)} is "
                f"outside the global shape {list(shape)}"
            )
        if chunk not in found.chunks:
            found.chunks[chunk] = rank
            yield found, chunk, local

    def check(self) -> None:
        """Every sharded tensor is tiled by its chunks, once.

        Raises:
            LayoutMismatchError: a part of a tensor no rank holds, or two chunks that overlap.
        """
        for s in self.sharded.values():
            check_tiling(key_name(s.path), s.global_shape, s.chunks)


def check_tiling(name: str, shape: tuple[int, ...], chunks: Iterable[Chunk]) -> None:
    """Raise unless `chunks` tile a tensor of `shape` once (empty chunks aside).

    Raises:
        LayoutMismatchError: a part no chunk covers, or two chunks that overlap.
    """
    cells = [c for c in chunks if c.numel]
    if not cells:
        if math.prod(shape):
            raise LayoutMismatchError(f"{name}: no rank holds any part of it")
        return
    grid = 1
    for d, size in enumerate(shape):
        extents = sorted({(c.offsets[d], c.sizes[d]) for c in cells})
        at = 0
        for start, extent in extents:
            if start != at:
                what = "a gap" if start > at else "overlapping shards"
                raise LayoutMismatchError(f"{name}: {what} at {start} along dimension {d}")
            at = start + extent
        if at != size:
            raise LayoutMismatchError(f"{name}: no shard covers dimension {d} from {at} to {size}")
        grid *= len(extents)
    if len(cells) != grid:
        raise LayoutMismatchError(f"{name}: {len(cells)} shards where the grid has {grid} cells")


def sharded_by_path(header: ShardHeader) -> dict[KeyPath, Any]:
    """The header's sharded entries by the key path of their tensor."""
    return {tuple(header.tensors[s.tensor].path): s for s in header.sharded}


def leaves(state: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(key path, value) of every leaf of nested dicts, lists and tuples."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from leaves(v, (*path, k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            yield from leaves(v, (*path, i))
    else:
        yield path, state


def element(state: Any, path: KeyPath) -> Any:
    """The value at `path` in nested dicts, lists and tuples."""
    for key in path:
        state = state[key]
    return state


def key_name(path: KeyPath) -> str:
    """A key path as a dotted name (`model.0.weight`)."""
    return ".".join(map(str, path))
