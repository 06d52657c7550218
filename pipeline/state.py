"""Training state <-> shard image: flatten nested state into a header plus raw blobs, and back.

A state is what `Checkpointer.save()` accepts: dicts (str or int keys), lists, tuples, tensors,
numpy arrays, plain values (None, bool, int, float, str, bytes), numpy scalars, `torch.Size`,
`torch.dtype`, `torch.device`, and objects with `state_dict()` (modules, optimizers, schedulers),
which are stored as their state dict. The structure and plain values go into the header as msgpack
(the state tree: `tierpipe.tree`); every tensor becomes a view of a blob. Tensors that share
storage share one blob and come back sharing it (tied weights stay tied); any other tensor is
stored compact and comes back contiguous. A DTensor is stored as its local shard, in a blob of its
own with a digest per 1 MiB block (a resharded restore reads parts of it), and its global layout
(`ShardHeader.sharded`, its mesh listed once in `ShardHeader.meshes`). A replicated value is
stored once per job: of the ranks whose local shards are the same box, only the writer (the
lowest rank, `ShardedEntry.writer`) stores its bytes; the others store the entry with an empty
blob, and restore it from the writer's shard (`tierpipe.reshard`). Tensors under the top-level
keys a save declares `replicated` (a DDP job's model: the same on every rank) are such values: a
DTensor replicated over a 1-D mesh of the whole world, written by rank 0. No pickle: a shard
holds data only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierpipe.errors import LayoutMismatchError, UnsupportedStateError
from tierpipe.schemas import BlobEntry, MeshEntry, ShardedEntry, ShardHeader, TensorEntry
from tierpipe.storage.shard import (
    DTYPE_SIZES,
    align_up,
    blocks_nbytes,
    contiguous_strides,
    encode_head,
    sharded_layouts,
)
from tierpipe.storage.sharding import declare_replicated, stored_elsewhere, stores_bytes
from tierpipe.tree import (
    KeyPath,
    decode_tree,
    describe_dtensor,
    dtype_name,
    encode_tree,
    is_dtensor,
)

__all__ = (
    "Layout",
    "StatePlan",
    "blob_view",
    "flatten_targets",
    "gc_paused",
    "layout_mismatch",
    "local_target",
    "plan_state",
    "rebuild_state",
    "tensor_buffer",
)

_ZERO = bytes(16)


class _GcPause:
    """`gc_paused`'s count of the blocks under way (threads may overlap)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._blocks:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._blocks += 1
        try:
            yield
        finally:
            with self._lock:
                self._blocks -= 1
                if not self._blocks and self._was_enabled:
                    gc.enable()


#: Holds off Python's cyclic garbage collector while the block runs (nested and concurrent
#: blocks: until the last ends). Flattening or rebuilding a state creates objects per tensor,
#: and each collection walks them all: with 200,000 tensors, collections were half of a
#: save's plan and of a restore (measured). Nothing these blocks make is a cycle to collect.
gc_paused = _GcPause()


@dataclass(frozen=True, slots=True)
class _Copy:
    offset: int  # in the image
    nbytes: int
    src: torch.Tensor
    raw: bool  # src is a uint8 view of a shared storage's byte span


