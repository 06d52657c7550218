"""Staging slots: the host-RAM tier, as files in shared memory that trainer and agent both map.

Layout under the staging root (default `/dev/shm/tierpipe`)::

    <job>/rank-<rank:05d>/owner.lock                  held (flock) by the live trainer of this rank
    <job>/rank-<rank:05d>/slot-<i>                    an unsealed shard image, reused across saves
    <job>/rank-<rank:05d>/slot-<i>.step-<step:012d>   marker: slot i holds an unreleased step

A slot is busy while its marker exists. The trainer creates the marker after the copy and before
publishing `staged`; the node agent removes it once the NVMe copy is verified, or once the save
failed for good (`release`). Because the bytes live in files, a trainer crash after `save()`
returns does not lose the checkpoint, and a restarted trainer never reuses a slot whose step the
agent has not released (it reclaims only markers the stream proves dead: `SlotPool.reclaim`).

Every image begins with a bump of the slot's generation (`Slot.begin`), before any other byte of
the new image is written; `staged` carries the value. A reader (the agent) reads the generation
first, copies, and reads it again: the same value proves no reuse of the slot began meanwhile
(`tierpipe.storage.staged_image.StagedImage.check`), so an agent that was paused for minutes can
never seal another step's bytes under this step's header. This module is the trainer's side of the
slots (and the node-wide `NodeSlots`); `tierpipe.storage.staged_image` is the agent's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import structlog

from tierpipe.errors import (
    ConfigError,
    NoSpaceError,
    SlotTimeoutError,
)
from tierpipe.names import validate_token
from tierpipe.schemas import ShardHeader, ShardStaged, shard_event
from tierpipe.storage.shard import (
    GENERATION_OFFSET,
    Head,
    set_slot_generation,
    slot_generation,
)

__all__ = (
    "NodeSlots",
    "Slot",
    "SlotPool",
    "marker_path",
    "markers",
    "rank_dir",
    "stage_image",
    "staged_event",
    "stale_markers",
    "try_lock",
)

log = structlog.get_logger(__name__)

_MARKER = re.compile(r"^slot-(\d+)\.step-(\d{12})$")
#: End of the generation field in the prefix (a u64 at `GENERATION_OFFSET`).
GENERATION_END = GENERATION_OFFSET + 8
_GROW_ALIGN = 2 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def rank_dir(root: str | os.PathLike[str], job: str, rank: int) -> Path:
    return Path(root).absolute() / validate_token("job", job) / f"rank-{rank:05d}"


def markers(directory: Path) -> list[tuple[int, int]]:
    """(slot, step) of every busy marker in a rank directory."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [(int(m[1]), int(m[2])) for m in map(_MARKER.match, names) if m]


def marker_path(directory: Path, slot: int, step: int) -> Path:
    return directory / f"slot-{slot}.step-{step:012d}"


