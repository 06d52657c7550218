"""Snapshot stage (in the trainer): copy a rank's state into a staging slot in shared memory.

This is the only part of tierpipe on the training loop's critical path, so it does nothing but
the copy: no hashing, no disk or network I/O. CPU tensors are copied with `copy_` into views of
the slot (torch parallelises large copies). CUDA tensors are copied device-to-host with
non-blocking copies into the slot itself, which is page-locked once with `cudaHostRegister`
(pinned staging without a second host copy), then synchronised; the overlapped mode queues them
on a side stream instead and lets the next optimizer step wait for that stream on the GPU.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierpipe.pinned import page_lock, page_unlock
from tierpipe.staging import Slot, SlotPool
from tierpipe.state import StatePlan

__all__ = ("Snapshot", "StagedCopy")


@dataclass(slots=True)
class _Image:
    mm: mmap.mmap
    tensor: torch.Tensor
    #: Page-locked for CUDA (cudaHostRegister), so device-to-host copies can be asynchronous.
    pinned: bool
    #: The device whose context registered it (unregistered in the same one).
    device: torch.device | None = None


@dataclass(slots=True)
class StagedCopy:
    """A copy in progress (overlapped mode): CUDA events to wait for, CPU copies still to do."""

    plan: StatePlan
    slot: Slot
    dsts: list[torch.Tensor]
    #: (device, event recorded on its copy stream after the last device-to-host copy)
    cuda_events: list[tuple[torch.device, torch.cuda.Event]]

    def finish(self, on_host_done: Callable[[], None]) -> None:
        """Run the CPU part, report it, then wait for the CUDA part (on a helper thread)."""
        self.plan.copy_into(self.dsts, device=torch.device("cpu"))
        on_host_done()
        for _, event in self.cuda_events:
            event.synchronize()


class Snapshot:
    """Copies states into one rank's staging slots. Owned by a `Checkpointer`."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._images: dict[int, _Image] = {}
        # slot index -> (layout, image, destination views): a save with the layout of the last
        # one in the same slot reuses its views (building 200 views costs ~1 ms per save).
        self._dsts: dict[int, tuple[tuple, torch.Tensor, list[torch.Tensor]]] = {}
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def reserve(self, slot: Slot, plan: StatePlan) -> None:
        """Allocate, fault in (and for CUDA, page-lock) `slot` for a state like `plan`."""
        self._image(slot, plan.nbytes, device=_first(plan.cuda_devices))

    def prepare(self, slot: Slot, plan: StatePlan) -> list[torch.Tensor]:
        """Map `slot` with room for `plan`, bump its generation, then write the image's head;
        returns the copy targets. `slot.generation` is the new image's generation."""
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
        return cached[2]

    def copy(self, slot: Slot, plan: StatePlan, dsts: list[torch.Tensor]) -> None:
        """Copy every tensor and return once the bytes are in the slot (blocking save)."""
        if not plan.cuda_devices:
            plan.copy_into(dsts)
            return
        pinned = self._images[slot.index].pinned
        plan.copy_into(dsts, device=torch.device("cpu"))
        for device in plan.cuda_devices:
            plan.copy_into(dsts, device=device, non_blocking=pinned)
        for device in plan.cuda_devices:
            torch.cuda.current_stream(device).synchronize()

    def start_copy(self, slot: Slot, plan: StatePlan, dsts: list[torch.Tensor]) -> StagedCopy:
        """Queue the CUDA copies on side streams (ordered after work already queued on the
        current streams) and return; `StagedCopy.finish()` completes the copy."""
        events = []
        pinned = self._images[slot.index].pinned
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
            events.append((device, event))
        return StagedCopy(plan, slot, dsts, events)

    def close(self) -> None:
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


def _first(devices: frozenset[torch.device]) -> torch.device | None:
    """The lowest-numbered CUDA device of a state (None for a CPU-only state)."""
    return min(devices, key=lambda d: d.index or 0, default=None)
