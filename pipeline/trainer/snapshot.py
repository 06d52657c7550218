"""Snapshot stage (in the trainer): slot, copy, mark, `staged` event.

`Checkpointer.save()` has `Snapshot` take one of the rank's staging slots, copy the state into
it (blocking, or overlapped on the copier thread) and mark it busy with the step, then publishes
the `staged` event (`tierpipe.storage.staging.staged_event`); a restore's write-back stages a
shard read from object storage the same way (`tierpipe.storage.staging.stage_image`), with the
same builder. At start, `reclaim_slots` drops markers no node agent will release and
`newest_staged_step` finds where this rank's saves left off.

This is the only part of tierpipe on the training loop's critical path, so it does nothing but
the copy: no hashing, no disk or network I/O. CPU tensors are copied with `copy_` into views of
the slot (torch parallelises large copies). CUDA tensors are copied device-to-host with
non-blocking copies into the slot itself, which is page-locked once with `cudaHostRegister`
(pinned staging without a second host copy), then synchronised; the overlapped mode queues them
on a side stream instead and lets the next optimizer step wait for that stream on the GPU.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from tierpipe.bus.client import Bus
from tierpipe.names import shard_subject
from tierpipe.schemas import (
    Event,
    ShardEvent,
    ShardStaged,
    ShardVerified,
    StageFailed,
    decode_event,
)
from tierpipe.state import StatePlan
from tierpipe.storage.pinned import page_lock, page_unlock
from tierpipe.storage.staging import Slot, SlotPool, staged_event, stale_markers

__all__ = (
    "Snapshot",
    "StagedCopy",
    "newest_staged_step",
    "reclaim_slots",
)


@dataclass(slots=True)
class _Image:
    mm: mmap.mmap
    tensor: torch.Tensor
    #: Page-locked for CUDA (cudaHostRegister), so device-to-host copies can be asynchronous.
    pinned: bool
    #: The device whose context registered it (unregistered in the same one).
    device: torch.device | None = None


#: What an overlapped save calls once its copy is over: with the `staged` event, or the error.
Then = Callable[[ShardStaged | BaseException], None]


@dataclass(slots=True)
class StagedCopy:
    """A copy into a slot (from `Snapshot.prepare`); in overlapped mode, the CUDA events to wait
    for and the CPU copies still to do."""

    plan: StatePlan
    slot: Slot
    dsts: list[torch.Tensor]
    #: (device, event recorded on its copy stream after the last device-to-host copy)
    cuda_events: list[tuple[torch.device, torch.cuda.Event]]
    #: Set once the CPU part is over (done or failed): CPU tensors may change again.
    host_copied: threading.Event = field(default_factory=threading.Event)

    def finish(self) -> None:
        """Run the CPU part, report it, then wait for the CUDA part (on the copier thread)."""
        try:
            self.plan.copy_cpu_serially(self.dsts)
        finally:
            self.host_copied.set()
        for _, event in self.cuda_events:
            event.synchronize()

    def barrier(self) -> None:
        """Make what the caller does next wait for the copy: CUDA work on the GPU (the current
        streams wait for the copy streams, no host sync), CPU work on the host."""
        for device, event in self.cuda_events:
            torch.cuda.current_stream(device).wait_event(event)
        self.host_copied.wait()


class Snapshot:
    """Copies states into one rank's staging slots and marks them (`node`: the agent's node,
    named in the `staged` events). Owned by a `Checkpointer`; `save()` calls it from the
    training thread, one save at a time."""

    def __init__(self, pool: SlotPool, *, node: str) -> None:
        self.pool = pool
        self.node = node
        self._images: dict[int, _Image] = {}
        # slot index -> (layout, image, destination views): a save with the layout of the last
        # one in the same slot reuses its views (building 200 views costs ~1 ms per save).
        self._dsts: dict[int, tuple[tuple, torch.Tensor, list[torch.Tensor]]] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        #: The overlapped copy in progress and its completion on the copier thread.
        self._inflight: tuple[StagedCopy, concurrent.futures.Future[None]] | None = None

    def reserve(self, plan: StatePlan) -> None:
        """Allocate, fault in (and for CUDA, page-lock) every free slot for a state like `plan`."""
        busy = self.pool.busy()
        for slot in self.pool.slots:
            if slot.index not in busy:
                self._image(slot, plan.nbytes, device=_first(plan.cuda_devices))

    def acquire(
        self,
        *,
        wait: bool,
        timeout_s: float,
        waiting: Callable[[list[int]], None] | None = None,
    ) -> Slot | None:
        """A free slot (None: none free and `wait` is False); `waiting` is called with the busy
        slots' steps while it waits (see `SlotPool.acquire`).

        Raises:
            SlotTimeoutError: `wait` and no slot freed up within `timeout_s`.
        """
        return self.pool.acquire(wait=wait, timeout_s=timeout_s, waiting=waiting)

    def prepare(self, slot: Slot, plan: StatePlan) -> StagedCopy:
        """Map `slot` with room for `plan`, bump its generation, then write the image's head;
        returns the copy to make (`copy` or `copy_soon`). `slot.generation` is the new image's
        generation."""
        image = self._image(slot, plan.nbytes, device=_first(plan.cuda_devices))
        # First the generation, then everything else: an agent still copying the slot's last
        # image sees the bump and discards its copy (see `Slot.begin`).
        slot.begin(plan.head)
        cached = self._dsts.get(slot.index)
        if cached is None or cached[1] is not image.tensor or cached[0] != plan.layout:
            cached = self._dsts[slot.index] = (
                plan.layout,
                image.tensor,
                plan.destinations(image.tensor),
            )
        return StagedCopy(plan, slot, cached[2], [])

    def copy(self, copy: StagedCopy, *, started: float, rewind_to: int | None) -> ShardStaged:
        """Make `copy` (from `prepare`), mark its slot and return its `staged` event (blocking
        save; `started`: `perf_counter()` when the save began)."""
        plan, dsts = copy.plan, copy.dsts
        if not plan.cuda_devices:
            plan.copy_into(dsts)
        else:
            pinned = self._images[copy.slot.index].pinned
            plan.copy_into(dsts, device=torch.device("cpu"))
            for device in plan.cuda_devices:
                plan.copy_into(dsts, device=device, non_blocking=pinned)
            for device in plan.cuda_devices:
                torch.cuda.current_stream(device).synchronize()
        stall_s = time.perf_counter() - started
        return self.mark(copy.slot, plan, stall_s=stall_s, blocking=True, rewind_to=rewind_to)

    def copy_soon(
        self, copy: StagedCopy, *, started: float, rewind_to: int | None, then: Then
    ) -> None:
        """Queue `copy` and return (overlapped save): CUDA copies on side streams, the rest
        on the copier thread, which then marks the slot and calls `then` with the `staged`
        event, or with what made the copy fail. `barrier()` holds back changes to the state
        until the copy is over; `wait()` waits for `then` to return."""
        self._start_copy(copy)
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierpipe-copy"
            )
        self._inflight = (copy, self._copier.submit(self._finish, copy, started, rewind_to, then))

    def _finish(self, copy: StagedCopy, started: float, rewind_to: int | None, then: Then) -> None:
        try:
            copy.finish()
            stall_s = time.perf_counter() - started
            event = self.mark(
                copy.slot, copy.plan, stall_s=stall_s, blocking=False, rewind_to=rewind_to
            )
        except BaseException as e:
            then(e)
            return
        then(event)

    def barrier(self) -> None:
        """Make the caller's next change to the state wait for an overlapped copy."""
        inflight = self._inflight
        if inflight is not None:
            inflight[0].barrier()

    def wait(self) -> None:
        """Wait until an overlapped copy is over and its `then` returned."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight[1].result()  # `then` reports the copy's errors

    def _start_copy(self, copy: StagedCopy) -> None:
        """Queue the CUDA copies on side streams (ordered after work already queued on the
        current streams) and return; `StagedCopy.finish()` completes the copy."""
        plan, dsts = copy.plan, copy.dsts
        pinned = self._images[copy.slot.index].pinned
        for device in plan.cuda_devices:
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                plan.copy_into(dsts, device=device, non_blocking=pinned)
                for c in plan.copies:
                    if c.src.device == device:
                        c.src.record_stream(side)  # the allocator must not reuse it mid-copy
                event = torch.cuda.Event()
                event.record(side)
            copy.cuda_events.append((device, event))

    def mark(
        self,
        slot: Slot,
        plan: StatePlan,
        *,
        stall_s: float,
        blocking: bool,
        rewind_to: int | None,
    ) -> ShardStaged:
        """Mark `slot` busy with the copied save (the agent releases it) and return its
        `staged` event; `unmark` gives the slot back if that event is never published."""
        self.pool.mark(slot, plan.header.step)
        return staged_event(
            plan.header,
            slot,
            node=self.node,
            nbytes=plan.nbytes,
            stall_s=stall_s,
            blocking=blocking,
            rewind_to=rewind_to,
        )

    def unmark(self, event: ShardStaged) -> None:
        """Give the slot of a save whose `staged` event was not published back."""
        self.pool.unmark(self.pool.slots[event.slot], event.step)

    def close(self) -> None:
        """Let an overlapped copy finish, then unmap (and unpin) the slots' images."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        for index in list(self._images):
            self._drop(index)

    def _image(self, slot: Slot, nbytes: int, *, device: torch.device | None) -> _Image:
        image = self._images.get(slot.index)
        if image is None or slot.capacity < nbytes or slot.mm is not image.mm:
            self._drop(slot.index)
            mm = slot.ensure(nbytes)
            image = _Image(mm, torch.frombuffer(mm, dtype=torch.uint8), pinned=False)
            self._images[slot.index] = image
        if device is not None and not image.pinned:
            # Registered in the state's device context, not whatever this thread has current.
            image.pinned = page_lock(image.mm, what="staging slot", device=device)
            image.device = device
        return image

    def _drop(self, index: int) -> None:
        self._dsts.pop(index, None)
        image = self._images.pop(index, None)
        if image is not None and image.pinned:
            page_unlock(image.mm, device=image.device)


