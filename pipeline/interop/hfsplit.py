"""The full model of a step as safetensors files, written in place rank by rank
(`tierpipe export --to safetensors --merged`): at most one rank's state in memory, never the
whole model.

Two passes over the ranks (a rank with no copy on this node's NVMe is downloaded in each).
The first (`plan`) reads each rank's header only (its shapes, dtypes, sharded entries and plain
values; `shaped`) and lays the output out: every sharded tensor as its global tensor, every
other tensor and value rank 0's (`tierpipe.interop.merge` says which rank's part each piece
takes and checks that the shards tile each tensor); files of at most `max_file_bytes` (Hugging
Face's 5 GB by default), each made at its full size with its safetensors header. The second
(`add`) copies each rank's parts into their places in the mapped files. `finish` checks that
every part arrived, syncs the files, renames them into place and, for more than one file,
writes `model.safetensors.index.json` (Hugging Face's: `metadata.total_size` and
`weight_map`, key -> file) last.

Each file is a plain safetensors file: an 8-byte header length, the JSON header (each
tensor's dtype, shape and byte range; `__metadata__` with `format: pt`, the checkpoint's
identity `tierpipe.checkpoint` and, in the first file and the index, the plain values as JSON
`tierpipe.values`), the tensors' bytes in row-major order, largest element size first so that
every tensor starts aligned.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierpipe.errors import LayoutMismatchError, UnsupportedStateError
from tierpipe.interop.merge import Chunk, Merge, key_name, leaves, sharded_by_path
from tierpipe.schemas import ShardHeader
from tierpipe.tree import KeyPath, decode_tree

__all__ = ("INDEX_NAME", "MAX_FILE_BYTES", "SafetensorsWriter", "shaped")

#: Hugging Face's default largest file of a split checkpoint (`max_shard_size="5GB"`).
MAX_FILE_BYTES = 5 * 10**9
#: The index of a split safetensors checkpoint, as Hugging Face names it.
INDEX_NAME = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}  # fmt: skip


@dataclass(slots=True)
class _File:
    """An output file being filled: made at its full size, mapped."""

    path: Path
    fd: int
    mapped: mmap.mmap
    #: The data region as bytes (None once released, before the map closes).
    data: torch.Tensor | None


@dataclass(slots=True)
class _Tensor:
    """One output tensor: its place, and the parts still to arrive (rank, box; None: whole)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: set[tuple[int, Chunk | None]]
    file: int = 0
    start: int = 0

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class SafetensorsWriter:
    """`plan` every rank (in order), then `add` every rank (in order), then `finish`."""

    def __init__(self, out: Path, identity: dict[str, Any], *, max_file_bytes: int) -> None:
        self.out, self.identity, self.max_file_bytes = out, identity, max_file_bytes
        self._merge = Merge()
        self._tensors: dict[KeyPath, _Tensor] = {}
        self._values: dict[str, Any] = {}
        self._files: list[_File] = []

    def plan(self, rank: int, header: ShardHeader) -> None:
        """Lay out what `rank` adds, from its header alone.

        Raises:
            LayoutMismatchError: its shards disagree with a lower rank's.
            UnsupportedStateError: a dtype safetensors cannot hold.
        """
        state = shaped(header)
        tensors = {tuple(t.path) for t in header.tensors}
        for sharded, chunk, _ in self._merge.add_rank(rank, header, state):
            found = self._tensors.get(sharded.path)
            if found is None:
                found = self._tensor(sharded.path, sharded.dtype, sharded.global_shape)
            found.parts.add((rank, chunk))
        for path, leaf in leaves(state):
            if path in self._merge.sharded or not self._merge.first(rank, path):
                continue
            if path in tensors:
                t = torch.as_tensor(leaf)
                self._tensor(path, t.dtype, tuple(t.shape)).parts.add((rank, None))
            else:
                self._values[key_name(path)] = leaf

    def _tensor(self, path: KeyPath, dtype: torch.dtype, shape: tuple[int, ...]) -> _Tensor:
        if dtype not in _DTYPES:
            raise UnsupportedStateError(path, f"safetensors holds no {dtype}")
        made = self._tensors[path] = _Tensor(key_name(path), dtype, shape, set())
        return made

    def open(self) -> None:
        """Make the files at their full size, each with its header, and map them.

        Raises:
            LayoutMismatchError: a sharded tensor whose shards do not tile it.
        """
        self._merge.check()
        groups = _split(list(self._tensors.values()), self.max_file_bytes)
        meta = {"format": "pt", "tierpipe.checkpoint": json.dumps(self.identity)}
        for i, group in enumerate(groups):
            group.sort(key=lambda t: -t.dtype.itemsize)  # (every tensor starts aligned)
            extra = {"tierpipe.values": json.dumps(self._values, default=str)} if i == 0 else {}
            header: dict[str, Any] = {"__metadata__": {**meta, **extra}}
            at = 0
            for t in group:
                t.file, t.start = i, at
                header[t.key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                                 "data_offsets": [at, at + t.nbytes]}  # fmt: skip
                at += t.nbytes
            head = json.dumps(header, separators=(",", ":")).encode()
            head += b" " * (-len(head) % 8)
            prefix = len(head).to_bytes(8, "little") + head
            self._files.append(_mapped(self._name(i, len(groups)), prefix, at))

    def add(self, rank: int, header: ShardHeader, state: Any) -> None:
        """Copy `rank`'s parts into their places in the files."""
        sharded = sharded_by_path(header)
        for path, leaf in leaves(state):
            t = self._tensors.get(path)
            if t is None:
                continue
            part = (rank, Chunk(tuple(sharded[path].offsets), tuple(leaf.shape))) if (
                path in sharded) else (rank, None)  # fmt: skip
            if part not in t.parts:
                continue
            data = self._files[t.file].data
            assert data is not None  # (`open` mapped it)
            target = data[t.start : t.start + t.nbytes].view(t.dtype).view(t.shape)
            chunk = part[1]
            source = torch.as_tensor(leaf)
            if chunk is None:
                target.copy_(source)
            elif chunk.numel:
                target[chunk.index()] = source
            t.parts.discard(part)

    def finish(self) -> list[Path]:
        """Sync the files, rename them into place, write the index; the paths written.

        Raises:
            LayoutMismatchError: a part that no rank delivered (a rank changed between passes).
        """
        missing = [t.key for t in self._tensors.values() if t.parts]
        if missing:
            raise LayoutMismatchError(f"parts of {', '.join(missing[:5])} never arrived")
        written = []
        files, self._files = self._files, []
        for f in files:
            f.data = None  # (the map closes only once no view of it is left)
            f.mapped.flush()
            f.mapped.close()
            os.fsync(f.fd)
            os.close(f.fd)
            final = f.path.with_name(f.path.name.removesuffix(".tmp"))
            f.path.replace(final)
            written.append(final)
        if len(written) > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in self._tensors.values()),
                             "format": "pt", "tierpipe.checkpoint": json.dumps(self.identity),
                             "tierpipe.values": json.dumps(self._values, default=str)},
                "weight_map": {t.key: written[t.file].name for t in self._tensors.values()},
            }  # fmt: skip
            (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            written.append(self.out / INDEX_NAME)
        return written

    def close(self) -> None:
        """Unmap and remove files not finished (an export that failed half way; idempotent)."""
        files, self._files = self._files, []
        for f in files:
            f.data = None
            with contextlib.suppress(BufferError):
                f.mapped.close()
            os.close(f.fd)
            with contextlib.suppress(FileNotFoundError):
                f.path.unlink()

    def _name(self, i: int, n: int) -> Path:
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        return self.out / f"{name}.tmp"


def _mapped(path: Path, prefix: bytes, nbytes: int) -> _File:
    """`path` made at its full size with `prefix` written, and mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, len(prefix) + nbytes)
        os.pwrite(fd, prefix, 0)
        mapped = mmap.mmap(fd, len(prefix) + nbytes)
    except BaseException:
        os.close(fd)
        raise
    data = torch.empty(0, dtype=torch.uint8)
    if nbytes:
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=len(prefix))
    return _File(path, fd, mapped, data)


def _split(tensors: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """Tensors in order, into files of at most `max_bytes` (a larger tensor gets one of its
    own), as Hugging Face's `split_torch_state_dict_into_shards` fills them."""
    files: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def shaped(header: ShardHeader) -> Any:
    """The state `header` describes, its tensors stand-ins of their shape and dtype that hold
    no memory (a zero expanded), its plain values as saved."""
    stand_ins = [
        torch.zeros((), dtype=getattr(torch, t.dtype)).expand(t.shape) for t in header.tensors
    ]
    return decode_tree(header.tree, stand_ins, "<header>")
