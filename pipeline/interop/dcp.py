"""A step as one torch.distributed.checkpoint (DCP) checkpoint, and a DCP checkpoint read back
without running any code it holds.

Writing (`DcpWriter`, `tierpipe export --to dcp`) uses DCP's own `FileSystemWriter` in this one
process, a rank at a time, so the folder is exactly what `dcp.save` of the job would leave:
`__<rank>_0.distcp` per saving rank (`torch.save` records at the offsets the metadata gives)
and one `.metadata` (a pickled `Metadata`), written last. Keys are DCP's own (its
`flatten_state_dict`: dict keys joined by dots, list indices where a list holds tensors or
dicts, a tuple or a list of plain values kept whole), so `dcp.load(state_dict)` of a state
shaped like the one saved finds every key. A sharded tensor (a DTensor's local shards) is one
tensor entry with one chunk per distinct shard (`tierpipe.interop.merge`); every other value is
rank 0's, as DCP keeps rank 0's copy of a value that is not a DTensor.

Reading (`read_dcp`, `tierpipe import --from dcp`): DCP's `FileSystemReader.read_metadata`
unpickles `.metadata` with `pickle.load`, and its default planner loads every non-tensor value
with `torch.load(weights_only=False)`: either runs whatever code a crafted file names. Here
`.metadata` is unpickled by an allow-list of DCP's metadata classes (anything else refused
before it is called), checked (file names inside the folder, byte ranges inside the files,
chunks that tile their tensors and fit in their records), and every value is loaded with
`torch.load(weights_only=True)`, as DCP already loads tensors.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor
from torch.distributed.checkpoint.storage import WriteResult

from tierpipe.errors import LayoutMismatchError, ShardFormatError, UnsupportedStateError
from tierpipe.interop.merge import Chunk, Merge, Sharded, check_tiling, element, sharded_by_path
from tierpipe.interop.merged import tensor_of
from tierpipe.schemas import ShardHeader

__all__ = ("METADATA_NAME", "DcpWriter", "nest", "read_dcp", "read_metadata")

#: The file that makes a folder a DCP checkpoint (written last).
METADATA_NAME = ".metadata"

_DCP_MD = "torch.distributed.checkpoint.metadata"
#: Every global a `.metadata` written by DCP names (torch 2.4-2.13), and nothing else.
_ALLOWED = frozenset(
    {(_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                            "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                            "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}
)  # fmt: skip


class DcpWriter:
    """Writes a step's ranks, one at a time (`add`), as one DCP checkpoint in `out`."""

    def __init__(self, out: Path) -> None:
        # (a crash half way must not leave an older `.metadata` naming files half rewritten)
        (out / METADATA_NAME).unlink(missing_ok=True)
        self.out = out
        self._writer = FileSystemWriter(out, single_file_per_rank=True, thread_count=1)
        self._writer.set_up_storage_writer(True)
        self._merge = Merge()
        self._items: list[WriteItem] = []
        self._results: list[list[WriteResult]] = []
        self._mapping: dict[str, tuple[str | int, ...]] = {}
        self._sharded: set[str] = set()

    def add(self, rank: int, header: ShardHeader, state: Any) -> None:
        """Write what `rank` adds to the checkpoint into `__<rank>_0.distcp`.

        Raises:
            LayoutMismatchError: its shards disagree with a lower rank's, or a sharded tensor
                sits where DCP keeps a value whole (in a tuple).
            UnsupportedStateError: two keys DCP would flatten to one name.
        """

        state = _numpy_free(state)
        try:
            flat, mapping = flatten_state_dict(state)
        except ValueError as e:  # ("duplicated flatten key": {0: ..} and {"0": ..})
            raise UnsupportedStateError((), f"not a DCP state dict: {e}") from e
        shards = {id(element(state, p)) for p in sharded_by_path(header)}
        new = {id(local): (s, c) for s, c, local in self._merge.add_rank(rank, header, state)}
        items: list[WriteItem] = []
        data: dict[MetadataIndex, Any] = {}
        found = set()
        for fqn, value in flat.items():
            if id(value) in shards:
                if fqn in self._merge.plain:
                    raise LayoutMismatchError(f"{fqn}: plain on a lower rank, sharded on {rank}")
                found.add(id(value))
                self._sharded.add(fqn)
                self._mapping.setdefault(fqn, mapping[fqn])
                if id(value) in new:
                    item = _shard_item(fqn, *new[id(value)], value)
                    items.append(item)
                    data[item.index] = value
                continue
            if fqn in self._sharded:
                raise LayoutMismatchError(f"{fqn}: sharded on a lower rank, plain on {rank}")
            if not self._merge.first(rank, fqn):
                continue
            self._mapping[fqn] = mapping[fqn]
            item = _value_item(fqn, value)
            items.append(item)
            data[item.index] = value
        if found != shards:
            raise LayoutMismatchError(
                "a sharded tensor inside a tuple or a list of plain values: DCP keeps those "
                "whole (pickled), so its shards would not merge"
            )
        if not items:
            return
        plan = SavePlan(items, storage_data=_StoragePrefix(f"__{rank}_"))
        plan = self._writer.prepare_local_plan(plan)
        self._results.append(self._writer.write_data(plan, _Resolver(data)).wait())
        self._items.extend(items)

    def finish(self) -> list[Path]:
        """Check the layout and write `.metadata` (the checkpoint exists from then on).

        Raises:
            LayoutMismatchError: a sharded tensor whose shards do not tile it.
        """
        self._merge.check()
        _, metadata = create_default_global_save_plan([SavePlan(self._items)])
        metadata.planner_data = dict(self._mapping)
        self._writer.finish(metadata, self._results)
        return [self.out]


