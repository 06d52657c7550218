"""A test oracle: events folded into job -> step -> rank -> copies on each tier, from the whole
history (not in the wheel: the product reads the job state in KV, `tierpipe.control.jobstate`).

The property tests hold the job state against it, and `oracle_plan` plans over it;
`Catalog.replay` folds a job's stored history. Applying the same event twice changes nothing,
so replays and redeliveries are harmless.

A copy counts only with the evidence its tier needs, so one schema-valid but bogus event cannot
make a step restorable:
- an NVMe copy is verified only by a `verified` event that follows a `written` event of the same
  node with the same path, size and header digest;
- an object-storage copy counts only if its header digest and size match a verified NVMe copy of
  the same shard, or if `tierpipe reindex` published it (`origin="reindex"`: read back from the
  object's own metadata, for a node that is gone);
- a replica on another node's NVMe (the `peer` tier, keyed by its holder) counts only if its
  header digest and size match the verified NVMe copy of its `source` node, and never when the
  holder names itself as the source (a replica on its own source node survives nothing). An
  `evicted` of tier `peer` from the holder removes it; a permanent failure with evidence from
  the holder proves it bad; a rewind supersedes it like any copy.
The residual: whoever can publish events can forge a matching pair, or a reindex `flushed`. That
buys at most a wasted restore round, never wrong bytes: every load checks the shard header's
identity (job, step, rank, world size) and header digest against the plan before any byte
reaches a target, and falls back to the next copy (`tierpipe.recovery.load`).

"Unreachable" is not "corrupt": only evidence (a digest or identity mismatch, a garbled file)
marks a copy corrupt, and a later good check of the same copy (`verified`, `flushed`, or a
restore that loaded it) clears the mark.

A run that went back in a job's history (it restored step r, or saved with `overwrite=True`)
sets `rewind_to` on its saves: this rank's copies of later steps saved by older epochs are
superseded, whatever order their events arrive in. A copy's slot (tier, node) never goes back
from a newer epoch's save to an older one's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierpipe.errors import EVIDENCE_ERRORS
from tierpipe.names import job_subjects
from tierpipe.schemas import (
    Event,
    NodeBatch,
    RecoveryPlanned,
    RestoreReport,
    ShardEvent,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
    Tier,
)

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus

__all__ = ("Catalog", "Copy", "Shard")


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
    #: Why the copy is marked corrupt (the failure that proved it), for operators.
    corrupt_reason: str = ""
    #: The save's epoch, and whether a later rewind of its rank abandoned it.
    epoch: int = 0
    superseded: bool = False

    @property
    def usable(self) -> bool:
        return self.verified and not self.corrupt and not self.evicted and not self.superseded


@dataclass(slots=True)
class Shard:
    job: str
    step: int
    rank: int
    world_size: int
    copies: dict[tuple[Tier, str], Copy] = field(default_factory=dict)
    failures: list[StageFailed] = field(default_factory=list)
    #: Events ignored for lack of evidence (a `verified` with no matching `written`, ...).
    doubts: list[str] = field(default_factory=list)

    def copy(self, tier: Tier, node: str = "") -> Copy | None:
        return self.copies.get((tier, node))

    def usable(self, tier: Tier) -> list[Copy]:
        """Verified, intact, present copies on `tier`."""
        return [c for (t, _), c in self.copies.items() if t == tier and c.usable]


class Catalog:
    """Mutable fold of events; feed it with `apply()` in stream order."""

    def __init__(self) -> None:
        self._shards: dict[tuple[str, int, int], Shard] = {}
        self._by_rank: dict[tuple[str, int], list[Shard]] = {}
        #: (job, rank) -> the rewinds of that rank: (epoch, rewind_to).
        self._rewinds: dict[tuple[str, int], set[tuple[int, int]]] = {}

    @classmethod
    async def replay(cls, bus: Bus, job: str) -> Catalog:
        """The catalog of `job` as the stream holds it now: every stored event of the job,
        folded in stream order.

        Raises:
            BusUnavailableError: NATS did not answer (or the replay stalled).
            BusError: the server refused the replay's consumer.
        """
        catalog = cls()
        for event in await bus.history(job_subjects(job)):
            catalog.apply(event)
        return catalog

    def apply(self, event: Event) -> None:
        if isinstance(event, ShardEvent) and event.rewind_to is not None:
            self.rewind(event.job, event.rank, event.epoch, event.rewind_to)
        match event:
            case RecoveryPlanned():
                return  # restore coordination, not copies
            case NodeBatch():
                return  # a node's report of events also published per rank (folded there)
            case RestoreReport():
                self._loaded(event)
            case StageFailed():
                self._failed(event)
            case ShardStaged():
                shard = self._shard(event.job, event.step, event.rank, event.world_size)
                ram = shard.copy("ram", event.node)
                if ram is None or ram.epoch < event.epoch:
                    shard.copies[("ram", event.node)] = self._mark(
                        shard,
                        Copy(
                            "ram",
                            event.node,
                            event.staging_path,
                            event.nbytes,
                            by=event.node,
                            epoch=event.epoch,
                        ),
                    )
            case ShardWritten():
                # A first write, or a rewrite of a different save: verification starts over.
                shard = self._shard(event.job, event.step, event.rank, event.world_size)
                nvme = shard.copy("nvme", event.node)
                if nvme is not None and nvme.epoch > event.epoch:
                    _doubt(shard, f"nvme@{event.node}: `written` of an older epoch (ignored)")
                    return
                self._mark(shard, _nvme_copy(shard, event))
            case ShardVerified():
                self._verified(event)
            case ShardFlushed():
                self._flushed(event)
            case ShardReplicated():
                self._replicated(event)
            case ShardEvicted():
                shard = self._shard(event.job, event.step, event.rank, event.world_size)
                key = (event.tier, "" if event.tier == "s3" else event.node)
                found = shard.copies.get(key)
                if found is not None and found.epoch <= event.epoch:
                    found.evicted = True

    def _verified(self, event: ShardVerified) -> None:
        shard = self._shard(event.job, event.step, event.rank, event.world_size)
        nvme = shard.copy("nvme", event.node)
        if nvme is None or not _same_file(nvme, event):
            _doubt(shard, f"nvme@{event.node}: `verified` without a matching `written` (ignored)")
            return
        nvme.verified, nvme.evicted = True, False
        _clear(nvme)

    def _flushed(self, event: ShardFlushed) -> None:
        shard = self._shard(event.job, event.step, event.rank, event.world_size)
        backed = event.origin == "reindex" or any(
            c.verified and c.header_digest == event.header_digest and c.nbytes == event.nbytes
            for (tier, _), c in shard.copies.items()
            if tier == "nvme"
        )
        if not backed:
            _doubt(shard, f"s3 by {event.node}: `flushed` matches no verified NVMe copy (ignored)")
            return
        known = shard.copy("s3")
        if known is not None and known.epoch > event.epoch:
            _doubt(shard, f"s3 by {event.node}: `flushed` of an older epoch (ignored)")
            return
        # The store confirmed size and checksum after the upload: a verified copy.
        location = f"s3://{event.bucket}/{event.key}"
        shard.copies[("s3", "")] = self._mark(
            shard,
            Copy(
                "s3",
                "",
                location,
                event.nbytes,
                event.header_digest,
                event.node,
                verified=True,
                epoch=event.epoch,
            ),
        )

    def _replicated(self, event: ShardReplicated) -> None:
        shard = self._shard(event.job, event.step, event.rank, event.world_size)
        if event.source == event.node:
            _doubt(shard, f"peer@{event.node}: a replica of its own copy (ignored)")
            return
        source = shard.copy("nvme", event.source)
        if (
            source is None
            or not source.verified
            or (source.header_digest, source.nbytes) != (event.header_digest, event.nbytes)
        ):
            _doubt(shard, f"peer@{event.node}: no verified copy of {event.source} (ignored)")
            return
        known = shard.copy("peer", event.node)
        if known is not None and known.epoch > event.epoch:
            _doubt(shard, f"peer@{event.node}: `replicated` of an older epoch (ignored)")
            return
        shard.copies[("peer", event.node)] = self._mark(
            shard,
            Copy(
                "peer",
                event.node,
                event.path,
                event.nbytes,
                event.header_digest,
                event.node,
                verified=True,
                epoch=event.epoch,
            ),
        )

    def _failed(self, event: StageFailed) -> None:
        if event.step is None or event.rank is None:
            return
        shard = self._shard(event.job, event.step, event.rank, event.world_size or 0)
        if event not in shard.failures:
            shard.failures.append(event)
        bad = event.tier or ("nvme" if event.stage == "verify" else None)
        copy = shard.copy(bad, "" if bad == "s3" else event.node) if bad else None
        # Only evidence marks a copy corrupt: an outage, a refusal or a missing copy is retried
        # or skipped by its reader, never held against the copy. (verify's final verdict on a
        # copy it could never verify counts too: nothing else will judge that copy.)
        proof = event.error in EVIDENCE_ERRORS or event.stage == "verify"
        if copy is not None and not event.retryable and proof:
            copy.corrupt = True
            copy.corrupt_reason = f"{event.stage}: {event.error}: {event.message}"

    def _loaded(self, report: RestoreReport) -> None:
        """A restore loaded this copy, every digest checked: it is good after all."""
        if report.phase != "loaded" or report.step is None or report.tier is None:
            return
        shard = self._shards.get((report.job, report.step, report.rank))
        copy = None
        if shard is not None:
            copy = shard.copy(report.tier, "" if report.tier == "s3" else report.node)
        if copy is not None and copy.verified:
            _clear(copy)

    def rewind(self, job: str, rank: int, epoch: int, rewind_to: int) -> None:
        """Record a rewind of (job, rank) and supersede the copies it abandons."""
        known = self._rewinds.setdefault((job, rank), set())
        if (epoch, rewind_to) in known:
            return
        known.add((epoch, rewind_to))
        for shard in self._by_rank.get((job, rank), []):
            if shard.step > rewind_to:
                for copy in shard.copies.values():
                    if copy.epoch < epoch:
                        copy.superseded = True

    def forget(self, job: str, step: int) -> None:
        """Drop every shard of `step` (a fold that keeps only the steps still kept)."""
        for rank in [r for (j, t, r) in self._shards if j == job and t == step]:
            shard = self._shards.pop((job, step, rank))
            self._by_rank[(job, rank)].remove(shard)

    def _mark(self, shard: Shard, copy: Copy) -> Copy:
        """`copy`, marked superseded if a known rewind of its rank abandoned it."""
        copy.superseded = any(
            copy.epoch < epoch and shard.step > rewind_to
            for epoch, rewind_to in self._rewinds.get((shard.job, shard.rank), ())
        )
        return copy

    def _shard(self, job: str, step: int, rank: int, world_size: int) -> Shard:
        key = (job, step, rank)
        shard = self._shards.get(key)
        if shard is None:
            shard = self._shards[key] = Shard(job, step, rank, world_size)
            self._by_rank.setdefault((job, rank), []).append(shard)
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


def _nvme_copy(shard: Shard, event: ShardWritten) -> Copy:
    """The node's NVMe copy of this save (a new, unverified one if the node had none, or a
    copy of a different save)."""
    nvme = shard.copy("nvme", event.node)
    if nvme is None or not _same_file(nvme, event):
        nvme = shard.copies[("nvme", event.node)] = Copy(
            "nvme",
            event.node,
            event.path,
            event.nbytes,
            event.header_digest,
            event.node,
            epoch=event.epoch,
        )
    return nvme


def _same_file(copy: Copy, event: ShardWritten | ShardVerified) -> bool:
    """The event names this very NVMe copy (same path, size and header digest)."""
    return (copy.location, copy.nbytes, copy.header_digest) == (
        event.path,
        event.nbytes,
        event.header_digest,
    )


def _clear(copy: Copy) -> None:
    copy.corrupt, copy.corrupt_reason = False, ""


def _doubt(shard: Shard, why: str) -> None:
    if why not in shard.doubts:
        shard.doubts.append(why)