async def reclaim_slots(bus: Bus, pool: SlotPool, *, job: str, node: str, rank: int) -> None:
    """Drop staging markers no agent will release: never published, or verified, failed
    for good or superseded according to the stream. Three direct gets of this rank's
    newest events on this node, never a replay: a restart reads nothing that grows with
    the job's history."""
    newest: dict[str, tuple[int, Event]] = {}
    for kind in ("staged", "verified", "failed"):
        raw = await bus.last_raw(shard_subject(job, kind, node, rank))
        if raw is None:
            continue
        try:
            newest[kind] = (raw[0], decode_event(raw[1]))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    staged, verified, failed = (newest.get(k) for k in ("staged", "verified", "failed"))
    published = _step_of(staged, ShardStaged)
    failed_step = None
    if failed is not None and isinstance(failed[1], StageFailed):
        f = failed[1]
        if not f.retryable and f.stage in ("nvme-write", "verify"):
            failed_step = f.step
    pending = None
    later = [found[0] for found in (verified, failed) if found is not None]
    if staged is not None and all(staged[0] > seq for seq in later):
        pending = published  # staged after both: that save is still on its way
    verified_step = _step_of(verified, ShardVerified)
    pool.reclaim(
        stale_markers(pool.busy(), published_up_to=published, verified_up_to=verified_step,
                      failed=failed_step, pending=pending)
    )  # fmt: skip


async def newest_staged_step(bus: Bus, *, job: str, rank: int) -> int | None:
    """The step of this rank's most recent `staged` event on any node (one direct get of the
    newest message on its subjects: no consumer, so no JetStream API request)."""
    newest = await bus.last_event(shard_subject(job, "staged", "*", rank))
    return newest.step if isinstance(newest, ShardStaged) else None


def _step_of(found: tuple[int, Event] | None, kind: type[ShardEvent]) -> int | None:
    return found[1].step if found is not None and isinstance(found[1], kind) else None


def _first(devices: frozenset[torch.device]) -> torch.device | None:
    """The lowest-numbered CUDA device of a state (None for a CPU-only state)."""
    return min(devices, key=lambda d: d.index or 0, default=None)
