"""The job state: one job's compacted state, folded from its events: per step and tier (the
saver's NVMe, object storage, a replica on a peer's NVMe), which ranks have a good copy; the
newest complete steps; the retention floors.

The retention coordinator (`tierpipe.control.coordinator`) feeds it the job's events (or their
facts, `tierpipe.schemas.facts`) and stores what changed in JetStream KV
(`tierpipe.control.kvstate`); restarts, retention and operators read the KV, never the history.
Pure (no I/O), so property tests hold it against a fold of the whole history (the test
oracle `Catalog`, tests/oracle_catalog.py). Copies go into a ledger (`tierpipe.control.ledger`),
each rank's usable ones into its step's bitmaps (`tierpipe.control.bitmap.StepBits`), with the
global layout its copies name (`StepRecord.layout`, once every rank named the same one).

Memory stays bounded by what is kept: steps in the window (the NVMe retention window and what
is in flight) are folded from their events; older kept steps are known by their records alone,
changed only by removals; a step below both floors leaves memory and the KV. Work per event is
O(1) in the number of steps, but O(kept steps) when it completes a step or moves a floor, and
O(that rank's kept steps) when it rewinds a rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from tierpipe.control.bitmap import TIERS, StepBits, bitmap, has_rank, ranks_of
from tierpipe.control.changes import Changes
from tierpipe.control.ledger import Ledger, LedgerShard
from tierpipe.control.upload import targets
from tierpipe.errors import EVIDENCE_ERRORS
from tierpipe.schemas import Event, Tier
from tierpipe.schemas.facts import (
    BaseFact,
    BatchFact,
    EvictedFact,
    Fact,
    FailedFact,
    RestoreFact,
    ShardFact,
    fact_of,
)
from tierpipe.schemas.jobstate import (
    HEAD_RECORD_BYTES,
    RANKS_PER_CHUNK,
    Floors,
    JobHead,
    Keep,
    RankDigests,
    StepRecord,
    StoredRecord,
    stored_record,
)

__all__ = ("Changes", "JobState")  # (`Changes` lives in `tierpipe.control.changes`)


class JobState:
    """The fold. Feed it with `apply()` in stream order; `take_changes()` says what to store.

    Args:
        head, floors, records: what the KV holds (a coordinator taking over). Records of steps
            from `head.window` on are not loaded: the events from `head.resume_seq` rebuild them.
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
        self._ledger = Ledger()
        self.seq = head.seq if head else 0
        window = head.window if head else 0
        self._steps = {t: StepBits.of(r) for t, r in records.items() if t < window}
        #: Steps known by their records alone (older than the window when this fold started).
        self._record_only = set(self._steps)
        #: step -> the stream sequence of the first of its events this fold saw.
        self._first_seq: dict[int, int] = {}
        self._resume = (head.resume_seq, head.window) if head else (0, 0)
        #: The stream sequence the stored head had folded, and the steps it listed: an event up
        #: to it of a step not listed was folded, and its step removed since (`_gone`).
        self._listed = (head.seq, frozenset(head.steps)) if head else (0, frozenset[int]())
        self._world_size = head.world_size if head else 0
        #: When the stream `seq` counts in was made (`on_stream`).
        self.stream = head.stream if head else ""
        self._floors = floors or Floors()
        self._pinned: frozenset[int] = frozenset()
        self._hold, self._now = False, 0.0  # (the newest event's `ts`: `Keep.s3_every_s`)
        #: The newest step a restart loaded (an upload target older than it is done with).
        self._restored = -1
        self._complete: dict[Tier | None, list[int]] = {t: [] for t in (*TIERS, None)}
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
        # The fold's clock is its events' (a fold of the same events names the same targets).
        self._now = max(self._now, fact.ts)
        if type(fact) is BatchFact:
            fold = self._fold_shard
            for inner in fact.events:  # (of the batch's job: `NodeBatch`, `decode_fact`)
                fold(seq, inner)
        elif isinstance(fact, ShardFact):
            self._fold_shard(seq, fact)
        elif (step := getattr(fact, "step", None)) is not None and (
            rank := getattr(fact, "rank", None)
        ) is not None:  # (a verdict on a copy, or a restore's report; not a plan)
            if type(fact) is RestoreFact and fact.phase == "loaded" and step > self._restored:
                self._restored = step
                self._move_floors()
            if step in self._record_only:
                self._apply_to_record(step, rank, fact)
            elif step in self._steps or not self._gone(step, seq):
                shard = self._ledger.apply(fact)
                if step in self._steps:
                    self._refresh(step, rank, None, shard)

    def _fold_shard(self, seq: int, f: ShardFact) -> None:
        step, rank, rewind = f.step, f.rank, f.rewind_to
        if step in self._record_only:
            self._apply_to_record(step, rank, f)
            if rewind is not None:
                self._ledger.rewind(rank, f.epoch, rewind)
        elif step in self._steps or not self._gone(step, seq):  # (a late event of a dropped step)
            shard = self._ledger.apply(f)
            self._first_seq.setdefault(step, seq)
            self._refresh(step, rank, f.world_size, shard)
            s = self._steps.get(step) if (layout := getattr(f, "layout", "")) else None
            if s is not None and f.world_size == s.world_size and s.note_layout(rank, layout):
                self._changes.put.add(step)
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
        self._ledger = Ledger()
        self._record_only = set(self._steps)
        self._first_seq.clear()
        self._resume = (0, max(self._steps, default=-1) + 1)
        self._listed = (0, frozenset())
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
        self, step: int, rank: int, world_size: int | None, shard: LedgerShard | None = None
    ) -> None:
        """Recompute `rank`'s bits in `step` from the ledger (`shard`: its entry there, if the
        caller has it at hand)."""
        s = self._steps.get(step)
        if s is None:
            if not world_size or self._gone(step):
                return
            s = self._steps[step] = StepBits(world_size)
            if step >= max(self._steps):
                self._world_size = world_size
            self._changes.put.add(step)
        if shard is None:
            shard = self._ledger.shard(step, rank)
        if shard is None or shard.world_size != s.world_size or rank >= s.world_size:
            return
        epoch, usable = shard.usable()
        epoch = max(epoch, s.epoch)
        changed = epoch != s.epoch
        s.epoch = epoch
        late = s.s3_removed and "s3" in usable and not has_rank(s.bits["s3"], rank)
        flipped, recount = s.update(rank, usable)
        if late:
            self._late(step, rank)
        # Every tier's copy is the same file: the first verified one gives the rank's digest.
        copy = usable.get("nvme") or usable.get("s3") or usable.get("peer")
        if copy is not None and s.note_copy(rank, copy.header_digest, copy.nbytes):
            self._changes.digests.add((step, rank // RANKS_PER_CHUNK))
        if changed or flipped:
            self._changes.put.add(step)
        if recount:
            self._recount()

    def _late(self, step: int, rank: int) -> None:
        """`rank`'s object of `step` was confirmed after retention removed the step's objects
        (its upload completed as the floor passed): it is removed too (`Changes.s3_late`)."""
        s = self._steps[step]
        before = self._changes.s3_late.get(step)
        ranks = [*ranks_of(before.s3), rank] if before is not None else [rank]
        self._changes.s3_late[step] = msgspec.structs.replace(
            s.record(step), s3=bitmap(ranks, s.world_size)
        )

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
        if tier in TIERS and rank < s.world_size and not (tier == "s3" and s.s3_removed):
            before = s.status()
            self._clear(step, [rank], (tier,))
            if s.status() != before:
                self._recount()

    def _rewound(self, rank: int, epoch: int, rewind_to: int) -> None:
        """A rewind of `rank` (folded into the ledger already): its older-epoch copies of
        later steps no longer count, and floors the abandoned branch raised above `rewind_to`
        come down to it (floors otherwise only rise: the new branch's steps would be below
        them, and evict would remove them as superseded)."""
        floors = self._floors
        if max(floors.nvme, floors.s3) > rewind_to:
            self._floors = msgspec.structs.replace(
                floors, nvme=min(floors.nvme, rewind_to), s3=min(floors.s3, rewind_to)
            )
            self._changes.floors = True
        for step in [t for t in self._steps if t > rewind_to]:
            if step not in self._record_only:
                self._refresh(step, rank, None)
            elif self._steps[step].epoch < epoch:
                before = self._steps[step].status()
                self._clear(step, [rank], TIERS)
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
        """Never removed: the newest complete step of each tier (NVMe, object storage, peers)
        and of any of them, and the steps a restore reads."""
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
        floors = targets(floors, self._floors, self._complete, self.keep, self._now,
                         self._restored)  # fmt: skip
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

    def _gone(self, step: int, seq: int = 0) -> bool:
        """Below both floors and kept by no rule, and no NVMe copy left that was never in
        object storage (those stay, unless the job keeps none): nothing of the step is kept
        any more, and a node that still holds a copy of it may remove it. Or (an event at
        stream sequence `seq`) the stored state this fold began from had folded the event and
        removed the step since: a fold taking over does not make it again (its keys are
        deleted, and a write may not bring them back), even where a rewind lowered the
        floors under it afterwards."""
        if seq and seq <= self._listed[0] and step not in self._listed[1]:
            return True
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
            peer_steps=list(self._complete["peer"]),
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
