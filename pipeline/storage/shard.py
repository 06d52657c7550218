"""Shard file format at the byte level: the 64-byte prefix, the header, and layout checks.

A shard image is the same bytes on every tier. In a staging slot it is *unsealed* (all digests
zero); the nvme-write stage seals it by filling in the per-blob xxh3-128 digests (and the block
digests of a sharded tensor's blob: `block_digests`) and the header digest. A sharded tensor's
global layout is checked here too (against `sharding.local_box`), its mesh's entry once a mesh
(`mesh_of` finds a sharded entry's mesh). Nothing here imports torch: the
node agent works on bytes only (see `tierpipe.state` for tensors).
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import xxhash

from tierpipe.errors import IntegrityError, ShardFormatError
from tierpipe.schemas import (
    ALIGN,
    BLOCK_BYTES,
    BLOCK_DIGEST_BYTES,
    FORMAT_VERSION,
    MAGIC,
    BlobEntry,
    MeshEntry,
    ShardedEntry,
    ShardHeader,
    TensorEntry,
)
from tierpipe.storage.sharding import local_box, position, replica_writer, stores_bytes

__all__ = (
    "DTYPE_SIZES",
    "GENERATION_OFFSET",
    "PREFIX_NBYTES",
    "Head",
    "align_up",
    "block_digests",
    "blocks_nbytes",
    "contiguous_strides",
    "encode_head",
    "file_nbytes",
    "mesh_of",
    "parse_head",
    "parse_prefix",
    "seal_header",
    "set_slot_generation",
    "sharded_layouts",
    "slot_generation",
)

# magic, format version, flags, header length, file length, header digest, slot generation;
# padded to 64 bytes. The generation is only meaningful in a staging slot (0 in a sealed file).
_PREFIX = struct.Struct("<8sHHIQ16sQ16x")
PREFIX_NBYTES = _PREFIX.size
_GENERATION = struct.Struct("<Q")
#: Offset of the slot generation in the prefix.
GENERATION_OFFSET = 40
_FLAG_SEALED = 1
_ZERO_DIGEST = bytes(16)
#: A header larger than this is treated as garbage rather than allocated.
_MAX_HEADER_NBYTES = 1 << 30
_INT64_MAX = (1 << 63) - 1

#: Every dtype a shard may hold, with its element size. Loading maps names through this table
#: only, so a header can never name an arbitrary attribute.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShardHeader)


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class Head:
    """A parsed prefix + header."""

    header: ShardHeader
    header_bytes: bytes
    #: xxh3-128 of `header_bytes` as recorded in the prefix (zeros when unsealed).
    header_digest: bytes
    sealed: bool
    data_offset: int
    file_nbytes: int


def file_nbytes(data_offset: int, blobs: tuple[BlobEntry, ...] | list[BlobEntry]) -> int:
    end = max((b.offset + b.nbytes for b in blobs), default=0)
    return data_offset + align_up(end)


def encode_head(header: ShardHeader, *, sealed: bool) -> bytes:
    """Prefix + header + zero padding up to the data region (a multiple of 4 KiB).

    An unsealed head (staging) carries zero digests; the header's length is the same either way
    because every digest is a fixed 16-byte field.
    """
    body = _encoder.encode(header)
    data_offset = align_up(PREFIX_NBYTES + len(body))
    digest = xxhash.xxh3_128_digest(body) if sealed else _ZERO_DIGEST
    prefix = _PREFIX.pack(
        MAGIC,
        FORMAT_VERSION,
        _FLAG_SEALED if sealed else 0,
        len(body),
        file_nbytes(data_offset, header.blobs),
        digest,
        0,
    )
    return prefix + body + bytes(data_offset - PREFIX_NBYTES - len(body))


def slot_generation(image: bytes | memoryview | bytearray | mmap.mmap) -> int:
    """The generation a staging slot's prefix records (see `set_slot_generation`)."""
    generation: int = _GENERATION.unpack_from(image, GENERATION_OFFSET)[0]
    return generation


