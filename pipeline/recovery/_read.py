"""From a sealed shard's bytes to the caller's tensors (the private half of `load`).

The data region is read by `queue_depth` threads in chunks of up to `chunk_bytes`, each blob's
xxh3-128 computed as its chunks arrive. A blob whose tensors all go into targets is read into a
reusable arena and copied into them in place only once its digest matched; any other blob is
read into its own buffer, which becomes the returned tensor without a copy. Reading runs ahead
of hashing and copying as far as the arena allows: os.preadv and torch's copies release the
GIL, and xxh3 hashes at ~20 GB/s.

Reads go through the page cache by default (kernel readahead under the threads' reads), or use
O_DIRECT (`direct_io`). The pages stay cached: clean pages the kernel reclaims first; dropping
them (POSIX_FADV_DONTNEED) measured as costly as a third of the reads here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from tierpipe.errors import IntegrityError, ShardFormatError
from tierpipe.pinned import page_lock, page_unlock
from tierpipe.schemas import ShardHeader
from tierpipe.shard import Head
from tierpipe.state import KeyPath, blob_view, flatten_targets, rebuild_state
from tierpipe.storage.aligned import aligned_buffer, pread_into, round_up

__all__: tuple[str, ...] = ()  # private to tierpipe.recovery: `load` is the entry

#: The smallest restore arena (see `_Layout`).
ARENA_MIN_BYTES = 64 << 20


@dataclass(slots=True)
class _Read:
    """One read of a contiguous file range into contiguous memory."""

    file_offset: int
    buffer: Any  # the arena or a blob's own buffer (a writable buffer object)
    buffer_offset: int
    length: int  # a multiple of 4 KiB
    needed: int  # bytes that must arrive (the rest is padding, or past the end of the file)
    vend: int  # virtual arena end it overwrites (0: not in the arena)
    pieces: list[tuple[int, int, int]]  # (blob, offset in buffer, bytes), in file order


class _Layout:
    """Where every blob lands and the reads that put it there.

    Blobs whose tensors all go into targets are staged in an arena: a ring of reusable memory,
    placed in file order, each blob contiguous and only overwritten once its tensors were copied
    out (positions are virtual, growing by laps, so "free" is one number). It is sized to hold
    the largest such blob plus two queue depths of reads, so copies overlap reads; a restore into
    preallocated targets touches fresh memory only for the arena, which matters as much as the
    disk when page faults cost ~0.5 s/GiB (virtual machines). Other blobs get their own buffer,
    which becomes the returned tensor without a copy. Reads are coalesced across adjacent blobs
    up to `chunk` bytes.
    """

    def __init__(self, head: Head, staged: list[bool], depth: int, chunk: int) -> None:
        blobs = head.header.blobs
        sizes = [round_up(b.nbytes) for b in blobs]
        largest = max((n for n, a in zip(sizes, staged, strict=True) if a), default=0)
        total = sum(n for n, a in zip(sizes, staged, strict=True) if a)
        self.arena_bytes = min(total, max(ARENA_MIN_BYTES, largest + 2 * depth * chunk))
        self.arena = aligned_buffer(self.arena_bytes) if self.arena_bytes else None
        self.views: list[torch.Tensor | None] = [None] * len(blobs)
        #: Per staged blob: the virtual position up to which the arena is free once it was
        #: copied out (its end, or past the padding to the next lap when the next one wraps).
        self.frees = [0] * len(blobs)
        self.reads: list[_Read] = []
        arena_t = torch.frombuffer(self.arena, dtype=torch.uint8) if self.arena else None
        cursor, last = 0, -1  # virtual arena position, the last staged blob
        for i, b in enumerate(blobs):
            if not b.nbytes:
                continue
            if staged[i]:
                assert arena_t is not None
                if cursor % self.arena_bytes + sizes[i] > self.arena_bytes:
                    cursor += self.arena_bytes - cursor % self.arena_bytes  # next lap
                    if last >= 0:
                        self.frees[last] = cursor
                vstart, cursor = cursor, cursor + sizes[i]
                last = i
                buffer, at = self.arena, vstart % self.arena_bytes
                self.views[i] = arena_t[at : at + b.nbytes]
                self.frees[i] = cursor
            else:
                vstart, buffer, at = -1, aligned_buffer(sizes[i]), 0
                self.views[i] = torch.frombuffer(buffer, dtype=torch.uint8, count=b.nbytes)
            for off in range(0, b.nbytes, chunk):
                n = min(chunk, b.nbytes - off)
                self._add(
                    _Read(
                        file_offset=head.data_offset + b.offset + off,
                        buffer=buffer,
                        buffer_offset=at + off,
                        length=round_up(n),
                        needed=n,
                        vend=vstart + off + round_up(n) if vstart >= 0 else 0,
                        pieces=[(i, at + off, n)],
                    ),
                    chunk,
                )

    def _add(self, r: _Read, chunk: int) -> None:
        last = self.reads[-1] if self.reads else None
        if (
            last is not None
            and last.buffer is r.buffer
            and last.buffer_offset + last.length == r.buffer_offset
            and last.file_offset + last.length == r.file_offset
            and last.length + r.length <= chunk
        ):
            last.needed = last.length + r.needed
            last.length += r.length
            last.vend = r.vend
            last.pieces += r.pieces
        else:
            self.reads.append(r)


class _Readers:
    """`depth` threads that claim reads in file order, each as soon as its arena space is free
    (never waiting for the consumer otherwise), and publish their results."""

    def __init__(self, fd: int, layout: _Layout, depth: int) -> None:
        self._fd, self._reads, self._size = fd, layout.reads, layout.arena_bytes
        self._cond = threading.Condition()
        self._next = 0  # the next read to claim
        self._released = 0  # virtual arena position below which the consumer is done
        self._results: dict[int, int | BaseException] = {}
        self._stop = False
        self._threads = [
            threading.Thread(target=self._work, name=f"tierpipe-restore-{n}", daemon=True)
            for n in range(min(depth, len(self._reads)))
        ]
        for t in self._threads:
            t.start()

    def result(self, k: int) -> int:
        """Bytes read `k` got (waits for it); re-raises its error."""
        with self._cond:
            while k not in self._results:
                self._cond.wait()
            got = self._results.pop(k)
        if isinstance(got, BaseException):
            raise got
        return got

    def release(self, upto: int) -> None:
        with self._cond:
            self._released = upto
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._stop
                    and self._next < len(self._reads)
                    and (self._reads[self._next].vend - self._size > self._released)
                ):
                    self._cond.wait()
                if self._stop or self._next >= len(self._reads):
                    return
                k, self._next = self._next, self._next + 1
            r = self._reads[k]
            got: int | BaseException
            try:
                with memoryview(r.buffer) as view:
                    end = r.buffer_offset + r.length
                    got = pread_into(self._fd, view[r.buffer_offset : end], r.file_offset)
            except BaseException as e:  # handed to the consumer
                got = e
            with self._cond:
                self._results[k] = got
                self._cond.notify_all()


def read_blobs(
    fd: int,
    head: Head,
    path: str,
    depth: int,
    chunk: int,
    staged: list[bool],
    devices: set[torch.device],
) -> Iterator[tuple[int, torch.Tensor]]:
    """(blob index, verified uint8 tensor) in file order, read by `depth` threads. Staged
    blobs' tensors are arena memory, valid until the consumer resumes this generator: copy
    them out first. Copies to the CUDA `devices` may be queued (the arena is page-locked for
    them); they are waited for before the arena space is reused.
    """
    blobs = head.header.blobs
    layout = _Layout(head, staged, depth, chunk)
    # This runs on a helper thread, whose current device is 0: register in the targets'
    # device context, or every rank of a node would create a context on GPU 0.
    lock_device = min(devices, key=lambda d: d.index or 0, default=None)
    pinned = (
        lock_device is not None
        and layout.arena is not None
        and page_lock(layout.arena, what="restore arena", device=lock_device)
    )
    hashers = [xxhash.xxh3_128() for _ in blobs]
    done = [0] * len(blobs)
    for i, b in enumerate(blobs):  # empty blobs have nothing to read
        if not b.nbytes:
            check_blob(path, head.header, i, hashers[i].digest())
            yield i, torch.empty(0, dtype=torch.uint8)
    readers = _Readers(fd, layout, depth)
    try:
        for r_index, r in enumerate(layout.reads):
            if readers.result(r_index) < r.needed:
                raise ShardFormatError(path, "truncated data region")
            with memoryview(r.buffer) as view:
                for i, at, n in r.pieces:
                    hashers[i].update(view[at : at + n])
                    done[i] += n
                    if done[i] < blobs[i].nbytes:
                        continue
                    check_blob(path, head.header, i, hashers[i].digest())
                    tensor, layout.views[i] = layout.views[i], None
                    assert tensor is not None
                    yield i, tensor
                    del tensor
                    if staged[i]:
                        for d in devices:  # the consumer's copies out of the arena
                            torch.cuda.current_stream(d).synchronize()
                        readers.release(layout.frees[i])
    finally:
        readers.close()
        if pinned and layout.arena is not None:
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
            page_unlock(layout.arena, device=lock_device)


def check_blob(path: str, header: ShardHeader, i: int, actual: bytes) -> None:
    expected = header.blobs[i].digest
    if actual != expected:
        name = next(
            ("tensor " + "/".join(map(str, e.path)) for e in header.tensors if e.blob == i),
            f"blob {i}",
        )
        raise IntegrityError(path, name, expected.hex(), actual.hex())


def as_tensor(buf: Any, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


class Match:
    """The caller's targets matched to the saved tensors: key path, shape and dtype equal."""

    def __init__(self, header: ShardHeader, into: Any) -> None:
        targets, self.loaders = flatten_targets(into) if into is not None else ({}, [])
        self.targets: list[torch.Tensor | None] = []
        for e in header.tensors:
            t = targets.get(e.path)
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


