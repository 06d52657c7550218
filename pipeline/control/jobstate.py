"""One job's compacted state, folded from its events: per step and tier, which ranks have a
good copy; the newest complete steps; the retention floors.

The retention coordinator (`tierpipe.control.coordinator`) feeds it the job's events and stores what
changed in JetStream KV (`tierpipe.control.kvstate`); restarts, retention and operators read the KV,
never the history. Pure (no I/O), so property tests can hold it against a fold of the whole
history (`tierpipe.control.catalog.Catalog`) on arbitrary event sequences.

It folds an event's facts (`tierpipe.schemas.facts`, what the coordinator decodes on its hot
path; a full event is taken to its facts first) into a ledger of the window's copies with the
catalog's evidence rules, kept lean: a few slots per copy, no history of failures or doubts.

Memory stays bounded by what is kept, not by the history: the steps in the window (the NVMe
retention window and what is in flight) are folded from their events, with the evidence rules
of the catalog; older steps that are still kept (object storage, the period rule) are known by
their records alone, and only removals change them. A step below both floors leaves memory and
the KV. Work per event is O(1) in the number of steps, but when it completes a step or moves a
floor (O(kept steps)), or rewinds a rank (O(that rank's kept steps)).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from tierpipe.errors import EVIDENCE_ERRORS
from tierpipe.schemas import Event, Tier
from tierpipe.schemas.facts import (
    BaseFact,
    BatchFact,
    EvictedFact,
    Fact,
    FailedFact,
    FlushedFact,
    RestoreFact,
    ShardFact,
    StagedFact,
    VerifiedFact,
    WrittenFact,
    fact_of,
)
from tierpipe.schemas.jobstate import (
    DIGEST_BYTES,
    HEAD_RECORD_BYTES,
    RANKS_PER_CHUNK,
    SIZE_BYTES,
    Floors,
    JobHead,
    Keep,
    RankDigests,
    StepRecord,
    StoredRecord,
    stored_record,
)

__all__ = ("Changes", "JobState", "bitmap", "has_rank", "is_full", "ranks_of")

_TIERS: tuple[Tier, Tier] = ("nvme", "s3")


def bitmap(ranks: Iterable[int], world_size: int) -> bytes:
    """Rank r in bit `r % 8` of byte `r // 8`; `world_size` bits, rounded up to whole bytes."""
    out = bytearray((world_size + 7) // 8)
    for r in ranks:
        out[r >> 3] |= 1 << (r & 7)
    return bytes(out)


def has_rank(bits: bytes | bytearray, rank: int) -> bool:
    i = rank >> 3
    return i < len(bits) and bool(bits[i] >> (rank & 7) & 1)


def ranks_of(bits: bytes | bytearray) -> list[int]:
    return [i * 8 + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1]


def is_full(bits: bytes | bytearray, world_size: int) -> bool:
    """`bits` holds every rank below `world_size`, and no other."""
    return len(bits) == (world_size + 7) // 8 and sum(b.bit_count() for b in bits) == world_size


class _Step:
    """One step's bitmaps, mutable, with their counts."""

    __slots__ = ("bits", "count", "digests", "either", "epoch", "s3_removed", "sizes", "world_size")

    def __init__(self, world_size: int, epoch: int = 0) -> None:
        self.world_size = world_size
        self.epoch = epoch
        size = (world_size + 7) // 8
        self.bits: dict[Tier, bytearray] = {"nvme": bytearray(size), "s3": bytearray(size)}
        self.count: dict[Tier, int] = {"nvme": 0, "s3": 0}
        #: Ranks with a copy on either tier.
        self.either = 0
        #: Retention removed the step's objects; `s3` still says which ranks were there.
        self.s3_removed = False
        #: Each rank's verified copy: header digest and size (`RankDigests`; zero: none yet).
        #: Empty for a step known by its record alone (its digests stay in the KV as they are).
        self.digests = bytearray()
        self.sizes = bytearray()

    def note_copy(self, rank: int, digest: str, nbytes: int) -> bool:
        """Record `rank`'s verified copy; whether that changed anything."""
        if not self.sizes:
            self.digests = bytearray(DIGEST_BYTES * self.world_size)
            self.sizes = bytearray(SIZE_BYTES * self.world_size)
        d = slice(rank * DIGEST_BYTES, (rank + 1) * DIGEST_BYTES)
        z = slice(rank * SIZE_BYTES, (rank + 1) * SIZE_BYTES)
        new_d, new_z = bytes.fromhex(digest), nbytes.to_bytes(SIZE_BYTES, "little")
        if self.digests[d] == new_d and self.sizes[z] == new_z:
            return False
        self.digests[d], self.sizes[z] = new_d, new_z
        return True

    def rank_digests(self, step: int, chunk: int) -> RankDigests:
        lo, hi = chunk * RANKS_PER_CHUNK, min((chunk + 1) * RANKS_PER_CHUNK, self.world_size)
        return RankDigests(
            step=step,
            first=lo,
            digests=bytes(self.digests[lo * DIGEST_BYTES : hi * DIGEST_BYTES]),
            sizes=bytes(self.sizes[lo * SIZE_BYTES : hi * SIZE_BYTES]),
        )

    @classmethod
    def of(cls, rec: StepRecord) -> _Step:
        s = cls(rec.world_size, rec.epoch)
        s.s3_removed = rec.s3_removed
        for tier in _TIERS:
            for rank in ranks_of(getattr(rec, tier)):
                if rank < rec.world_size:
                    s.set(tier, rank, True)
        return s

    def set(self, tier: Tier, rank: int, on: bool) -> bool:
        """Set or clear `rank` on `tier`; whether that changed anything."""
        bits = self.bits[tier]
        i, mask = rank >> 3, 1 << (rank & 7)
        if bool(bits[i] & mask) == on:
            return False
        bits[i] ^= mask
        self.count[tier] += 1 if on else -1
        other = self.bits["s3" if tier == "nvme" else "nvme"]
        if not other[i] & mask:  # (the rank's copy on either tier came, or went, with this)
            self.either += 1 if on else -1
        return True

    def unflushed(self) -> bool:
        """Some rank has a verified NVMe copy that never reached object storage."""
        return any(n & ~m for n, m in zip(self.bits["nvme"], self.bits["s3"], strict=True))

    def status(self) -> tuple[bool, bool, bool]:
        """Complete on NVMe, in object storage, on one or the other."""
        return self.complete("nvme"), self.complete("s3"), self.complete(None)

    def complete(self, tier: Tier | None) -> bool:
        """Every rank has a copy on `tier` (None: on one tier or the other)."""
        if self.s3_removed and tier != "nvme":
            return tier is None and self.count["nvme"] == self.world_size
        return (self.either if tier is None else self.count[tier]) == self.world_size

    def record(self, step: int) -> StepRecord:
        return StepRecord(
            step=step,
            world_size=self.world_size,
            epoch=self.epoch,
            nvme=bytes(self.bits["nvme"]),
            s3=bytes(self.bits["s3"]),
            s3_removed=self.s3_removed,
        )


