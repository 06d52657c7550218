"""One rank's state, assembled from parts of the shards another world (or mesh) saved.

`assemble` plans (`tierpipe.reshard.planning`) which saved shards fill each target that is a
DTensor (or a plain tensor of the saved global shape): from the step's global layout where its
record names one, before any shard header is read, and every saved rank that holds a needed
part is read at once, the value rank among them (`value_rank`: by default new rank r takes
saved rank `r % old_world`'s values); without a layout (an older step), from the head of the
value rank, the others read once it gave the plan (while its own parts are still read). Every
other tensor and plain value comes from the value rank's shard (its head read in either case:
the tree, the plain tensors). Reads are `reads.read_parts`: whole blocks, each checked; every
header read must hold the layout planned from. The parts are copied into the targets' local
tensors in place. Objects with `load_state_dict()` among the
targets get their state loaded, unless every entry of a module's state went into its own
tensors in place.

A saved DTensor without a target comes back as the value rank's local shard (a plain tensor):
there is no new layout to reshard it into (an optimizer's state must exist, e.g. after one
step, to be resharded into). A replica is read from its writer's shard only (the lowest rank
holding its box: `ShardedEntry.writer`), the one that stored its bytes; so is the value rank's
own local shard where that rank stored none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
import torch
from anyio.abc import TaskGroup

from tierpipe.errors import LayoutMismatchError, ShardFormatError
from tierpipe.reshard.buffers import Budget, first_error
from tierpipe.reshard.layout import Span, blocks, copy_piece
from tierpipe.reshard.planning import Plan, check_layout, plan_header, plan_layout, spans
from tierpipe.reshard.reads import Origin, Tally, Tiers, read_parts
from tierpipe.schemas import BLOCK_BYTES, ShardHeader
from tierpipe.schemas.layout import StepLayout
from tierpipe.state import KeyPath, blob_view, flatten_targets
from tierpipe.storage.shard import Head
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
    layout: StepLayout | None = None,
) -> Assembled:
    """Rebuild new `rank`'s state from the step whose saved ranks `origin` gives (see the
    module docstring); `local`: the saved ranks whose copy is on this node's NVMe (preferred
    among the holders of a replicated part); `tally`: where the bytes read and the copies
    that failed are counted (also when this raises); `layout`: the step's global layout
    (its record's), planned from before any header is read.

    Raises:
        LayoutMismatchError: a saved tensor does not fit its target (names the key path).
        ShardMissingError: a saved rank had no good copy left for a part this rank needs.
    """
    targets, loaders = flatten_targets(into) if into is not None else ({}, [])
    v = value_rank_of(value_rank, rank, old_world)
    plan = Plan(v)
    tally = Tally() if tally is None else tally

    def pick(holders: list[int]) -> int:
        mine = [h for h in holders if h in local]
        return (mine or holders)[rank % len(mine or holders)]

    if layout is not None:
        plan_layout(plan, layout, targets, old_world, pick)

    def need_value(head: Head) -> list[Span]:
        check_layout(plan, head.header)
        plan_header(plan, head.header, targets, old_world, pick)
        wanted = spans(head.header, plan, v)
        for b in sorted(plan.whole):
            nbytes = head.header.blobs[b].nbytes
            wanted.append(Span(b, 0, -(-nbytes // BLOCK_BYTES)))
        return blocks((s.blob, *s.byte_range(head.header.blobs[s.blob].nbytes)) for s in wanted)

    def take_value(head: Head, span: Span, data: memoryview) -> None:
        if span.blob in plan.whole:
            _take_whole(head.header, plan, span.blob, data, targets)
        _take_pieces(plan, v, span, data)

    # The value rank's reads go on while the other saved ranks are read: they start at once
    # where the layout gave the plan, else once the value rank's header did (all share one
    # budget of read buffers).
    planned, budget = anyio.Event(), Budget()
    heads: list[Head] = []
    started: set[int] = {v}

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
                check_layout(plan, h.header)
                return spans(h.header, plan, s)

            def take(h: Head, span: Span, data: memoryview) -> None:
                _take_pieces(plan, s, span, data)

            await read_parts(tiers, await origin(s), need, take, tally, budget=budget)

    def start(tg: TaskGroup) -> None:
        for s in sorted({p.source for f in plan.fills for p in f.pieces} - started):
            started.add(s)
            tg.start_soon(one, s)

    async def others() -> None:
        async with anyio.create_task_group() as tg:
            if layout is not None:
                start(tg)
                log.debug("reshard_planned", rank=rank, planned_from="layout",
                          heads_read=tally.heads, sources=len(started))  # fmt: skip
            await planned.wait()
            if layout is None:
                log.debug("reshard_planned", rank=rank, planned_from="header",
                          heads_read=tally.heads, sources=len(started))  # fmt: skip
            start(tg)  # (the value rank's header may name more: plain tensors into DTensors)

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


def _take_pieces(plan: Plan, source: int, span: Span, data: memoryview) -> None:
    """Copy every piece of `source` that lies in `span` (checked bytes) into its target."""
    start = span.first * BLOCK_BYTES
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
    for fill, piece, e, lo, hi in plan.parts.get(source, {}).get(span.blob, []):
        if start <= lo and hi <= start + len(data):
            copy_piece(piece, raw, start, e.shape, fill.local)


def _take_whole(
    header: ShardHeader,
    plan: Plan,
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