def assemble(
    head: Head, blobs: Iterator[tuple[int, torch.Tensor]], match: Match, path: str
) -> tuple[Any, int]:
    """The state rebuilt from verified `blobs`, and how many tensors went into targets in place
    (objects with `load_state_dict()` get their part loaded)."""
    header = head.header
    by_blob: dict[int, list[int]] = {}
    for index, e in enumerate(header.tensors):
        by_blob.setdefault(e.blob, []).append(index)
    restored: list[torch.Tensor | None] = [None] * len(header.tensors)
    copied: dict[KeyPath, torch.Tensor] = {}
    for i, blob in blobs:
        for index in by_blob.get(i, []):
            e, target = header.tensors[index], match.targets[index]
            view = blob_view(blob, e)
            if target is None:
                restored[index] = view
                continue
            target.copy_(view, non_blocking=target.is_cuda)
            restored[index] = target
            copied[e.path] = target
    for device in match.cuda_devices:
        torch.cuda.current_stream(device).synchronize()
    state = rebuild_state(header, [], path, tensors=restored)
    for obj, keypath in match.loaders:
        sub = _at(state, keypath)
        if isinstance(obj, torch.nn.Module) and _restored_in_place(obj, sub, keypath, copied):
            continue  # every entry was copied into the module's own parameters and buffers
        obj.load_state_dict(sub)
    return state, len(copied)


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