class _Copy:
    """One copy of a shard on one tier of one node (what `tierpipe.control.catalog.Copy` says of it
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


class _Shard:
    __slots__ = ("copies", "rank", "step", "world_size")

    def __init__(self, step: int, rank: int, world_size: int) -> None:
        self.step, self.rank, self.world_size = step, rank, world_size
        #: (tier, node) -> the copy; node "" for object storage.
        self.copies: dict[tuple[str, str], _Copy] = {}


class _Ledger:
    """The copies of the steps still folded from their events, with the evidence rules of
    `tierpipe.control.catalog.Catalog` (its docstring says them; the property tests hold the two
    together): a `verified` counts only after a matching `written` of the same node, a
    `flushed` only if it matches a verified NVMe copy (or was reindexed), only evidence marks a
    copy corrupt, and a rank's rewind supersedes its older epochs' copies of later steps."""

    def __init__(self) -> None:
        self._steps: dict[int, dict[int, _Shard]] = {}
        self._by_rank: dict[int, list[_Shard]] = {}
        #: rank -> its rewinds: (epoch, rewind_to).
        self._rewinds: dict[int, set[tuple[int, int]]] = {}

    def shard(self, step: int, rank: int) -> _Shard | None:
        ranks = self._steps.get(step)
        return None if ranks is None else ranks.get(rank)

    def steps(self) -> list[int]:
        """The steps with a copy in the ledger."""
        return sorted(self._steps)

    def forget(self, step: int) -> None:
        for shard in self._steps.pop(step, {}).values():
            self._by_rank[shard.rank].remove(shard)

    def apply(self, f: Fact) -> _Shard | None:
        """Fold one fact of this job (a batch's facts one by one, by the caller); the shard it
        is about, if it names one."""
        if isinstance(f, WrittenFact):
            shard = self._shard(f.step, f.rank, f.world_size, f.epoch, f.rewind_to)
            key = ("nvme", f.node)
            nvme = shard.copies.get(key)
            if nvme is not None and nvme.epoch > f.epoch:
                return shard  # (a `written` of an older epoch)
            if nvme is None or not _same_file(nvme, f.path, f.nbytes, f.header_digest):
                nvme = shard.copies[key] = _Copy(f.path, f.nbytes, f.header_digest, f.epoch)
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
                copy = _Copy("", f.nbytes, f.header_digest, f.epoch, verified=True)
                shard.copies[("s3", "")] = self._mark(shard, copy)
            return shard
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
                copy = _Copy(f.staging_path, f.nbytes, "", f.epoch)
                shard.copies[("ram", f.node)] = self._mark(shard, copy)
            return shard
        if isinstance(f, FailedFact):
            return self._failed(f)
        if isinstance(f, RestoreFact):
            return self._loaded(f)
        return None

    def _failed(self, f: FailedFact) -> _Shard | None:
        if f.step is None or f.rank is None:
            return None
        shard = self._shard(f.step, f.rank, f.world_size or 0)
        bad = f.tier or ("nvme" if f.stage == "verify" else None)
        copy = shard.copies.get((bad, "" if bad == "s3" else f.node)) if bad else None
        # Only evidence marks a copy corrupt (see `tierpipe.control.catalog.Catalog._failed`).
        proof = f.error in EVIDENCE_ERRORS or f.stage == "verify"
        if copy is not None and not f.retryable and proof:
            copy.corrupt = True
        return shard

    def _loaded(self, f: RestoreFact) -> _Shard | None:
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

    def _mark(self, shard: _Shard, copy: _Copy) -> _Copy:
        """`copy`, marked superseded if a known rewind of its rank abandoned it."""
        rewinds = self._rewinds.get(shard.rank)
        copy.superseded = bool(rewinds) and any(
            copy.epoch < epoch and shard.step > rewind_to for epoch, rewind_to in rewinds or ()
        )
        return copy

    def _shard(
        self, step: int, rank: int, world_size: int, epoch: int = 0, rewind_to: int | None = None
    ) -> _Shard:
        """The shard, made if new; a shard event's rewind is recorded first."""
        if rewind_to is not None:
            self.rewind(rank, epoch, rewind_to)
        ranks = self._steps.get(step)
        if ranks is None:
            ranks = self._steps[step] = {}
        shard = ranks.get(rank)
        if shard is None:
            shard = ranks[rank] = _Shard(step, rank, world_size)
            self._by_rank.setdefault(rank, []).append(shard)
        elif world_size and not shard.world_size:
            shard.world_size = world_size
        return shard


def _same_file(copy: _Copy, path: str, nbytes: int, digest: str) -> bool:
    """The fact names this very NVMe copy (same path, size and header digest)."""
    return copy.location == path and copy.nbytes == nbytes and copy.header_digest == digest


@dataclass
class Changes:
    """What the events folded since the last `take_changes()` changed, for the KV writer."""

    #: Steps whose record changed (to put) and steps that left the state (to delete).
    put: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    #: Steps whose objects are to be removed now (below the object-storage floor), with their
    #: record as it was (the ranks whose objects were confirmed in `s3`).
    s3_removed: dict[int, StepRecord] = field(default_factory=dict)
    #: (step, chunk) whose `RankDigests` changed; steps that left, with their chunk count.
    digests: set[tuple[int, int]] = field(default_factory=set)
    digests_deleted: dict[int, int] = field(default_factory=dict)
    #: Steps that became complete in object storage (every rank's object confirmed): the
    #: coordinator writes their COMMIT manifest. Not the steps complete when a fold starts from
    #: the stored state (committed by whoever folded them), but again for one that completes
    #: again (a rewound run's newer save of it; the manifest is created once per timeline).
    committed: set[int] = field(default_factory=set)
    head: bool = False
    floors: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.put
            or self.deleted
            or self.s3_removed
            or self.digests
            or self.head
            or self.floors
            or self.committed
        )


