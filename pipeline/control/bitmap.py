"""Rank bitmaps: which ranks of a step hold a copy, one bit per rank, as the job state stores
them (`tierpipe.schemas.jobstate.StepRecord`), and `StepBits`, one step's bitmaps per tier (NVMe,
object storage, peer replicas) as the fold (`tierpipe.control.jobstate.JobState`) keeps them
while it changes them."""

from __future__ import annotations

from collections.abc import Container, Iterable

from tierpipe.schemas import Tier
from tierpipe.schemas.jobstate import (
    DIGEST_BYTES,
    RANKS_PER_CHUNK,
    SIZE_BYTES,
    RankDigests,
    StepRecord,
)

__all__ = ("TIERS", "StepBits", "bitmap", "has_rank", "is_full", "ranks_of")

#: The tiers a step's bitmaps cover (a copy in RAM is not kept state): the saver's NVMe, object
#: storage, a replica on another node's NVMe.
TIERS: tuple[Tier, Tier, Tier] = ("nvme", "s3", "peer")


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


class StepBits:
    """One step's bitmaps, mutable, with their counts."""

    __slots__ = (
        "bits", "count", "digests", "either", "epoch", "layout", "layout_count", "layout_ranks",
        "s3_removed", "sizes", "world_size",
    )  # fmt: skip

    def __init__(self, world_size: int, epoch: int = 0) -> None:
        self.world_size = world_size
        self.epoch = epoch
        size = (world_size + 7) // 8
        self.bits: dict[Tier, bytearray] = {t: bytearray(size) for t in TIERS}
        self.count: dict[Tier, int] = dict.fromkeys(TIERS, 0)
        #: Ranks with a copy on any tier.
        self.either = 0
        #: Retention removed the step's objects; `s3` still says which ranks were there.
        self.s3_removed = False
        #: Each rank's verified copy: header digest and size (`RankDigests`; zero: none yet).
        #: Empty for a step known by its record alone (its digests stay in the KV as they are).
        self.digests = bytearray()
        self.sizes = bytearray()
        #: The layout digest the step's copies reported (None: two ranks disagreed), and the
        #: ranks that reported it: the record names it once every rank did.
        self.layout: str | None = ""
        self.layout_ranks = bytearray()
        self.layout_count = 0

    def note_layout(self, rank: int, digest: str) -> bool:
        """`rank`'s copy reported layout `digest`; whether the record's layout changed (a
        disagreement clears it for good: the restore then reads a shard header instead)."""
        before = self.agreed_layout()
        if self.layout is not None and self.layout not in ("", digest):
            self.layout = None
        elif self.layout is not None:
            self.layout = digest
            if not self.layout_ranks:
                self.layout_ranks = bytearray((self.world_size + 7) // 8)
            i, mask = rank >> 3, 1 << (rank & 7)
            if not self.layout_ranks[i] & mask:
                self.layout_ranks[i] |= mask
                self.layout_count += 1
        return self.agreed_layout() != before

    def agreed_layout(self) -> str:
        """The layout every rank reported, or ""."""
        full = self.layout_count >= self.world_size
        return self.layout if self.layout and full else ""

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
    def of(cls, rec: StepRecord) -> StepBits:
        s = cls(rec.world_size, rec.epoch)
        s.s3_removed = rec.s3_removed
        if rec.layout:
            s.layout, s.layout_count = rec.layout, rec.world_size
        for tier in TIERS:
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
        others = 0
        for t in TIERS:
            if t != tier:
                others |= self.bits[t][i]
        if not others & mask:  # (the rank's copy on any tier came, or went, with this)
            self.either += 1 if on else -1
        return True

    def update(self, rank: int, on: Container[str]) -> tuple[bool, bool]:
        """Set `rank` on the tiers in `on`, clear it on the others (`s3` keeps its ranks once
        retention removed the objects, and gains one whose object was confirmed after:
        `Changes.s3_late`); whether that changed anything, and whether it changed the step's
        completeness on some tier (or on any)."""
        i, mask = rank >> 3, 1 << (rank & 7)
        # One rank moves each count by one at most, and no tier counts more ranks than `either`:
        # below `world_size - 1` no completeness can change.
        near = self.either >= self.world_size - 1
        before, flipped = self._full() if near else (), False
        for t in TIERS:
            wanted = t in on
            kept = t == "s3" and self.s3_removed and not wanted
            if bool(self.bits[t][i] & mask) != wanted and not kept:
                flipped |= self.set(t, rank, wanted)
        return flipped, flipped and near and before != self._full()

    def _full(self) -> tuple[bool, ...]:
        """Completeness as `status` says it (cheaper where no objects were removed)."""
        if self.s3_removed:
            return self.status()
        w, count = self.world_size, self.count
        return count["nvme"] == w, count["s3"] == w, count["peer"] == w, self.either == w

    def unflushed(self) -> bool:
        """Some rank has a verified NVMe copy that never reached object storage."""
        return any(n & ~m for n, m in zip(self.bits["nvme"], self.bits["s3"], strict=True))

    def status(self) -> tuple[bool, ...]:
        """Complete on NVMe, in object storage, on peers, on any of them."""
        return (*(self.complete(t) for t in TIERS), self.complete(None))

    def complete(self, tier: Tier | None) -> bool:
        """Every rank has a copy on `tier` (None: on any tier)."""
        if self.s3_removed and tier in ("s3", None):
            if tier == "s3":
                return False
            nvme, peer = (int.from_bytes(self.bits[t], "little") for t in ("nvme", "peer"))
            return (nvme | peer).bit_count() == self.world_size
        return (self.either if tier is None else self.count[tier]) == self.world_size

    def record(self, step: int) -> StepRecord:
        return StepRecord(
            step=step,
            world_size=self.world_size,
            epoch=self.epoch,
            nvme=bytes(self.bits["nvme"]),
            s3=bytes(self.bits["s3"]),
            s3_removed=self.s3_removed,
            # (none: empty, so the records of a job without replicas stay as small as before)
            peer=bytes(self.bits["peer"]) if self.count["peer"] else b"",
            layout=self.agreed_layout(),
        )