def _shard_item(fqn: str, sharded: Sharded, chunk: Chunk, local: torch.Tensor) -> WriteItem:
    offsets = torch.Size(chunk.offsets)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk.sizes)),
            properties=TensorProperties.create_from_tensor(local),
            size=torch.Size(sharded.global_shape),
        ),
    )


def _value_item(fqn: str, value: Any) -> WriteItem:
    if isinstance(value, torch.Tensor):
        return _create_write_item_for_tensor(fqn, value)
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _numpy_free(state: Any) -> Any:
    """`state` with numpy arrays as tensors (DCP pickles anything else, and numpy's pickles
    need code to load); every other value is the same object."""
    if isinstance(state, dict):
        return {k: _numpy_free(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_numpy_free(v) for v in state]
    if type(state) is tuple:
        return tuple(_numpy_free(v) for v in state)
    return tensor_of(state)


class _Resolver(SavePlanner):
    """The one part of a `SavePlanner` DCP's writer calls: each item's bytes (a tensor, or a
    value `torch.save`d as DCP's default planner does)."""

    def __init__(self, data: dict[MetadataIndex, Any]) -> None:
        self._data = data

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> Any:
        raise NotImplementedError

    def create_global_plan(self, plans: Any) -> Any:
        raise NotImplementedError

    def finish_plan(self, plan: Any) -> Any:
        return plan

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self._data[item.index]
        if isinstance(value, torch.Tensor):
            return value.detach()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return buffer


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a `.metadata`, refusing any global that is not one of DCP's metadata types."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype | torch.layout | torch.memory_format):
                return found
        raise ShardFormatError(
            self.path, f"names {module}.{name}, which no DCP metadata holds (refused unread: "
            "unpickling it could run code)",
        )  # fmt: skip


def read_metadata(folder: Path) -> Metadata:
    """The checked `Metadata` of the DCP checkpoint in `folder`.

    Raises:
        ShardFormatError: no `.metadata`, a global outside DCP's metadata types, or metadata
            that does not describe the files beside it.
    """
    path = folder / METADATA_NAME
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
    except FileNotFoundError:
        raise ShardFormatError(str(folder), "not a DCP checkpoint: no .metadata in it") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError, MemoryError, RecursionError) as e:  # fmt: skip
        raise ShardFormatError(str(path), f"garbled: {type(e).__name__}: {e}") from e
    _check_metadata(metadata, folder, str(path))
    return metadata


