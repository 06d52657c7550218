"""The state tree: a state's structure and plain values, as msgpack, with references to tensors.

`encode_tree` walks a state (see `tierpipe.state`) and writes its structure as msgpack values:
scalars as they are; containers and references as arrays tagged by their first item (`d` dict, `l`
list, `t` tuple, `T` tensor and `N` numpy array by index, `I` big int, `S` numpy scalar, `Z`
`torch.Size`, `y` dtype, `v` device). Tensors are collected, in order, with their key paths; the
shard stores their bytes as blobs. A DTensor is stored as its local shard (a `T` reference like any
tensor) with its global layout beside it (`describe_dtensor`: a `ShardedEntry`, with the rank
that writes its bytes for all the ranks holding the same box, and its mesh a `MeshEntry` listed
once however many DTensors lie on it). `decode_tree`
reads a tree back from a file, so it checks every tag's items to be what `encode_tree` writes. No
pickle: a tree holds data only.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from tierpipe.errors import ShardFormatError, UnsupportedStateError
from tierpipe.schemas import MeshEntry, ShardedEntry
from tierpipe.storage.shard import DTYPE_SIZES
from tierpipe.storage.sharding import local_box, position, replica_writer

__all__ = (
    "KeyPath",
    "decode_tree",
    "describe_dtensor",
    "dtype_name",
    "encode_tree",
    "is_dtensor",
    "placement_text",
)

KeyPath = tuple[str | int, ...]

_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_tree_encoder = msgspec.msgpack.Encoder()
_tree_decoder = msgspec.msgpack.Decoder()
#: How deeply containers may nest in a state (each side of a round trip enforces it, so what
#: saves also loads, and a crafted tree cannot exhaust the stack).
_MAX_DEPTH = 128
#: torch dtypes numpy shares (`N` references: numpy arrays saved as tensors).
_NUMPY_DTYPES = frozenset(
    {"bool", "float16", "float32", "float64", "complex64", "complex128"}
    | {f"{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)}
)
#: A numpy scalar's dtype string as `_encode_numpy` writes it (`<f4`, `|b1`): numeric only.
_NUMPY_SCALAR = re.compile(r"[<>|=][biufc][0-9]{1,2}")


def encode_tree(
    state: Any,
) -> tuple[bytes, list[torch.Tensor], list[KeyPath], list[ShardedEntry], list[MeshEntry]]:
    """The state tree of `state` as msgpack, its tensors in reference order, their key paths,
    the global layouts of those that are DTensors' local shards (`ShardedEntry.tensor` indexes
    the tensors) and the meshes those lie on, each once (`ShardedEntry.mesh` indexes them).

    Raises:
        UnsupportedStateError: a value cannot be stored without pickle, or a DTensor's layout
            cannot be described (names its key path).
    """
    tensors: list[torch.Tensor] = []
    paths: list[KeyPath] = []
    sharded = _Layouts()
    tree = _encode(state, (), tensors, paths, set(), sharded)
    try:
        tree_bytes = _tree_encoder.encode(tree)
    except (TypeError, OverflowError, UnicodeEncodeError) as e:
        raise UnsupportedStateError((), f"cannot encode plain values: {e}") from e
    return tree_bytes, tensors, paths, sharded.entries, sharded.meshes


class _Layouts:
    """The sharded entries of a state being encoded and its table of meshes: a mesh is listed
    once, found by identity (`describe_dtensor` gives one `MeshEntry` object a mesh), else by
    equality (a new object is compared with the few meshes listed, not hashed: ranks can
    number thousands)."""

    def __init__(self) -> None:
        self.entries: list[ShardedEntry] = []
        self.meshes: list[MeshEntry] = []
        self._by_id: dict[int, tuple[MeshEntry, int]] = {}  # (holds the object: ids stay unique)

    def add(self, layout: ShardedEntry, mesh: MeshEntry, tensor: int) -> None:
        hit = self._by_id.get(id(mesh))
        if hit is None or hit[0] is not mesh:
            index = next((i for i, m in enumerate(self.meshes) if m == mesh), len(self.meshes))
            if index == len(self.meshes):
                self.meshes.append(mesh)
            hit = self._by_id[id(mesh)] = (mesh, index)
        self.entries.append(msgspec.structs.replace(layout, tensor=tensor, mesh=hit[1]))


def decode_tree(tree: bytes, tensors: list[Any], path: str) -> Any:
    """The state that `tree` (from the shard at `path`) describes, with `tensors` (one per header
    entry) in place of its references.

    Raises:
        ShardFormatError: the tree is garbled or not what `encode_tree` writes.
    """
    try:
        return _decode(_tree_decoder.decode(tree), tensors)
    except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError, RecursionError) as e:
        raise ShardFormatError(path, f"garbled state tree: {e}") from e


def _encode(
    v: Any, path: KeyPath, tensors: list, paths: list, active: set[int], sharded: _Layouts
) -> Any:
    if type(v) in _SCALARS and type(v) is not int:
        return v
    if isinstance(v, torch.Tensor):
        if is_dtensor(v):
            local, layout, mesh = describe_dtensor(v, path)
            sharded.add(layout, mesh, len(tensors))
            v = local
        paths.append(path)
        tensors.append(_check_tensor(v, path))
        return ["T", len(tensors) - 1]
    np = sys.modules.get("numpy")  # numpy values can only exist if numpy was imported
    if np is not None and hasattr(np, "generic") and isinstance(v, np.ndarray | np.generic):
        return _encode_numpy(np, v, path, tensors, paths)
    if isinstance(v, int):  # subclasses (IntEnum, ...) are stored as their base type
        v = int(v)
        return v if _INT_MIN <= v <= _UINT_MAX else ["I", str(v)]
    if isinstance(v, float | str):
        return float(v) if isinstance(v, float) else str(v)
    if isinstance(v, torch.Size):
        return ["Z", *map(int, v)]
    if isinstance(v, torch.dtype):
        return ["y", dtype_name(v, path)]
    if isinstance(v, torch.device):
        return ["v", str(v)]
    if isinstance(v, Mapping | list | tuple) and len(path) >= _MAX_DEPTH:
        raise UnsupportedStateError(path, f"containers nest deeper than {_MAX_DEPTH} levels")
    if id(v) in active:
        raise UnsupportedStateError(path, "the state contains a reference cycle")
    active.add(id(v))
    try:
        if isinstance(v, Mapping):
            out: list[Any] = ["d"]
            for k, item in v.items():
                if not isinstance(k, str | int):
                    raise UnsupportedStateError(path, f"dict key {k!r} is not a str or int")
                out += [
                    _encode(k, path, tensors, paths, active, sharded),
                    _encode(item, (*path, k), tensors, paths, active, sharded),
                ]
            return out
        if isinstance(v, list | tuple):
            tag = "l" if isinstance(v, list) else "t"
            if all(type(x) in _SCALARS for x in v) and all(
                _INT_MIN <= x <= _UINT_MAX for x in v if type(x) is int
            ):  # e.g. random.getstate(): 625 ints, encoded as they are
                return [tag, *v]
            items = [
                _encode(x, (*path, i), tensors, paths, active, sharded) for i, x in enumerate(v)
            ]
            return [tag, *items]
        if callable(getattr(v, "state_dict", None)):
            return _encode(v.state_dict(), path, tensors, paths, active, sharded)
    finally:
        active.discard(id(v))
    raise UnsupportedStateError(path, f"values of type {type(v).__qualname__} are not supported")


def _encode_numpy(np: Any, v: Any, path: KeyPath, tensors: list, paths: list) -> Any:
    if isinstance(v, np.generic):
        if v.dtype.kind not in "biufc":
            raise UnsupportedStateError(path, f"numpy scalar of dtype {v.dtype} is not supported")
        return ["S", v.dtype.str, v.tobytes()]
    if v.dtype.kind not in "biufc" or v.dtype.byteorder == ">":
        raise UnsupportedStateError(path, f"numpy arrays of dtype {v.dtype.str} are not supported")
    paths.append(path)
    tensors.append(torch.from_numpy(np.ascontiguousarray(v)))
    return ["N", len(tensors) - 1]


def _decode(v: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    """Rebuild one value of the state tree. The tree comes from a file, so every tag's items
    are checked to be what `_encode` writes: a bad tree is a ValueError, never a value the
    writer could not have made (an out-of-range tensor reference, an object dtype)."""
    if not isinstance(v, list):
        if type(v) not in _SCALARS:  # a map, or a msgpack extension type
            raise ValueError(f"unexpected {type(v).__name__} in state tree")
        return v
    if not v:
        raise ValueError("empty array in state tree")
    tag, items = v[0], v[1:]
    match tag:
        case "d" | "l" | "t":
            if depth >= _MAX_DEPTH:
                raise ValueError(f"state tree nested deeper than {_MAX_DEPTH}")
            children = [_decode(x, tensors, depth + 1) for x in items]
            if tag == "l":
                return children
            if tag == "t":
                return tuple(children)
            if len(children) % 2 or not all(type(k) in (str, int, bool) for k in children[::2]):
                raise ValueError("malformed dict in state tree")
            return dict(zip(children[::2], children[1::2], strict=True))
        case "T":
            return tensors[_reference(items, tensors)]
        case "N":
            t = tensors[_reference(items, tensors)]
            if str(t.dtype).removeprefix("torch.") not in _NUMPY_DTYPES:
                raise ValueError(f"numpy array of dtype {t.dtype}")
            return t.numpy()
        case "I" if len(items) == 1 and type(items[0]) is str:
            return int(items[0])
        case "S":
            return _numpy_scalar(items)
        case "Z" if all(type(n) is int and _INT_MIN <= n < -_INT_MIN for n in items):
            return torch.Size(items)
        case "y" if len(items) == 1 and items[0] in DTYPE_SIZES:
            return getattr(torch, items[0])
        case "v" if len(items) == 1 and type(items[0]) is str:
            try:
                return torch.device(items[0])
            except RuntimeError as e:  # torch's error for an unknown device string
                raise ValueError(f"bad device {items[0]!r}: {e}") from e
    raise ValueError(f"unknown or malformed tag {tag!r} in state tree")


def _numpy_scalar(items: list[Any]) -> Any:
    """A numpy scalar from its `S` items: a numeric dtype string and exactly its bytes."""
    if len(items) != 2 or type(items[0]) is not str or not _NUMPY_SCALAR.fullmatch(items[0]):
        raise ValueError(f"numpy scalar {items!r:.80}")
    import numpy as np

    dtype = np.dtype(items[0])
    if type(items[1]) is not bytes or len(items[1]) != dtype.itemsize:
        raise ValueError(f"numpy scalar of dtype {items[0]} holds {items[1]!r:.80}")
    return np.frombuffer(items[1], dtype=dtype)[0]


def _reference(items: list[Any], tensors: list[torch.Tensor]) -> int:
    """The tensor index a `T`/`N` item holds, checked."""
    if len(items) != 1 or type(items[0]) is not int or not 0 <= items[0] < len(tensors):
        raise ValueError(f"tensor reference {items!r:.80} (the shard has {len(tensors)} tensors)")
    return items[0]


def _check_tensor(t: torch.Tensor, path: KeyPath) -> torch.Tensor:
    if type(t) not in _PLAIN_TENSOR_TYPES:
        raise UnsupportedStateError(
            path, f"tensor subclass {type(t).__qualname__} (save its local tensor instead)"
        )
    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested:
        raise UnsupportedStateError(
            path, f"only dense strided tensors are supported (got {t.layout})"
        )
    dtype_name(t.dtype, path)
    return t.detach()


def is_dtensor(v: object) -> bool:
    """Whether `v` is a `torch.distributed.tensor.DTensor` (none exists unless that module was
    imported, so a state without one never imports torch.distributed; nor until the module,
    maybe being imported by another thread, has defined it)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(v, cls)


