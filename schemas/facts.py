"""What the job-state fold reads of an event: its facts, decoded for the coordinator's hot path.

The coordinator folds every node's batches of every checkpoint (4 per node per checkpoint, 8
events each at 8 ranks a node). Decoding them as full events (`tierpipe.schemas.events`) spends
three quarters of its time in the regular expressions of names and digests, once per event of a
batch. These mirrors have the same fields and checks, but for those patterns, which
`decode_fact` applies where they cost least: a batch's job and node once (its events must carry
the same ones, as `NodeBatch` requires), a digest by its characters. What a full decode refuses,
`decode_fact` refuses too (`msgspec.ValidationError`; `tests/test_facts.py` holds the two
together), so the fold sees the same events either way. Restore reports and plans are decoded in
full (the coordinator pins steps with them); their facts come from `fact_of`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from tierpipe.schemas.events import BATCH_MAX, SCHEMA_VERSION, Event, encode_event
from tierpipe.schemas.names import TOKEN_PATTERN

__all__ = (
    "BaseFact",
    "BatchFact",
    "EvictedFact",
    "Fact",
    "FailedFact",
    "FlushedFact",
    "PlanFact",
    "ReplicatedFact",
    "RestoreFact",
    "ShardFact",
    "StagedFact",
    "VerifiedFact",
    "WrittenFact",
    "decode_fact",
    "fact_of",
)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
#: Checked for hex digits by `decode_fact` (a length is free, a pattern is not).
Digest = Annotated[str, msgspec.Meta(min_length=32, max_length=32)]
#: A layout digest: "" or 16 hex digits (checked by `decode_fact`).
Layout = Annotated[str, msgspec.Meta(max_length=16)]
Tier = Literal["ram", "nvme", "peer", "s3"]

_TOKEN = re.compile(TOKEN_PATTERN)
_HEX = frozenset("0123456789abcdef")


class BaseFact(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    v: int = SCHEMA_VERSION
    job: str
    node: str
    ts: float


class _ShardFact(BaseFact, frozen=True, kw_only=True):
    step: NonNegInt
    rank: NonNegInt
    world_size: PosInt
    epoch: NonNegInt = 0
    rewind_to: Annotated[int, msgspec.Meta(ge=-1)] | None = None


class StagedFact(_ShardFact, frozen=True, kw_only=True, tag="staged"):
    staging_path: str
    slot: NonNegInt
    nbytes: NonNegInt
    tensors: NonNegInt
    stall_s: float
    blocking: bool = True
    origin: Literal["save", "restore"] = "save"
    generation: NonNegInt = 0


class _NvmeFact(_ShardFact, frozen=True, kw_only=True):
    path: str
    nbytes: NonNegInt
    header_digest: Digest
    seconds: float
    origin: Literal["save", "restore"] = "save"
    staged_ts: float = 0.0
    layout: Layout = ""


class WrittenFact(_NvmeFact, frozen=True, kw_only=True, tag="written"):
    tensors: NonNegInt


class VerifiedFact(_NvmeFact, frozen=True, kw_only=True, tag="verified"):
    rewritten: bool = False


class FlushedFact(_ShardFact, frozen=True, kw_only=True, tag="flushed"):
    bucket: str
    key: str
    etag: str
    checksum: str
    header_digest: Digest
    nbytes: NonNegInt
    seconds: float
    origin: Literal["flush", "reindex"] = "flush"
    layout: Layout = ""


class ReplicatedFact(_ShardFact, frozen=True, kw_only=True, tag="replicated"):
    #: The node whose verified copy was copied (`node` holds the replica).
    source: str
    path: str
    nbytes: NonNegInt
    header_digest: Digest
    seconds: float


class EvictedFact(_ShardFact, frozen=True, kw_only=True, tag="evicted"):
    tier: Tier
    location: str
    reason: str


class FailedFact(BaseFact, frozen=True, kw_only=True, tag="failed"):
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
    tier: Tier | None = None
    epoch: NonNegInt = 0
    generation: NonNegInt | None = None


class RestoreFact(BaseFact, frozen=True, kw_only=True, tag="restore"):
    """(Only from `fact_of`: the coordinator decodes restore reports in full, for its pins.)"""

    rank: NonNegInt
    phase: Literal["hold", "ready", "loaded", "failed"]
    step: NonNegInt | None = None
    tier: Tier | None = None


class PlanFact(BaseFact, frozen=True, kw_only=True, tag="plan"):
    """(Only from `fact_of`, as `RestoreFact`.)"""


ShardFact = StagedFact | WrittenFact | VerifiedFact | FlushedFact | ReplicatedFact | EvictedFact


class BatchFact(BaseFact, frozen=True, kw_only=True, tag="batch"):
    batch: Literal["written", "verified", "flushed", "evicted"]
    events: list[WrittenFact | VerifiedFact | FlushedFact | EvictedFact]


Fact = ShardFact | FailedFact | RestoreFact | PlanFact | BatchFact

_decoder = msgspec.json.Decoder(Fact)


def decode_fact(data: bytes) -> Fact:
    """Decode an event's facts, refusing what `decode_event` refuses.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: not a valid event of this schema version.
    """
    fact = _decoder.decode(data)
    if fact.v != SCHEMA_VERSION:
        raise msgspec.ValidationError(f"schema version {fact.v} is not supported")
    _name(fact.job)
    _name(fact.node)
    if isinstance(fact, BatchFact):
        if not 0 < len(fact.events) <= BATCH_MAX:
            raise msgspec.ValidationError(f"a batch holds 1 to {BATCH_MAX} events")
        for e in fact.events:
            if e.v != SCHEMA_VERSION or (e.job, e.node, e.__struct_config__.tag) != (
                fact.job,
                fact.node,
                fact.batch,
            ):
                raise msgspec.ValidationError(f"a {fact.batch} batch holds a foreign event")
            _shard(e)
    elif isinstance(fact, _ShardFact):
        _shard(fact)
        if isinstance(fact, ReplicatedFact):
            _name(fact.source)
    return fact


def fact_of(event: Event) -> Fact:
    """The facts of a full event (off the hot path: tests, replays)."""
    return decode_fact(encode_event(event))


def _name(name: str) -> None:
    if not _TOKEN.fullmatch(name):
        raise msgspec.ValidationError(f"not a valid name: {name[:80]!r}")


def _shard(e: ShardFact) -> None:
    if e.rank >= e.world_size:
        raise msgspec.ValidationError(f"rank {e.rank} out of range for world_size {e.world_size}")
    digest = getattr(e, "header_digest", None)
    if digest is not None and not _HEX.issuperset(digest):
        raise msgspec.ValidationError("a header digest is 32 lowercase hex digits")
    layout = getattr(e, "layout", "")
    if layout and (len(layout) != 16 or not _HEX.issuperset(layout)):
        raise msgspec.ValidationError("a layout digest is 16 lowercase hex digits")
