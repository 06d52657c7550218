"""What a resharded restore reads: which parts of which saved shards fill each target.

`plan_layout` plans from the step's global layout (`tierpipe.schemas.layout`, named by its
record) before any shard header is read: the value rank's sharded entries follow from it
(`steplayout.skeleton`), and so does every saved rank's box. `plan_header` plans from the
value rank's header: the plain tensors and values it holds (read whole), and, without a
layout, its sharded tensors too (the boxes of every saved shard follow from one
`ShardedEntry`: global shape, mesh, placements). Each target that is a DTensor (or a plain
tensor of the saved global shape) is a `Fill`: the pieces of the saved shards that overlap its
local shard (`layout.overlaps`). `check_layout` holds every header read afterwards to the
layout planned from, and `spans` turns a source's pieces into the whole blocks to read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import structlog
import torch

from tierpipe.errors import LayoutMismatchError
from tierpipe.reshard.layout import (
    Box,
    Piece,
    Span,
    blocks,
    box_of,
    full_box,
    overlaps,
    placements_of,
)
from tierpipe.reshard.steplayout import layout_digest, layout_of, mesh_boxes, skeleton
from tierpipe.schemas import MeshEntry, ShardedEntry, ShardHeader, TensorEntry
from tierpipe.schemas.layout import StepLayout
from tierpipe.state import KeyPath
from tierpipe.storage.shard import contiguous_strides, sharded_layouts
from tierpipe.storage.sharding import local_box, stores_bytes

__all__ = ("Fill", "Plan", "check_layout", "plan_header", "plan_layout", "spans")

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Fill:
    """One target filled from saved shards: its local tensor and the pieces it needs."""

    path: KeyPath
    target: torch.Tensor
    local: torch.Tensor
    pieces: list[Piece]
    #: The saved global shape (a plain saved tensor: its shape).
    global_shape: tuple[int, ...]
    dtype: str


@dataclass(slots=True)
class Plan:
    """What one rank reads of the saved shards and where it goes (`plan_layout`,
    `plan_header`, `spans` fill it in)."""

    #: The saved rank whose plain values this rank takes.
    value: int
    fills: list[Fill] = field(default_factory=list)
    #: Index in the value rank's header -> the target it goes into (filled by resharding).
    filled: dict[int, torch.Tensor] = field(default_factory=dict)
    #: The value rank's blobs read whole for its plain values, and each blob's tensors.
    whole: set[int] = field(default_factory=set)
    members: dict[int, list[int]] = field(default_factory=dict)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    #: Per header read (by identity): key path -> index of its tensor.
    paths: dict[int, dict[KeyPath, int]] = field(default_factory=dict)
    #: Saved rank -> once its header is read, its pieces by blob, with the saved entry and
    #: the piece's bytes in it.
    parts: dict[int, dict[int, list[tuple[Fill, Piece, TensorEntry, int, int]]]] = field(
        default_factory=dict
    )
    #: The fills planned from the step's layout before any header was read, by key path; and
    #: that layout's digest, which every header read must give (`check_layout`).
    early: dict[KeyPath, Fill] = field(default_factory=dict)
    layout: str = ""


def plan_header(
    plan: Plan,
    header: ShardHeader,
    targets: Mapping[KeyPath, torch.Tensor],
    old_world: int,
    pick: Callable[[list[int]], int],
) -> None:
    """What the value rank's header says each target needs (`plan`, filled once; a fill the
    layout planned already is taken as it is)."""
    if plan.tensors:
        return
    sharded = sharded_layouts(header)
    plan.tensors = [None] * len(header.tensors)
    for i, e in enumerate(header.tensors):
        plan.members.setdefault(e.blob, []).append(i)
        se, mesh = sharded.get(i, (None, None))
        fill = plan.early.get(e.path)
        if fill is None:
            fill = _fill_of(plan, e, se, mesh, targets.get(e.path), old_world, pick)
            if fill is not None:
                plan.fills.append(fill)
        if fill is None:
            plan.whole.add(e.blob)
        else:
            plan.filled[i] = plan.tensors[i] = fill.target


def plan_layout(
    plan: Plan,
    layout: StepLayout,
    targets: Mapping[KeyPath, torch.Tensor],
    old_world: int,
    pick: Callable[[list[int]], int],
) -> None:
    """The fills of the layout's tensors, planned before any header is read: the value
    rank's sharded entries follow from the layout (`steplayout.skeleton`)."""
    plan.layout = layout_digest(layout)
    header = skeleton(layout, job="", step=0, rank=plan.value, world_size=old_world)
    sharded = sharded_layouts(header)
    for i, e in enumerate(header.tensors):
        se, mesh = sharded[i]
        fill = _fill_of(plan, e, se, mesh, targets.get(e.path), old_world, pick, quiet=True)
        if fill is not None:
            plan.early[e.path] = fill
            plan.fills.append(fill)


