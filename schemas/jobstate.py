"""A job's compacted state, as kept in the JetStream KV bucket (`tierpipe.control.kvstate`).

The event stream is the audit log and the stages' trigger; these records are what restarts,
retention and operators read instead of replaying it. One writer (the job's retention
coordinator, holding the `Lease`) folds the job's events into them; every value stays far below
the 256 KiB message limit at any job size, and what one restarting rank reads stays a few KiB:
a step's two rank bitmaps (20 KiB at 80,000 ranks) are stored deflated (`encode_record`), ~100
B for a complete step.

Keys (job names are tokens, so a key's parts never contain a dot):
- `<job>.head`: `JobHead`, the newest complete steps and what is kept;
- `<job>.floor`: `Floors`, the retention floors nodes watch to remove their own NVMe copies;
- `<job>.step.<step>`: `StepRecord` (`encode_record`), which ranks have a good copy on each tier;
- `<job>.step.<step>.ranks.<chunk>`: `RankDigests`, the header digest and size of each rank's
  verified copy, `RANKS_PER_CHUNK` ranks a key (what a restoring rank checks its copy against);
- `<job>.keep`: `Keep`, the job's retention policy (set by the trainer);
- `<job>.lease`: `Lease`, who coordinates the job;
- `<job>.budget`: `Budget`, the job-wide admission budgets (`tierpipe flush rate --job`);
- `<job>.shares`: `Shares`, each active node's part of them (written by the coordinator);
- `<job>.layout.<digest>`: a `tierpipe.schemas.layout.StepLayout` (msgpack), the global layout of
  the steps whose records name that digest, created once by the first agent to write a shard
  of it (kept until `tierpipe rm`);
- `<job>.location`: `StoreLocation`, where the job's objects live (created once, by the first
  agent to write one; every later object write or delete of the job checks it).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from tierpipe.schemas.events import deflated_bitmap, inflate_bitmap
from tierpipe.schemas.layout import LayoutDigest
from tierpipe.schemas.names import Token

__all__ = (
    "RANKS_PER_CHUNK",
    "Budget",
    "Floors",
    "JobHead",
    "Keep",
    "Lease",
    "RankDigests",
    "Shares",
    "StepRecord",
    "StoreLocation",
    "StoredRecord",
    "decode_record",
    "encode_record",
    "stored_record",
)

#: Ranks per `RankDigests` value: 24 bytes a rank, about 8 KiB a value as JSON (base64), what
#: a restoring rank reads to check its copy (a node's ranks share one).
RANKS_PER_CHUNK = 256
#: Bytes of one header digest (xxh3-128) and of one size in `RankDigests`.
DIGEST_BYTES = 16
SIZE_BYTES = 8

#: A restart's candidate steps (`JobHead.candidates`): the newest with a record, and the newest
#: complete ones on each tier.
NEWEST, COMPLETE = 3, 2
#: The stored bitmaps of candidate records the head carries at most (`JobHead.records`): a few
#: hundred bytes a complete step, whatever the world size; partial ones of huge jobs may not fit,
#: and are read from their own keys.
HEAD_RECORD_BYTES = 64 * 1024

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
#: A step, or -1 for none.
StepOrNone = Annotated[int, msgspec.Meta(ge=-1)]


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Which ranks of one step have a good copy on each tier.

    A bitmap holds rank r in bit `r % 8` of byte `r // 8` (`tierpipe.control.bitmap`); a
    step is complete on a tier when its bitmap holds every rank below `world_size`.
    """

    step: NonNegInt
    world_size: PosInt
    #: The newest timeline (`ShardEvent.epoch`) among the step's saves (each rank has its own).
    epoch: NonNegInt = 0
    #: Ranks with a verified, intact NVMe copy on at least one node.
    nvme: bytes = b""
    #: Ranks whose object is confirmed in the store (size and checksum, after the upload).
    s3: bytes = b""
    #: Retention removed the step's objects: `s3` still says which ranks were flushed (their
    #: NVMe copies may go), but no rank has a copy there any more.
    s3_removed: bool = False
    #: Ranks with a verified replica on another node's NVMe than the one that saved it (the
    #: `peer` tier: `ShardReplicated`).
    peer: bytes = b""
    #: The digest of the global layout every rank's copy reported (`<job>.layout.<digest>`,
    #: `tierpipe.schemas.layout.StepLayout`): "" for a plain save, an older one, or ranks
    #: that disagree. A resharded restore plans from it without reading a shard header.
    layout: LayoutDigest = ""


class StoredRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A `StepRecord` as the KV holds it: each bitmap deflated (`*_z`) where that is smaller,
    its plain field then empty (`stored_record`; back with `record()`)."""

    step: NonNegInt
    world_size: PosInt
    epoch: NonNegInt = 0
    nvme: bytes = b""
    s3: bytes = b""
    s3_removed: bool = False
    nvme_z: bytes = b""
    s3_z: bytes = b""
    peer: bytes = b""
    peer_z: bytes = b""
    layout: LayoutDigest = ""

    def record(self) -> StepRecord:
        """The record, its bitmaps inflated.

        Raises:
            msgspec.ValidationError: a deflated bitmap is garbled or holds more than
                `world_size` ranks.
        """
        try:
            nvme = inflate_bitmap(self.nvme_z, self.world_size) if self.nvme_z else self.nvme
            s3 = inflate_bitmap(self.s3_z, self.world_size) if self.s3_z else self.s3
            peer = inflate_bitmap(self.peer_z, self.world_size) if self.peer_z else self.peer
        except ValueError as e:
            raise msgspec.ValidationError(f"step record {self.step}: {e}") from e
        return StepRecord(
            step=self.step, world_size=self.world_size, epoch=self.epoch, nvme=nvme, s3=s3,
            s3_removed=self.s3_removed, peer=peer, layout=self.layout,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """The bitmaps' bytes as stored."""
        return sum(map(len, (self.nvme, self.s3, self.peer, self.nvme_z, self.s3_z, self.peer_z)))


def stored_record(rec: StepRecord) -> StoredRecord:
    nvme, nvme_z = deflated_bitmap(rec.nvme)
    s3, s3_z = deflated_bitmap(rec.s3)
    peer, peer_z = deflated_bitmap(rec.peer)
    return StoredRecord(
        step=rec.step, world_size=rec.world_size, epoch=rec.epoch, nvme=nvme, s3=s3,
        s3_removed=rec.s3_removed, nvme_z=nvme_z, s3_z=s3_z, peer=peer, peer_z=peer_z,
        layout=rec.layout,
    )  # fmt: skip


_stored = msgspec.json.Decoder(StoredRecord)


def encode_record(rec: StepRecord) -> bytes:
    """`rec` as the KV stores it under its step key (`StoredRecord`)."""
    return msgspec.json.encode(stored_record(rec))


def decode_record(value: bytes) -> StepRecord:
    """A step record as the KV stores it (its bitmaps inflated).

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: not a record (see `StoredRecord.record`).
    """
    return _stored.decode(value).record()


class RankDigests(msgspec.Struct, frozen=True, kw_only=True):
    """The header digest and file size of the verified copy of ranks `first` to
    `first + RANKS_PER_CHUNK - 1` of one step (all zero for a rank with none yet). Every tier's
    copy of a shard is the same file, so one digest per rank: a restoring rank refuses any copy
    whose header does not hash to it."""

    step: NonNegInt
    first: NonNegInt
    #: `DIGEST_BYTES` per rank, in rank order.
    digests: bytes
    #: `SIZE_BYTES` per rank (little-endian), in rank order.
    sizes: bytes

    def of(self, rank: int) -> tuple[str, int] | None:
        """(header digest as hex, size) of `rank`, or None if it has no verified copy."""
        return digest_at(self.digests, self.sizes, rank - self.first)


def digest_at(digests: bytes, sizes: bytes, i: int) -> tuple[str, int] | None:
    """(header digest as hex, size) of entry `i` of packed `digests` and `sizes` (as in
    `RankDigests`), or None: out of range, or size zero (no verified copy)."""
    if not 0 <= i < len(sizes) // SIZE_BYTES:
        return None
    size = int.from_bytes(sizes[i * SIZE_BYTES : (i + 1) * SIZE_BYTES], "little")
    digest = digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]
    return (digest.hex(), size) if size else None


class JobHead(msgspec.Struct, frozen=True, kw_only=True):
    """The job at a glance: what a restart reads first."""

    job: Token
    #: The world size of the newest step seen.
    world_size: NonNegInt = 0
    #: Complete steps still kept, ascending, per tier.
    nvme_steps: list[NonNegInt] = []
    s3_steps: list[NonNegInt] = []
    #: Steps every rank of which has a verified replica on a partner node (`peer` tier).
    peer_steps: list[NonNegInt] = []
    #: Steps with a record (complete or not) that are not below both floors, ascending.
    steps: list[NonNegInt] = []
    #: The stream sequence of the last event folded in.
    seq: NonNegInt = 0
    #: What a new coordinator folds again to rebuild what it keeps in memory: the events from
    #: `resume_seq` on, which hold every event of the steps from `window` on (the steps still in
    #: NVMe retention or in flight); older steps are known from their records alone.
    resume_seq: NonNegInt = 0
    window: NonNegInt = 0
    #: When the job's stream whose sequences `seq` and `resume_seq` count was made (a stream
    #: deleted, or lost by its server, and made again numbers its events from 1 again).
    stream: str = ""
    #: The records of the restart's `candidates()`, newest first, as many as fit in
    #: `HEAD_RECORD_BYTES`: a restarting node reads them with the head, not one by one.
    records: list[StoredRecord] = []

    def candidates(self, step: int | None = None) -> list[int]:
        """The steps a restart considers, newest first: the newest `NEWEST` with a record and
        the newest `COMPLETE` complete ones on each tier (a node that was replaced has only
        its partners' replicas and object storage). `step`: only that one."""
        if step is not None:
            return [step]
        complete = (
            self.nvme_steps[-COMPLETE:] + self.s3_steps[-COMPLETE:] + self.peer_steps[-COMPLETE:]
        )
        return sorted(set(self.steps[-NEWEST:]) | set(complete), reverse=True)

    @property
    def newest_nvme(self) -> int | None:
        return self.nvme_steps[-1] if self.nvme_steps else None

    @property
    def newest_s3(self) -> int | None:
        return self.s3_steps[-1] if self.s3_steps else None


