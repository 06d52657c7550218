"""The pipeline's stages, one module each: snapshot (in the trainer), then the node agent's
nvme_write, verify, flush and evict workers.

An agent stage module is its contract (`tierpipe.runner.Stage`): `STAGE` (its name), `KINDS`
(the events it consumes), an optional `open(settings, bus)` (an async context manager that opens
its resources and yields its context) and `handle(ctx, event, attempt)`, which returns the
event(s) to publish. The runner does the rest: consumer, acks, retries, heartbeats, logging.
Stages never import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierpipe.stages import evict, flush, nvme_write, verify

if TYPE_CHECKING:
    from tierpipe.runner import Stage

#: Agent stages in pipeline order, by the name `tierpipe worker <name>` uses.
AGENT_STAGES: dict[str, Stage] = {
    nvme_write.STAGE: nvme_write,
    verify.STAGE: verify,
    flush.STAGE: flush,
    evict.STAGE: evict,
}

__all__ = ("AGENT_STAGES",)