def placement_text(p: object) -> str | None:
    """A torch placement as `ShardedEntry.placements` spells it (`R`, `S<d>`, `SS<d>:<f>`);
    None for one that is no value yet (`Partial`) or unknown."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return f"SS{p.dim}:{int(p.split_factor)}"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    return "R" if isinstance(p, Replicate) else None


def describe_dtensor(v: Any, path: KeyPath = ()) -> tuple[torch.Tensor, ShardedEntry, MeshEntry]:
    """A DTensor's local tensor (detached: it is this rank's memory, no copy), its global layout
    (`ShardedEntry.tensor` and `.mesh` left 0): the global shape, where the local shard lies in
    the global tensor (torch's `compute_local_shape_and_global_offset`, what DCP records as a
    chunk) and the placements; and its mesh with this rank's coordinate (one `MeshEntry`
    object for every DTensor of a mesh, while the cache holds it).

    Raises:
        UnsupportedStateError: a layout a `ShardedEntry` cannot describe exactly, named with
            its key path: a `Partial` placement (a pending reduction, not a value yet), a rank
            outside the mesh, a shard that is not one box of the global tensor, a non-default
            shard order.
    """
    spec = v._spec  # (placements, mesh and shard order in one: a DTensor always has it)
    order = None if spec.use_strided_shard_as_shard_order else spec.shard_order
    try:
        at = spec.mesh.get_coordinate()  # (part of the key: meshes compare equal across ranks)
        coordinate = None if at is None else tuple(at)
        layout, mesh, shape = _layout(spec.mesh, coordinate, spec.placements, tuple(v.shape), order)
    except UnsupportedStateError as e:
        raise UnsupportedStateError(path, e.reason) from None
    local = v._local_tensor.detach()
    if tuple(local.shape) != shape:
        raise UnsupportedStateError(
            path, f"DTensor's local tensor has shape {tuple(local.shape)}, its layout {shape}"
        )
    return local, layout, mesh


@functools.lru_cache(maxsize=4096)
def _layout(
    mesh: Any,
    coordinate: tuple[int, ...] | None,
    placements: tuple[Any, ...],
    global_shape: tuple[int, ...],
    order: Any,
) -> tuple[ShardedEntry, MeshEntry, tuple[int, ...]]:
    """`describe_dtensor`'s layout, mesh and local shape: the same for every DTensor of one mesh,
    placements and shape, so worked out once (a save describes every DTensor of the state
    each time, and torch's arithmetic takes ~0.2 ms a tensor)."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    strings: list[str] = []
    for p in placements:
        if (text := placement_text(p)) is not None:
            strings.append(text)
        elif isinstance(p, Partial):
            raise UnsupportedStateError(
                (), f"DTensor with a Partial placement ({p}): a pending reduction, not a value "
                "yet (redistribute it to Replicate or Shard before saving)"
            )  # fmt: skip
        else:
            raise UnsupportedStateError((), f"DTensor placement {p!r} is not supported")
    if order is not None and order != DTensorSpec.compute_default_shard_order(placements):
        raise UnsupportedStateError((), f"DTensor with a non-default shard order {order}")
    if coordinate is None:
        raise UnsupportedStateError((), "DTensor on a mesh this rank is not part of")
    shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    entry = _mesh_entry(mesh, coordinate)
    layout = ShardedEntry(
        tensor=0,
        global_shape=tuple(map(int, global_shape)),
        offsets=tuple(map(int, offsets)),
        mesh=0,
        placements=tuple(strings),
    )
    box = local_box(layout.global_shape, entry.shape, entry.coordinate, layout.placements)
    if box != (layout.offsets, tuple(shape)):
        raise UnsupportedStateError(
            (), f"DTensor of shape {global_shape} with placements {placements}: this rank's "
            f"shard (shape {tuple(shape)} at {layout.offsets}) is not one box of the global "
            "tensor"
        )  # fmt: skip
    writer = replica_writer(
        layout.global_shape, entry.shape, entry.ranks, entry.coordinate, layout.placements
    )
    own = entry.ranks[position(entry.coordinate, entry.shape)]
    layout = msgspec.structs.replace(layout, writer=own if writer is None else writer)
    return layout, entry, tuple(map(int, shape))


@functools.lru_cache(maxsize=64)
def _mesh_entry(mesh: Any, coordinate: tuple[int, ...]) -> MeshEntry:
    """A mesh with this rank's coordinate in it: one object a mesh (and coordinate), however
    many layouts lie on it, so a save's table of meshes finds it by identity."""
    return MeshEntry(
        shape=tuple(map(int, mesh.shape)),
        dims=tuple(mesh.mesh_dim_names or ()),
        ranks=tuple(map(int, mesh.mesh.flatten().tolist())),
        coordinate=tuple(map(int, coordinate)),
    )


def dtype_name(dtype: torch.dtype, path: KeyPath = ()) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UnsupportedStateError(path, f"dtype {dtype} is not supported")
    return name