class Floors(msgspec.Struct, frozen=True, kw_only=True):
    """Retention floors: each node removes its own NVMe copies of steps below `nvme` (once
    they are in object storage, unless the job keeps unflushed copies); the coordinator removes
    the objects of steps below `s3` (but for `Keep.s3_keep_period` steps). Floors never go
    down; the steps in `keep` stay on every tier whatever the floors say (the newest complete
    step of each tier and of both together, and the steps a restore is reading)."""

    nvme: StepOrNone = -1
    s3: StepOrNone = -1
    keep: list[NonNegInt] = []
    #: The step the job names for object storage now: every node uploads its shards of it
    #: (and of steps `Keep.s3_keep_period` keeps), and no other; named again once it is
    #: complete there (never lower). -1: none yet.
    upload: StepOrNone = -1
    #: The newest step that survives the loss of any one node: complete in object storage, or
    #: every rank with a verified replica on a partner node. -1: none. A superseded NVMe
    #: copy below the NVMe floor that will never be uploaded goes once this passes its step.
    safe: StepOrNone = -1
    #: When `upload` was named (wall-clock s since the epoch; 0: never), for `Keep.s3_every_s`.
    upload_ts: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class Keep(msgspec.Struct, frozen=True, kw_only=True):
    """A job's retention policy (`Checkpointer(keep=...)`; the agent's settings are defaults).
    The newest complete step of each tier, and of both together, is kept whatever it says."""

    #: Complete steps kept on NVMe (torchtitan's keep_latest_k).
    nvme_keep_latest_k: Annotated[int, msgspec.Meta(ge=2)] = 3
    #: Complete steps kept in object storage.
    s3_keep_latest_k: PosInt = 10
    #: Also keep every step divisible by this in object storage (0: off; Orbax's keep_period).
    s3_keep_period: NonNegInt = 0
    #: Remove NVMe copies below the floor even when they never reached object storage.
    evict_unflushed: bool = False
    #: Object-storage cadence: the next step named for upload (`Floors.upload`) is at least
    #: this many steps after the last one, and named at least this many seconds after it.
    s3_every_steps: PosInt = 1
    s3_every_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """Who coordinates a job until when. A holder renews it well before `expires`; another
    agent takes it over (compare-and-set on the key's revision) once it has expired."""

    holder: str
    #: Bumped at every takeover: a holder that finds a newer term has lost the lease.
    term: PosInt
    #: Wall-clock time (s since the epoch) after which the lease is free.
    expires: float
    #: The holding agent's process (its node is `holder`), as its node's record names it: an
    #: agent of the node that is another process and started after `since`, or a record that
    #: says the agent stopped or went silent, shows the holder gone, and a restart takes the
    #: lease at once (`tierpipe.control.holder`). 0: the holder is no agent (a restart folding
    #: the job's state), whose lease is never taken before it expires.
    pid: int = 0
    host: str = ""
    #: When this term began (the holder's clock; renewals keep it).
    since: float = 0.0


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """A job's admission budgets for object storage, for the whole job (0: no job-wide cap);
    the coordinator divides them among the job's active nodes (`Shares`)."""

    #: Upload bytes/s of every node of the job together.
    flush_bytes_per_s: NonNegInt = 0
    #: Concurrent object GETs of every node of the job together, during a restore.
    restore_gets: NonNegInt = 0


class Shares(msgspec.Struct, frozen=True, kw_only=True):
    """Each node's part of the job's `Budget`: the budget divided by the active nodes, rounded
    down (so the parts never add up to more), at least 1 GET (a node must read to restore).
    0 means no job-wide cap. A node's own settings still apply: it uses the lower of the two."""

    flush_bytes_per_s_per_node: NonNegInt = 0
    restore_gets_per_node: NonNegInt = 0
    #: How many nodes the budget was divided among.
    nodes: NonNegInt = 0
    #: The lease term of the coordinator that wrote it.
    term: NonNegInt = 0


class StoreLocation(msgspec.Struct, frozen=True, kw_only=True):
    """Where a job's objects live: bound to the job in KV by the first agent that writes one of
    them (`tierpipe.control.location.bind_location`), and what every agent's own object store must
    be before it writes or deletes another. Never a credential."""

    #: The S3 endpoint URL as compared (`tierpipe.control.location.normal_endpoint`); "" for AWS's.
    endpoint: str = ""
    bucket: str
    #: The key prefix, without leading or trailing slashes.
    prefix: str = ""

    def __str__(self) -> str:
        where = "/".join(p for p in (self.bucket, self.prefix) if p)
        return f"s3://{where} at {self.endpoint or 'the AWS default endpoint'}"
