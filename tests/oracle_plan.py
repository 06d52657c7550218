"""A test oracle: the restore plan folded from the whole event history (`oracle_catalog`), not
from the job state in KV (not in the wheel; the product plans with `tierpipe.recovery.plan`).

`plan_recovery` is a pure function of the catalog, the new run's world size, the nodes that
survived and the new run's rank -> node map. It picks the newest step for which every rank has a
verified copy it can reach: its own node's NVMe copy if that node survived and still holds it,
else the object-storage copy. Each rank gets its sources in order of preference; every newer step
that could not be used is listed with the reason. The tests of the catalog's evidence rules and
the planning benchmarks (`bench/plan.py`, `bench/control.py`) use it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from tests.oracle_catalog import Catalog, Copy, Shard
from tierpipe.errors import ConfigError, NoCheckpointError, WorldSizeMismatchError
from tierpipe.recovery.plan import Source

__all__ = ("Plan", "plan_recovery")


@dataclass(frozen=True, slots=True)
class Plan:
    """The step to restore and every rank's sources; `describe()` says it for operators."""

    job: str
    step: int
    world_size: int
    #: rank -> copies to try, best first.
    sources: dict[int, list[Source]]
    #: newer step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)
    #: What operators should know about the chosen step (copies skipped as corrupt, ...).
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"restore step {self.step} of job {self.job!r} ({self.world_size} ranks)"]
        for rank, srcs in sorted(self.sources.items()):
            first = srcs[0]
            where = f"NVMe on {first.node}" if first.tier == "nvme" else "object storage"
            more = f" (then {len(srcs) - 1} fallback)" if len(srcs) > 1 else ""
            lines.append(f"  rank {rank}: {where}: {first.location}{more}")
        for step, why in sorted(self.rejected.items(), reverse=True):
            lines.append(f"  step {step} rejected: {why}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan_recovery(
    catalog: Catalog,
    job: str,
    *,
    world_size: int,
    alive: Collection[str],
    rank_nodes: Mapping[int, str],
    step: int | None = None,
    exclude: Collection[int] | Mapping[int, str] = (),
    local_steps: Mapping[int, Collection[int]] | None = None,
) -> Plan:
    """The newest restorable step (or exactly `step`) and every rank's sources.

    Args:
        alive: nodes that survived with their NVMe (a replaced node is not alive).
        rank_nodes: the new run's node for each rank.
        step: restore this step rather than the newest possible one.
        exclude: steps already found unusable in this restart (a rank had no loadable copy);
            a mapping gives the reason for each.
        local_steps: per rank, the steps whose NVMe copy that rank found on its node (checked on
            disk); when given, an NVMe copy counts only if it is listed.

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
    if step is not None and step not in steps:
        raise NoCheckpointError(
            f"step {step} of job {job!r} was never saved; {_newest_saved(catalog, job)}"
        )
    rejected: dict[int, str] = {}
    candidates = sorted((s for s in steps if step is None or s == step), reverse=True)
    for s in candidates:
        shards = steps[s]
        if s in exclude:
            why = exclude[s] if isinstance(exclude, Mapping) else ""
            rejected[s] = f"a rank found no loadable copy in this restore ({why or 'see its log'})"
            continue
        # Only shards with a verified copy say which world size saved the step: a bogus event
        # must not turn into a world-size error.
        backed = [sh for sh in shards if any(c.usable for c in sh.copies.values())]
        if not backed:
            rejected[s] = "; ".join(_why_not(sh, sh.rank, "", alive) for sh in shards)
            continue
        saved_world = backed[0].world_size
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
            here = None if local_steps is None else s in local_steps.get(rank, ())
            found = _sources(by_rank.get(rank), rank_nodes[rank], alive, here)
            if found:
                sources[rank] = found
            else:
                problems.append(_why_not(by_rank.get(rank), rank, rank_nodes[rank], alive))
        if not problems:
            return Plan(job, s, world_size, sources, rejected, _notes(by_rank.values(), job))
        rejected[s] = "; ".join(problems)
    detail = "; ".join(f"step {s}: {why}" for s, why in rejected.items())
    raise NoCheckpointError(f"no restorable step of job {job!r} ({detail})")


def _newest_saved(catalog: Catalog, job: str, count: int = 5) -> str:
    done = catalog.complete_steps(job, ("nvme", "s3"))
    if not done:
        return "no step of it is complete on any tier"
    newest = ", ".join(map(str, reversed(done[-count:])))
    return f"the newest complete steps are {newest}"


def _sources(
    shard: Shard | None, node: str, alive: Collection[str], on_disk: bool | None
) -> list[Source]:
    if shard is None:
        return []
    out = []
    nvme = shard.copy("nvme", node)
    if nvme is not None and nvme.usable and node in alive and on_disk is not False:
        out.append(_ref(nvme, node))
    obj = shard.copy("s3")
    if obj is not None and obj.usable:
        out.append(_ref(obj, ""))
    return out


def _ref(copy: Copy, node: str) -> Source:
    return Source(
        tier=copy.tier,
        node=node,
        location=copy.location,
        nbytes=copy.nbytes,
        header_digest=copy.header_digest or "0" * 32,
    )


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
        + (
            "superseded (a later run went back past it)"
            if c.superseded
            else "evicted"
            if c.evicted
            else _corrupt(c, shard.job)
            if c.corrupt
            else "unverified"
        )
        for c in shard.copies.values()
        if c.tier != "ram" and not c.usable
    ]
    reason = ", ".join(held + states + shard.doubts) or "no copy beyond RAM"
    where = f" (on {node})" if node else ""
    return f"rank {rank}{where} has no reachable verified copy [{reason}]"


def _corrupt(copy: Copy, job: str) -> str:
    why = copy.corrupt_reason or "a failed check"
    if len(why) > 160:
        why = why[:157] + "..."
    return f"marked corrupt ({why}; `tierpipe reindex --job {job}` re-checks it)"


def _notes(shards: Iterable[Shard], job: str) -> list[str]:
    """Copies of the chosen step the plan skipped as corrupt (a fallback took their place)."""
    return [
        f"rank {sh.rank}: {c.tier}{'@' + c.node if c.node else ''} skipped: {_corrupt(c, job)}"
        for sh in shards
        for c in sh.copies.values()
        if c.corrupt and not c.evicted
    ]
