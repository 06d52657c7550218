"""tierpipe: asynchronous multi-tier checkpoints for large training runs.

Training code uses `Checkpointer`; node agents run the stages in `stages/`. Names are imported on
first use, so node agents (which never touch tensors) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tierpipe.errors import (
    AgentLockedError,
    BusAuthError,
    BusUnavailableError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
    NoCheckpointError,
    NoSpaceError,
    PermanentError,
    RestoreTimeoutError,
    RetryableError,
    ShardFailedError,
    ShardFormatError,
    ShardMissingError,
    SlotTimeoutError,
    SourceUnreachableError,
    StaleStepError,
    StorageAuthError,
    StorageConflictError,
    StorageUnavailableError,
    TierpipeError,
    UnavailableError,
    UnsupportedStateError,
    WorldSizeMismatchError,
)
from tierpipe.settings import Settings, load_settings

if TYPE_CHECKING:
    from tierpipe.client import Checkpointer
    from tierpipe.handle import SaveHandle, SaveStats
    from tierpipe.recovery.load import load_shard
    from tierpipe.storage.shardfile import write_shard

_LAZY = {
    "Checkpointer": "tierpipe.client",
    "SaveHandle": "tierpipe.handle",
    "SaveStats": "tierpipe.handle",
    "load_shard": "tierpipe.recovery.load",
    "write_shard": "tierpipe.storage.shardfile",
}

__all__ = (
    "AgentLockedError",
    "BusAuthError",
    "BusUnavailableError",
    "Checkpointer",
    "ConfigError",
    "IntegrityError",
    "InvalidNameError",
    "NoCheckpointError",
    "NoSpaceError",
    "PermanentError",
    "RestoreTimeoutError",
    "RetryableError",
    "SaveHandle",
    "SaveStats",
    "Settings",
    "ShardFailedError",
    "ShardFormatError",
    "ShardMissingError",
    "SlotTimeoutError",
    "SourceUnreachableError",
    "StaleStepError",
    "StorageAuthError",
    "StorageConflictError",
    "StorageUnavailableError",
    "TierpipeError",
    "UnavailableError",
    "UnsupportedStateError",
    "WorldSizeMismatchError",
    "load_settings",
    "load_shard",
    "write_shard",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
