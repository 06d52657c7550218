"""Retention: which copies a node may remove now, decided from the catalog alone.

A pure function, so every node reaches the same verdicts from the same events, and the property
tests can throw arbitrary histories at it. The rules, per job:

- NVMe keeps the newest `nvme_keep_latest_k` steps that are complete on NVMe (every rank has a
  verified copy), and every newer step (those may still be in flight). An older NVMe copy goes
  only once the same save is safely in object storage, unless `evict_unflushed`.
- Below `nvme_min_free_bytes` free, the oldest flushed NVMe copies go first, newest ones too.
- Object storage keeps the newest `s3_keep_latest_k` complete steps, every newer step, and every
  step divisible by `s3_keep_period`.
- Never removed, whatever the rules above say: any copy of the newest complete step of each tier,
  and any copy of the newest step that is complete across tiers together (what recovery would
  load), so the last good checkpoint always survives; nor any copy of a step that an
  in-progress restore planned (`pinned`), while its ranks read it.
- A node removes only what it owns: its own NVMe files, and the objects it uploaded.
- Copies a rewind superseded (an abandoned branch of the job's history) go at once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tierpipe.catalog import Catalog, Copy, Shard
from tierpipe.schemas import Tier
from tierpipe.settings import Settings

__all__ = ("Eviction", "Policy", "plan_evictions")


@dataclass(frozen=True, slots=True)
class Policy:
    nvme_keep_latest_k: int = 3
    s3_keep_latest_k: int = 10
    s3_keep_period: int = 0
    evict_unflushed: bool = False
    nvme_min_free_bytes: int = 0

    @classmethod
    def from_settings(cls, s: Settings) -> Policy:
        return cls(
            s.nvme_keep_latest_k,
            s.s3_keep_latest_k,
            s.s3_keep_period,
            s.evict_unflushed,
            s.nvme_min_free_bytes,
        )


@dataclass(frozen=True, slots=True)
class Eviction:
    tier: Tier
    job: str
    step: int
    rank: int
    world_size: int
    location: str
    nbytes: int
    reason: str
    #: The copy's header digest as recorded (NVMe removals check the file still holds it).
    header_digest: str | None = None
    #: The copy's save's epoch (the `evicted` event names it, so a newer save is never hit).
    epoch: int = 0


def plan_evictions(
    catalog: Catalog,
    job: str,
    policy: Policy,
    *,
    node: str,
    nvme_free_bytes: int | None = None,
    pinned: Collection[int] = (),
) -> list[Eviction]:
    """Copies of `job` that `node` should remove now, oldest first.

    Args:
        pinned: steps an in-progress restore of the job reads: none of their copies goes.
    """
    steps = catalog.steps(job)
    nvme_done = catalog.complete_steps(job, ("nvme",))
    s3_done = catalog.complete_steps(job, ("s3",))
    any_done = catalog.complete_steps(job, ("nvme", "s3"))
    protected = {done[-1] for done in (nvme_done, s3_done, any_done) if done} | set(pinned)

    evictions: list[Eviction] = []
    for shards in steps.values():  # abandoned by a rewind: never restored again, whatever step
        for shard in shards:
            for copy in (shard.copy("nvme", node), shard.copy("s3")):
                if copy is None:
                    continue
                mine = copy.tier == "nvme" or copy.by == node
                if mine and copy.superseded and not copy.evicted:
                    evictions.append(_eviction(shard, copy, "superseded"))
    nvme_floor = _floor(nvme_done, policy.nvme_keep_latest_k)
    spare: list[tuple[Shard, Copy]] = []  # kept NVMe copies that pressure may still take
    for step, shards in steps.items():
        for shard in shards:
            nvme = shard.copy("nvme", node)
            if nvme is None or nvme.evicted or nvme.superseded or step in protected:
                continue
            if not nvme.verified and not nvme.corrupt:
                continue  # still being written or verified: not ours to judge yet
            removable = nvme.corrupt or policy.evict_unflushed or _flushed(shard, nvme)
            if not removable:
                continue
            if nvme_floor is not None and step < nvme_floor:
                reason = "corrupt copy" if nvme.corrupt else "retention"
                evictions.append(_eviction(shard, nvme, reason))
            else:
                spare.append((shard, nvme))

    if nvme_free_bytes is not None and nvme_free_bytes < policy.nvme_min_free_bytes:
        free = nvme_free_bytes + sum(e.nbytes for e in evictions)
        for shard, nvme in spare:  # oldest first
            if free >= policy.nvme_min_free_bytes:
                break
            evictions.append(_eviction(shard, nvme, "disk pressure"))
            free += nvme.nbytes

    s3_floor = _floor(s3_done, policy.s3_keep_latest_k)
    if s3_floor is not None:
        for step, shards in steps.items():
            if step >= s3_floor or step in protected:
                continue
            if policy.s3_keep_period and step % policy.s3_keep_period == 0:
                continue
            for shard in shards:
                obj = shard.copy("s3")
                if obj is not None and not obj.evicted and not obj.superseded and obj.by == node:
                    evictions.append(_eviction(shard, obj, "retention"))

    evictions.sort(key=lambda e: (e.step, e.rank, e.tier))
    return evictions


def _floor(done: list[int], keep: int) -> int | None:
    """The oldest step still kept, once more than `keep` complete steps exist."""
    return done[-keep] if len(done) >= keep else None


def _flushed(shard: Shard, nvme: Copy) -> bool:
    obj = shard.copy("s3")
    return obj is not None and obj.usable and obj.header_digest == nvme.header_digest


def _eviction(shard: Shard, copy: Copy, reason: str) -> Eviction:
    return Eviction(
        copy.tier, shard.job, shard.step, shard.rank, shard.world_size, copy.location,
        copy.nbytes, reason, copy.header_digest, copy.epoch,
    )  # fmt: skip
