"""The ledger: the copies of the steps the job state still folds from their events, one entry
per copy of a shard on a tier of a node, with the evidence rules of the test oracle's catalog
(`Catalog`, tests/oracle_catalog.py), kept lean: a few slots per copy, no history of failures or
doubts. The fold (`tierpipe.control.jobstate.JobState`) reads a rank's usable copies from it."""

from __future__ import annotations

from tierpipe.errors import EVIDENCE_ERRORS
from tierpipe.schemas.facts import (
    EvictedFact,
    Fact,
    FailedFact,
    FlushedFact,
    ReplicatedFact,
    RestoreFact,
    StagedFact,
    VerifiedFact,
    WrittenFact,
)

__all__ = ("Ledger", "LedgerCopy", "LedgerShard")


class LedgerCopy:
    """One copy of a shard on one tier of one node (what the test oracle's `Copy` says of it
    that the state needs)."""

    __slots__ = (
        "corrupt", "epoch", "evicted", "header_digest", "location", "nbytes", "superseded",
        "verified",
    )  # fmt: skip

    def __init__(
        self, location: str, nbytes: int, digest: str, epoch: int, *, verified: bool = False
    ) -> None:
        self.location, self.nbytes, self.header_digest = location, nbytes, digest
        self.epoch, self.verified = epoch, verified
        self.corrupt = self.evicted = self.superseded = False


class LedgerShard:
    __slots__ = ("copies", "rank", "step", "world_size")

    def __init__(self, step: int, rank: int, world_size: int) -> None:
        self.step, self.rank, self.world_size = step, rank, world_size
        #: (tier, node) -> the copy; node "" for object storage, the holder for a replica.
        self.copies: dict[tuple[str, str], LedgerCopy] = {}

    def usable(self) -> tuple[int, dict[str, LedgerCopy | None]]:
        """The newest epoch among the copies, and per tier with a usable copy (verified, not
        evicted, proven bad or superseded) the first such copy with a digest (None: none has
        one). One pass over the copies: this runs for every event of every rank."""
        epoch = 0
        found: dict[str, LedgerCopy | None] = {}
        for (tier, _), c in self.copies.items():
            if c.epoch > epoch:
                epoch = c.epoch
            if tier == "ram" or not c.verified or c.corrupt or c.evicted or c.superseded:
                continue
            if found.get(tier) is None:
                found[tier] = c if c.header_digest else None
        return epoch, found


