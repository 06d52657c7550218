"""Recovery: getting a job's state back after a restart.

`plan` decides which step to restore and where each rank reads it from (pure); `agree` runs the
ranks' agreement on the stream (or through `collective`, torch.distributed); `load` reads a
shard back from NVMe or object storage, verified; `reindex` rebuilds a job's events from the
shards themselves. Names are imported on first use, so `tierpipe plan` and `tierpipe reindex`
never pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierpipe.recovery.agree import Restored
    from tierpipe.recovery.load import Expected, load_into, load_shard
    from tierpipe.recovery.plan import Plan, Source, plan_recovery

_LAZY = {
    "Expected": "tierpipe.recovery.load",
    "Plan": "tierpipe.recovery.plan",
    "Restored": "tierpipe.recovery.agree",
    "Source": "tierpipe.recovery.plan",
    "load_into": "tierpipe.recovery.load",
    "load_shard": "tierpipe.recovery.load",
    "plan_recovery": "tierpipe.recovery.plan",
}

__all__ = (
    "Expected",
    "Plan",
    "Restored",
    "Source",
    "load_into",
    "load_shard",
    "plan_recovery",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierpipe.recovery' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
