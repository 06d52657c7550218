"""tierpipe: asynchronous multi-tier checkpoints for large training runs.

Training code uses `Checkpointer`; node agents run the stages in `stages/`. Names are imported on
first use, so node agents (which never touch tensors) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from tierpipe import errors
from tierpipe.errors import *  # noqa: F403  (the whole error tree is public)
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings, load_settings

if TYPE_CHECKING:
    from tierpipe.recovery.load import load_shard
    from tierpipe.storage.shardfile import write_shard
    from tierpipe.trainer.checkpointer import Checkpointer
    from tierpipe.trainer.handle import SaveHandle, SaveStats

try:
    #: The installed distribution's version (`tierpipe --version` prints it).
    __version__ = importlib.metadata.version("tierpipe")
except importlib.metadata.PackageNotFoundError:  # (a source tree on sys.path, not installed)
    __version__ = "0+unknown"

_LAZY = {
    "Checkpointer": "tierpipe.trainer.checkpointer",
    "SaveHandle": "tierpipe.trainer.handle",
    "SaveStats": "tierpipe.trainer.handle",
    "load_shard": "tierpipe.recovery.load",
    "write_shard": "tierpipe.storage.shardfile",
}

__all__ = (
    "__version__",
    "Checkpointer",
    "Keep",
    "SaveHandle",
    "SaveStats",
    "Settings",
    "load_settings",
    "load_shard",
    "write_shard",
    *errors.__all__,
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