def check_layout(plan: Plan, header: ShardHeader) -> None:
    """A header read after planning from the layout holds that layout (else the plan's
    byte ranges would not be its tensors').

    Raises:
        LayoutMismatchError: it does not.
    """
    if plan.layout and layout_digest(layout_of(header)) != plan.layout:
        raise LayoutMismatchError(
            f"rank {header.rank}'s shard of step {header.step} does not hold the layout "
            f"{plan.layout} its record names"
        )


def _fill_of(
    plan: Plan,
    e: TensorEntry,
    se: ShardedEntry | None,
    mesh: MeshEntry | None,
    target: torch.Tensor | None,
    old_world: int,
    pick: Callable[[list[int]], int],
    *,
    quiet: bool = False,
) -> Fill | None:
    """How the value rank's tensor `e` (with its sharded entry and mesh, if it has them) gets
    into its target: filled from saved shards, or None: its blob is read whole (a plain
    value, or a saved DTensor without a target: warned of unless `quiet`).

    Raises:
        LayoutMismatchError: it does not fit its target.
    """
    from torch.distributed.tensor import DTensor

    if target is None and se is not None and mesh and not stores_bytes(se, mesh):
        return _replica(e, se, mesh, old_world)
    if target is None or (se is None and not isinstance(target, DTensor)):
        if not quiet and se is not None and tuple(e.shape) != tuple(se.global_shape):
            log.warning("reshard_without_target", path=list(e.path),
                        hint="comes back as the value rank's local shard")  # fmt: skip
        return None
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
    return Fill(e.path, target, local, pieces, tuple(global_shape), e.dtype)


def _replica(e: TensorEntry, se: ShardedEntry, mesh: MeshEntry, old_world: int) -> Fill:
    """A replica the value rank's shard holds no bytes of, without a target: its local shard
    (a new tensor, as a stored one would come back), read from the writer's shard."""
    local = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
    box = box_of(se.global_shape, mesh.shape, mesh.coordinate, se.placements)
    holders = _saved_boxes(se, mesh, e, old_world, _name(e.path))
    pieces = overlaps(box, holders, pick=min) if local.numel() else []
    return Fill(e.path, local, local, pieces, tuple(se.global_shape), e.dtype)


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


def _entry(plan: Plan, header: ShardHeader, path: KeyPath, fill: Fill) -> TensorEntry:
    """The saved tensor at `path` in a source's header, checked to be a piece of `fill`'s."""
    paths = plan.paths.get(id(header))
    if paths is None:
        paths = plan.paths[id(header)] = {e.path: i for i, e in enumerate(header.tensors)}
    i = paths.get(path, -1)
    if i < 0:
        raise LayoutMismatchError(f"{_name(path)}: not in rank {header.rank}'s shard")
    e = header.tensors[i]
    if e.dtype != fill.dtype or e.stride != contiguous_strides(e.shape) or e.offset:
        raise LayoutMismatchError(f"{_name(path)}: rank {header.rank}'s shard holds "
                                  f"{e.dtype} {e.shape} stride {e.stride}")  # fmt: skip
    se = sharded_layouts(header).get(i)
    global_shape = se[0].global_shape if se is not None else e.shape
    if tuple(global_shape) != fill.global_shape:
        raise LayoutMismatchError(f"{_name(path)}: rank {header.rank} saved global "
                                  f"shape {global_shape}, not {fill.global_shape}")  # fmt: skip
    return e


def spans(header: ShardHeader, plan: Plan, source: int) -> list[Span]:
    """The byte spans of `source`'s shard that hold its pieces, as whole merged blocks (and
    its pieces by blob, for `_take_pieces`)."""
    parts: dict[int, list[tuple[Fill, Piece, TensorEntry, int, int]]] = {}
    for fill, piece in [(f, p) for f in plan.fills for p in f.pieces if p.source == source]:
        e = _entry(plan, header, fill.path, fill)
        lo, hi = piece.byte_span(e.shape, fill.local.element_size())
        parts.setdefault(e.blob, []).append((fill, piece, e, lo, hi))
    plan.parts[source] = parts
    return blocks((blob, lo, hi) for blob, got in parts.items() for *_, lo, hi in got)


def _name(path: KeyPath) -> str:
    return "/".join(map(str, path)) or "<root>"