@dataclass(frozen=True, slots=True)
class StatePlan:
    """Where every byte of one state goes in a shard image."""

    header: ShardHeader
    #: Unsealed prefix + header + padding: the first `len(head)` bytes of the image.
    head: bytes
    #: Size of the whole image.
    nbytes: int
    copies: tuple[_Copy, ...]
    #: CUDA devices the state's tensors live on (empty for a CPU-only state).
    cuda_devices: frozenset[torch.device]
    #: Where each copy lands, as (offset, nbytes, dtype, shape): equal layouts can reuse the
    #: destination views of an earlier save into the same image.
    layout: tuple[tuple[int, int, torch.dtype, tuple[int, ...]], ...]

    @property
    def tensor_nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def destinations(self, image: torch.Tensor) -> list[torch.Tensor]:
        """Views of `image` (a CPU uint8 tensor of at least `nbytes`) that the copies fill."""
        dsts = []
        with gc_paused():
            for c in self.copies:
                dst = image[c.offset : c.offset + c.nbytes]
                dsts.append(dst if c.raw else dst.view(c.src.dtype).view(c.src.shape))
        return dsts

    def copy_into(
        self,
        dsts: list[torch.Tensor],
        *,
        device: torch.device | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Copy the tensors' bytes into their `destinations()`.

        The head is not written here: the caller owns the image's buffer. `device` limits the
        copy to tensors on that device. With `non_blocking`, copies from CUDA tensors are queued
        on the current stream and the caller synchronises.
        """
        for c, dst in zip(self.copies, dsts, strict=True):
            if device is None or c.src.device == device:
                dst.copy_(c.src, non_blocking=non_blocking)

    def copy_cpu_serially(self, dsts: list[torch.Tensor]) -> None:
        """`copy_into` for the CPU tensors, on the calling thread alone: a plain memmove per
        contiguous tensor (it releases the GIL), `copy_` for the rest. For an overlapped copy on
        a helper thread: torch's own copy would start an OpenMP team there, whose threads spin
        against the training threads' long after the copy (measured: +20 % on a 2-core
        training run with a save every 50 steps; `bench overhead`)."""
        for c, dst in zip(self.copies, dsts, strict=True):
            src = c.src
            if src.device.type != "cpu":
                continue
            if (
                src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
                and not src.is_conj() and not src.is_neg() and c.nbytes
                == src.numel() * src.element_size()
            ):  # fmt: skip
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), c.nbytes)
            else:
                dst.copy_(src)


def plan_state(
    state: Any, *, job: str, step: int, rank: int, world_size: int, node: str, epoch: int = 0,
    replicated: frozenset[str] = frozenset(),
) -> StatePlan:  # fmt: skip
    """Flatten `state` and lay it out as a shard image. `replicated`: the top-level keys of
    `state` whose tensors are the same on every rank (see the module docstring).

    Raises:
        UnsupportedStateError: a value cannot be stored without pickle (names its key path).
    """
    with gc_paused():
        return _plan_state(
            state, job=job, step=step, rank=rank, world_size=world_size, node=node, epoch=epoch,
            replicated=replicated,
        )  # fmt: skip


def _plan_state(
    state: Any, *, job: str, step: int, rank: int, world_size: int, node: str, epoch: int,
    replicated: frozenset[str],
) -> StatePlan:  # fmt: skip
    tree_bytes, tensors, paths, sharded, meshes = encode_tree(state)
    if replicated:
        shapes = [tuple(t.shape) for t in tensors]
        sharded, meshes = declare_replicated(replicated, shapes, paths, sharded, meshes,
                                             rank=rank, world=world_size)  # fmt: skip
    # A local shard gets a blob of its own, so its block digests describe exactly its bytes;
    # a replica another rank writes gets an empty one.
    own = {s.tensor for s in sharded}
    elsewhere = {s.tensor for s in sharded if not stores_bytes(s, meshes[s.mesh])}

    groups: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        shareable = t.numel() > 0 and not (t.is_conj() or t.is_neg()) and i not in own
        key = (t.device, t.untyped_storage().data_ptr()) if shareable else ("own", i)
        groups.setdefault(key, []).append(i)

    entries: list[TensorEntry | None] = [None] * len(tensors)
    blobs: list[BlobEntry] = []
    copies: list[tuple[int, int, torch.Tensor, bool]] = []  # (blob, nbytes, src, raw)
    offset = 0
    for members in groups.values():
        blob = len(blobs)
        if len(members) == 1:
            t = tensors[members[0]]
            nbytes = 0 if members[0] in elsewhere else t.numel() * t.element_size()
            entries[members[0]] = TensorEntry(
                paths[members[0]],
                dtype_name(t.dtype),
                tuple(t.shape),
                contiguous_strides(t.shape),
                blob,
                0,
            )
            src, raw = t, False
        else:
            first = tensors[members[0]]
            spans = [(_byte_span(tensors[i]), i) for i in members]
            start = min(s for (s, _), _ in spans) // 16 * 16
            end = max(e for (_, e), _ in spans)
            nbytes = end - start
            for (s, _), i in spans:
                t = tensors[i]
                entries[i] = TensorEntry(
                    paths[i],
                    dtype_name(t.dtype),
                    tuple(t.shape),
                    tuple(t.stride()),
                    blob,
                    (s - start) // t.element_size(),
                )
            src = torch.empty(0, dtype=torch.uint8, device=first.device)
            src.set_(first.untyped_storage(), start, (nbytes,), (1,))
            raw = True
        blocks = bytes(blocks_nbytes(nbytes)) if members[0] in own else b""
        blobs.append(BlobEntry(offset, nbytes, _ZERO, blocks))
        copies.append((blob, nbytes, src, raw))
        offset = align_up(offset + nbytes)

    header = ShardHeader(
        job=job,
        step=step,
        rank=rank,
        world_size=world_size,
        node=node,
        created=time.time(),
        epoch=epoch,
        tree=tree_bytes,
        tensors=tuple(e for e in entries if e is not None),
        blobs=tuple(blobs),
        meshes=tuple(meshes),
        sharded=tuple(sharded),
    )
    head = encode_head(header, sealed=False)
    data_offset = len(head)
    plan_copies = tuple(
        _Copy(data_offset + blobs[b].offset, n, src, raw) for b, n, src, raw in copies if n
    )
    return StatePlan(
        header=header,
        head=head,
        nbytes=data_offset + align_up(offset),
        copies=plan_copies,
        cuda_devices=frozenset(t.device for t in tensors if t.is_cuda),
        layout=tuple((c.offset, c.nbytes, c.src.dtype, tuple(c.src.shape)) for c in plan_copies),
    )


def rebuild_state(
    header: ShardHeader,
    blobs: list[torch.Tensor],
    path: str = "<shard>",
    *,
    tensors: list[torch.Tensor | None] | None = None,
) -> Any:
    """Rebuild the saved state from its header and one uint8 tensor per blob (or from the
    tensors already built, one per header entry).

    Tensors are views of the blob tensors (no copy); tensors that shared a blob share storage.
    """
    if tensors is not None:
        return decode_tree(header.tree, tensors, path)
    return decode_tree(header.tree, [blob_view(blobs[e.blob], e) for e in header.tensors], path)


def blob_view(blob: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """Entry `e`'s tensor as a view of its blob's uint8 tensor (no copy). The layout was
    checked against the blob when the header was parsed (`tierpipe.storage.shard`)."""
    t = torch.empty(0, dtype=getattr(torch, e.dtype))  # e.dtype was checked against DTYPE_SIZES
    base = blob.storage_offset() // DTYPE_SIZES[e.dtype]
    return t.set_(blob.untyped_storage(), base + e.offset, e.shape, e.stride)


def flatten_targets(into: Any) -> tuple[dict[KeyPath, torch.Tensor], list[tuple[Any, KeyPath]]]:
    """Key path -> tensor for every tensor in `into` (objects with `state_dict()` contribute
    their state's tensors, which alias their parameters; a DTensor stays one), and the objects
    with `load_state_dict()` with their key paths, outermost first. A fresh optimizer of DTensor
    parameters gets its state first (`_init_sharded_optimizer`)."""
    targets: dict[KeyPath, torch.Tensor] = {}
    loaders: list[tuple[Any, KeyPath]] = []

    def walk(v: Any, path: KeyPath) -> None:
        if isinstance(v, torch.Tensor):
            targets[path] = v.detach()
        elif isinstance(v, Mapping):
            for k, item in v.items():
                walk(item, (*path, k))
        elif isinstance(v, list | tuple):
            for i, item in enumerate(v):
                walk(item, (*path, i))
        elif callable(getattr(v, "state_dict", None)):
            if callable(getattr(v, "load_state_dict", None)):
                loaders.append((v, path))
            if isinstance(v, torch.optim.Optimizer):
                _init_sharded_optimizer(v)
            walk(v.state_dict(), path)

    walk(into, ())
    return targets, loaders


def _init_sharded_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer of DTensor parameters its state (as DCP does before a load: one
    step with zero gradients and a zero learning rate), so its DTensor states are targets the
    saved shards go into in place. Without them, the shards would come back as plain local
    tensors, which such an optimizer cannot step with."""
    if optimizer.state or not any(
        is_dtensor(p) for group in optimizer.param_groups for p in group["params"]
    ):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


#: A sharded tensor's layout and the mesh it lies on (`storage.shard.sharded_layouts`).
Layout = tuple[ShardedEntry, MeshEntry]


def local_target(target: torch.Tensor, e: TensorEntry, saved: Layout | None) -> torch.Tensor:
    """The tensor a saved tensor (entry `e`, with its layout and mesh `saved` if it is a local
    shard) goes into in place, where it or its target is sharded: a DTensor target's local tensor,
    where the target has the saved layout (global shape, mesh shape, placements and this
    rank's box in the global tensor) and dtype; or, where both the saved tensor and the target
    hold the whole global tensor (a plain tensor, a replicated DTensor, a DTensor on a mesh of
    one), the target's (local) tensor. The one rule both the in-place restore and the choice
    to reshard (`layout_mismatch`) follow.

    Raises:
        LayoutMismatchError: any other pairing (names the key path and both layouts).
    """
    if is_dtensor(target):
        try:
            local, layout, mesh = describe_dtensor(target, e.path)
        except UnsupportedStateError as err:
            where = "/".join(map(str, e.path)) or "<root>"
            raise LayoutMismatchError(f"{where}: the target's layout: {err.reason}") from err
        target_text = _layout_text((layout, mesh), tuple(local.shape))
        mine: Layout | None = (layout, mesh)
    else:
        local, mine = target, None
        target_text = f"a plain tensor of shape {tuple(target.shape)}"
    fits = tuple(local.shape) == e.shape and local.dtype == getattr(torch, e.dtype)
    if fits and (_same_layout(saved, mine) or (_whole(saved, e.shape) and _whole(mine, e.shape))):
        return local
    saved_text = _layout_text(saved, e.shape) if saved else f"a plain tensor of shape {e.shape}"
    raise LayoutMismatchError(
        f"{'/'.join(map(str, e.path)) or '<root>'}: saved as {saved_text} ({e.dtype}), the "
        f"target is {target_text} ({str(local.dtype).removeprefix('torch.')})"
    )


def _same_layout(a: Layout | None, b: Layout | None) -> bool:
    return (
        a is not None
        and b is not None
        and (a[0].global_shape, a[0].offsets, a[1].shape, a[0].placements)
        == (b[0].global_shape, b[0].offsets, b[1].shape, b[0].placements)
    )


def _whole(s: Layout | None, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` with layout `s` (None: plain) is its whole global tensor."""
    return s is None or (s[0].global_shape == shape and not any(s[0].offsets))


def _layout_text(layout: Layout, shape: tuple[int, ...]) -> str:
    s, mesh = layout
    return (
        f"a shard of shape {tuple(shape)} at {s.offsets} of a {s.global_shape} DTensor, "
        f"placements {'/'.join(s.placements)} on a {'x'.join(map(str, mesh.shape))} mesh"
    )


def layout_mismatch(header: ShardHeader, into: Any) -> LayoutMismatchError | None:
    """The first saved tensor of `header` that cannot go into its target in `into` in place
    (`local_target`), where it or its target is sharded, or whose bytes this shard does not
    hold (`stored_elsewhere`); None where every one can (the in-place restore then loads the
    shard, else it has to be resharded)."""
    if (elsewhere := stored_elsewhere(header)) is not None:
        return elsewhere
    targets, _ = flatten_targets(into) if into is not None else ({}, [])
    layouts = sharded_layouts(header)
    for index, e in enumerate(header.tensors):
        t = targets.get(e.path)
        if t is not None and (index in layouts or is_dtensor(t)):
            try:
                local_target(t, e, layouts.get(index))
            except LayoutMismatchError as err:
                return err
    return None


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (keep `t` alive while using it)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return int(start), int(start + extent * t.element_size())
