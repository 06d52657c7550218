"""Loading a shard back into tensors, verified before any byte reaches the model.

The data region is read in large chunks at queue depth > 1 (O_DIRECT where the filesystem
allows: a restart reads cold data, and the page cache would only be polluted). Each chunk lands
in its blob's page-aligned buffer, each blob's xxh3-128 is computed as its chunks arrive, and
only a blob whose digest matches is copied into its target tensors in place, or handed out as a
new tensor (no copy). Reading, hashing and copying overlap: os.preadv, python-xxhash and torch's
copies all release the GIL.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from pipeline.errors import IntegrityError, ShardFormatError
from pipeline.shard import DTYPE_SIZES, Head
from pipeline.state import KeyPath, flatten_targets, rebuild_state
from pipeline.storage.nvme import open_for_read, read_head_fd
from schemas import ShardHeader, TensorEntry

__all__ = ["Loaded", "load_image", "load_into", "load_shard"]


@dataclass(frozen=True, slots=True)
class Loaded:
    header: ShardHeader
    state: Any
    nbytes: int
    seconds: float
    #: How many tensors were written in place into the caller's targets.
    in_place: int


def load_into(
    path: str,
    into: Any = None,
    *,
    direct_io: bool = True,
    queue_depth: int = 4,
    chunk_bytes: int = 8 << 20,
) -> Loaded:
    """Read a sealed shard file, verify every blob, and rebuild its state.

    Args:
        into: optional targets shaped like the saved state (tensors, or objects with
            `state_dict()`, in nested dicts/lists): a saved tensor whose key path has a target of
            the same shape and dtype is copied into it in place; the rest come back as new CPU
            tensors. Objects with `load_state_dict()` get their restored state loaded.

    Raises:
        ShardFormatError: missing, truncated or garbled (names the file).
        IntegrityError: a digest does not match (names the file and tensor).
    """
    t0 = time.perf_counter()
    try:
        fd = open_for_read(path, direct_io=direct_io)
    except FileNotFoundError as e:
        raise ShardFormatError(path, "file is missing") from e
    try:
        head = read_head_fd(fd, path, os.fstat(fd).st_size)
        blobs = _read_blobs(fd, head, path, queue_depth, chunk_bytes)
        return _assemble(head, blobs, into, path, t0)
    except OSError as e:
        raise ShardFormatError(path, f"read failed: {e}") from e
    finally:
        os.close(fd)


def load_shard(path: str | os.PathLike[str]) -> tuple[ShardHeader, Any]:
    """Read a sealed shard file and rebuild its state on the CPU, every digest checked first.

    Raises:
        ShardFormatError: truncated, garbled or not a shard (the message names the file).
        IntegrityError: a digest does not match.
    """
    loaded = load_into(os.fspath(path))
    return loaded.header, loaded.state


def load_image(image: memoryview, head: Head, path: str, into: Any = None) -> Loaded:
    """The same from a sealed image already in memory (e.g. downloaded from object storage)."""
    t0 = time.perf_counter()

    def blobs() -> Iterator[tuple[int, torch.Tensor]]:
        for i, b in enumerate(head.header.blobs):
            start = head.data_offset + b.offset
            data = image[start : start + b.nbytes]
            _check(path, head.header, i, xxhash.xxh3_128_digest(data))
            yield i, _tensor(data, b.nbytes)

    return _assemble(head, blobs(), into, path, t0)


def _read_blobs(
    fd: int, head: Head, path: str, depth: int, chunk: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(blob index, verified uint8 tensor) in file order, read at queue depth `depth`."""
    blobs = head.header.blobs
    plan = [  # (blob, offset in blob, length): every chunk in file order
        (i, off, min(chunk, b.nbytes - off))
        for i, b in enumerate(blobs)
        for off in range(0, b.nbytes, chunk)
    ]
    buffers: dict[int, mmap.mmap] = {}
    hashers = [xxhash.xxh3_128() for _ in blobs]
    done = [0] * len(blobs)
    pending: dict[int, Future[int]] = {}
    next_blob = 0
    with ThreadPoolExecutor(depth, thread_name_prefix="tierpipe-restore") as pool:

        def submit(k: int) -> None:
            i, off, n = plan[k]
            if i not in buffers:  # allocated when first needed, dropped once handed out
                buffers[i] = mmap.mmap(-1, -(-blobs[i].nbytes // 4096) * 4096)
            start = head.data_offset + blobs[i].offset + off
            pending[k] = pool.submit(_pread, fd, buffers[i], off, -(-n // 4096) * 4096, start)

        try:
            for k in range(min(depth, len(plan))):
                submit(k)
            for k, (i, off, n) in enumerate(plan):
                if pending.pop(k).result() < n:
                    raise ShardFormatError(path, "truncated data region")
                if k + depth < len(plan):
                    submit(k + depth)
                with memoryview(buffers[i]) as view:
                    hashers[i].update(view[off : off + n])
                done[i] += n
                while next_blob < len(blobs) and done[next_blob] == blobs[next_blob].nbytes:
                    _check(path, head.header, next_blob, hashers[next_blob].digest())
                    buf = buffers.pop(next_blob, None)
                    yield next_blob, _tensor(buf, blobs[next_blob].nbytes)
                    next_blob += 1
            for i in range(next_blob, len(blobs)):  # trailing empty blobs
                _check(path, head.header, i, hashers[i].digest())
                yield i, _tensor(None, 0)
        finally:
            for f in pending.values():
                f.cancel()


def _pread(fd: int, buf: mmap.mmap, offset: int, length: int, file_offset: int) -> int:
    got = 0
    with memoryview(buf) as view:
        while got < length:
            n = os.preadv(fd, [view[offset + got : offset + length]], file_offset + got)
            if n == 0:
                break
            got += n
    return got


def _check(path: str, header: ShardHeader, i: int, actual: bytes) -> None:
    expected = header.blobs[i].digest
    if actual != expected:
        name = next(
            ("tensor " + "/".join(map(str, e.path)) for e in header.tensors if e.blob == i),
            f"blob {i}",
        )
        raise IntegrityError(path, name, expected.hex(), actual.hex())


def _tensor(buf: Any, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def _assemble(
    head: Head, blobs: Iterator[tuple[int, torch.Tensor]], into: Any, path: str, t0: float
) -> Loaded:
    header = head.header
    targets, loaders = flatten_targets(into) if into is not None else ({}, [])
    by_blob: dict[int, list[int]] = {}
    for index, e in enumerate(header.tensors):
        by_blob.setdefault(e.blob, []).append(index)
    restored: list[torch.Tensor | None] = [None] * len(header.tensors)
    copied: set[KeyPath] = set()
    for i, blob in blobs:
        for index in by_blob.get(i, []):
            e = header.tensors[index]
            view = _view(blob, e)
            target = targets.get(e.path)
            if target is not None and target.shape == view.shape and target.dtype == view.dtype:
                target.copy_(view, non_blocking=target.is_cuda)
                restored[index] = target
                copied.add(e.path)
            else:
                restored[index] = view
    if any(t.is_cuda for t in targets.values()):
        torch.cuda.synchronize()
    state = rebuild_state(header, [], path, tensors=restored)
    for obj, keypath in loaders:
        sub = _at(state, keypath)
        if isinstance(obj, torch.nn.Module):
            theirs = {(*keypath, k) for k in obj.state_dict()}
            if theirs <= copied:
                continue  # every tensor already copied into the module's own parameters
        obj.load_state_dict(sub)
    return Loaded(header, state, head.file_nbytes, time.perf_counter() - t0, len(copied))


def _view(blob: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    t = torch.empty(0, dtype=getattr(torch, e.dtype))  # e.dtype was checked against DTYPE_SIZES
    base = blob.storage_offset() // DTYPE_SIZES[e.dtype]
    return t.set_(blob.untyped_storage(), base + e.offset, e.shape, e.stride)


def _at(state: Any, keypath: KeyPath) -> Any:
    for k in keypath:
        state = state[k]
    return state
