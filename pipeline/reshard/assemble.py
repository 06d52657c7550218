"""One rank's state, assembled from parts of the shards another world (or mesh) saved.

`assemble` reads the head of the saved rank whose values this rank takes (`value_rank`: by
default new rank r takes saved rank `r % old_world`'s), and plans from its header: each tensor
it lists whose target is a DTensor (or a plain tensor of the saved global shape) is filled from
the saved shards that overlap the target's local shard (`layout.overlaps`; the boxes of every
saved shard follow from one `ShardedEntry`: global shape, mesh, placements); every other tensor
and plain value comes from the value rank's shard. Then every saved rank that holds a needed
part is read (`reads.read_parts`: whole blocks, each checked), the others at once as soon as
the value rank's header gave the plan (while its own parts are still read), and the parts are
copied into the targets' local tensors in place. Objects with `load_state_dict()` among the
targets get their state loaded, unless every entry of a module's state went into its own
tensors in place.

A saved DTensor without a target comes back as the value rank's local shard (a plain tensor):
there is no new layout to reshard it into (an optimizer's state must exist, e.g. after one
step, to be resharded into). A replica is read from its writer's shard only (the lowest rank
holding its box: `ShardedEntry.writer`), the one that stored its bytes; so is the value rank's
own local shard where that rank stored none.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
import torch

from tierpipe.errors import LayoutMismatchError, ShardFormatError
from tierpipe.reshard.buffers import Budget, first_error
from tierpipe.reshard.layout import (
    Box,
    Piece,
    Span,
    blocks,
    box_of,
    copy_piece,
    full_box,
    overlaps,
    placements_of,
)
from tierpipe.reshard.reads import Origin, Tally, Tiers, read_parts
from tierpipe.reshard.steplayout import mesh_boxes
from tierpipe.schemas import BLOCK_BYTES, MeshEntry, ShardedEntry, ShardHeader, TensorEntry
from tierpipe.state import KeyPath, blob_view, flatten_targets
from tierpipe.storage.shard import Head, sharded_layouts
from tierpipe.storage.sharding import local_box, stores_bytes
from tierpipe.tree import decode_tree

__all__ = (
    "Assembled", "ValueRank", "assemble", "holds_dtensor", "value_rank_of",
)  # fmt: skip

log = structlog.get_logger(__name__)

#: Which saved rank's plain values a new rank takes: a rank for all, or new rank -> saved rank.
ValueRank = int | Callable[[int], int] | None

#: Saved ranks read at once.
_LANES = 8


def value_rank_of(rule: ValueRank, rank: int, old_world: int) -> int:
    """The saved rank whose values new `rank` takes (default `rank % old_world`).

    Raises:
        LayoutMismatchError: the rule names no rank of the saved world.
    """
    v = rank % old_world if rule is None else rule if isinstance(rule, int) else rule(rank)
    if not isinstance(v, int) or not 0 <= v < old_world:
        raise LayoutMismatchError(f"value_rank gave {v!r} for rank {rank}: the step has "
                                  f"{old_world} saved ranks")  # fmt: skip
    return v


def holds_dtensor(into: Any) -> bool:
    """Whether any target in `into` (as `restore` walks it) is a DTensor."""
    if into is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    targets, _ = flatten_targets(into)
    return any(isinstance(t, DTensor) for t in targets.values())


@dataclass(frozen=True, slots=True)
class Assembled:
    """The rebuilt state, and how the reads went."""

    state: Any
    #: The saved rank whose values this rank took, and its header.
    value_rank: int
    header: ShardHeader
    tally: Tally
    #: Tensors written in place into targets (in whole or in part).
    in_place: int


@dataclass(slots=True)
class _Fill:
    """One target filled from saved shards: its local tensor and the pieces it needs."""

    path: KeyPath
    target: torch.Tensor
    local: torch.Tensor
    pieces: list[Piece]
    #: The saved global shape (a plain saved tensor: its shape).
    global_shape: tuple[int, ...]
    dtype: str


@dataclass(slots=True)
class _Plan:
    value: int
    fills: list[_Fill] = field(default_factory=list)
    #: Index in the value rank's header -> the target it goes into (filled by resharding).
    filled: dict[int, torch.Tensor] = field(default_factory=dict)
    #: The value rank's blobs read whole for its plain values, and each blob's tensors.
    whole: set[int] = field(default_factory=set)
    members: dict[int, list[int]] = field(default_factory=dict)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    #: Per header read (by identity): key path -> index of its tensor.
    paths: dict[int, dict[KeyPath, int]] = field(default_factory=dict)
    #: Saved rank -> the pieces it holds; and, once its header is read, by blob, with the
    #: saved entry and the piece's bytes in it.
    by_source: dict[int, list[tuple[_Fill, Piece]]] = field(default_factory=dict)
    parts: dict[int, dict[int, list[tuple[_Fill, Piece, TensorEntry, int, int]]]] = field(
        default_factory=dict
    )


async def assemble(
    tiers: Tiers,
    origin: Callable[[int], Awaitable[Origin]],
    into: Any,
    *,
    rank: int,
    old_world: int,
    value_rank: ValueRank = None,
    local: frozenset[int] = frozenset(),
    tally: Tally | None = None,
) -> Assembled:
    """Rebuild new `rank`'s state from the step whose saved ranks `origin` gives (see the
    module docstring); `local`: the saved ranks whose copy is on this node's NVMe (preferred
    among the holders of a replicated part); `tally`: where the bytes read and the copies
    that failed are counted (also when this raises).

    Raises:
        LayoutMismatchError: a saved tensor does not fit its target (names the key path).
        ShardMissingError: a saved rank had no good copy left for a part this rank needs.
    """
    targets, loaders = flatten_targets(into) if into is not None else ({}, [])
    v = value_rank_of(value_rank, rank, old_world)
    plan = _Plan(v)
    tally = Tally() if tally is None else tally

    def pick(holders: list[int]) -> int:
        mine = [h for h in holders if h in local]
        return (mine or holders)[rank % len(mine or holders)]

    def need_value(head: Head) -> list[Span]:
        _plan(plan, head.header, targets, old_world, pick)
        spans = _spans(head.header, plan, v)
        for b in sorted(plan.whole):
            nbytes = head.header.blobs[b].nbytes
            spans.append(Span(b, 0, -(-nbytes // BLOCK_BYTES)))
        return blocks((s.blob, *s.byte_range(head.header.blobs[s.blob].nbytes)) for s in spans)

    def take_value(head: Head, span: Span, data: memoryview) -> None:
        if span.blob in plan.whole:
            _take_whole(head.header, plan, span.blob, data, targets)
        _take_pieces(plan, v, span, data)

    # The value rank's reads go on while the other saved ranks are read: they start once its
    # header gave the plan (all share one budget of read buffers).
    planned, budget = anyio.Event(), Budget()
    heads: list[Head] = []

    def need_then_go(head: Head) -> list[Span]:
        spans = need_value(head)
        planned.set()
        return spans

    async def value() -> None:
        heads.append(await read_parts(tiers, await origin(v), need_then_go, take_value, tally,
                                      budget=budget))  # fmt: skip

    lanes = anyio.Semaphore(_LANES)

    async def one(s: int) -> None:
        async with lanes:

            def need(h: Head) -> list[Span]:
                return _spans(h.header, plan, s)

            def take(h: Head, span: Span, data: memoryview) -> None:
                _take_pieces(plan, s, span, data)

            await read_parts(tiers, await origin(s), need, take, tally, budget=budget)

    async def others() -> None:
        await planned.wait()
        async with anyio.create_task_group() as tg:
            for s in sorted({p.source for f in plan.fills for p in f.pieces} - {v}):
                tg.start_soon(one, s)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(value)
            tg.start_soon(others)
    except BaseExceptionGroup as group:
        raise first_error(group) from group
    header = heads[0].header
    for i, e in enumerate(header.tensors):
        if plan.tensors[i] is None:  # (an empty blob: nothing was read)
            plan.tensors[i] = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
    state = decode_tree(header.tree, plan.tensors, f"rank {v} of step {header.step}")
    copied = {f.path for f in plan.fills} | {
        e.path for i, e in enumerate(header.tensors) if plan.tensors[i] is targets.get(e.path)
    }
    for obj, keypath in loaders:
        sub = _at(state, keypath)
        if isinstance(obj, torch.nn.Module) and _in_place(obj, sub, keypath, copied):
            continue
        obj.load_state_dict(sub)
    return Assembled(state, v, header, tally, len(copied))


def _plan(
    plan: _Plan,
    header: ShardHeader,
    targets: Mapping[KeyPath, torch.Tensor],
    old_world: int,
    pick: Callable[[list[int]], int],
) -> None:
    """What the value rank's header says each target needs (`plan`, filled once)."""
    if plan.tensors:
        return
    from torch.distributed.tensor import DTensor

    sharded = sharded_layouts(header)
    plan.tensors = [None] * len(header.tensors)
    for i, e in enumerate(header.tensors):
        plan.members.setdefault(e.blob, []).append(i)
        target = targets.get(e.path)
        se, mesh = sharded.get(i, (None, None))
        if target is None and se is not None and mesh and not stores_bytes(se, mesh):
            _replica(plan, i, e, se, mesh, old_world)
            continue
        if target is None or (se is None and not isinstance(target, DTensor)):
            if se is not None and tuple(e.shape) != tuple(se.global_shape):  # (a replica: whole)
                log.warning("reshard_without_target", path=list(e.path),
                            hint="comes back as the value rank's local shard")  # fmt: skip
            plan.whole.add(e.blob)
            continue
        global_shape = se.global_shape if se is not None else e.shape
        if tuple(target.shape) != tuple(global_shape) or target.dtype != getattr(torch, e.dtype):
            raise LayoutMismatchError(
                f"{_name(e.path)}: saved {e.dtype} {tuple(global_shape)}, target "
                f"{str(target.dtype).removeprefix('torch.')} {tuple(target.shape)}"
            )
        holders = (
            _saved_boxes(se, mesh, e, old_world, _name(e.path)) if se is not None and mesh
            else [(plan.value, full_box(e.shape))]
        )  # fmt: skip
        box, local = _target_box(target)
        # (a replica's bytes are in its writer's shard alone: the lowest of its holders)
        once = min if se is not None and se.writer >= 0 else pick
        pieces = overlaps(box, holders, pick=once) if local.numel() else []
        plan.fills.append(_Fill(e.path, target, local, pieces, tuple(global_shape), e.dtype))
        plan.filled[i] = target
        plan.tensors[i] = target