def set_slot_generation(image: memoryview | bytearray, generation: int) -> None:
    """Record `generation` in a staging slot's prefix. The trainer bumps it *before* it writes
    anything else into a reused slot, so a reader that sees the same generation before and
    after copying the slot knows no reuse began meanwhile."""
    _GENERATION.pack_into(image, GENERATION_OFFSET, generation)


def seal_header(
    header: ShardHeader, digests: list[bytes], blocks: list[bytes] | None = None
) -> ShardHeader:
    """The header with each blob's digest filled in, and its block digests where `blocks` has
    them (one entry per blob; empty for a blob without block digests: its placeholder stays)."""
    blobs = tuple(
        msgspec.structs.replace(b, digest=d, blocks=k or b.blocks)
        for b, d, k in zip(header.blobs, digests, blocks or [b""] * len(digests), strict=True)
    )
    return msgspec.structs.replace(header, blobs=blobs)


def blocks_nbytes(nbytes: int) -> int:
    """The length of a `nbytes` blob's block digests (`BlobEntry.blocks`)."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_DIGEST_BYTES


def block_digests(data: bytes | memoryview) -> bytes:
    """xxh3-64 (8 bytes, big-endian) of each `BLOCK_BYTES` block of `data`, concatenated: what
    `BlobEntry.blocks` records for a blob of these bytes (a ranged read of whole blocks from
    offset k * BLOCK_BYTES checks against digests k...)."""
    with memoryview(data) as view:
        return b"".join(
            xxhash.xxh3_64_digest(view[at : at + BLOCK_BYTES])
            for at in range(0, len(view), BLOCK_BYTES)
        )


def parse_prefix(prefix: bytes | memoryview, path: str) -> tuple[int, int, bytes, bool]:
    """Check the fixed prefix; return (header length, file length, header digest, sealed)."""
    if len(prefix) < PREFIX_NBYTES:
        raise ShardFormatError(path, f"truncated: {len(prefix)} bytes, no complete prefix")
    magic, version, flags, header_len, nbytes, digest, _ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ShardFormatError(path, f"not a tierpipe shard (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            path, f"format version {version} (this build reads {FORMAT_VERSION})"
        )
    if not 0 < header_len <= _MAX_HEADER_NBYTES:
        raise ShardFormatError(path, f"implausible header length {header_len}")
    if nbytes < align_up(PREFIX_NBYTES + header_len) or nbytes % ALIGN:
        raise ShardFormatError(path, f"implausible file length {nbytes}")
    return header_len, nbytes, digest, bool(flags & _FLAG_SEALED)


def parse_head(
    buf: bytes | memoryview,
    path: str,
    *,
    sealed: bool = True,
    actual_nbytes: int | None = None,
) -> Head:
    """Parse and check a head read from the start of a shard image.

    Args:
        buf: at least the prefix and the header (the first `data_offset` bytes suffice).
        path: named in errors.
        sealed: require a sealed image and check the header digest.
        actual_nbytes: the file's real size, checked against the recorded one.

    Raises:
        ShardFormatError: truncated, garbled or inconsistent.
        IntegrityError: the header bytes do not match the recorded header digest.
    """
    header_len, nbytes, digest, is_sealed = parse_prefix(buf, path)
    if actual_nbytes is not None and actual_nbytes != nbytes:
        raise ShardFormatError(
            path, f"truncated or padded: {actual_nbytes} bytes, header says {nbytes}"
        )
    if sealed and not is_sealed:
        raise ShardFormatError(path, "image is not sealed (a staging copy, not a written shard)")
    end = PREFIX_NBYTES + header_len
    if len(buf) < end:
        raise ShardFormatError(path, f"truncated: header needs {end} bytes, have {len(buf)}")
    body = bytes(buf[PREFIX_NBYTES:end])
    if sealed:
        actual = xxhash.xxh3_128_digest(body)
        if actual != digest:
            raise IntegrityError(path, "header", digest.hex(), actual.hex())
    try:
        header = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ShardFormatError(path, f"garbled header: {e}") from e
    data_offset = align_up(end)
    _check_layout(header, path, data_offset, nbytes)
    return Head(header, body, digest, is_sealed, data_offset, nbytes)


def _check_layout(header: ShardHeader, path: str, data_offset: int, nbytes: int) -> None:
    """Reject any layout that would read outside a blob or the file, before torch sees it.

    Blobs lie in order inside the file without overlapping. A tensor alone in its blob is what
    the writer makes of it (`tierpipe.state.plan_state`): contiguous from the blob's start and
    filling it exactly. Only a blob that several tensors declare they share may be viewed with
    overlaps, gaps or zero strides (tied weights, expanded views); even then every element
    lies inside the blob. Sizes that do not fit torch's int64 are refused here rather than
    left to raise from torch.
    """
    if file_nbytes(data_offset, header.blobs) != nbytes:
        raise ShardFormatError(path, "blob layout does not match the file length")
    end = 0
    for i, b in enumerate(header.blobs):
        if b.offset % ALIGN or b.offset < end or b.nbytes < 0 or len(b.digest) != 16:
            raise ShardFormatError(path, f"blob {i} is misplaced or malformed")
        end = b.offset + b.nbytes
    users = Counter(t.blob for t in header.tensors)
    for i, m in enumerate(header.meshes):
        problem = _mesh_problem(m)
        if problem:
            raise ShardFormatError(path, f"mesh {i}: {problem}")
    sharded_blobs, elsewhere = set(), set()
    # Each layout's writer, once per (mesh, global shape, placements): a mesh's ranks can
    # number thousands, too many to hash per tensor.
    writers: dict[tuple[int, tuple[int, ...], tuple[str, ...]], int | None] = {}
    for s in header.sharded:
        if not 0 <= s.tensor < len(header.tensors):
            raise ShardFormatError(path, f"sharded entry names missing tensor {s.tensor}")
        t = header.tensors[s.tensor]
        if users[t.blob] > 1 or t.blob in sharded_blobs:
            raise ShardFormatError(path, f"sharded tensor {t.path!r} shares blob {t.blob}")
        sharded_blobs.add(t.blob)
        if not 0 <= s.mesh < len(header.meshes):
            raise ShardFormatError(path, f"sharded tensor {t.path!r} names missing mesh {s.mesh}")
        _check_sharded(s, header.meshes[s.mesh], t, path, writers)
        if not stores_bytes(s, header.meshes[s.mesh]):
            elsewhere.add(s.tensor)
            if header.blobs[t.blob].nbytes:
                raise ShardFormatError(
                    path, f"sharded tensor {t.path!r} holds bytes rank {s.writer} writes"
                )
    for i, t in enumerate(header.tensors):
        _check_tensor(t, header.blobs, users[t.blob] > 1, path, stored=i not in elsewhere)
    for i, b in enumerate(header.blobs):
        want = blocks_nbytes(b.nbytes) if i in sharded_blobs else 0
        if len(b.blocks) != want:
            raise ShardFormatError(
                path, f"blob {i} has {len(b.blocks)} bytes of block digests, not {want}"
            )


def mesh_of(header: ShardHeader, s: ShardedEntry) -> MeshEntry:
    """The device mesh sharded entry `s` of `header` lies on (a parsed header's index is
    checked)."""
    return header.meshes[s.mesh]


def sharded_layouts(header: ShardHeader) -> dict[int, tuple[ShardedEntry, MeshEntry]]:
    """Each sharded tensor's layout and mesh, by its index in `header.tensors`."""
    return {s.tensor: (s, header.meshes[s.mesh]) for s in header.sharded}


