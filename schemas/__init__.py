"""Wire and on-disk types of tierpipe: events on the bus and the shard file header.

Only msgspec types and their codecs live here; no I/O, no settings.
"""

from tierpipe.schemas.events import (
    SCHEMA_VERSION,
    Event,
    FlushAction,
    FlushControl,
    RecoveryPlanned,
    RestoreReport,
    ShardEvent,
    ShardEvicted,
    ShardFlushed,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    SourceRef,
    StageFailed,
    Tier,
    decode_event,
    encode_event,
)
from tierpipe.schemas.names import TOKEN_PATTERN, Token
from tierpipe.schemas.shard import (
    ALIGN,
    FORMAT_VERSION,
    MAGIC,
    BlobEntry,
    ShardHeader,
    TensorEntry,
)

__all__ = (
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "SCHEMA_VERSION",
    "TOKEN_PATTERN",
    "BlobEntry",
    "Event",
    "FlushAction",
    "FlushControl",
    "RecoveryPlanned",
    "RestoreReport",
    "ShardEvent",
    "ShardEvicted",
    "ShardFlushed",
    "ShardHeader",
    "ShardStaged",
    "ShardVerified",
    "ShardWritten",
    "SourceRef",
    "StageFailed",
    "TensorEntry",
    "Tier",
    "Token",
    "decode_event",
    "encode_event",
)