class JobState:
    """The fold. Feed it with `apply()` in stream order; `take_changes()` says what to store.

    Args:
        head, floors, records: what the KV holds (a coordinator taking over). Records of steps
            from `head.window` on are not loaded: folding the events from `head.resume_seq` on
            again rebuilds them, evidence and all.
    """

    def __init__(
        self,
        job: str,
        keep: Keep,
        *,
        head: JobHead | None = None,
        floors: Floors | None = None,
        records: Mapping[int, StepRecord] = {},
    ) -> None:
        self.job = job
        self.keep = keep
        self._ledger = _Ledger()
        self.seq = head.seq if head else 0
        window = head.window if head else 0
        self._steps = {t: _Step.of(r) for t, r in records.items() if t < window}
        #: Steps known by their records alone (older than the window when this fold started).
        self._record_only = set(self._steps)
        #: step -> the stream sequence of the first of its events this fold saw.
        self._first_seq: dict[int, int] = {}
        self._resume = (head.resume_seq, head.window) if head else (0, 0)
        self._world_size = head.world_size if head else 0
        #: When the stream `seq` counts in was made (`on_stream`).
        self.stream = head.stream if head else ""
        self._floors = floors or Floors()
        self._pinned: frozenset[int] = frozenset()
        self._hold = False
        self._complete: dict[Tier | None, list[int]] = {"nvme": [], "s3": [], None: []}
        self._changes = Changes()
        #: step -> (record, stored form) of the records the last head carried.
        self._stored: dict[int, tuple[StepRecord, StoredRecord]] = {}
        self._recount()
        self._changes.committed.clear()  # (complete already: committed by an earlier fold)

    # --- folding

    def apply(self, seq: int, event: Event | Fact) -> None:
        """Fold one event of this job, or its facts (stored at stream sequence `seq`; a
        node's batch is its events, each folded)."""
        fact = event if isinstance(event, BaseFact) else fact_of(event)
        if fact.job != self.job:
            return
        self.passed(seq)
        if type(fact) is BatchFact:
            fold = self._fold_shard
            for inner in fact.events:  # (of the batch's job: `NodeBatch`, `decode_fact`)
                fold(seq, inner)
        elif isinstance(fact, ShardFact):
            self._fold_shard(seq, fact)
        elif (step := getattr(fact, "step", None)) is not None and (
            rank := getattr(fact, "rank", None)
        ) is not None:  # (a verdict on a copy, or a restore's report; not a plan)
            if step in self._record_only:
                self._apply_to_record(step, rank, fact)
            elif step in self._steps or not self._gone(step):
                shard = self._ledger.apply(fact)
                if step in self._steps:
                    self._refresh(step, rank, None, shard)

    def _fold_shard(self, seq: int, f: ShardFact) -> None:
        step, rank, rewind = f.step, f.rank, f.rewind_to
        if step in self._record_only:
            self._apply_to_record(step, rank, f)
            if rewind is not None:
                self._ledger.rewind(rank, f.epoch, rewind)
        elif step in self._steps or not self._gone(step):  # (a late event of a dropped step)
            shard = self._ledger.apply(f)
            self._first_seq.setdefault(step, seq)
            self._refresh(step, rank, f.world_size, shard)
        if rewind is not None:
            self._rewound(rank, f.epoch, rewind)

    def on_stream(self, created: str, last_seq: int) -> bool:
        """The job's stream as it is now (when it was made, its newest sequence); whether it
        was made again since this fold read it (then the fold is `renumber`ed). A state stored
        before heads named their stream counts as made again only if the stream's sequences
        went back."""
        if created == self.stream:
            return False
        made_again = bool(self.stream) or last_seq < self.seq
        self.stream = created
        self._changes.head = True
        if made_again:
            self.renumber()
        return made_again

    def renumber(self) -> None:
        """The job's stream was made again (deleted, or lost by its server), and numbers its
        events from 1 again. What the old stream's events proved stays, as records: every step
        known now is known by its record alone from here on (only removals change it; a step
        still in flight then never completes: its evidence went with the old stream, and a newer
        step will). The fold goes on from the new stream's first event."""
        self.seq = 0
        self._ledger = _Ledger()
        self._record_only = set(self._steps)
        self._first_seq.clear()
        self._resume = (0, max(self._steps, default=-1) + 1)
        self._changes.head = True

    def passed(self, seq: int) -> None:
        """The fold has seen the job's events up to stream sequence `seq` (one it cannot read
        included): a restart waits for `head().seq` to reach its own newest event."""
        if seq > self.seq:
            self.seq = seq
            self._changes.head = True

    def pin(self, steps: Iterable[int], *, hold: bool = False) -> None:
        """Steps an in-progress restore reads: kept on every tier while it lasts. `hold`: a
        restore is planning, so the floors stay where they are until it has a plan."""
        pinned = frozenset(steps)
        if pinned != self._pinned or hold != self._hold:
            self._pinned, self._hold = pinned, hold
            self._move_floors()

    def _refresh(
        self, step: int, rank: int, world_size: int | None, shard: _Shard | None = None
    ) -> None:
        """Recompute `rank`'s bits in `step` from the ledger (`shard`: its entry there, if the
        caller has it at hand)."""
        s = self._steps.get(step)
        if s is None:
            if not world_size or self._gone(step):
                return
            s = self._steps[step] = _Step(world_size)
            if step >= max(self._steps):
                self._world_size = world_size
            self._changes.put.add(step)
        if shard is None:
            shard = self._ledger.shard(step, rank)
        if shard is None or shard.world_size != s.world_size or rank >= s.world_size:
            return
        # One pass over the shard's copies (this runs for every event of every rank): the
        # newest epoch, and per tier whether a usable copy exists and the first with a digest.
        epoch = s.epoch
        nvme = s3 = False
        first_nvme = first_s3 = None
        for (tier, _), c in shard.copies.items():
            if c.epoch > epoch:
                epoch = c.epoch
            if tier == "ram" or not c.verified or c.corrupt or c.evicted or c.superseded:
                continue  # (not usable)
            if tier == "nvme":
                nvme = True
                if first_nvme is None and c.header_digest:
                    first_nvme = c
            else:
                s3 = True
                if first_s3 is None and c.header_digest:
                    first_s3 = c
        changed = epoch != s.epoch
        s.epoch = epoch
        i, mask = rank >> 3, 1 << (rank & 7)
        flip_nvme = bool(s.bits["nvme"][i] & mask) != nvme
        # (removed objects: `s3` keeps their ranks)
        flip_s3 = not s.s3_removed and bool(s.bits["s3"][i] & mask) != s3
        # Completeness can only change where a count reaches or leaves the world size.
        counts = (s.count["nvme"], s.count["s3"], s.either) if flip_nvme or flip_s3 else None
        if flip_nvme:
            s.set("nvme", rank, nvme)
        if flip_s3:
            s.set("s3", rank, s3)
        # Every tier's copy is the same file: the first verified one gives the rank's digest.
        copy = first_nvme or first_s3
        if (
            copy is not None
            and copy.header_digest
            and s.note_copy(rank, copy.header_digest, copy.nbytes)
        ):
            self._changes.digests.add((step, rank // RANKS_PER_CHUNK))
        if changed or counts is not None:
            self._changes.put.add(step)
        if counts is not None:
            w, (n, o, e) = s.world_size, counts
            if (
                (n == w) != (s.count["nvme"] == w)
                or (o == w) != (s.count["s3"] == w)
                or (e == w) != (s.either == w)
            ):
                self._recount()

    def _apply_to_record(self, step: int, rank: int, f: Fact) -> None:
        """An event about a step known by its record alone: only removals count (a copy
        evicted, or proven bad); nothing else can be checked against evidence any more."""
        s = self._steps[step]
        tier: str | None = None
        if isinstance(f, EvictedFact):
            tier = f.tier
        elif (
            isinstance(f, FailedFact)
            and not f.retryable
            and (f.error in EVIDENCE_ERRORS or f.stage == "verify")
        ):
            tier = f.tier or ("nvme" if f.stage == "verify" else None)
        if tier in _TIERS and rank < s.world_size and not (tier == "s3" and s.s3_removed):
            before = s.status()
            self._clear(step, [rank], (tier,))
            if s.status() != before:
                self._recount()

    def _rewound(self, rank: int, epoch: int, rewind_to: int) -> None:
        """A rewind of `rank` (folded into the ledger already): its older-epoch copies of
        later steps no longer count."""
        for step in [t for t in self._steps if t > rewind_to]:
            if step not in self._record_only:
                self._refresh(step, rank, None)
            elif self._steps[step].epoch < epoch:
                before = self._steps[step].status()
                self._clear(step, [rank], _TIERS)
                if self._steps[step].status() != before:
                    self._recount()

    def _clear(self, step: int, ranks: Iterable[int], tiers: Iterable[Tier]) -> bool:
        """Clear `ranks` on `tiers` in `step`; whether that changed anything (the caller
        recounts)."""
        s = self._steps[step]
        changed = False
        for tier in tiers:
            for rank in ranks:
                changed |= s.set(tier, rank, False)
        if changed:
            self._changes.put.add(step)
        return changed

    # --- what is complete, what is kept

    def _recount(self, *, move: bool = True) -> None:
        steps = sorted(self._steps)
        complete = {
            tier: [t for t in steps if self._steps[t].complete(tier)] for tier in self._complete
        }
        if complete != self._complete:
            self._changes.committed |= set(complete["s3"]) - set(self._complete["s3"])
            self._complete = complete
            self._changes.head = True
            if move:
                self._move_floors()

    def _kept(self) -> set[int]:
        """Never removed: the newest complete step of each tier and of both together, and
        the steps a restore reads."""
        return {done[-1] for done in self._complete.values() if done} | set(self._pinned)

    def _period_kept(self, step: int) -> bool:
        period = self.keep.s3_keep_period
        s = self._steps.get(step)
        return bool(period) and step % period == 0 and s is not None and s.complete("s3")

    def _move_floors(self) -> None:
        if self._hold:
            return
        nvme = _floor(self._complete["nvme"], self.keep.nvme_keep_latest_k)
        s3 = _floor(self._complete["s3"], self.keep.s3_keep_latest_k)
        kept = self._kept()
        floors = Floors(
            nvme=max(nvme, self._floors.nvme),
            s3=max(s3, self._floors.s3),
            keep=sorted(t for t in kept if t < max(nvme, s3, self._floors.nvme, self._floors.s3)),
        )
        if floors != self._floors:
            self._floors = floors
            self._changes.floors = True
        for step in sorted(self._steps):
            if step >= floors.s3:
                break
            s = self._steps[step]
            if step in kept or self._period_kept(step) or s.s3_removed:
                continue
            self._changes.s3_removed[step] = s.record(step)
            s.s3_removed = True
            self._changes.put.add(step)
        for step in [t for t in self._steps if self._gone(t)]:
            self._drop(step)
        self._recount(move=False)  # (what the removals changed; the floors stay)

    def _gone(self, step: int) -> bool:
        """Below both floors and kept by no rule, and no NVMe copy left that was never in
        object storage (those stay, unless the job keeps none): nothing of the step is kept
        any more, and a node that still holds a copy of it may remove it."""
        if step in self._kept() or self._period_kept(step):
            return False
        if not (step < self._floors.nvme and step < self._floors.s3):
            return False
        s = self._steps.get(step)
        return s is None or self.keep.evict_unflushed or not s.unflushed()

    def _drop(self, step: int) -> None:
        world_size = self._steps.pop(step).world_size
        self._changes.digests = {(t, c) for t, c in self._changes.digests if t != step}
        self._changes.digests_deleted[step] = -(-world_size // RANKS_PER_CHUNK)
        self._record_only.discard(step)
        self._first_seq.pop(step, None)
        self._ledger.forget(step)
        self._changes.put.discard(step)
        self._changes.committed.discard(step)
        self._changes.deleted.add(step)
        self._changes.head = True

    # --- views

    def record(self, step: int) -> StepRecord | None:
        s = self._steps.get(step)
        return None if s is None else s.record(step)

    def records(self) -> dict[int, StepRecord]:
        return {t: s.record(t) for t, s in sorted(self._steps.items())}

    def rank_digests(self, step: int, chunk: int) -> RankDigests | None:
        """The digests of ranks `chunk * RANKS_PER_CHUNK`... of `step` (None: the step is not
        folded from its events here, or has no verified copy yet)."""
        s = self._steps.get(step)
        return None if s is None or not s.sizes else s.rank_digests(step, chunk)

    def floors(self) -> Floors:
        return self._floors

    def head(self) -> JobHead:
        window = [t for t in self._first_seq if t >= self._floors.nvme or t in self._kept()]
        if window:
            resume = min(self._first_seq[t] for t in window), min(window)
            self._resume = max(self._resume, resume)
        head = JobHead(
            job=self.job,
            world_size=self._world_size,
            nvme_steps=list(self._complete["nvme"]),
            s3_steps=list(self._complete["s3"]),
            steps=sorted(self._steps),
            seq=self.seq,
            resume_seq=self._resume[0],
            window=self._resume[1],
            stream=self.stream,
        )
        return msgspec.structs.replace(head, records=self._head_records(head))

    def _head_records(self, head: JobHead) -> list[StoredRecord]:
        """The records of `head`'s candidates that fit in `HEAD_RECORD_BYTES` (each deflated
        once per change of the record, not per head)."""
        out, room, cache = [], HEAD_RECORD_BYTES, {}
        for step in head.candidates():
            rec = self.record(step)
            if rec is None:
                continue
            stored = self._stored.get(step)
            if stored is None or stored[0] != rec:
                stored = (rec, stored_record(rec))
            cache[step] = stored
            if stored[1].nbytes <= room:
                out.append(stored[1])
                room -= stored[1].nbytes
        self._stored = cache
        return out

    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        return changes


def _floor(done: list[int], keep: int) -> int:
    """The oldest step still kept once `keep` complete steps exist, else -1."""
    return done[-keep] if len(done) >= keep else -1