def _mesh_problem(m: MeshEntry) -> str:
    """What is wrong with a mesh entry ("" if nothing): its ranks fill its shape, once each and
    none negative, its coordinate lies inside it, its names are none or one a dimension."""
    if not all(0 < n <= _INT64_MAX for n in m.shape):
        return f"malformed mesh shape {m.shape}"
    if len(m.dims) not in (0, len(m.shape)):
        return f"{len(m.dims)} dimension names for a mesh of shape {m.shape}"
    ranks = len(m.ranks)
    if math.prod(m.shape) != ranks or len(set(m.ranks)) != ranks or min(m.ranks) < 0:
        return f"{ranks} mesh ranks for a mesh of shape {m.shape}"
    if len(m.coordinate) != len(m.shape) or not all(
        0 <= c < n for c, n in zip(m.coordinate, m.shape, strict=True)
    ):
        return f"coordinate {m.coordinate} outside the mesh {m.shape}"
    return ""


def _check_sharded(
    s: ShardedEntry,
    m: MeshEntry,
    t: TensorEntry,
    path: str,
    writers: dict[tuple[int, tuple[int, ...], tuple[str, ...]], int | None],
) -> None:
    """A sharded entry's layout is consistent: its shard is the box its placements give this
    rank's coordinate of its (checked) mesh, inside the global shape; its writer is the one
    the layout gives (or -1: an older file), so a holder cannot claim to store a replica's
    bytes that its writer stores, nor name another writer (`writers`: the layouts' writers
    worked out so far)."""
    problem = _layout_problem(
        t.shape, s.global_shape, s.offsets, m.shape, m.coordinate, s.placements
    )
    if not problem and s.writer != -1:
        key = (s.mesh, s.global_shape, s.placements)
        if key not in writers:
            writers[key] = replica_writer(
                s.global_shape, m.shape, m.ranks, m.coordinate, s.placements
            )
        writer = writers[key]
        if s.writer != (m.ranks[position(m.coordinate, m.shape)] if writer is None else writer):
            problem = f"names rank {s.writer} as its writer, the layout gives rank {writer}"
    if problem:
        raise ShardFormatError(path, f"sharded tensor {t.path!r}: {problem}")


