"""Placement: how a sealed shard file takes its final path, never over another valid save.

A complete, fsynced temp file is hard-linked to its final path (a link fails where a rename
would replace). What is already there is judged first (`judge`): this very save (a redelivery:
left alone), an unreadable, misplaced or corrupt file (set aside as `.<name>.corrupt`), a valid
save of an abandoned timeline (an older epoch, and the new save's run rewound to before this
step: removed), or another valid save (a conflict: it stays). A file counts as valid only once
it passed a full verification against its own header. `place` links, judges and retries.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import structlog

from tierpipe.errors import IntegrityError, RetryableError, ShardFormatError, StorageConflictError
from tierpipe.faults import maybe_die
from tierpipe.schemas import ShardHeader
from tierpipe.storage.durable import fsync_dir, unlink_quietly
from tierpipe.storage.reader import BlobReader, open_for_read, read_head_fd

__all__ = ("Verdict", "judge", "place")

log = structlog.get_logger(__name__)

Verdict = Literal["absent", "same", "corrupt", "superseded", "conflict"]


def place(
    tmp: Path,
    final: Path,
    header: ShardHeader,
    rewind_to: int | None,
    *,
    reader: BlobReader,
    direct_io: bool,
    fault_point: str,
) -> str | None:
    """Link the complete temp file to `final`, never over a valid file (see
    `NvmeStore.write_image`).

    Args:
        reader: the store's blob reader, to verify what `final` already holds.
        fault_point: the store's fault point (`faults.maybe_die`).

    Returns:
        None once placed; the header digest of `final` if it already held this very save.

    Raises:
        StorageConflictError: `final` holds another valid save this one does not supersede.
        RetryableError: `final` kept changing (or could not be read) while being placed.
    """
    for _ in range(3):
        try:
            os.link(tmp, final)  # EEXIST instead of replacing: unlike rename
        except FileExistsError:
            verdict, found = judge(final, header, rewind_to, reader=reader, direct_io=direct_io)
            if verdict == "same":
                unlink_quietly(tmp)
                return found
            if verdict == "conflict":
                raise StorageConflictError(str(final), found) from None
            if verdict == "corrupt":
                _set_aside(final, found)
            elif verdict == "superseded":
                _drop_superseded(final, found)
            continue
        maybe_die("nvme-write:after-link", fault_point)
        os.unlink(tmp)
        fsync_dir(final.parent)
        return None
    raise RetryableError(f"{final} kept changing while it was being placed")


def judge(
    final: Path,
    header: ShardHeader,
    rewind_to: int | None,
    *,
    reader: BlobReader,
    direct_io: bool,
) -> tuple[Verdict, str]:
    """What `final` holds compared with the save `header` describes, and the header digest
    (for `same`) or the reason (otherwise). A file is judged valid only once it passed a
    full verification against its own header.

    Raises:
        RetryableError: `final` cannot be read (an I/O error, not a verdict on its bytes).
    """
    try:
        fd = open_for_read(final, direct_io=direct_io)
    except FileNotFoundError:
        return "absent", ""
    try:
        try:
            found = read_head_fd(fd, str(final), os.fstat(fd).st_size)
            reader.check(fd, found, str(final))
        except (ShardFormatError, IntegrityError) as e:
            return "corrupt", str(e)
    except OSError as e:
        raise RetryableError(f"cannot read {final}: {e}") from e
    finally:
        os.close(fd)
    old = found.header
    if _identity(old) != _identity(header):
        return "corrupt", (
            f"holds {old.job} step {old.step} rank {old.rank} of {old.world_size}, "
            "not the shard of this path"
        )
    if _same_save(old, header):
        return "same", found.header_digest.hex()
    if old.epoch < header.epoch and rewind_to is not None and header.step > rewind_to:
        return "superseded", (
            f"epoch {old.epoch} is superseded by epoch {header.epoch}, "
            f"which rewound to step {rewind_to}"
        )
    return "conflict", (
        f"holds another valid save of this shard (created {old.created}, epoch {old.epoch}); "
        f"the new save (created {header.created}, epoch {header.epoch}, rewind_to "
        f"{rewind_to}) does not supersede it, and a valid shard file is never replaced"
    )


def _set_aside(final: Path, reason: str) -> None:
    aside = final.with_name(f".{final.name}.corrupt")
    os.replace(final, aside)  # one kept for forensics: an older one is overwritten
    fsync_dir(final.parent)
    log.warning("corrupt_shard_set_aside", path=str(final), kept=str(aside), reason=reason)


def _drop_superseded(final: Path, reason: str) -> None:
    os.unlink(final)
    fsync_dir(final.parent)
    log.warning("superseded_shard_replaced", path=str(final), reason=reason)


def _identity(h: ShardHeader) -> tuple[str, int, int, int]:
    return (h.job, h.step, h.rank, h.world_size)


def _same_save(old: ShardHeader, new: ShardHeader) -> bool:
    """Whether two headers describe the same save (identity, creation time and layout)."""
    return (
        _identity(old) == _identity(new)
        and (old.created, old.epoch, old.tree, old.tensors)
        == (new.created, new.epoch, new.tree, new.tensors)
        and [(b.offset, b.nbytes) for b in old.blobs] == [(b.offset, b.nbytes) for b in new.blobs]
    )
