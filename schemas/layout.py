"""A step's global layout: what every rank's sharded (DTensor) tensors are, without any rank.

Every rank of a DTensor save writes the same global facts into its shard header (each
`ShardedEntry` with its `MeshEntry`): the tensor's key path, dtype, global shape, mesh and
placements. `StepLayout` is those facts once, with nothing rank-specific (no coordinate, no
offsets, no local shape, no writer rank), so it is the same value for every rank of a save and
a resharded restore plans from it alone: every saved rank's box, and which rank stores a
replica's bytes, follow from it (`tierpipe.reshard.steplayout`).

The job state stores it once per distinct layout, under a key named by its digest
(`<job>.layout.<digest>`, `tierpipe.control.kvstate.layout_key`); a step's record names that
digest (`StepRecord.layout`) and its COMMIT manifest carries the bytes. About 60 bytes a tensor
as msgpack, whatever the world size.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = (
    "LAYOUT_DIGEST_PATTERN",
    "LayoutDigest",
    "LayoutMesh",
    "LayoutTensor",
    "StepLayout",
    "decode_layout",
    "encode_layout",
)

#: A layout's digest: xxh3-64 of its msgpack encoding, as 16 lowercase hex digits ("": none).
LAYOUT_DIGEST_PATTERN = r"^([0-9a-f]{16})?\Z"

LayoutDigest = Annotated[str, msgspec.Meta(pattern=LAYOUT_DIGEST_PATTERN)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class LayoutMesh(msgspec.Struct, frozen=True, array_like=True):
    """A device mesh of the save: a `MeshEntry` without the coordinate of its rank."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    #: The global ranks in the mesh, row-major.
    ranks: tuple[int, ...]


class LayoutTensor(msgspec.Struct, frozen=True, array_like=True):
    """One sharded tensor of the save, as every rank's `ShardedEntry` describes it."""

    path: tuple[str | int, ...]
    dtype: str
    global_shape: tuple[int, ...]
    #: Index of its mesh in `StepLayout.meshes`.
    mesh: NonNegInt
    placements: tuple[str, ...]
    #: The bytes of a box held by several ranks are stored once, by its writer
    #: (`tierpipe.storage.sharding.replica_writer`); False for an older save, where every
    #: holder stored its own (`ShardedEntry.writer` -1).
    once: bool = True


class StepLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The global layout of a save's sharded tensors (see the module docstring)."""

    meshes: tuple[LayoutMesh, ...] = ()
    tensors: tuple[LayoutTensor, ...] = ()


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepLayout)


def encode_layout(layout: StepLayout) -> bytes:
    """The layout as stored (and digested): msgpack, the same bytes for equal layouts."""
    return _encoder.encode(layout)


def decode_layout(data: bytes) -> StepLayout:
    """A stored layout.

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: not a layout.
    """
    return _decoder.decode(data)