@functools.lru_cache(maxsize=1024)
def _layout_problem(
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    offsets: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[str, ...],
) -> str:
    """What is wrong with a sharded layout on a valid mesh ("" if nothing): the same for the
    many tensors of a state that share shapes and a mesh, so worked out once per layout."""
    ndim = len(global_shape)
    if not (len(shape) == len(offsets) == ndim):
        return "dimensions differ from the tensor's"
    if len(placements) != len(mesh_shape):
        return "mesh dimensions differ"
    if not all(0 <= n <= _INT64_MAX for n in (*global_shape, *offsets)):
        return "malformed shape or offsets"
    if any(o + n > g for o, n, g in zip(offsets, shape, global_shape, strict=True)):
        return f"shard at {offsets} of shape {shape} outside {global_shape}"
    try:
        box = local_box(global_shape, mesh_shape, coordinate, placements)
    except ValueError as e:
        return str(e)
    if box != (offsets, shape):
        return f"placements {placements} do not give the shard at {offsets}"
    return ""


def _check_tensor(
    t: TensorEntry, blobs: tuple[BlobEntry, ...], shared: bool, path: str, *, stored: bool = True
) -> None:
    size = DTYPE_SIZES.get(t.dtype)
    if size is None:
        raise ShardFormatError(path, f"tensor {t.path!r} has unknown dtype {t.dtype!r}")
    if not 0 <= t.blob < len(blobs):
        raise ShardFormatError(path, f"tensor {t.path!r} refers to missing blob {t.blob}")
    if len(t.shape) != len(t.stride) or not all(
        0 <= n <= _INT64_MAX for n in (*t.shape, *t.stride, t.offset)
    ):
        raise ShardFormatError(path, f"tensor {t.path!r} has a malformed shape or stride")
    # torch multiplies the sizes in int64 (and zero-size tensors still carry the others).
    nominal = math.prod(max(n, 1) for n in t.shape)
    if nominal * size > _INT64_MAX:
        raise ShardFormatError(path, f"tensor {t.path!r} is too large for int64 sizes")
    blob_nbytes = blobs[t.blob].nbytes
    numel = math.prod(t.shape) if stored else 0  # (a replica another rank writes: no bytes)
    if not shared:
        if t.offset or t.stride != contiguous_strides(t.shape) or numel * size != blob_nbytes:
            raise ShardFormatError(
                path,
                f"tensor {t.path!r} alone in blob {t.blob} must be contiguous and fill its "
                f"{blob_nbytes} bytes (shape {t.shape}, stride {t.stride}, offset {t.offset})",
            )
        return
    last = t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True))
    if (numel and (last + 1) * size > blob_nbytes) or t.offset * size > blob_nbytes:
        raise ShardFormatError(path, f"tensor {t.path!r} reaches past the end of its blob")


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides as torch gives them (a zero-size dimension counts as 1)."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
