"""The pipeline's stages, one module each: snapshot (in the trainer), then the node agent's
nvme_write, verify, flush and evict workers.

Agent stages expose `run(settings, bus, *, task_status)`.
"""

from tierpipe.stages import evict, flush, nvme_write, verify

#: Agent stages in pipeline order, by the name `tierpipe worker <name>` uses.
AGENT_STAGES = {
    nvme_write.STAGE: nvme_write.run,
    verify.STAGE: verify.run,
    flush.STAGE: flush.run,
    evict.STAGE: evict.run,
}

__all__ = ["AGENT_STAGES"]
