"""The node agent's stages, one module each, in pipeline order: nvme_write, verify, replicate
(copies to partner nodes), flush and evict. (The first stage, the snapshot, runs in the
trainer: `tierpipe.trainer.snapshot`.)

An agent stage module is its contract (`tierpipe.runner.Stage`): `STAGE` (its name), `KINDS`
(the events it consumes), an optional `open(settings, bus)` (an async context manager that opens
its resources and yields its context) and `handle(ctx, event, attempt)`, which returns the
event(s) to publish. The runner does the rest: consumer, acks, retries, heartbeats, logging.
Stages never import each other, nothing outside this package imports one (the agent finds them
by name here: `agent_stage`), and this package imports none of them until asked.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierpipe.runner import Stage

#: Agent stages in pipeline order, by the name `tierpipe worker <name>` uses: their modules
#: (or a stage itself, as a test may put in).
AGENT_STAGES: dict[str, str | Stage] = {
    "nvme-write": "tierpipe.stages.nvme_write",
    "verify": "tierpipe.stages.verify",
    "replicate": "tierpipe.stages.replicate",
    "flush": "tierpipe.stages.flush",
    "evict": "tierpipe.stages.evict",
}


def agent_stage(name: str) -> Stage:
    """The agent stage called `name` (imported now)."""
    stage = AGENT_STAGES[name]
    return importlib.import_module(stage) if isinstance(stage, str) else stage


__all__ = ("AGENT_STAGES", "agent_stage")
