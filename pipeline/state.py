"""Training state <-> shard image: flatten nested state into a header plus raw blobs, and back.

A state is what `Checkpointer.save()` accepts: dicts (str or int keys), lists, tuples, tensors,
numpy arrays, plain values (None, bool, int, float, str, bytes), numpy scalars, `torch.Size`,
`torch.dtype`, `torch.device`, and objects with `state_dict()` (modules, optimizers, schedulers),
which are stored as their state dict. The structure and plain values go into the header as msgpack;
every tensor becomes a view of a blob. Tensors that share storage share one blob and come back
sharing it (tied weights stay tied); any other tensor is stored compact and comes back contiguous.
No pickle: a shard holds data only.
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from tierpipe.errors import ShardFormatError, UnsupportedStateError
from tierpipe.schemas import BlobEntry, ShardHeader, TensorEntry
from tierpipe.shard import (
    DTYPE_SIZES,
    align_up,
    encode_head,
)

__all__ = (
    "StatePlan",
    "blob_view",
    "flatten_targets",
    "plan_state",
    "rebuild_state",
    "tensor_buffer",
)

KeyPath = tuple[str | int, ...]

_ZERO = bytes(16)
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


@dataclass(frozen=True, slots=True)
class _Copy:
    offset: int  # in the image
    nbytes: int
    src: torch.Tensor
    raw: bool  # src is a uint8 view of a shared storage's byte span


@dataclass(frozen=True, slots=True)
class StatePlan:
    """Where every byte of one state goes in a shard image."""

    header: ShardHeader
    #: Unsealed prefix + header + padding: the first `len(head)` bytes of the image.
    head: bytes
    #: Size of the whole image.
    nbytes: int
    copies: tuple[_Copy, ...]
    #: CUDA devices the state's tensors live on (empty for a CPU-only state).
    cuda_devices: frozenset[torch.device]
    #: Where each copy lands, as (offset, nbytes, dtype, shape): equal layouts can reuse the
    #: destination views of an earlier save into the same image.
    layout: tuple[tuple[int, int, torch.dtype, tuple[int, ...]], ...]

    @property
    def tensor_nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)

    def destinations(self, image: torch.Tensor) -> list[torch.Tensor]:
        """Views of `image` (a CPU uint8 tensor of at least `nbytes`) that the copies fill."""
        dsts = []
        for c in self.copies:
            dst = image[c.offset : c.offset + c.nbytes]
            dsts.append(dst if c.raw else dst.view(c.src.dtype).view(c.src.shape))
        return dsts

    def copy_into(
        self,
        dsts: list[torch.Tensor],
        *,
        device: torch.device | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Copy the tensors' bytes into their `destinations()`.

        The head is not written here: the caller owns the image's buffer. `device` limits the
        copy to tensors on that device. With `non_blocking`, copies from CUDA tensors are queued
        on the current stream and the caller synchronises.
        """
        for c, dst in zip(self.copies, dsts, strict=True):
            if device is None or c.src.device == device:
                dst.copy_(c.src, non_blocking=non_blocking)


def plan_state(
    state: Any, *, job: str, step: int, rank: int, world_size: int, node: str, epoch: int = 0
) -> StatePlan:
    """Flatten `state` and lay it out as a shard image.

    Raises:
        UnsupportedStateError: a value cannot be stored without pickle (names its key path).
    """
    tensors: list[torch.Tensor] = []
    paths: list[KeyPath] = []
    tree = _encode(state, (), tensors, paths, set())
    try:
        tree_bytes = _tree_encoder.encode(tree)
    except (TypeError, OverflowError, UnicodeEncodeError) as e:
        raise UnsupportedStateError((), f"cannot encode plain values: {e}") from e

    groups: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        shareable = t.numel() > 0 and not (t.is_conj() or t.is_neg())
        key = (t.device, t.untyped_storage().data_ptr()) if shareable else ("own", i)
        groups.setdefault(key, []).append(i)

    entries: list[TensorEntry | None] = [None] * len(tensors)
    blobs: list[BlobEntry] = []
    copies: list[tuple[int, int, torch.Tensor, bool]] = []  # (blob, nbytes, src, raw)
    offset = 0
    for members in groups.values():
        blob = len(blobs)
        if len(members) == 1:
            t = tensors[members[0]]
            nbytes = t.numel() * t.element_size()
            entries[members[0]] = TensorEntry(
                paths[members[0]],
                _dtype_name(t.dtype),
                tuple(t.shape),
                _contiguous(t.shape),
                blob,
                0,
            )
            src, raw = t, False
        else:
            first = tensors[members[0]]
            spans = [(_byte_span(tensors[i]), i) for i in members]
            start = min(s for (s, _), _ in spans) // 16 * 16
            end = max(e for (_, e), _ in spans)
            nbytes = end - start
            for (s, _), i in spans:
                t = tensors[i]
                entries[i] = TensorEntry(
                    paths[i],
                    _dtype_name(t.dtype),
                    tuple(t.shape),
                    tuple(t.stride()),
                    blob,
                    (s - start) // t.element_size(),
                )
            src = torch.empty(0, dtype=torch.uint8, device=first.device)
            src.set_(first.untyped_storage(), start, (nbytes,), (1,))
            raw = True
        blobs.append(BlobEntry(offset, nbytes, _ZERO))
        copies.append((blob, nbytes, src, raw))
        offset = align_up(offset + nbytes)

    header = ShardHeader(
        job=job,
        step=step,
        rank=rank,
        world_size=world_size,
        node=node,
        created=time.time(),
        epoch=epoch,
        tree=tree_bytes,
        tensors=tuple(e for e in entries if e is not None),
        blobs=tuple(blobs),
    )
    head = encode_head(header, sealed=False)
    data_offset = len(head)
    plan_copies = tuple(
        _Copy(data_offset + blobs[b].offset, n, src, raw) for b, n, src, raw in copies if n
    )
    return StatePlan(
        header=header,
        head=head,
        nbytes=data_offset + align_up(offset),
        copies=plan_copies,
        cuda_devices=frozenset(t.device for t in tensors if t.is_cuda),
        layout=tuple((c.offset, c.nbytes, c.src.dtype, tuple(c.src.shape)) for c in plan_copies),
    )


