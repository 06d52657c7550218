"""DDP's replicated state in the integrations: the top-level keys of a framework's checkpoint
that a callback declares `replicated` to its `Checkpointer` (their tensors stored once per job).

Under DistributedDataParallel every rank holds the whole model and, the gradients being averaged
before each step, the same optimizer state: stored by every rank, they cost world-size copies.
The Lightning and Hugging Face callbacks therefore declare the keys of those two (each names
its own) when a run is data parallel over more than one rank, and none otherwise (a single
device; DTensor state, which describes its own layout). Everything else stays each rank's own:
its RNG states, the loops' and callbacks' state, a stateful loader's position, and every plain
value under a declared key. A callback's `replicated` argument overrides the rule. And the
torch RNG state each rank saves as its own (`rng_state`, `put_back_rng`). No framework is
imported here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from tierpipe.errors import ConfigError

__all__ = (
    "Replicated",
    "check_declared",
    "declared_keys",
    "put_back_rng",
    "rng_state",
    "validate_replicated",
)

#: A callback's `replicated` argument: None for the default rule, else the keys (`()`: none).
Replicated = Collection[str] | None


def validate_replicated(choice: Replicated) -> frozenset[str] | None:
    """`choice` as a callback keeps it: None (the default rule), or a frozenset of key names.

    Raises:
        ConfigError: a bare string (one key is `("key",)`), or a key that is not a string.
    """
    if choice is None:
        return None
    if isinstance(choice, str) or not all(isinstance(k, str) for k in choice):
        raise ConfigError(f"replicated takes key names, e.g. ('model',) (got {choice!r})")
    return frozenset(choice)


def declared_keys(
    choice: Replicated, default: Collection[str], *, data_parallel: bool
) -> frozenset[str]:
    """The keys to declare: `choice` where given, else `default` if the run is data parallel
    (DDP over more than one rank), else none."""
    if choice is not None:
        return frozenset(choice)
    return frozenset(default) if data_parallel else frozenset()


def check_declared(keys: Collection[str], present: Collection[object]) -> None:
    """Refuse declared keys the checkpoint does not have (a typo would store every byte per rank).

    Raises:
        ConfigError: naming the missing keys and the checkpoint's.
    """
    missing = sorted(set(keys) - set(present))
    if missing:
        raise ConfigError(
            f"replicated names keys the checkpoint does not have: {missing} "
            f"(it has {sorted(map(str, present))})"
        )


def rng_state() -> dict[str, Any]:
    """This rank's torch RNG states: the CPU's, and every CUDA device's once CUDA is in use."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def put_back_rng(state: dict[str, Any] | None) -> None:
    """Set torch's RNG to `state`, as `rng_state()` took it (None: leave it)."""
    if state is not None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
