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

__all__ = (
    "ALIGN",
    "BLOCK_BYTES",
    "BLOCK_DIGEST_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "BlobEntry",
    "MeshEntry",
    "ShardHeader",
    "ShardedEntry",
    "TensorEntry",
)

MAGIC = b"TPSHARD\x00"
FORMAT_VERSION = 1
#: Alignment of the data region and of every blob: the O_DIRECT and page granularity.
ALIGN = 4096
#: The unit a partial read checks: a sharded tensor's blob carries one xxh3-64 digest per block
#: (the last block shorter), so a resharded restore reads and checks only the blocks it needs.
BLOCK_BYTES = 1 << 20
BLOCK_DIGEST_BYTES = 8


class BlobEntry(msgspec.Struct, frozen=True, array_like=True):
    """A run of raw bytes in the file: one tensor, or one storage shared by several tensors."""

    #: Offset from the start of the data region (itself at `align(64 + header length)`).
    offset: int
    nbytes: int
    #: xxh3-128 of the blob's bytes; all zeros in an unsealed (staging) image.
    digest: bytes
    #: xxh3-64 of each `BLOCK_BYTES` block of the blob, concatenated (`BLOCK_DIGEST_BYTES` a
    #: block); all zeros unsealed. Empty but for a blob that holds a sharded tensor's local
    #: shard (a `ShardedEntry`): only those are read in part.
    blocks: bytes = b""


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


class MeshEntry(msgspec.Struct, frozen=True, array_like=True):
    """The device mesh: its shape, dim names or empty, the global ranks row-major, this rank's
    coordinate. One entry per distinct mesh of a shard (`ShardHeader.meshes`), however many
    sharded entries lie on it."""

    shape: tuple[int, ...]
    #: The mesh's dimension names (`mesh.mesh_dim_names`), or empty.
    dims: tuple[str, ...]
    #: The global ranks in the mesh, row-major (`mesh.mesh.flatten()`).
    ranks: tuple[int, ...]
    #: This rank's coordinate in the mesh.
    coordinate: tuple[int, ...]


class ShardedEntry(msgspec.Struct, frozen=True, array_like=True):
    """A tensor of the state that is this rank's part of a global tensor (a DTensor's local
    shard), with the global layout a restore into another mesh or world size plans from.

    Placements, one per mesh dimension, as strings: `R` (replicated), `S<d>` (sharded on tensor
    dim d), `SS<d>:<split_factor>` (torch's `_StridedShard`). Partial placements are refused at
    save (they are not values yet). The local shard is the box `offsets` + the tensor's shape
    in the global tensor (torch's `compute_local_shape_and_global_offset`, as DCP records it)
    for this rank's coordinate in its mesh.
    """

    #: Index of the local shard in `ShardHeader.tensors`.
    tensor: int
    global_shape: tuple[int, ...]
    #: Where the local shard starts in the global tensor, per tensor dimension.
    offsets: tuple[int, ...]
    #: Index of the device mesh in `ShardHeader.meshes`.
    mesh: int
    placements: tuple[str, ...]
    #: The global rank whose shard file holds this local shard's bytes for every rank holding
    #: the same box (a replica: ranks that differ only on `R` mesh dims): the lowest of them
    #: (`tierpipe.storage.sharding.replica_writer`, a pure function of the layout). A holder
    #: that is not the writer stores its entry with an empty blob and no bytes. This rank's own
    #: for an empty shard; -1 in older files: every holder stored its own bytes.
    writer: int = -1


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
    #: The device meshes the sharded entries lie on, each once (`ShardedEntry.mesh`).
    meshes: tuple[MeshEntry, ...] = ()
    #: The tensors that are local shards of global (DTensor) tensors; empty for a plain state.
    sharded: tuple[ShardedEntry, ...] = ()