def _check_metadata(md: Any, folder: Path, path: str) -> None:
    def bad(reason: str) -> ShardFormatError:
        return ShardFormatError(path, reason)

    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise bad("not a DCP Metadata")
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    sizes: dict[str, int] = {}
    for where in storage.values():
        name = getattr(where, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise bad(f"a data file name outside the folder: {name!r}")
        if getattr(where, "transform_descriptors", None):
            raise bad(f"{name}: stream transforms (compression) are not supported")
        if name not in sizes:
            try:
                if (folder / name).is_symlink():
                    raise bad(f"its data file {name} is a symbolic link (it could name any file)")
                sizes[name] = (folder / name).stat().st_size
            except OSError as e:
                raise bad(f"its data file {name} cannot be read: {e}") from e
        offset, length = getattr(where, "offset", -1), getattr(where, "length", -1)
        if not (isinstance(offset, int) and isinstance(length, int)) or offset < 0 or length < 0:
            raise bad(f"{name}: a record at {offset!r} of {length!r} bytes")
        if offset + length > sizes[name]:
            raise bad(f"{name}: a record ends at {offset + length}, past its {sizes[name]} bytes")
    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"a key that is not a string: {fqn!r}")
        keys = mapping.get(fqn, (fqn,))
        if (
            not isinstance(keys, tuple | list)
            or not keys
            or any(
                type(k) not in (str, int) or (type(k) is int and not 0 <= k < 1 << 20) for k in keys
            )
        ):
            raise bad(f"{fqn}: a key path {keys!r}")
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise bad(f"{fqn}: a value with no record")
            continue
        if not isinstance(item, TensorStorageMetadata) or not isinstance(
            getattr(item.properties, "dtype", None), torch.dtype
        ):
            raise bad(f"{fqn}: neither a tensor nor a value")
        shape = tuple(item.size)
        if any(type(n) is not int or n < 0 for n in shape):
            raise bad(f"{fqn}: a shape {list(shape)}")
        itemsize = torch.empty((), dtype=item.properties.dtype).element_size()
        chunks = {}
        for c in item.chunks:
            chunk = Chunk(tuple(c.offsets), tuple(c.sizes))
            if (
                len(chunk.offsets) != len(shape)
                or len(chunk.sizes) != len(shape)
                or any(type(x) is not int or x < 0 for x in (*chunk.offsets, *chunk.sizes))
            ):
                raise bad(f"{fqn}: a chunk {chunk} of a {len(shape)}-d tensor")
            where = storage.get(MetadataIndex(fqn, torch.Size(chunk.offsets)))
            if where is None:
                raise bad(f"{fqn}: the chunk at {list(chunk.offsets)} has no record")
            if chunk.numel * itemsize > where.length:
                raise bad(f"{fqn}: the chunk at {list(chunk.offsets)} is larger than its record")
            chunks[chunk] = 0
        try:
            check_tiling(fqn, shape, chunks)
        except LayoutMismatchError as e:
            raise bad(str(e)) from e


def read_dcp(folder: Path) -> dict[str, Any]:
    """The whole state of the DCP checkpoint in `folder` (full tensors, values), nested as it
    was saved (DCP's `planner_data`).

    Raises:
        ShardFormatError: the checkpoint is not one (see `read_metadata`), or its data files do
            not hold what the metadata says, or a value needs code to load.
    """

    metadata = read_metadata(folder)
    flat: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[fqn] = None
    try:
        dcp.load(flat, storage_reader=_reader(folder, metadata), planner=_planner(), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise ShardFormatError(str(folder), f"its data does not load: {_first_line(e)}") from e
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return nest(flat, {k: tuple(mapping.get(k, (k,))) for k in flat}, str(folder))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return next((line for line in reversed(text) if line.strip()), type(e).__name__)[:500]


def _reader(folder: Path, metadata: Metadata) -> Any:
    class _Reader(FileSystemReader):
        """DCP's reader, given the metadata already read (and checked) instead of unpickling
        `.metadata` itself."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata

    return _Reader(folder)


def _planner() -> Any:
    class _Planner(DefaultLoadPlanner):
        """DCP's load planner over flat keys, loading values with `weights_only=True` (its
        own uses `weights_only=False`: a crafted value would run code)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            value = torch.load(value, weights_only=True)
            self.original_state_dict[read_item.dest_index.fqn] = value

    return _Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def nest(flat: dict[str, Any], paths: dict[str, tuple[str | int, ...]], where: str) -> Any:
    """The nested state `flat` came from: each value at its key path, a container whose keys
    are the ints 0..n-1 a list (as DCP's `set_element` builds them).

    Raises:
        ShardFormatError: two keys that need a value and a container at one place.
    """
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        node = root
        *parents, last = paths[fqn]
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ShardFormatError(where, f"{fqn}: a value and a container at one key")
        if last in node:
            raise ShardFormatError(where, f"{fqn}: two values at one key")
        node[last] = _Leaf(value)
    return _lists(root)


class _Leaf:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _lists(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    built = {k: _lists(v) for k, v in node.items()}
    if built and all(type(k) is int for k in built) and sorted(built) == list(range(len(built))):
        return [built[i] for i in range(len(built))]
    return built