def _replica(
    plan: _Plan, i: int, e: TensorEntry, se: ShardedEntry, mesh: MeshEntry, old_world: int
) -> None:
    """A replica the value rank's shard holds no bytes of, without a target: its local shard
    (a new tensor, as a stored one would come back), read from the writer's shard."""
    local = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
    box = box_of(se.global_shape, mesh.shape, mesh.coordinate, se.placements)
    holders = _saved_boxes(se, mesh, e, old_world, _name(e.path))
    pieces = overlaps(box, holders, pick=min) if local.numel() else []
    plan.fills.append(_Fill(e.path, local, local, pieces, tuple(se.global_shape), e.dtype))
    plan.filled[i] = plan.tensors[i] = local


def _saved_boxes(
    se: ShardedEntry, mesh: MeshEntry, e: TensorEntry, old_world: int, name: str
) -> list[tuple[int, Box]]:
    """Every saved rank's box of the tensor `se` describes (from its mesh and placements)."""
    if math.prod(mesh.shape) != len(mesh.ranks) or any(not 0 <= r < old_world for r in mesh.ranks):
        raise LayoutMismatchError(
            f"{name}: saved mesh {mesh.shape} of ranks {mesh.ranks[:8]} does not fit "
            f"{old_world} ranks"
        )
    # (torch's offsets, as saved: an empty shard's is the dimension's size)
    own = local_box(se.global_shape, mesh.shape, mesh.coordinate, se.placements)
    if own != (tuple(se.offsets), tuple(e.shape)):
        raise LayoutMismatchError(
            f"{name}: saved local shard {tuple(e.shape)} at {tuple(se.offsets)} is not what its "
            f"placements {se.placements} give ({own})"
        )
    boxes = mesh_boxes(tuple(se.global_shape), tuple(mesh.shape), tuple(se.placements))
    return list(zip(mesh.ranks, boxes, strict=True))


