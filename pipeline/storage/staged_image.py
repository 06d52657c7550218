"""A staging slot as the node agent sees it: the staged image mapped read-only, proven unchanged
by the slot's generation (`StagedImage.check`), and the slot released once the agent is done with
its step (`release`). The trainer's side is `tierpipe.storage.staging`.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from tierpipe.errors import ShardFormatError, StagingGoneError, TierpipeError
from tierpipe.schemas import ShardStaged
from tierpipe.storage.shard import PREFIX_NBYTES, Head, parse_head, parse_prefix, slot_generation
from tierpipe.storage.staging import GENERATION_END, marker_path, markers, rank_dir, try_lock

__all__ = ("StagedImage", "open_image", "open_staged", "release")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StagedImage:
    """A staged shard image, mapped read-only by the agent."""

    path: Path
    mm: mmap.mmap
    head: Head
    #: The slot's generation, read before any other byte of the image.
    generation: int
    slot: int
    step: int

    def view(self) -> memoryview:
        return memoryview(self.mm)

    def check(self) -> None:
        """Prove the slot still holds this image: call after copying it, before trusting the copy.

        Raises:
            StagingGoneError: the slot was reused (its generation moved on) or released meanwhile.
        """
        # The generation first: unchanged means none of a reuse's writes reached our copy
        # (`Slot.begin`). The marker then proves the save was not released or reclaimed.
        now = slot_generation(self.mm)
        if now != self.generation:
            raise StagingGoneError(
                str(self.path),
                f"slot reused while it was copied (generation {self.generation} -> {now})",
            )
        if (self.slot, self.step) not in markers(self.path.parent):
            raise StagingGoneError(str(self.path), f"step {self.step} was released meanwhile")

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass


def open_image(root: str | os.PathLike[str], event: ShardStaged) -> StagedImage:
    """Map the slot a `staged` event names and check that it still holds that shard.

    Raises:
        StagingGoneError: the slot is missing, released, or holds another shard now.
        ShardFormatError: the image is garbled, or the event points outside the staging root.
    """
    directory = rank_dir(root, event.job, event.rank)
    path = directory / f"slot-{event.slot}"
    if Path(event.staging_path) != path:
        raise ShardFormatError(
            event.staging_path,
            f"not this agent's staging slot {path}: trainer and agent must share staging_root",
        )
    if (event.slot, event.step) not in markers(directory):
        raise StagingGoneError(str(path), f"step {event.step} was released or never marked")
    image = _map(path, event.slot, event.job, event.step, event.rank, event.world_size)
    if image.generation != event.generation:
        image.close()
        raise StagingGoneError(
            str(path),
            f"slot is at generation {image.generation}, the event's copy was {event.generation}",
        )
    if image.head.file_nbytes != event.nbytes:
        image.close()
        raise StagingGoneError(
            str(path), f"slot holds {image.head.file_nbytes} bytes, event says {event.nbytes}"
        )
    return image


def open_staged(
    root: str | os.PathLike[str], job: str, rank: int, step: int, world_size: int
) -> StagedImage | None:
    """The staging copy of a shard if a slot still holds it (not yet released), else None."""
    directory = rank_dir(root, job, rank)
    for slot, marked in markers(directory):
        if marked == step:
            try:
                return _map(directory / f"slot-{slot}", slot, job, step, rank, world_size)
            except StagingGoneError:
                return None
    return None


def _map(path: Path, slot: int, job: str, step: int, rank: int, world_size: int) -> StagedImage:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise StagingGoneError(str(path), "slot file is missing") from e
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        # The generation before any other byte: a reuse that began after this read shows as a
        # new generation in `check()`, whatever else of it the copy may have seen.
        generation = slot_generation(mm) if len(mm) >= GENERATION_END else 0
        head = parse_head(memoryview(mm), str(path), sealed=False)
        h = head.header
        if (h.job, h.step, h.rank, h.world_size) != (job, step, rank, world_size):
            raise StagingGoneError(str(path), f"slot now holds step {h.step} of rank {h.rank}")
        if head.file_nbytes > len(mm):
            raise StagingGoneError(
                str(path), f"slot holds {len(mm)} bytes, image needs {head.file_nbytes}"
            )
    except BaseException:
        mm.close()
        raise
    return StagedImage(path, mm, head, generation, slot, step)


def release(
    root: str | os.PathLike[str], job: str, rank: int, step: int, *,
    epoch: int | None = None, generation: int | None = None,
) -> Path | None:  # fmt: skip
    """Free the slot holding `step` of (job, rank); delete the slot file if its trainer is gone.

    Args:
        epoch: free it only if it holds that save's epoch (after a rewind, a late event about
            an abandoned save of the same step must not free the new save's slot).
        generation: free it only if it still holds that copy (a `staged` event that reached the
            stream late, after its save was reported failed and retried in the same slot, must
            not free the retry's slot).

    Returns:
        The slot path that was released, or None if no slot held that step (already released).
    """
    directory = rank_dir(root, job, rank)
    released = None
    for slot, marked in markers(directory):
        path = directory / f"slot-{slot}"
        if (
            marked == step
            and (epoch is None or _image_epoch(path) in (epoch, None))
            and (generation is None or _generation(path) in (generation, None))
        ):
            marker_path(directory, slot, step).unlink(missing_ok=True)
            released = path
    if released is not None:
        _delete_if_orphaned(directory, released)
    return released


def _generation(path: Path) -> int | None:
    """The generation of the slot file at `path` (None: unreadable)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(GENERATION_END)
    except OSError:
        return None
    return slot_generation(prefix) if len(prefix) == GENERATION_END else None


def _image_epoch(path: Path) -> int | None:
    """The epoch in the header of the image a slot holds (None: unreadable)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX_NBYTES)
            head = prefix + f.read(parse_prefix(prefix, str(path))[0])
        return parse_head(head, str(path), sealed=False).header.epoch
    except (OSError, TierpipeError):
        return None


def _delete_if_orphaned(directory: Path, slot_path: Path) -> None:
    # The trainer holds owner.lock exclusively while it lives. Holding it shared while we delete
    # means a trainer starting right now waits for us before it maps any slot.
    fd = try_lock(directory / "owner.lock", shared=True)
    if fd is None:
        return  # (no trainer ever ran here, or one lives)
    try:
        index = slot_path.name.removeprefix("slot-")
        if not any(str(s) == index for s, _ in markers(directory)):
            slot_path.unlink(missing_ok=True)
    finally:
        os.close(fd)
