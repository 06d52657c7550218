"""Events that move a shard through the tiers, as published on `tp.<job>.<kind>.<node>.<rank>`.

Every event is a frozen, tagged msgspec Struct encoded as compact JSON, so `nats stream view` and
`nats sub 'tp.>'` show readable bodies. Tensor bytes never travel on the bus: events carry
references (paths, sizes, digests).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Annotated, Literal, Protocol, TypeVar

import msgspec

from tierpipe.schemas.layout import LayoutDigest
from tierpipe.schemas.names import Token

__all__ = (
    "BATCH_MAX", "READY_RANKS", "SCHEMA_VERSION", "BatchKind", "Event", "FlushAction",
    "FlushControl", "NodeBatch", "RankSteps", "RecoveryPlanned", "RestoreReport", "ShardEvent",
    "ShardEvicted", "ShardFlushed", "ShardIdentity", "ShardReplicated", "ShardStaged",
    "ShardVerified", "ShardWritten", "SourceRef", "StageFailed", "Tier", "decode_event",
    "deflated_bitmap", "encode_event", "inflate_bitmap", "shard_event",
)  # fmt: skip

#: Bumped when a field changes meaning or a required field is added.
SCHEMA_VERSION = 1

#: Where a copy lives: staging RAM, its own node's NVMe, another node's NVMe (a replica made by
#: the replicate stage), object storage.
Tier = Literal["ram", "nvme", "peer", "s3"]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Digest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}\Z")]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    #: Schema version; `decode_event` refuses any other (an event is never guessed at).
    v: int = SCHEMA_VERSION
    job: Token
    node: Token
    ts: float


E = TypeVar("E", bound=_Event)


class ShardEvent(_Event, frozen=True, kw_only=True):
    """Common identity of one rank's shard of one step."""

    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    #: The save's timeline (the saving Checkpointer's start, in ns; 0 before timelines existed).
    #: A run that rewinds (restores, or saves with `overwrite=True`) starts a newer epoch, and
    #: its saves supersede older epochs' saves of later steps (`rewind_to`).
    epoch: NonNegInt = 0
    #: Set on every save of a run that rewound to this step (it restored it, or saves with
    #: `overwrite=True`): this rank's saves of a later step with an older epoch are superseded,
    #: and a writer may replace their files and objects. -1: every step. Carried by every event
    #: that follows the save's `staged`.
    rewind_to: Annotated[int, msgspec.Meta(ge=-1)] | None = None

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")

    def follow(self, kind: type[E], *, node: str, **fields: object) -> E:
        """The next event about the same shard (what a stage publishes for its input)."""
        if issubclass(kind, ShardEvent):
            fields = {"rewind_to": self.rewind_to, **fields}
        return shard_event(kind, self, node=node, **fields)


