"""The catalog: events folded into job -> step -> rank -> copies on each tier.

One fold serves every reader of the stream (the demo and `status` today; eviction and recovery
next). Applying the same event twice changes nothing, so replays and redeliveries are harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import (
    Event,
    RecoveryPlanned,
    RestoreReport,
    ShardEvicted,
    ShardFlushed,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
    Tier,
)

__all__ = ["Catalog", "Copy", "Shard"]


@dataclass(slots=True)
class Copy:
    """One copy of a shard on one tier of one node (`node` is "" for the object store)."""

    tier: Tier
    node: str
    location: str
    nbytes: int
    header_digest: str | None = None
    #: The node whose agent made this copy (for object storage: the one that uploaded it).
    by: str = ""
    verified: bool = False
    corrupt: bool = False
    evicted: bool = False

    @property
    def usable(self) -> bool:
        return self.verified and not self.corrupt and not self.evicted


@dataclass(slots=True)
class Shard:
    job: str
    step: int
    rank: int
    world_size: int
    copies: dict[tuple[Tier, str], Copy] = field(default_factory=dict)
    failures: list[StageFailed] = field(default_factory=list)

    def copy(self, tier: Tier, node: str = "") -> Copy | None:
        return self.copies.get((tier, node))

    def usable(self, tier: Tier) -> list[Copy]:
        """Verified, intact, present copies on `tier`."""
        return [c for (t, _), c in self.copies.items() if t == tier and c.usable]


class Catalog:
    """Mutable fold of events; feed it with `apply()` in stream order."""

    def __init__(self) -> None:
        self._shards: dict[tuple[str, int, int], Shard] = {}

    def apply(self, event: Event) -> None:
        if isinstance(event, RecoveryPlanned | RestoreReport):
            return  # restore coordination, not copies
        if isinstance(event, StageFailed):
            if event.step is not None and event.rank is not None:
                shard = self._shard(event.job, event.step, event.rank, event.world_size or 0)
                if event not in shard.failures:
                    shard.failures.append(event)
                bad = event.tier or ("nvme" if event.stage == "verify" else None)
                copy = shard.copy(bad, "" if bad == "s3" else event.node) if bad else None
                if copy is not None and not event.retryable:
                    copy.corrupt = True
            return
        shard = self._shard(event.job, event.step, event.rank, event.world_size)
        match event:
            case ShardStaged():
                shard.copies.setdefault(
                    ("ram", event.node),
                    Copy("ram", event.node, event.staging_path, event.nbytes, by=event.node),
                )
            case ShardWritten():
                # A first write, or a rewrite of a different save: verification starts over.
                _nvme_copy(shard, event)
            case ShardVerified():
                nvme = _nvme_copy(shard, event)
                nvme.verified, nvme.corrupt, nvme.evicted = True, False, False
            case ShardFlushed():
                # The store confirmed size and checksum after the upload: a verified copy.
                location = f"s3://{event.bucket}/{event.key}"
                shard.copies[("s3", "")] = Copy(
                    "s3", "", location, event.nbytes, event.header_digest, event.node, verified=True
                )
            case ShardEvicted():
                key = (event.tier, "" if event.tier == "s3" else event.node)
                found = shard.copies.get(key)
                if found is not None:
                    found.evicted = True

    def _shard(self, job: str, step: int, rank: int, world_size: int) -> Shard:
        key = (job, step, rank)
        shard = self._shards.get(key)
        if shard is None:
            shard = self._shards[key] = Shard(job, step, rank, world_size)
        elif world_size and not shard.world_size:
            shard.world_size = world_size
        return shard

    def jobs(self) -> list[str]:
        return sorted({job for job, _, _ in self._shards})

    def shards(self, job: str) -> list[Shard]:
        """Every shard of `job`, by step then rank."""
        return [self._shards[k] for k in sorted(k for k in self._shards if k[0] == job)]

    def shard(self, job: str, step: int, rank: int) -> Shard | None:
        return self._shards.get((job, step, rank))

    def steps(self, job: str) -> dict[int, list[Shard]]:
        """step -> its shards (by rank), oldest step first."""
        out: dict[int, list[Shard]] = {}
        for shard in self.shards(job):
            out.setdefault(shard.step, []).append(shard)
        return out

    def complete_steps(self, job: str, tiers: tuple[Tier, ...]) -> list[int]:
        """Steps (ascending) where every rank has a usable copy on one of `tiers`."""
        done = []
        for step, shards in self.steps(job).items():
            world = shards[0].world_size
            ranks = {
                s.rank for s in shards if s.world_size == world and any(s.usable(t) for t in tiers)
            }
            if world and ranks == set(range(world)):
                done.append(step)
        return done


def _nvme_copy(shard: Shard, event: ShardWritten | ShardVerified) -> Copy:
    """The node's NVMe copy of this save (a new, unverified one if the node had none, or a
    copy of a different save)."""
    nvme = shard.copy("nvme", event.node)
    if nvme is None or nvme.header_digest != event.header_digest:
        nvme = shard.copies[("nvme", event.node)] = Copy(
            "nvme", event.node, event.path, event.nbytes, event.header_digest, event.node
        )
    return nvme
