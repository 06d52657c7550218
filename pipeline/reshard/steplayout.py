"""A save's global layout (`tierpipe.schemas.layout.StepLayout`): from a shard header, and back.

`layout_of` takes what one rank's header says of its sharded tensors and drops everything
rank-specific (its coordinates, offsets, local shapes, the writer of its boxes): every rank of
a DTensor save gives the same layout, so the nvme-write stage stores it once per job and
layout (`layout_digest` names it) and a step's record names it. The reverse is pure arithmetic
on the placements (`tierpipe.reshard.layout.box_of`, `tierpipe.storage.sharding`): `boxes`
gives every saved rank's box of a tensor, `skeleton` the sharded part of any saved rank's
header (its entries, offsets, local shapes and writers as that rank wrote them), so a
resharded restore plans without reading a shard header.
"""

from __future__ import annotations

import functools
import math

import msgspec
import structlog
import xxhash

from tierpipe.control.kvstate import JobStore, layout_key
from tierpipe.errors import LayoutMismatchError
from tierpipe.reshard.layout import Box, box_of, coordinate_of
from tierpipe.schemas import MeshEntry, ShardedEntry, ShardHeader, TensorEntry
from tierpipe.schemas.layout import (
    LayoutMesh,
    LayoutTensor,
    StepLayout,
    decode_layout,
    encode_layout,
)
from tierpipe.storage.shard import contiguous_strides
from tierpipe.storage.sharding import local_box, replica_writer

__all__ = (
    "boxes", "layout_digest", "layout_of", "mesh_boxes", "skeleton", "store_layout",
    "stored_layout",
)  # fmt: skip

log = structlog.get_logger(__name__)


def layout_of(header: ShardHeader) -> StepLayout:
    """The global layout of the sharded tensors `header` lists (in its order), its meshes in
    the order they are first used (so every rank of the save gives the same value)."""
    meshes: list[LayoutMesh] = []
    tensors: list[LayoutTensor] = []
    for s in header.sharded:
        m = header.meshes[s.mesh]
        mesh = LayoutMesh(tuple(m.shape), tuple(m.dims), tuple(m.ranks))
        if mesh not in meshes:
            meshes.append(mesh)
        e = header.tensors[s.tensor]
        tensors.append(
            LayoutTensor(
                tuple(e.path),
                e.dtype,
                tuple(s.global_shape),
                meshes.index(mesh),
                tuple(s.placements),
                s.writer >= 0,
            )
        )
    return StepLayout(meshes=tuple(meshes), tensors=tuple(tensors))


def layout_digest(layout: StepLayout) -> str:
    """The layout's name: xxh3-64 of its encoding, 16 hex digits (`LAYOUT_DIGEST_PATTERN`)."""
    return xxhash.xxh3_64_hexdigest(encode_layout(layout))


async def store_layout(store: JobStore, job: str, data: bytes, *, digest: str = "") -> str:
    """Store an encoded layout under its digest (`layout_key`), unless it is there already
    (atomic: of writers racing, one stores; the value is the same); its digest.

    Raises:
        ValueError: `digest` is given and is not the digest of `data`.
        BusError, BusUnavailableError: the store did not answer.
    """
    actual = xxhash.xxh3_64_hexdigest(data)
    if digest and digest != actual:
        raise ValueError(f"layout bytes hash to {actual}, not {digest}")
    if await store.create(layout_key(job, actual), data):
        log.info("layout_stored", job=job, layout=actual, nbytes=len(data))
    return actual


async def stored_layout(store: JobStore, job: str, digest: str) -> StepLayout | None:
    """The layout stored under `digest`, or None: not stored, or its bytes do not hash to
    `digest` or do not decode (logged; the caller then reads a shard header as before).

    Raises:
        BusError, BusUnavailableError: the store did not answer.
    """
    data = await store.value(layout_key(job, digest))
    if data is None:
        return None
    if xxhash.xxh3_64_hexdigest(data) != digest:
        log.warning("layout_refused", job=job, layout=digest, reason="digest")
        return None
    try:
        return decode_layout(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("layout_refused", job=job, layout=digest, reason=str(e))
        return None


def boxes(layout: StepLayout, i: int) -> list[tuple[int, Box]]:
    """Every saved rank's box of tensor `i` of the layout: (its global rank, its box), in
    mesh order.

    Raises:
        LayoutMismatchError: the mesh's ranks do not fill its shape, or the placements do not
            fit it.
    """
    t = layout.tensors[i]
    mesh = layout.meshes[t.mesh]
    if math.prod(mesh.shape) != len(mesh.ranks):
        raise LayoutMismatchError(f"saved mesh {mesh.shape} of {len(mesh.ranks)} ranks")
    got = mesh_boxes(t.global_shape, mesh.shape, t.placements)
    return list(zip(mesh.ranks, got, strict=True))


def skeleton(layout: StepLayout, *, job: str, step: int, rank: int, world_size: int) -> ShardHeader:
    """The sharded part of saved `rank`'s header, as it wrote it: a tensor entry (key path,
    dtype, local shape; no bytes) with its sharded entry and mesh for every tensor of the
    layout, but no plain tensors, blobs or tree. What `tierpipe.state.layout_mismatch` and
    `stored_elsewhere` need to judge that rank's shard without reading it.

    Raises:
        LayoutMismatchError: `rank` is not in a tensor's mesh, its shard is not one box, or the
            placements do not fit the mesh.
    """
    meshes: list[MeshEntry] = []
    tensors: list[TensorEntry] = []
    sharded: list[ShardedEntry] = []
    for i, t in enumerate(layout.tensors):
        m = layout.meshes[t.mesh]
        if rank not in m.ranks:
            raise LayoutMismatchError(f"rank {rank} is not in the saved mesh of ranks {m.ranks}")
        coordinate = coordinate_of(m.ranks.index(rank), m.shape)
        mesh = MeshEntry(m.shape, m.dims, m.ranks, coordinate)
        try:
            box = local_box(t.global_shape, m.shape, coordinate, t.placements)
            writer = replica_writer(t.global_shape, m.shape, m.ranks, coordinate, t.placements)
        except ValueError as e:
            raise LayoutMismatchError(f"saved placements {t.placements}: {e}") from e
        if box is None:
            raise LayoutMismatchError(f"rank {rank}'s shard of {t.path} is not one box")
        offsets, shape = box
        if mesh not in meshes:
            meshes.append(mesh)
        tensors.append(TensorEntry(t.path, t.dtype, shape, contiguous_strides(shape), i, 0))
        sharded.append(
            ShardedEntry(
                tensor=i,
                global_shape=t.global_shape,
                offsets=offsets,
                mesh=meshes.index(mesh),
                placements=t.placements,
                writer=(rank if writer is None else writer) if t.once else -1,
            )
        )
    return ShardHeader(
        job=job, step=step, rank=rank, world_size=world_size, node="", created=0.0, tree=b"",
        tensors=tuple(tensors), blobs=(), meshes=tuple(meshes), sharded=tuple(sharded),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def mesh_boxes(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...]
) -> tuple[Box, ...]:
    """The box of each mesh position, row-major (the tensors of a model share few layouts)."""
    return tuple(
        box_of(global_shape, mesh_shape, coordinate_of(i, mesh_shape), placements)
        for i in range(math.prod(mesh_shape))
    )
