"""tierpipe: asynchronous multi-tier checkpoints for large training runs.

Training code uses `Checkpointer`; node agents run the stages in `stages/`. Names are imported on
first use, so node agents (which never touch tensors) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.errors import (
    AgentLockedError,
    BusAuthError,
    BusUnavailableError,
    ConfigError,
    IntegrityError,
    InvalidNameError,
    NoSpaceError,
    PermanentError,
    RetryableError,
    ShardFailedError,
    ShardFormatError,
    ShardMissingError,
    SlotTimeoutError,
    StaleStepError,
    StorageAuthError,
    StorageConflictError,
    StorageUnavailableError,
    TierpipeError,
    UnavailableError,
    UnsupportedStateError,
)
from pipeline.settings import Settings, load_settings

if TYPE_CHECKING:
    from pipeline.client import Checkpointer, SaveHandle, SaveStats
    from pipeline.restore import load_shard
    from pipeline.state import write_shard

_LAZY = {
    "Checkpointer": "pipeline.client",
    "SaveHandle": "pipeline.client",
    "SaveStats": "pipeline.client",
    "load_shard": "pipeline.restore",
    "write_shard": "pipeline.state",
}

__all__ = [
    "AgentLockedError",
    "BusAuthError",
    "BusUnavailableError",
    "Checkpointer",
    "ConfigError",
    "IntegrityError",
    "InvalidNameError",
    "NoSpaceError",
    "PermanentError",
    "RetryableError",
    "SaveHandle",
    "SaveStats",
    "Settings",
    "ShardFailedError",
    "ShardFormatError",
    "ShardMissingError",
    "SlotTimeoutError",
    "StaleStepError",
    "StorageAuthError",
    "StorageConflictError",
    "StorageUnavailableError",
    "TierpipeError",
    "UnavailableError",
    "UnsupportedStateError",
    "load_settings",
    "load_shard",
    "write_shard",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