class ShardIdentity(Protocol):
    """A shard and its save's timeline, as `shard_event` reads them off anything that has them
    (an event, a shard header, a copy on NVMe)."""

    @property
    def job(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def epoch(self) -> int: ...


def shard_event(kind: type[E], of: ShardIdentity, *, node: str, **fields: object) -> E:
    """A `kind` event, published by `node` now, about the shard `of` names: anything with `job`,
    `step`, `rank`, `world_size` and `epoch` (an event, a shard header, a retention decision)."""
    make: Callable[..., E] = kind  # (mypy sees only the base's fields)
    event: E = make(
        job=of.job,
        node=node,
        ts=time.time(),
        step=of.step,
        rank=of.rank,
        world_size=of.world_size,
        epoch=of.epoch,
        **fields,
    )
    return event


class ShardStaged(ShardEvent, frozen=True, kw_only=True, tag="staged"):
    """The trainer copied the shard into a staging slot in shared memory.

    The slot file holds an unsealed shard image (header with zero digests, then data), so the
    layout and the non-tensor state travel in the slot, not on the bus.
    """

    staging_path: str
    slot: NonNegInt
    nbytes: NonNegInt
    tensors: NonNegInt
    stall_s: float
    blocking: bool = True
    #: "restore": a shard read back from object storage, staged so this node's NVMe gets a copy.
    origin: Literal["save", "restore"] = "save"
    #: The slot's generation when this image was copied in: the trainer bumps it in the slot
    #: (`tierpipe.storage.shard.slot_generation`) before it reuses the slot, so a writer that reads
    #: the same value before and after copying proves it copied this very save.
    generation: NonNegInt = 0


class _NvmeCopy(ShardEvent, frozen=True, kw_only=True):
    """What a stage says of the NVMe copy it wrote or re-read: `header_digest` (xxh3-128 of the
    header, which holds every tensor's digest) commits to the whole file."""

    path: str
    nbytes: NonNegInt
    header_digest: Digest
    seconds: float
    #: "restore": rewritten from a copy read back during a restore (see `ShardStaged.origin`).
    origin: Literal["save", "restore"] = "save"
    #: The `ts` of the `staged` event this copy was written from (0: no staging wrote it, as
    #: for `reindex` and `prefetch`). A copy written again from a new staging (a repair: a
    #: restore's write-back, verify's rewrite of it) is a new fact, even with the same bytes;
    #: the same staging delivered again is not (`tierpipe.names.msg_id`).
    staged_ts: float = 0.0
    #: The save's global layout's digest (stored in KV before this event; `schemas.layout`).
    layout: LayoutDigest = ""


class ShardWritten(_NvmeCopy, frozen=True, kw_only=True, tag="written"):
    """The shard file was written, fsynced and renamed into place on the node's NVMe."""

    tensors: NonNegInt


class ShardVerified(_NvmeCopy, frozen=True, kw_only=True, tag="verified"):
    """The NVMe copy was re-read from the device and every digest matched."""

    rewritten: bool = False


class ShardFlushed(ShardEvent, frozen=True, kw_only=True, tag="flushed"):
    """The shard was uploaded to object storage, and its size and checksum confirmed there."""

    bucket: str
    key: str
    etag: str
    #: The store's own checksum of the object (S3 composite CRC32C, `<base64>-<parts>`).
    checksum: str
    #: The shard's header digest, recorded as object metadata too.
    header_digest: Digest
    nbytes: NonNegInt
    seconds: float
    #: "reindex": republished by `tierpipe reindex` from the object's own metadata. The catalog
    #: counts a `flush` copy only if it matches a verified NVMe copy; a reindexed one stands on
    #: its own (its node may be gone), and restore checks its header on load either way.
    origin: Literal["flush", "reindex"] = "flush"
    layout: LayoutDigest = ""  # (as its `verified` event, or its COMMIT manifest, said)


class ShardReplicated(ShardEvent, frozen=True, kw_only=True, tag="replicated"):
    """A replica of another node's verified copy was written durably to this node's NVMe
    (`node`: the holder) and every digest checked (`tierpipe.stages.replicate`). The replica
    is the same file as the copy it was made from (same header digest)."""

    #: The node whose verified copy was copied (never `node`).
    source: Token
    path: str
    nbytes: NonNegInt
    header_digest: Digest
    seconds: float


class ShardEvicted(ShardEvent, frozen=True, kw_only=True, tag="evicted"):
    """A copy of the shard was removed from a tier (for `ram`, its staging slot was released)."""

    tier: Tier
    location: str
    reason: str


class StageFailed(_Event, frozen=True, kw_only=True, tag="failed"):
    """A stage could not process a message. Retryable failures are published on every attempt;
    a permanent one (or the last attempt) terminates the message. Identity fields are absent
    when the message could not be decoded."""

    stage: str
    error: str
    message: str
    retryable: bool
    attempt: PosInt
    step: NonNegInt | None = None
    rank: NonNegInt | None = None
    world_size: PosInt | None = None
    subject: str | None = None
    stream_seq: NonNegInt | None = None
    #: The tier of the copy found bad (verify, restore), so recovery skips it.
    tier: Tier | None = None
    #: The failed save's epoch (see `ShardEvent.epoch`).
    epoch: NonNegInt = 0
    #: The staging slot generation of the `staged` copy that failed (nvme-write): the slot is
    #: released for it only while it still holds that copy, never a retry's newer one.
    generation: NonNegInt | None = None


class SourceRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where one rank reads its shard from during a restore."""

    tier: Tier
    #: The node whose NVMe holds it ("" for object storage).
    node: str
    #: A path on that node, or `s3://bucket/key`.
    location: str
    nbytes: NonNegInt
    header_digest: Digest


class RecoveryPlanned(_Event, frozen=True, kw_only=True, tag="plan"):
    """Rank 0's decision for one restart, on `tp.<job>.plan`: the step every rank restores,
    which ranks read it from object storage, which from a peer's replica (the others from their
    own node's NVMe; object storage is the fallback where it has a copy). Compact at any job
    size: bitmaps, not sources (a rank derives its paths from job, step, rank and world size).
    A new `round` replaces the plan after a rank found no good copy; `final` confirms that
    every rank loaded the plan of that round."""

    restart: str
    round: PosInt
    step: NonNegInt
    world_size: PosInt
    #: Ranks that read from object storage: rank r is bit `r % 8` of byte `r // 8` (read it
    #: with `s3_bitmap()`).
    from_s3: bytes = b""
    #: Newer candidate steps that could not be used, with why (a few, each short).
    rejected: dict[int, str] = {}
    final: bool = False
    #: Set when rank 0 found nothing to restore (error class: message); ranks give up with it.
    error: str = ""
    #: `from_s3` deflated (zlib), where that is smaller; `from_s3` is then empty. Every rank
    #: receives the plan: at 80,000 ranks a bitmap of all of them is 13 KB as JSON, ~60 B so.
    from_s3_z: bytes = b""
    #: Ranks that read a replica on a surviving node, as `from_s3` (`peer_bitmap()` reads it).
    from_peer: bytes = b""
    from_peer_z: bytes = b""

    def __post_init__(self) -> None:
        self.s3_bitmap(), self.peer_bitmap()  # (a deflated bitmap garbled or too long: no plan)

    def s3_bitmap(self) -> bytes:
        """The bitmap of the ranks that read from object storage (`from_s3`, inflated).

        Raises:
            ValueError: `from_s3_z` is not a deflated bitmap of at most `world_size` bits.
        """
        return inflate_bitmap(self.from_s3_z, self.world_size) if self.from_s3_z else self.from_s3

    def peer_bitmap(self) -> bytes:
        """The ranks that read a peer's replica (`from_peer`, inflated; raises as `s3_bitmap`)."""
        return inflate_bitmap(z, self.world_size) if (z := self.from_peer_z) else self.from_peer


def deflated_bitmap(bits: bytes) -> tuple[bytes, bytes]:
    """(plain, deflated) of a rank bitmap (`RecoveryPlanned.from_s3` and `from_s3_z`, or the
    `from_peer` pair): the smaller one set, the other empty. A bitmap of many ranks is mostly
    runs: at 80,000 ranks a full one is 10 KB, ~40 B deflated."""
    packed = zlib.compress(bits, 9)
    return (b"", packed) if len(packed) < len(bits) else (bits, b"")


def inflate_bitmap(packed: bytes, world_size: int) -> bytes:
    """A deflated rank bitmap of at most `world_size` bits, inflated.

    Raises:
        ValueError: `packed` is not deflated, is cut short, or inflates past `world_size` bits.
    """
    limit = (world_size + 7) // 8
    try:
        inflate = zlib.decompressobj()
        bits = inflate.decompress(packed, limit)
    except zlib.error as e:
        raise ValueError(f"a bitmap is not deflated ({e})") from e
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"a deflated bitmap inflates past {limit} bytes, or is cut short")
    return bits


