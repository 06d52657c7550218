"""Where a job's shards are and what a restore would load, rendered from a catalog folded from the
event stream: the tables and JSON of `tierpipe status` and `tierpipe plan`, and the demo's summary.

Pure functions of a `Catalog`: the caller replays the events (the CLI, the demo), so this module
does no I/O and prints nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import msgspec

from tierpipe.catalog import Catalog, Shard

if TYPE_CHECKING:
    from tierpipe.recovery.plan import Plan

__all__ = ("plan_json", "plan_now", "shard_json", "shard_table")


def shard_table(shards: list[Shard]) -> str:
    """A human-readable table of shards and where their copies are."""
    rows = [("STEP", "RANK", "RAM", "NVME", "VERIFIED", "S3", "NVME PATH")]
    for s in shards:
        ram = next((c for (t, _), c in s.copies.items() if t == "ram"), None)
        nvme = next((c for (t, _), c in s.copies.items() if t == "nvme"), None)
        obj = s.copy("s3")
        rows.append(
            (
                str(s.step),
                f"{s.rank}/{s.world_size}",
                "-" if ram is None else "released" if ram.evicted else "staged",
                "-" if nvme is None else "evicted" if nvme.evicted else nvme.node,
                "-"
                if nvme is None
                else "CORRUPT"
                if nvme.corrupt
                else "yes"
                if nvme.verified
                else "no",
                "-" if obj is None else "evicted" if obj.evicted else "flushed",
                "" if nvme is None or nvme.evicted else nvme.location,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def shard_json(s: Shard) -> dict[str, Any]:
    """One shard and its copies as a JSON-ready object (a line of `tierpipe status --json`)."""
    return {
        "job": s.job,
        "step": s.step,
        "rank": s.rank,
        "world_size": s.world_size,
        "copies": [
            {
                "tier": c.tier,
                "node": c.node,
                "location": c.location,
                "nbytes": c.nbytes,
                "verified": c.verified,
                "corrupt": c.corrupt,
                "evicted": c.evicted,
            }
            for c in s.copies.values()
        ],
        "failures": [f.message for f in s.failures],
    }


def plan_now(
    catalog: Catalog, job: str, *, alive: Collection[str] | None = None, step: int | None = None
) -> Plan:
    """What a restore of `job` would load now: the world size of its newest complete step and
    every rank on the node of its newest NVMe (or RAM) copy.

    Args:
        catalog: the job's events folded (it must hold shards of `job`).
        alive: nodes that survived with their NVMe; None: every node the job ran on.
        step: plan this step rather than the newest restorable one.

    Raises:
        WorldSizeMismatchError, NoCheckpointError: as `plan_recovery`.
    """
    from tierpipe.recovery.plan import plan_recovery  # here: only `tierpipe plan` needs it

    steps = catalog.steps(job)
    # The world size of the newest complete step (a stray event of another size cannot set it).
    done = catalog.complete_steps(job, ("nvme", "s3"))
    world = steps[done[-1] if done else max(steps)][0].world_size
    rank_nodes: dict[int, str] = {}
    for shards in steps.values():  # each rank's node, from its newest NVMe copy
        for s in shards:
            for (tier, node), _ in s.copies.items():
                if tier in ("nvme", "ram") and node:
                    rank_nodes[s.rank] = node
    rank_nodes = {r: rank_nodes.get(r, "?") for r in range(world)}
    nodes = set(rank_nodes.values()) if alive is None else set(alive)
    return plan_recovery(
        catalog, job, world_size=world, alive=nodes, rank_nodes=rank_nodes, step=step
    )


def plan_json(job: str, plan: Plan) -> dict[str, Any]:
    """A plan as a JSON-ready object (`tierpipe plan --json`)."""
    return {
        "job": job,
        "step": plan.step,
        "world_size": plan.world_size,
        "sources": {
            str(r): [msgspec.to_builtins(s) for s in srcs] for r, srcs in plan.sources.items()
        },
        "rejected": {str(s): why for s, why in plan.rejected.items()},
        "notes": plan.notes,
    }