def rebuild_state(
    header: ShardHeader,
    blobs: list[torch.Tensor],
    path: str = "<shard>",
    *,
    tensors: list[torch.Tensor | None] | None = None,
) -> Any:
    """Rebuild the saved state from its header and one uint8 tensor per blob (or from the
    tensors already built, one per header entry).

    Tensors are views of the blob tensors (no copy); tensors that shared a blob share storage.
    """
    if tensors is not None:
        return _rebuild_tree(header, tensors, path)
    return _rebuild_tree(header, [blob_view(blobs[e.blob], e) for e in header.tensors], path)


def blob_view(blob: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """Entry `e`'s tensor as a view of its blob's uint8 tensor (no copy). The layout was
    checked against the blob when the header was parsed (`tierpipe.shard`)."""
    t = torch.empty(0, dtype=getattr(torch, e.dtype))  # e.dtype was checked against DTYPE_SIZES
    base = blob.storage_offset() // DTYPE_SIZES[e.dtype]
    return t.set_(blob.untyped_storage(), base + e.offset, e.shape, e.stride)


def _rebuild_tree(header: ShardHeader, tensors: list[Any], path: str) -> Any:
    try:
        return _decode(_tree_decoder.decode(header.tree), tensors)
    except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError, RecursionError) as e:
        raise ShardFormatError(path, f"garbled state tree: {e}") from e


def flatten_targets(into: Any) -> tuple[dict[KeyPath, torch.Tensor], list[tuple[Any, KeyPath]]]:
    """Key path -> tensor for every tensor in `into` (objects with `state_dict()` contribute
    their state's tensors, which alias their parameters), and the objects with
    `load_state_dict()` with their key paths, outermost first."""
    targets: dict[KeyPath, torch.Tensor] = {}
    loaders: list[tuple[Any, KeyPath]] = []

    def walk(v: Any, path: KeyPath) -> None:
        if isinstance(v, torch.Tensor):
            targets[path] = v.detach()
        elif isinstance(v, Mapping):
            for k, item in v.items():
                walk(item, (*path, k))
        elif isinstance(v, list | tuple):
            for i, item in enumerate(v):
                walk(item, (*path, i))
        elif callable(getattr(v, "state_dict", None)):
            if callable(getattr(v, "load_state_dict", None)):
                loaders.append((v, path))
            walk(v.state_dict(), path)

    walk(into, ())
    return targets, loaders


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (keep `t` alive while using it)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


# --- the state tree: msgpack values; containers and references are arrays tagged by their 1st item


def _encode(v: Any, path: KeyPath, tensors: list, paths: list, active: set[int]) -> Any:
    if type(v) in _SCALARS and type(v) is not int:
        return v
    if isinstance(v, torch.Tensor):
        paths.append(path)
        tensors.append(_check_tensor(v, path))
        return ["T", len(tensors) - 1]
    np = sys.modules.get("numpy")  # numpy values can only exist if numpy was imported
    if np is not None and isinstance(v, np.ndarray | np.generic):
        return _encode_numpy(np, v, path, tensors, paths)
    if isinstance(v, int):  # subclasses (IntEnum, ...) are stored as their base type
        v = int(v)
        return v if _INT_MIN <= v <= _UINT_MAX else ["I", str(v)]
    if isinstance(v, float | str):
        return float(v) if isinstance(v, float) else str(v)
    if isinstance(v, torch.Size):
        return ["Z", *map(int, v)]
    if isinstance(v, torch.dtype):
        return ["y", _dtype_name(v, path)]
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
                    _encode(k, path, tensors, paths, active),
                    _encode(item, (*path, k), tensors, paths, active),
                ]
            return out
        if isinstance(v, list | tuple):
            tag = "l" if isinstance(v, list) else "t"
            if all(type(x) in _SCALARS for x in v) and all(
                _INT_MIN <= x <= _UINT_MAX for x in v if type(x) is int
            ):  # e.g. random.getstate(): 625 ints, encoded as they are
                return [tag, *v]
            items = [_encode(x, (*path, i), tensors, paths, active) for i, x in enumerate(v)]
            return [tag, *items]
        if callable(getattr(v, "state_dict", None)):
            return _encode(v.state_dict(), path, tensors, paths, active)
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
    _dtype_name(t.dtype, path)
    return t.detach()


def _dtype_name(dtype: torch.dtype, path: KeyPath = ()) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise UnsupportedStateError(path, f"dtype {dtype} is not supported")
    return name


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return int(start), int(start + extent * t.element_size())
