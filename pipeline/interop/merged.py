"""The full model of a step as one file set a user loads without tierpipe (`tierpipe export
--merged`): every sharded tensor assembled into its global tensor, the other values rank 0's
(`tierpipe.interop.merge` says which rank's value is taken and checks that the shards tile
each tensor).

- `torch`: `model.pt`, `torch.save` of the merged state (nested dicts and lists as saved),
  loadable with `torch.load(path, weights_only=True)`.
- `safetensors`: `model.safetensors`, the tensors under their dotted key paths, the other
  values and the checkpoint's identity in its metadata as JSON (`tierpipe.values`,
  `tierpipe.checkpoint`); above `max_file_bytes` (5 GB, as Hugging Face's `max_shard_size`)
  split into `model-00001-of-0000N.safetensors` files with a `model.safetensors.index.json`
  (`metadata.total_size`, `weight_map`: key -> file), which `transformers` and
  `safetensors`-aware loaders read.

Ranks are added one at a time (`MergedWriter.add`): what is held is the merged state being
built (the size of the full model) and the rank being read, never every rank at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from tierpipe.interop.merge import Merge, key_name, leaves
from tierpipe.schemas import ShardHeader
from tierpipe.tree import KeyPath

__all__ = ("INDEX_NAME", "MAX_FILE_BYTES", "MergedWriter", "set_element", "tensor_of")

#: Hugging Face's default largest file of a split checkpoint (`max_shard_size="5GB"`).
MAX_FILE_BYTES = 5 * 10**9
#: The index of a split safetensors checkpoint, as Hugging Face names it.
INDEX_NAME = "model.safetensors.index.json"


class MergedWriter:
    """Builds the merged state rank by rank, then writes it (`finish`)."""

    def __init__(
        self, fmt: str, out: Path, identity: dict[str, Any], *, max_file_bytes: int
    ) -> None:
        self.fmt, self.out, self.identity = fmt, out, identity
        self.max_file_bytes = max_file_bytes
        self._merge = Merge()
        self._state: Any = None
        self._full: dict[KeyPath, torch.Tensor] = {}

    def add(self, rank: int, header: ShardHeader, state: Any) -> None:
        """Copy `rank`'s shards into their global tensors; keep its plain values that no lower
        rank had."""
        for sharded, chunk, local in self._merge.add_rank(rank, header, state):
            full = self._full.get(sharded.path)
            if full is None:
                full = torch.empty(sharded.global_shape, dtype=sharded.dtype)
                self._full[sharded.path] = full
            full[chunk.index()] = local
        if self._state is None:
            self._state = state
        for path, value in list(leaves(state)):
            if path in self._full or not self._merge.first(rank, path):
                continue
            if self._state is not state:
                self._state = set_element(self._state, path, value)

    def finish(self) -> list[Path]:
        """Write the merged state; the paths written.

        Raises:
            LayoutMismatchError: a sharded tensor whose shards do not tile it.
        """
        self._merge.check()
        state = self._state
        for key, full in self._full.items():
            state = set_element(state, key, full)
        self._state = None
        if self.fmt == "torch":
            path = self.out / "model.pt"
            torch.save(state, path)
            return [path]
        return self._safetensors(state)

    def _safetensors(self, state: Any) -> list[Path]:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        storages: set[int] = set()
        for path, leaf in leaves(state):
            value = tensor_of(leaf)
            if isinstance(value, torch.Tensor):
                tensors[key_name(path)] = _apart(value.detach(), storages)
            else:
                values[key_name(path)] = value
        files = _split(tensors, self.max_file_bytes)
        meta = {"format": "pt", "tierpipe.checkpoint": json.dumps(self.identity)}
        plain = json.dumps(values, default=str)
        if len(files) == 1:
            single = self.out / "model.safetensors"
            save_file(tensors, os.fspath(single), metadata={**meta, "tierpipe.values": plain})
            return [single]
        written, weight_map = [], {}
        for i, keys in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            extra = {"tierpipe.values": plain} if i == 0 else {}
            save_file({k: tensors[k] for k in keys}, os.fspath(self.out / name),
                      metadata={**meta, **extra})  # fmt: skip
            weight_map.update(dict.fromkeys(keys, name))
            written.append(self.out / name)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total, **meta, "tierpipe.values": plain},
                 "weight_map": weight_map}  # fmt: skip
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return [*written, self.out / INDEX_NAME]


def _split(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys in order, into files of at most `max_bytes` (a larger tensor gets one of its own),
    as Hugging Face's `split_torch_state_dict_into_shards` fills them."""
    files: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(key)
        size += nbytes
    return files


def _apart(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`t` as safetensors takes it: contiguous, in a storage of its own (a copy when it shares
    one with a tensor already taken, or is a view of a larger one)."""
    storage = t.untyped_storage()
    whole = t.is_contiguous() and t.numel() * t.element_size() == storage.nbytes()
    if not whole or storage.data_ptr() in storages:
        t = t.contiguous().clone()
        storage = t.untyped_storage()
    if storage.nbytes():
        storages.add(storage.data_ptr())
    return t


def set_element(state: Any, path: KeyPath, value: Any) -> Any:
    """`state` with `value` at `path` (the root returned: a tuple on the way is rebuilt; a
    missing dict on the way is made)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(state, tuple):
        items = list(state)
        items[key] = set_element(items[key], rest, value)  # type: ignore[index]
        return type(state)(items) if type(state) is tuple else type(state)(*items)
    if state is None:
        state = {}
    if isinstance(state, list) and isinstance(key, int) and key < len(state):
        state[key] = set_element(state[key], rest, value)
    elif isinstance(state, dict):
        state[key] = set_element(state.get(key), rest, value)
    else:
        raise TypeError(f"cannot place a value at {key_name(path)} in a {type(state).__name__}")
    return state


def tensor_of(value: Any) -> Any:
    """A numpy array as a tensor (sharing its memory); anything else as it is."""
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return torch.from_numpy(value)
    return value
