"""The storage contract: what every tier's store does with a shard's bytes.

`ShardStore` is the handful of async methods that the NVMe store (`nvme.NvmeStore`) and the
object store (`s3.S3Store`) both implement, so stages and recovery move shards without knowing a
tier's mechanics: `locate` the copy of a job's step and rank, `write` a shard there from its
source, `verify` a copy against its header byte for byte, `read_into` memory the caller chooses
(a `BlobSink`), and `delete` one save's copy. A location is what events and the catalog record:
an absolute path on NVMe, `s3://<bucket>/<key>` in object storage. What a tier writes from
differs (NVMe: a staged image in memory, `StagedShard`; object storage: the sealed NVMe file,
`SealedFile`), hence the store's type parameter. Blocking work runs in worker threads, never on
the event loop.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, runtime_checkable

from tierpipe.storage.shard import Head

__all__ = (
    "BlobSink",
    "ReadBack",
    "SealedFile",
    "ShardStore",
    "StagedShard",
    "VerifyResult",
    "Written",
)

SourceT = TypeVar("SourceT", contravariant=True)


class StagedShard(Protocol):
    """A staged (unsealed) shard image in memory: what the NVMe tier writes from
    (`tierpipe.storage.staged_image.StagedImage` is one)."""

    @property
    def head(self) -> Head: ...

    def view(self) -> memoryview:
        """The whole image (the writer releases the view when done)."""
        ...

    def check(self) -> None:
        """Raise unless the image still holds this save (called once every byte was copied)."""
        ...


@dataclass(frozen=True, slots=True)
class SealedFile:
    """A sealed shard file on NVMe and the save it holds: what object storage writes from."""

    path: Path
    #: The save's header digest (hex), recorded with the copy.
    header_digest: str
    #: The save's timeline (from its events): a rewound run's newer save may replace a copy of
    #: an older epoch (see `ShardStore.write`).
    epoch: int
    step: int


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """A copy that matched its size, its header digest and every blob digest."""

    location: str
    nbytes: int
    header_digest: str
    seconds: float


@dataclass(frozen=True, slots=True)
class ReadBack:
    """A shard read into a `BlobSink`."""

    head: Head
    seconds: float
    #: The whole sealed image in memory where the tier fetched it so (object storage): the
    #: caller owns it (the sink may hold views of it) and closes it. None when read in place.
    image: mmap.mmap | None


class Written(Protocol):
    """What every tier's `write` reports (each tier's result says more)."""

    @property
    def location(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def existed(self) -> bool:
        """The copy was already there with this very save (a redelivered event)."""
        ...


class BlobSink(Protocol):
    """Where `read_into` puts a shard's blobs: the reader's side of the contract. Its methods
    run in a worker thread, in this order: `accept`, `pin` (NVMe, if any blob passes through),
    `take` per blob in file order, `finish`."""

    def accept(self, head: Head, location: str) -> Sequence[bool]:
        """Check the shard's head before any blob is read (raise to refuse the shard).

        Returns:
            Per blob, whether its bytes only pass through (`take` copies them out): those may be
            read into memory that is reused once `take` returns.
        """
        ...

    def pin(self, ring: mmap.mmap) -> AbstractContextManager[object]:
        """Hold the reused memory passing blobs are read into while the reads run (e.g. page-
        locked, for asynchronous device copies out of it)."""
        ...

    def take(self, index: int, data: memoryview, *, reused: bool) -> None:
        """Blob `index`, its digest checked. `reused`: `data` is overwritten once this returns,
        so any copy out of it must be complete by then."""
        ...

    def finish(self) -> None:
        """Every blob was taken."""
        ...


@runtime_checkable
class ShardStore(Protocol[SourceT]):
    """One tier's shard copies (see the module docstring)."""

    def locate(self, job: str, step: int, rank: int, world_size: int) -> str:
        """Where this tier keeps the shard of `rank` of `step` (no I/O)."""
        ...

    async def write(
        self, source: SourceT, location: str, *, rewind_to: int | None = None
    ) -> Written:
        """Put the shard at `location`, write-once: the same save already there counts as done
        (`existed`); another valid save stays unless this save's run rewound to before its step
        (`rewind_to`) and it belongs to the abandoned timeline.

        Raises:
            StorageConflictError: `location` holds another save this one does not supersede.
            RetryableError: an I/O error or an outage (retry later).
        """
        ...

    async def verify(self, location: str, *, header_digest: str, nbytes: int) -> VerifyResult:
        """Read the copy back whole and check its size, header digest and every blob digest.

        Raises:
            ShardFormatError: missing, truncated or garbled.
            IntegrityError: a digest does not match (names the copy, the part, both digests).
        """
        ...

    async def read_into(self, location: str, sink: BlobSink, *, nbytes: int) -> ReadBack:
        """Read the copy of `nbytes` bytes into `sink`, every blob's digest checked before
        `take` sees it.

        Raises:
            ShardMissingError: the copy is not there.
            ShardFormatError, IntegrityError: it is truncated, garbled or corrupt.
        """
        ...

    async def delete(self, location: str, *, header_digest: str) -> bool:
        """Remove the copy if it holds the save `header_digest` names (and, in object storage,
        this node uploaded it).

        Returns:
            True once the copy is gone (now, or it was absent); False if it was left in place.
        """
        ...