class RankSteps(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank of a node can restore, as its node's local leader found it (a `ready`)."""

    rank: NonNegInt
    #: Candidate steps whose NVMe copy of this rank was checked on the node (newest first).
    local_steps: list[int] = []
    #: Candidate steps whose object of this rank the job state confirms (newest first).
    s3_steps: list[int] = []
    #: Why it lacks a copy of some candidate (short).
    error: str = ""
    #: Candidate steps with a verified replica of this rank on another node (newest first).
    peer_steps: list[int] = []


#: The most ranks one `ready` speaks for (a node of more ranks reports in several): ~100 B each,
#: so a report stays far below the message limit.
READY_RANKS = 64


class RestoreReport(_Event, frozen=True, kw_only=True, tag="restore"):
    """One rank's progress in a restart, on `tp.<job>.restore.<node>.<rank>`.

    A node's local leader reports `ready` for the node's ranks (`covers`, at most
    `READY_RANKS` a report, on the subject of the first of them); without `covers` a report
    speaks for `rank` alone."""

    restart: str
    rank: NonNegInt
    world_size: PosInt
    #: `hold`: rank 0 is about to read the job state (retention holds still until its plan).
    phase: Literal["hold", "ready", "loaded", "failed"]
    #: The plan round this report answers (0 for `ready`).
    round: NonNegInt = 0
    step: NonNegInt | None = None
    #: Candidate steps whose shard for this rank this rank's node holds on its NVMe, checked
    #: against the header digest recorded in the job state (a few, newest first).
    local_steps: list[int] = []
    #: Candidate steps whose shard for this rank is in object storage, per the job state.
    s3_steps: list[int] = []
    tier: Tier | None = None
    error: str = ""
    #: `ready` of a node's local leader: the ranks it checked, each with its own steps.
    covers: list[RankSteps] = []
    #: Candidate steps with a verified replica of this rank on another node (the `peer` tier).
    peer_steps: list[int] = []


#: The kinds a node's agent also reports per node, as a `NodeBatch` (what stages consume).
BatchKind = Literal["written", "verified", "flushed", "evicted"]
#: The most events one batch carries (a node of more ranks reports in several batches).
BATCH_MAX = 64


class NodeBatch(_Event, frozen=True, kw_only=True, tag="batch"):
    """One node's events of one kind, for any of its ranks and steps, on
    `tp.<job>.batch.<node>.<kind>`: what the next stage and the job's coordinator consume (a
    delivery per node, not per rank). Each event is also published on its own rank's subject,
    for the trainers' save handles and for operators; the two carry the same facts."""

    batch: BatchKind
    events: list[ShardWritten | ShardVerified | ShardFlushed | ShardEvicted]

    def __post_init__(self) -> None:
        if not 0 < len(self.events) <= BATCH_MAX:
            raise ValueError(f"a batch holds 1 to {BATCH_MAX} events, not {len(self.events)}")
        for e in self.events:
            if e.v != SCHEMA_VERSION:  # (`decode_event` checks the batch's own version only)
                raise ValueError(f"a batch holds an event of schema version {e.v}")
            if (e.job, e.node, e.__struct_config__.tag) != (self.job, self.node, self.batch):
                raise ValueError(
                    f"a {self.batch} batch of {self.job}@{self.node} holds a "
                    f"{e.__struct_config__.tag} event of {e.job}@{e.node}"
                )


Event = (
    ShardStaged
    | ShardWritten
    | ShardVerified
    | ShardFlushed
    | ShardReplicated
    | ShardEvicted
    | StageFailed
    | RecoveryPlanned
    | RestoreReport
    | NodeBatch
)


#: What a `FlushControl` asks of the flush stage.
FlushAction = Literal["rate", "pause", "resume"]


class FlushControl(msgspec.Struct, frozen=True, kw_only=True):
    """A run-time command for the flush stage, on `tp.ctl.flush` (every node) or
    `tp.ctl.flush.<node>`: change the upload rate, or hold and release uploads."""

    v: int = SCHEMA_VERSION
    action: FlushAction
    #: For `rate`: bytes/s, 0 for unlimited.
    rate_bytes_per_s: NonNegInt = 0
    ts: float = 0.0


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


def encode_event(event: Event) -> bytes:
    """Encode an event as compact JSON."""
    return _encoder.encode(event)


def decode_event(data: bytes) -> Event:
    """Decode and validate an event.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: the payload is not a valid event, or is
            of a schema version this build does not read (never guessed at).
    """
    event = _decoder.decode(data)
    if event.v != SCHEMA_VERSION:
        raise msgspec.ValidationError(
            f"schema version {event.v} is not supported (this build reads {SCHEMA_VERSION})"
        )
    return event
