"""Recovery planning: which step to restore, and where each rank reads its shard from.

`plan_recovery` is a pure function of the catalog, the new run's world size, the nodes that
survived and the new run's rank -> node map. It picks the newest step for which every rank has a
verified copy it can reach: its own node's NVMe copy if that node survived and still holds it,
else the object-storage copy. Each rank gets its sources in order of preference, so a copy that
turns out bad at load time falls back to the next one; every newer step that could not be used is
listed with the reason, for operators (`tierpipe plan`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from pipeline.catalog import Catalog, Shard
from pipeline.errors import ConfigError, TierpipeError
from schemas import Tier

__all__ = ["NoCheckpointError", "Plan", "Source", "WorldSizeMismatchError", "plan_recovery"]


class NoCheckpointError(TierpipeError):
    """No step of the job can be restored with the surviving copies."""


class WorldSizeMismatchError(ConfigError):
    """The checkpoint was saved with another world size (resharding is not supported)."""


@dataclass(frozen=True, slots=True)
class Source:
    """One readable copy of one rank's shard."""

    tier: Tier
    #: The node whose NVMe holds it ("" for object storage).
    node: str
    #: A path on that node, or `s3://bucket/key`.
    location: str
    nbytes: int
    header_digest: str


@dataclass(frozen=True, slots=True)
class Plan:
    job: str
    step: int
    world_size: int
    #: rank -> copies to try, best first.
    sources: dict[int, list[Source]]
    #: newer step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        lines = [f"restore step {self.step} of job {self.job!r} ({self.world_size} ranks)"]
        for rank, srcs in sorted(self.sources.items()):
            first = srcs[0]
            where = f"NVMe on {first.node}" if first.tier == "nvme" else "object storage"
            more = f" (then {len(srcs) - 1} fallback)" if len(srcs) > 1 else ""
            lines.append(f"  rank {rank}: {where}: {first.location}{more}")
        for step, why in sorted(self.rejected.items(), reverse=True):
            lines.append(f"  step {step} rejected: {why}")
        return "\n".join(lines)


def plan_recovery(
    catalog: Catalog,
    job: str,
    *,
    world_size: int,
    alive: Collection[str],
    rank_nodes: Mapping[int, str],
    step: int | None = None,
    exclude: Collection[int] = (),
) -> Plan:
    """The newest restorable step (or exactly `step`) and every rank's sources.

    Args:
        alive: nodes that survived with their NVMe (a replaced node is not alive).
        rank_nodes: the new run's node for each rank.
        step: restore this step rather than the newest possible one.
        exclude: steps already found unusable (a bad copy at load time).

    Raises:
        WorldSizeMismatchError: the newest checkpoint has another world size.
        NoCheckpointError: nothing restorable (the message says why for each step).
    """
    missing = set(range(world_size)) - set(rank_nodes)
    if missing:
        raise ConfigError(f"rank -> node map lacks ranks {sorted(missing)}")
    steps = catalog.steps(job)
    if not steps:
        raise NoCheckpointError(f"job {job!r} has no checkpoints in the event stream")
    rejected: dict[int, str] = {}
    candidates = sorted((s for s in steps if step is None or s == step), reverse=True)
    for s in candidates:
        shards = steps[s]
        if s in exclude:
            rejected[s] = "a copy failed verification at load time"
            continue
        saved_world = shards[0].world_size
        if saved_world != world_size:
            if not rejected and s == candidates[0]:
                raise WorldSizeMismatchError(
                    f"step {s} of job {job!r} was saved by {saved_world} ranks, this run has "
                    f"{world_size}; restore needs the same world size (no resharding yet)"
                )
            rejected[s] = f"saved with world size {saved_world}"
            continue
        by_rank = {sh.rank: sh for sh in shards if sh.world_size == world_size}
        sources: dict[int, list[Source]] = {}
        problems = []
        for rank in range(world_size):
            found = _sources(by_rank.get(rank), rank_nodes[rank], alive)
            if found:
                sources[rank] = found
            else:
                problems.append(_why_not(by_rank.get(rank), rank, rank_nodes[rank], alive))
        if not problems:
            return Plan(job, s, world_size, sources, rejected)
        rejected[s] = "; ".join(problems)
    detail = "; ".join(f"step {s}: {why}" for s, why in rejected.items())
    raise NoCheckpointError(f"no restorable step of job {job!r} ({detail})")


def _sources(shard: Shard | None, node: str, alive: Collection[str]) -> list[Source]:
    if shard is None:
        return []
    out = []
    nvme = shard.copy("nvme", node)
    if nvme is not None and nvme.usable and node in alive:
        out.append(Source("nvme", node, nvme.location, nvme.nbytes, nvme.header_digest or ""))
    obj = shard.copy("s3")
    if obj is not None and obj.usable:
        out.append(Source("s3", "", obj.location, obj.nbytes, obj.header_digest or ""))
    return out


def _why_not(shard: Shard | None, rank: int, node: str, alive: Collection[str]) -> str:
    if shard is None:
        return f"rank {rank} never saved it"
    held = [
        f"{c.tier} on {c.node}" + (" (node gone)" if c.node not in alive else "")
        for (tier, _), c in shard.copies.items()
        if tier == "nvme" and c.usable
    ]
    states = [
        f"{c.tier}{'@' + c.node if c.node else ''}: "
        + ("evicted" if c.evicted else "corrupt" if c.corrupt else "unverified")
        for c in shard.copies.values()
        if c.tier != "ram" and not c.usable
    ]
    reason = ", ".join(held + states) or "no copy beyond RAM"
    return f"rank {rank} (on {node}) has no reachable verified copy [{reason}]"