class Slot:
    """One reusable staging buffer, mapped shared into the trainer."""

    def __init__(self, directory: Path, index: int) -> None:
        self.index = index
        self.path = directory / f"slot-{index}"
        self._fd: int | None = None
        self.mm: mmap.mmap | None = None
        self.capacity = 0
        #: The generation of the image last begun in this slot (`begin`).
        self.generation = 0

    def ensure(self, nbytes: int) -> mmap.mmap:
        """Map the slot with room for `nbytes`, growing the file if needed (rare)."""
        if self.mm is not None and self.capacity >= nbytes:
            return self.mm
        self.unmap()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            capacity = max(
                os.fstat(fd).st_size, -(-(nbytes + (1 << 20)) // _GROW_ALIGN) * _GROW_ALIGN
            )
            # Allocate now: a shared-memory mapping that runs out of room later kills the trainer
            # with SIGBUS mid-copy; here it is a clear error instead.
            try:
                os.posix_fallocate(fd, 0, capacity)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                st = os.statvfs(self.path.parent)
                raise NoSpaceError(
                    str(self.path.parent), capacity, st.f_bavail * st.f_frsize, 0
                ) from e
            self.mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # Fault the whole mapping in now (one syscall) rather than page by page during the
            # first copy, which would take ~10x longer than the copy itself.
            with contextlib.suppress(OSError):
                self.mm.madvise(_MADV_POPULATE_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.capacity = fd, capacity
        log.debug("staging_slot_mapped", path=str(self.path), nbytes=capacity)
        return self.mm

    def begin(self, head: bytes | memoryview) -> int:
        """Start a new image in the mapped slot: bump the slot's generation, then write `head`
        (the image's first bytes) around the generation field. Returns the new generation.

        The bump is the first store of the new image: x86 makes stores visible in program order
        (TSO), so an agent that reads the old generation after its copy saw none of this image's
        bytes. (A weakly ordered CPU would need a release fence here and an acquire fence in the
        reader; tierpipe's agents run on x86-64.)
        """
        mm = self.mm
        if mm is None:
            raise RuntimeError("begin() on an unmapped slot: call ensure() first")
        with memoryview(mm) as view:
            generation = slot_generation(view) + 1
            set_slot_generation(view, generation)
            view[:GENERATION_OFFSET] = head[:GENERATION_OFFSET]
            view[GENERATION_END : len(head)] = head[GENERATION_END:]
        self.generation = generation
        return generation

    def unmap(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor view is still alive; the mapping dies with it
                pass
            self.mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.capacity = 0


class SlotPool:
    """The trainer's staging slots for one (job, rank) on this node."""

    def __init__(self, root: str | os.PathLike[str], job: str, rank: int, count: int) -> None:
        self.dir = rank_dir(root, job, rank)
        self.job, self.rank = job, rank
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(
            self.dir / "owner.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640
        )
        # An agent may hold the lock shared for a moment while it deletes an orphaned slot.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                os.close(self._lock_fd)
                raise ConfigError(
                    f"another process already stages job {job!r} rank {rank} under {self.dir}"
                ) from None
        self.slots = [Slot(self.dir, i) for i in range(count)]

    def busy(self) -> dict[int, int]:
        """slot index -> unreleased step."""
        return {slot: step for slot, step in markers(self.dir)}

    def acquire(
        self,
        *,
        wait: bool,
        timeout_s: float,
        waiting: Callable[[list[int]], None] | None = None,
    ) -> Slot | None:
        """A free slot; with `wait`, poll until one frees up or `timeout_s` passes, calling
        `waiting` with the busy slots' steps at each poll (it decides when to say so).

        Raises:
            SlotTimeoutError: `wait` and no slot freed up in time.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while True:
            busy = self.busy()
            for slot in self.slots:
                if slot.index not in busy:
                    return slot
            if not wait:
                return None
            if time.monotonic() >= deadline:
                raise SlotTimeoutError(self.job, self.rank, timeout_s, sorted(busy.values()))
            if waiting is not None:
                waiting(sorted(busy.values()))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def mark(self, slot: Slot, step: int) -> None:
        """Mark `slot` busy with `step` (after the copy, before `staged` is published)."""
        fd = os.open(
            marker_path(self.dir, slot.index, step), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640
        )
        os.close(fd)

    def unmark(self, slot: Slot, step: int) -> None:
        """Give a slot back without the agent (the save failed before the agent saw it)."""
        marker_path(self.dir, slot.index, step).unlink(missing_ok=True)

    def reclaim(self, stale: dict[int, str]) -> dict[int, str]:
        """Drop the markers of the `stale` steps (step -> why: see `stale_markers`), which the
        agent will never release; returns `stale`."""
        for slot, step in markers(self.dir):
            if step in stale:
                marker_path(self.dir, slot, step).unlink(missing_ok=True)
        if stale:
            log.warning(
                "staging_markers_reclaimed",
                job=self.job,
                rank=self.rank,
                steps=sorted(stale),
                reasons=[stale[s] for s in sorted(stale)],
            )
        return stale

    def close(self) -> None:
        """Unmap every slot and delete free ones; busy slots stay for the agent."""
        busy = self.busy()
        for slot in self.slots:
            slot.unmap()
            if slot.index not in busy:
                slot.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1


def stale_markers(
    busy: dict[int, int],
    *,
    published_up_to: int | None,
    verified_up_to: int | None = None,
    failed: int | None = None,
    pending: int | None = None,
) -> dict[int, str]:
    """Which busy steps (of `busy`: slot -> step) no agent will ever release, and why.

    Args:
        published_up_to: the step of this rank's newest `staged` event (None: none): a newer
            marker belongs to a trainer that died between marking and publishing.
        verified_up_to: the step of this rank's newest `verified` event on this node: that step
            is done, and older ones are superseded by it (a release that got lost).
        failed: the step of this rank's newest permanent nvme-write or verify failure on this
            node (a release that got lost).
        pending: the step of this rank's newest `staged` event when it came after both of
            those: a save of that step is still on its way (a rewound run saving it again),
            whatever an older save of the same step became.
    """
    stale: dict[int, str] = {}
    for step in busy.values():
        if step == pending:
            continue
        if published_up_to is None or step > published_up_to:
            stale[step] = "never published"
        elif verified_up_to is not None and step == verified_up_to:
            stale[step] = "verified"
        elif verified_up_to is not None and step < verified_up_to:
            stale[step] = f"superseded by verified step {verified_up_to}"
        elif failed is not None and step == failed:
            stale[step] = "failed permanently"
    return stale


def try_lock(path: Path, *, shared: bool = False, create: bool = False) -> int | None:
    """Open `path` and flock it without waiting: the open descriptor (closing it drops the
    lock), or None if another process holds it (or it does not exist and `create` is False)."""
    flags = os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
    try:
        fd = os.open(path, flags, 0o660)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class NodeSlots:
    """A node-wide counting semaphore: `count` lock files under the staging root that every
    process on the node shares (flock, so a crashed holder frees its slot). Caps concurrent
    reads from object storage per node during a restart, when every rank reads at once."""

    def __init__(self, root: str | os.PathLike[str], name: str, count: int) -> None:
        self.dir = Path(root).absolute() / f".{validate_token('slot set', name)}"
        self.count = count

    @contextlib.contextmanager
    def hold(self, *, poll_s: float = 0.005) -> Iterator[int]:
        """Block until a slot is free; yields its index."""
        self.dir.mkdir(parents=True, exist_ok=True)
        while True:
            for i in range(self.count):
                fd = try_lock(self.dir / f"slot-{i}", create=True)
                if fd is None:
                    continue
                try:
                    yield i
                finally:
                    os.close(fd)  # drops the lock
                return
            time.sleep(poll_s)


def staged_event(
    header: ShardHeader,
    slot: Slot,
    *,
    node: str,
    nbytes: int,
    stall_s: float = 0.0,
    blocking: bool = True,
    origin: Literal["save", "restore"] = "save",
    rewind_to: int | None = None,
) -> ShardStaged:
    """The `staged` event of the image in `slot` (whose header is `header`), as `node`'s.

    The shard's identity and timeline come from the image's own header, so the event cannot
    disagree with the bytes the agent will read.
    """
    return shard_event(
        ShardStaged,
        header,
        node=node,
        staging_path=str(slot.path),
        slot=slot.index,
        nbytes=nbytes,
        tensors=len(header.tensors),
        stall_s=round(stall_s, 6),
        blocking=blocking,
        origin=origin,
        generation=slot.generation,
        rewind_to=rewind_to,
    )


def stage_image(pool: SlotPool, image: mmap.mmap, head: Head, *, timeout_s: float) -> Slot | None:
    """Copy a sealed shard image into a staging slot (waiting for a free one) and mark it.

    Raises:
        SlotTimeoutError: no slot freed up within `timeout_s`.
    """
    slot = pool.acquire(wait=True, timeout_s=timeout_s)
    if slot is None:
        return None
    mm = slot.ensure(head.file_nbytes)
    with memoryview(image) as src:
        slot.begin(src[: head.data_offset])  # the generation first, as for every save
        mm[head.data_offset : head.file_nbytes] = src[head.data_offset : head.file_nbytes]
    pool.mark(slot, head.header.step)
    return slot