class Ledger:
    """The copies of the steps still folded from their events, with the evidence rules of
    the test oracle's `Catalog` (tests/oracle_catalog.py: its docstring says them; the property
    tests hold the two together): a `verified` counts only after a matching `written` of the
    same node, a `flushed` only if it matches a verified NVMe copy (or was reindexed), only
    a `replicated` only if it matches the verified NVMe copy of its source node and its holder is
    another node, only evidence marks a copy corrupt, and a rank's rewind supersedes its older
    epochs' copies of later steps."""

    def __init__(self) -> None:
        self._steps: dict[int, dict[int, LedgerShard]] = {}
        self._by_rank: dict[int, list[LedgerShard]] = {}
        #: rank -> its rewinds: (epoch, rewind_to).
        self._rewinds: dict[int, set[tuple[int, int]]] = {}

    def shard(self, step: int, rank: int) -> LedgerShard | None:
        ranks = self._steps.get(step)
        return None if ranks is None else ranks.get(rank)

    def steps(self) -> list[int]:
        """The steps with a copy in the ledger."""
        return sorted(self._steps)

    def forget(self, step: int) -> None:
        for shard in self._steps.pop(step, {}).values():
            self._by_rank[shard.rank].remove(shard)

    def apply(self, f: Fact) -> LedgerShard | None:
        """Fold one fact of this job (a batch's facts one by one, by the caller); the shard it
        is about, if it names one."""
        if isinstance(f, WrittenFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            key = ("nvme", f.node)
            nvme = shard.copies.get(key)
            if nvme is not None and nvme.epoch > f.epoch:
                return shard  # (a `written` of an older epoch)
            if nvme is None or not _same_file(nvme, f.path, f.nbytes, f.header_digest):
                nvme = shard.copies[key] = LedgerCopy(f.path, f.nbytes, f.header_digest, f.epoch)
            self._mark(shard, nvme)
            return shard
        if isinstance(f, VerifiedFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            nvme = shard.copies.get(("nvme", f.node))
            if nvme is not None and _same_file(nvme, f.path, f.nbytes, f.header_digest):
                nvme.verified, nvme.evicted, nvme.corrupt = True, False, False
            return shard
        if isinstance(f, FlushedFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            backed = f.origin == "reindex"
            if not backed:
                for (tier, _), c in shard.copies.items():
                    if (
                        tier == "nvme"
                        and c.verified
                        and c.header_digest == f.header_digest
                        and c.nbytes == f.nbytes
                    ):
                        backed = True
                        break
            known = shard.copies.get(("s3", ""))
            if backed and (known is None or known.epoch <= f.epoch):
                copy = LedgerCopy("", f.nbytes, f.header_digest, f.epoch, verified=True)
                shard.copies[("s3", "")] = self._mark(shard, copy)
            return shard
        if isinstance(f, ReplicatedFact):
            return self._replicated(f)
        if isinstance(f, EvictedFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            found = shard.copies.get((f.tier, "" if f.tier == "s3" else f.node))
            if found is not None and found.epoch <= f.epoch:
                found.evicted = True
            return shard
        if isinstance(f, StagedFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            ram = shard.copies.get(("ram", f.node))
            if ram is None or ram.epoch < f.epoch:
                copy = LedgerCopy(f.staging_path, f.nbytes, "", f.epoch)
                shard.copies[("ram", f.node)] = self._mark(shard, copy)
            return shard
        if isinstance(f, FailedFact):
            return self._failed(f)
        if isinstance(f, RestoreFact):
            return self._loaded(f)
        return None

    def _replicated(self, f: ReplicatedFact) -> LedgerShard:
        """A replica on `f.node` of `f.source`'s copy: it counts if that copy is verified and
        the same file (header digest and size), never on its own source node (a forged event)."""
        shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
        source = shard.copies.get(("nvme", f.source))
        backed = (
            f.source != f.node
            and source is not None
            and source.verified
            and (source.header_digest, source.nbytes) == (f.header_digest, f.nbytes)
        )
        known = shard.copies.get(("peer", f.node))
        if backed and (known is None or known.epoch <= f.epoch):
            copy = LedgerCopy(f.path, f.nbytes, f.header_digest, f.epoch, verified=True)
            shard.copies[("peer", f.node)] = self._mark(shard, copy)
        return shard

    def _failed(self, f: FailedFact) -> LedgerShard | None:
        if f.step is None or f.rank is None:
            return None
        shard = self._shard(f.step, f.rank, f.world_size or 0)
        bad = f.tier or ("nvme" if f.stage == "verify" else None)
        copy = shard.copies.get((bad, "" if bad == "s3" else f.node)) if bad else None
        # Only evidence marks a copy corrupt (see `Catalog._failed` in tests/oracle_catalog.py).
        proof = f.error in EVIDENCE_ERRORS or f.stage == "verify"
        if copy is not None and not f.retryable and proof:
            copy.corrupt = True
        return shard

    def _loaded(self, f: RestoreFact) -> LedgerShard | None:
        """A restore loaded this copy, every digest checked: it is good after all."""
        if f.phase != "loaded" or f.step is None or f.tier is None:
            return None
        shard = self.shard(f.step, f.rank)
        copy = None
        if shard is not None:
            copy = shard.copies.get((f.tier, "" if f.tier == "s3" else f.node))
        if copy is not None and copy.verified:
            copy.corrupt = False
        return shard

    def rewind(self, rank: int, epoch: int, rewind_to: int) -> None:
        """Record a rewind of `rank` and supersede the copies it abandons."""
        known = self._rewinds.setdefault(rank, set())
        if (epoch, rewind_to) in known:
            return
        known.add((epoch, rewind_to))
        for shard in self._by_rank.get(rank, []):
            if shard.step > rewind_to:
                for copy in shard.copies.values():
                    if copy.epoch < epoch:
                        copy.superseded = True

    def _mark(self, shard: LedgerShard, copy: LedgerCopy) -> LedgerCopy:
        """`copy`, marked superseded if a known rewind of its rank abandoned it."""
        rewinds = self._rewinds.get(shard.rank)
        copy.superseded = bool(rewinds) and any(
            copy.epoch < epoch and shard.step > rewind_to for epoch, rewind_to in rewinds or ()
        )
        return copy

    def _shard(
        self, step: int, rank: int, world_size: int, epoch: int = 0, rewind_to: int | None = None
    ) -> LedgerShard:
        """The shard, made if new; a shard event's rewind is recorded first."""
        if rewind_to is not None:
            self.rewind(rank, epoch, rewind_to)
        ranks = self._steps.get(step)
        if ranks is None:
            ranks = self._steps[step] = {}
        shard = ranks.get(rank)
        if shard is None:
            shard = ranks[rank] = LedgerShard(step, rank, world_size)
            self._by_rank.setdefault(rank, []).append(shard)
        elif world_size and not shard.world_size:
            shard.world_size = world_size
        return shard


def _same_file(copy: LedgerCopy, path: str, nbytes: int, digest: str) -> bool:
    """The fact names this very NVMe copy (same path, size and header digest)."""
    return copy.location == path and copy.nbytes == nbytes and copy.header_digest == digest
