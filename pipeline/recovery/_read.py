"""From a sealed shard's verified blobs to the caller's tensors (the private half of `load`).

The bytes come from a store's `read_into` (`tierpipe.storage`: its read-and-hash engine hands
on each blob once its digest matched). `Match` pairs the saved tensors with the caller's
targets; a blob whose tensors all go into targets only passes through (the NVMe reader stages it
in a reused arena, which `Assembly.pin` page-locks for asynchronous copies to a GPU) and is
copied into them in place; any other blob's memory becomes the returned tensors without a copy.
A DTensor target of the saved layout receives its shard into its local tensor; one of another
layout is a `LayoutMismatchError` (a resharded restore's business, not this one's), and so is a
target of a replica this shard holds no bytes of (its writer's); without a target, such a
replica comes back as a meta tensor (shape and dtype, no data: never other bytes).
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tierpipe.schemas import ShardHeader, TensorEntry
from tierpipe.state import KeyPath, blob_view, flatten_targets, local_target, rebuild_state
from tierpipe.storage.pinned import page_lock, page_unlock
from tierpipe.storage.shard import Head, sharded_layouts
from tierpipe.storage.sharding import stored_elsewhere
from tierpipe.tree import is_dtensor

__all__: tuple[str, ...] = ()  # private to tierpipe.recovery: `load` is the entry


def as_tensor(buf: Any, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def _alone(data: memoryview, e: TensorEntry) -> torch.Tensor:
    """The tensor alone in blob `data`: it fills the blob exactly, contiguous (the header was
    checked so: `tierpipe.storage.shard`), so it is the blob's bytes seen in its dtype and shape."""
    dtype = getattr(torch, e.dtype)
    if not len(data):  # (elements but no bytes: a replica its writer stored; no value here)
        return torch.empty(e.shape, dtype=dtype, device="meta" if math.prod(e.shape) else None)
    t = torch.frombuffer(data, dtype=dtype)
    return t if len(e.shape) == 1 else t.view(e.shape)


class Match:
    """The caller's targets matched to the saved tensors: key path, shape and dtype equal (for
    a DTensor target: the saved layout; its local tensor is the target).

    Raises:
        LayoutMismatchError: a DTensor target whose layout is not the saved one, or a saved
            tensor and its target of which only one is sharded (names the key path and both).
    """

    def __init__(self, header: ShardHeader, into: Any) -> None:
        targets, self.loaders = flatten_targets(into) if into is not None else ({}, [])
        if (elsewhere := stored_elsewhere(header, targets)) is not None:
            raise elsewhere  # (a replica another rank wrote, into a target: reshard it)
        layouts = sharded_layouts(header)
        self.targets: list[torch.Tensor | None] = []
        #: What the state returned holds for a tensor with a target: the target itself (for a
        #: DTensor, not its local tensor).
        self.values: dict[int, torch.Tensor] = {}
        for index, e in enumerate(header.tensors):
            t = targets.get(e.path)
            if t is not None and (index in layouts or is_dtensor(t)):
                self.values[index] = t
                t = local_target(t, e, layouts.get(index))
            ok = (
                t is not None
                and t.dtype == getattr(torch, e.dtype)
                and tuple(t.shape) == tuple(e.shape)
            )
            self.targets.append(t if ok else None)
        #: Per blob: every tensor in it goes into a target, so its bytes are only passing through.
        self.staged = [True] * len(header.blobs)
        for e, t in zip(header.tensors, self.targets, strict=True):
            if t is None:
                self.staged[e.blob] = False
        self.cuda_devices = {t.device for t in self.targets if t is not None and t.is_cuda}


