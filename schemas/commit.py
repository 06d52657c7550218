"""A step's COMMIT manifest: the object that says a step is complete in object storage.

The job's retention coordinator writes it once every rank's object of the step is confirmed
(`tierpipe.storage.s3.commit`, a conditional create), and retention removes it first when it
removes the step's objects. It names the step's objects (their keys follow from job, step, rank
and world size) and carries the same per-rank data as the job state's `RankDigests`: what
`tierpipe reindex` needs to rebuild the job state from storage alone, when the stream and the
KV are lost, and the step's global layout (`tierpipe.schemas.layout`), where its record names
one, so a resharded restore after a reindex still plans without shard headers. Encoded as
msgpack: 24 bytes a rank plus ~100 bytes (measured: 284 bytes at 8 ranks, 1.92 MB at 80,000;
one PUT, far below any object size limit), plus ~60 bytes a sharded tensor for the layout.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from tierpipe.schemas.jobstate import DIGEST_BYTES, SIZE_BYTES, RankDigests, digest_at
from tierpipe.schemas.layout import LayoutDigest
from tierpipe.schemas.names import Token

__all__ = ("COMMIT_VERSION", "CommitManifest", "decode_commit", "encode_commit")

#: Bumped on an incompatible change; a reader refuses a manifest of a newer version.
COMMIT_VERSION = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


class CommitManifest(msgspec.Struct, frozen=True, kw_only=True):
    """Step `step` of `job` is complete in object storage: every rank's object is confirmed,
    with the header digest and size below."""

    version: PosInt = COMMIT_VERSION
    job: Token
    step: NonNegInt
    world_size: PosInt
    #: The newest timeline (`ShardEvent.epoch`) among the step's saves (a rewound run's newer
    #: save of the step replaces a manifest of an older epoch, as its objects replace theirs).
    epoch: NonNegInt = 0
    #: `DIGEST_BYTES` per rank, in rank order: the header digest of each rank's object.
    digests: bytes
    #: `SIZE_BYTES` per rank (little-endian), in rank order: each object's size.
    sizes: bytes
    #: Who wrote it (the coordinator's node) and when (s since the epoch), for operators.
    by: str = ""
    ts: float = 0.0
    #: The step's global layout (`tierpipe.schemas.layout`): its digest, as the step's record
    #: names it, and its bytes, so `reindex` stores it again ("" and empty: none, or older).
    layout: LayoutDigest = ""
    layout_data: bytes = b""

    def __post_init__(self) -> None:
        if len(self.digests) != DIGEST_BYTES * self.world_size:
            raise ValueError(f"digests: {len(self.digests)} bytes for {self.world_size} ranks")
        if len(self.sizes) != SIZE_BYTES * self.world_size:
            raise ValueError(f"sizes: {len(self.sizes)} bytes for {self.world_size} ranks")

    @classmethod
    def from_chunks(
        cls,
        job: str,
        step: int,
        world_size: int,
        epoch: int,
        chunks: list[RankDigests],
        *,
        by: str = "",
        ts: float = 0.0,
        layout: str = "",
    ) -> CommitManifest:
        """The manifest of a step from its `RankDigests` chunks, in rank order.

        Raises:
            ValueError: the chunks do not cover exactly `world_size` ranks, or a rank has no
                verified copy (size zero): such a step is not complete.
        """
        manifest = cls(
            job=job, step=step, world_size=world_size, epoch=epoch,
            digests=b"".join(c.digests for c in chunks), sizes=b"".join(c.sizes for c in chunks),
            by=by, ts=ts, layout=layout,
        )  # fmt: skip
        missing = [r for r in range(world_size) if manifest.of(r) is None]
        if missing:
            raise ValueError(f"step {step}: no digest of rank {missing[0]} ({len(missing)} ranks)")
        return manifest

    def of(self, rank: int) -> tuple[str, int] | None:
        """(header digest as hex, size) of `rank`'s object, or None (no such rank)."""
        return digest_at(self.digests, self.sizes, rank)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CommitManifest)


def encode_commit(manifest: CommitManifest) -> bytes:
    return _encoder.encode(manifest)


def decode_commit(data: bytes) -> CommitManifest:
    """Decode a manifest.

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: not a manifest this version reads (a
            newer version included).
    """
    manifest = _decoder.decode(data)
    if manifest.version > COMMIT_VERSION:
        raise msgspec.ValidationError(f"COMMIT version {manifest.version} (this reads 1)")
    return manifest