def _target_box(target: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """The target's local shard in its global tensor, and its local tensor (written in place)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return full_box(target.shape), target
    mesh = target.device_mesh
    local = target.to_local()
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # (this rank is not in the target's mesh: nothing to hold)
        return full_box([0] * target.ndim), local
    box = box_of(target.shape, tuple(mesh.shape), coordinate, placements_of(target.placements))
    if box.shape != tuple(local.shape):
        raise LayoutMismatchError(f"a target's local shard {tuple(local.shape)} is not the "
                                  f"{box.shape} its placements give")  # fmt: skip
    return box, local


def _entry(plan: _Plan, header: ShardHeader, path: KeyPath, fill: _Fill) -> TensorEntry:
    """The saved tensor at `path` in a source's header, checked to be a piece of `fill`'s."""
    paths = plan.paths.get(id(header))
    if paths is None:
        paths = plan.paths[id(header)] = {e.path: i for i, e in enumerate(header.tensors)}
    i = paths.get(path, -1)
    if i < 0:
        raise LayoutMismatchError(f"{_name(path)}: not in rank {header.rank}'s shard")
    e = header.tensors[i]
    if e.dtype != fill.dtype or e.stride != _contiguous(e.shape) or e.offset:
        raise LayoutMismatchError(f"{_name(path)}: rank {header.rank}'s shard holds "
                                  f"{e.dtype} {e.shape} stride {e.stride}")  # fmt: skip
    se = sharded_layouts(header).get(i)
    global_shape = se[0].global_shape if se is not None else e.shape
    if tuple(global_shape) != fill.global_shape:
        raise LayoutMismatchError(f"{_name(path)}: rank {header.rank} saved global "
                                  f"shape {global_shape}, not {fill.global_shape}")  # fmt: skip
    return e


def _spans(header: ShardHeader, plan: _Plan, source: int) -> list[Span]:
    """The byte spans of `source`'s shard that hold its pieces, as whole merged blocks (and
    its pieces by blob, for `_take_pieces`)."""
    if not plan.by_source:
        for fill in plan.fills:
            for piece in fill.pieces:
                plan.by_source.setdefault(piece.source, []).append((fill, piece))
    parts: dict[int, list[tuple[_Fill, Piece, TensorEntry, int, int]]] = {}
    for fill, piece in plan.by_source.get(source, []):
        e = _entry(plan, header, fill.path, fill)
        lo, hi = piece.byte_span(e.shape, fill.local.element_size())
        parts.setdefault(e.blob, []).append((fill, piece, e, lo, hi))
    plan.parts[source] = parts
    return blocks((blob, lo, hi) for blob, got in parts.items() for *_, lo, hi in got)


def _take_pieces(plan: _Plan, source: int, span: Span, data: memoryview) -> None:
    """Copy every piece of `source` that lies in `span` (checked bytes) into its target."""
    start = span.first * BLOCK_BYTES
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
    for fill, piece, e, lo, hi in plan.parts.get(source, {}).get(span.blob, []):
        if start <= lo and hi <= start + len(data):
            copy_piece(piece, raw, start, e.shape, fill.local)


def _take_whole(
    header: ShardHeader,
    plan: _Plan,
    blob: int,
    data: memoryview,
    targets: Mapping[KeyPath, torch.Tensor],
) -> None:
    """The plain tensors of a blob read whole: into a target of their shape and dtype in
    place, else new (a copy: the read buffer is reused)."""
    if len(data) != header.blobs[blob].nbytes:
        raise ShardFormatError(f"rank {header.rank}", f"blob {blob} read in part")
    own = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else None
    for i in plan.members.get(blob, []):
        e = header.tensors[i]
        if i in plan.filled:
            continue
        view = (
            blob_view(own, e)
            if own is not None
            else torch.empty(e.shape, dtype=getattr(torch, e.dtype))
        )
        target = targets.get(e.path)
        if (
            target is not None
            and target.dtype == view.dtype
            and tuple(target.shape) == tuple(view.shape)
            and type(target) is torch.Tensor
        ):
            target.copy_(view)
            plan.tensors[i] = target
        else:
            plan.tensors[i] = view


def _in_place(module: torch.nn.Module, saved: Any, keypath: KeyPath, copied: set[KeyPath]) -> bool:
    """Whether every entry of the module's state went into its own tensors in place (its
    state dict's tensors are its parameters and buffers, which the targets alias)."""
    names = list(module.state_dict(keep_vars=True))
    if not isinstance(saved, Mapping) or set(saved) != set(names):
        return False
    live = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    state = module.state_dict(keep_vars=True)
    return all((*keypath, n) in copied and id(state[n]) in live for n in names)


def _at(state: Any, keypath: KeyPath) -> Any:
    for k in keypath:
        state = state[k]
    return state


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _name(path: KeyPath) -> str:
    return "/".join(map(str, path)) or "<root>"