class Assembly:
    """A `BlobSink` (`tierpipe.storage.store`) that rebuilds the saved state from verified blobs:
    a tensor with a matching target is copied into it in place (asynchronously into CUDA
    targets, from page-locked memory), any other is a view of its blob's memory. `result` is
    the state, and how many tensors went into targets in place; objects with
    `load_state_dict()` among the targets get their part loaded."""

    def __init__(self, into: Any, check_head: Callable[[Head, str], None]) -> None:
        self._into, self._check_head = into, check_head
        self.result: tuple[Any, int] | None = None

    def accept(self, head: Head, location: str) -> list[bool]:
        self._check_head(head, location)
        self._head, self._path = head, location
        self._match = Match(head.header, self._into)
        self._by_blob: dict[int, list[int]] = {}
        for index, e in enumerate(head.header.tensors):
            self._by_blob.setdefault(e.blob, []).append(index)
        self._restored: list[torch.Tensor | None] = [None] * len(head.header.tensors)
        self._copied: dict[KeyPath, torch.Tensor] = {}
        return self._match.staged

    @contextlib.contextmanager
    def pin(self, ring: mmap.mmap) -> Iterator[None]:
        # This runs on a helper thread, whose current device is 0: register in the targets'
        # device context, or every rank of a node would create a context on GPU 0.
        devices = self._match.cuda_devices
        device = min(devices, key=lambda d: d.index or 0, default=None)
        pinned = device is not None and page_lock(ring, what="restore arena", device=device)
        try:
            yield
        finally:
            if pinned:
                self._synchronize()
                page_unlock(ring, device=device)

    def take(self, index: int, data: memoryview, *, reused: bool) -> None:
        header = self._head.header
        members = self._by_blob.get(index, [])
        if len(members) == 1 and self._match.targets[members[0]] is None:
            (t,) = members  # (most blobs: one torch call, not three, for each of them)
            self._restored[t] = _alone(data, header.tensors[t])
            return
        blob = as_tensor(data, len(data))
        for t in members:
            e, target = header.tensors[t], self._match.targets[t]
            view = blob_view(blob, e)
            if target is None:
                self._restored[t] = view
                continue
            target.copy_(view, non_blocking=target.is_cuda)
            value = self._match.values.get(t, target)
            self._restored[t] = self._copied[e.path] = value
        if reused:
            self._synchronize()  # the copies out of `data` are done before it is overwritten

    def finish(self) -> None:
        self._synchronize()
        state = rebuild_state(self._head.header, [], self._path, tensors=self._restored)
        for obj, keypath in self._match.loaders:
            sub = _at(state, keypath)
            if isinstance(obj, torch.nn.Module) and _restored_in_place(
                obj, sub, keypath, self._copied
            ):
                continue  # every entry was copied into the module's own parameters and buffers
            obj.load_state_dict(sub)
        self.result = (state, len(self._copied))

    def _synchronize(self) -> None:
        for device in self._match.cuda_devices:
            torch.cuda.current_stream(device).synchronize()


def _restored_in_place(
    module: torch.nn.Module, saved: Any, keypath: KeyPath, copied: dict[KeyPath, torch.Tensor]
) -> bool:
    """Whether every entry of the module's state dict went into a tensor that provably IS one
    of its live parameters or buffers (same memory, shape, stride and dtype), and the saved
    entries are exactly those (`load_state_dict` reports missing and unexpected keys).

    `state_dict()` may return copies (FSDP full state dicts, hooks that clone or cast) or
    entries that are no tensor of the module (`_extra_state`); bytes copied into those never
    reach the module, so anything short of proof means calling `load_state_dict`.
    """
    live: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    live.update(module.named_buffers(remove_duplicate=False))
    names = list(module.state_dict(keep_vars=True))
    if not isinstance(saved, Mapping) or set(saved) != set(names):
        return False
    for name in names:
        target, own = copied.get((*keypath, name)), live.get(name)
        if target is None or own is None or not _same_tensor(target, own):
            return False
    return bool(names) or not live


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if is_dtensor(a) or is_dtensor(b):
        return (
            is_dtensor(a)
            and is_dtensor(b)
            and a.placements == b.placements  # type: ignore[attr-defined]
            and a.device_mesh == b.device_mesh  # type: ignore[attr-defined]
            and a.shape == b.shape
            and _same_tensor(a.to_local(), b.to_local())  # type: ignore[attr-defined]
        )
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _at(state: Any, keypath: KeyPath) -> Any:
    for k in keypath:
        state = state[k]
    return state
