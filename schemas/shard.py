"""The shard file header: one rank's state at one step, as laid out on staging, NVMe and S3.

File layout (DESIGN.md §6)::

    [prefix: 64 bytes][header: msgpack ShardHeader][pad to 4 KiB][blob 0][pad]...[blob n][pad]

The prefix holds the magic, format version, flags, header length, file size, the xxh3-128
digest of the header bytes and, in a staging slot only, the slot's generation (0 in a file).
The data region starts at the first 4 KiB boundary after the header and blob offsets count
from there, so the header's length never depends on its own offsets.
Every blob starts at a 4 KiB-aligned offset and holds raw tensor bytes in native layout, so the
file can be written and read with O_DIRECT and mapped zero-copy.
"""

from __future__ import annotations

import msgspec

__all__ = ("ALIGN", "FORMAT_VERSION", "MAGIC", "BlobEntry", "ShardHeader", "TensorEntry")

MAGIC = b"TPSHARD\x00"
FORMAT_VERSION = 1
#: Alignment of the data region and of every blob: the O_DIRECT and page granularity.
ALIGN = 4096


class BlobEntry(msgspec.Struct, frozen=True, array_like=True):
    """A run of raw bytes in the file: one tensor, or one storage shared by several tensors."""

    #: Offset from the start of the data region (itself at `align(64 + header length)`).
    offset: int
    nbytes: int
    #: xxh3-128 of the blob's bytes; all zeros in an unsealed (staging) image.
    digest: bytes


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of the state: where it sits in the state tree and how to view its blob."""

    #: Key path from the root of the state (dict keys and list/tuple indices).
    path: tuple[str | int, ...]
    #: torch dtype name without the `torch.` prefix, e.g. `bfloat16`.
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    blob: int
    #: Offset into the blob in elements of `dtype` (non-zero only for shared storages).
    offset: int


class ShardHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Identity, layout and non-tensor state of a shard."""

    job: str
    step: int
    rank: int
    world_size: int
    node: str
    created: float
    #: The state's structure and plain values as msgpack; tensors appear as references.
    tree: bytes
    tensors: tuple[TensorEntry, ...]
    blobs: tuple[BlobEntry, ...]
    #: The save's timeline (see `tierpipe.schemas.events.ShardEvent.epoch`); 0 in older files.
    epoch: int = 0
