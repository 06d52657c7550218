"""The full model of a step as one torch file a user loads without tierpipe (`tierpipe export
--to torch --merged`): `model.pt`, `torch.save` of the merged state (nested dicts and lists as
saved; every sharded tensor assembled into its global tensor, the other values rank 0's:
`tierpipe.interop.merge` says which rank's value is taken and checks that the shards tile each
tensor), loadable with `torch.load(path, weights_only=True)`.

Ranks are added one at a time (`MergedWriter.add`); `torch.save` takes one object, so what is
held is the merged state (the size of the full model) and the rank being read. The safetensors
export writes in place instead, holding one rank at a time (`tierpipe.interop.hfsplit`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tierpipe.interop.merge import Merge, key_name, leaves
from tierpipe.schemas import ShardHeader
from tierpipe.tree import KeyPath

__all__ = ("MergedWriter", "set_element", "tensor_of")


class MergedWriter:
    """Builds the merged state rank by rank, then writes it (`finish`)."""

    def __init__(self, out: Path) -> None:
        self.out = out
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
        path = self.out / "model.pt"
        torch.save(state, path)
        return [path]


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
