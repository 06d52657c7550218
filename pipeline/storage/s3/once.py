"""Write-once keys in the bucket: what an object already at an upload's key means for it.

A shard's key is written once (`IfNoneMatch="*"`). Before uploading, the store HEADs the key and
`existing` judges what it finds: the very same shard (same size and header digest: a redelivered
event, done), a save of an abandoned timeline that this save may replace (a rewound run's older
epoch, replaced only by matching its ETag), or anything else (`StorageConflictError`). After
completion, `confirm` checks the object's size and CRC32C against what was sent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tierpipe.errors import IntegrityError, StorageConflictError, StorageUnavailableError
from tierpipe.storage.s3.client import ObjectHead

__all__ = ("Found", "Save", "confirm", "existing")


@dataclass(frozen=True, slots=True)
class Save:
    """The shard an upload carries, as `existing` compares it with an object."""

    header_digest: str
    nbytes: int
    epoch: int
    step: int | None
    rewind_to: int | None


@dataclass(frozen=True, slots=True)
class Found:
    """An object already at an upload's key."""

    etag: str
    checksum: str
    header_digest: str | None
    #: Its `tp-epoch` (None: unreadable, so never treated as older).
    epoch: int | None
    superseded: bool


def existing(head: ObjectHead | None, save: Save, location: str) -> Found | None:
    """The object whose HEAD is `head`: this very shard (`superseded` False), or a save of an
    abandoned timeline that this save may replace (`superseded` True); None if there is none.

    An object is abandoned when it records an older epoch than this save and this save
    rewound to a step before its own (`rewind_to`): that rank's later steps from the older
    epoch no longer count. Objects from before epochs existed record none (0).

    Raises:
        StorageConflictError: something else holds the key (`location`).
    """
    if head is None:
        return None
    meta = head.get("Metadata", {})
    theirs = meta.get("tp-header-digest")
    found = Found(
        head.get("ETag", "").strip('"'),
        head.get("ChecksumCRC32C", ""),
        theirs,
        _int_or_none(meta.get("tp-epoch", "0")),
        superseded=False,
    )
    if head["ContentLength"] == save.nbytes and theirs == save.header_digest:
        return found
    if (
        found.epoch is not None
        and found.epoch < save.epoch
        and save.rewind_to is not None
        and save.step is not None
        and save.step > save.rewind_to
    ):
        return dataclasses.replace(found, superseded=True)
    raise StorageConflictError(
        location,
        f"holds {head['ContentLength']} bytes with header digest {theirs} "
        f"(epoch {meta.get('tp-epoch', 0)}); this shard is {save.nbytes} bytes with "
        f"{save.header_digest} (epoch {save.epoch}, rewind_to {save.rewind_to})",
    )


def confirm(head: ObjectHead | None, nbytes: int, expected: str, location: str) -> str:
    """The checksum of the object just uploaded to `location`, whose HEAD is `head`.

    Args:
        expected: the composite CRC32C of the parts sent.

    Raises:
        StorageUnavailableError: the object is missing right after the upload.
        IntegrityError: its size or the store's CRC32C disagrees with what was sent.
    """
    if head is None:
        raise StorageUnavailableError(f"{location} missing right after upload")
    actual = head.get("ChecksumCRC32C", "")
    if head["ContentLength"] != nbytes:
        raise IntegrityError(location, "size", str(nbytes), str(head["ContentLength"]))
    if actual and actual != expected:
        raise IntegrityError(location, "CRC32C", expected, actual)
    return actual or expected


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
