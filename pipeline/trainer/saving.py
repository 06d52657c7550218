"""A Checkpointer's saves: the staging slots, the copy, the hand-off of `staged` to the outbox,
and what a wait for a slot says.

`Saver.save` takes a free slot of this rank (warning every `wait_warning_s` while none is, with
what holds them: `_held_by`), has the snapshot stage copy the state into it and hands the
`staged` event to the outbox (`tierpipe.trainer.outbox`), which publishes it off the training loop.
A save whose event NATS did not take within its window is void: its handle and the log say why,
its slot is given back and the step may be saved again (`save_errors = "report"`); with
`save_errors = "raise"` a blocking save raises instead, after one try. A blocking save waits for
its event's first try (so a process killed after `save()` returned loses nothing), but not
behind earlier saves still waiting for NATS.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from functools import partial
from typing import Any

import structlog

from tierpipe.bus.portal import BusPortal
from tierpipe.control.advert import NodeState, read_node
from tierpipe.errors import SlotTimeoutError, StaleStepError, TierpipeError
from tierpipe.names import shard_subject
from tierpipe.schemas import ShardStaged, StageFailed
from tierpipe.settings import Settings
from tierpipe.state import plan_state
from tierpipe.storage.staging import Slot, SlotPool
from tierpipe.trainer.handle import SaveHandle, Saves
from tierpipe.trainer.outbox import Outbox, Outcome
from tierpipe.trainer.snapshot import Snapshot, newest_staged_step, reclaim_slots
from tierpipe.waits import Reminder, slot_wait_reason

__all__ = ("Saver",)

log = structlog.get_logger(__name__)


class Saver:
    """One rank's saves on this node: its slots (made with it), its steps, its hand-offs.

    Args:
        settings: the Checkpointer's, with the node's roots adopted (`tierpipe.control.advert`).
        portal: the bus client; `saves`: the handles; `outbox`: where `staged` events go.
        job, rank, world_size, node, epoch: whose saves.
        overwrite: saves may go back in the job's history (`Checkpointer(overwrite=True)`).
        replicated: the state's top-level keys the same on every rank (stored once per job).
    """

    def __init__(
        self,
        settings: Settings,
        portal: BusPortal,
        saves: Saves,
        outbox: Outbox,
        *,
        job: str,
        rank: int,
        world_size: int,
        node: str,
        epoch: int,
        overwrite: bool,
        replicated: frozenset[str] = frozenset(),
    ) -> None:
        self.settings, self._portal, self._saves, self._outbox = settings, portal, saves, outbox
        self.job, self.rank, self.world_size, self.node, self.epoch = (
            job, rank, world_size, node, epoch,
        )  # fmt: skip
        self._overwrite, self._replicated = overwrite, replicated
        self.pool = SlotPool(settings.staging_root, job, rank, settings.staging_slots)
        self.snapshot = Snapshot(self.pool, node=node)
        #: The newest step this rank saved in this job before this process (None: none).
        self._newest_saved: int | None = None
        # Set by `restore()` or the first `overwrite` save that goes back in the job's history:
        # this rank's older epochs' saves after it are superseded. `_last_step` moves once a
        # save is handed to the outbox, and back if it fails there (the step may be redone).
        self._last_step: int | None = None
        self._rewind_to: int | None = None
        self._steps = threading.Lock()  # (a failed publish resets them on the bus thread)

    async def open(self) -> None:
        """Before the first save: drop markers no agent will release, and learn where this
        rank's saves left off (direct gets)."""
        bus = self._portal.bus
        await reclaim_slots(bus, self.pool, job=self.job, node=self.node, rank=self.rank)
        self._newest_saved = await newest_staged_step(bus, job=self.job, rank=self.rank)

    def restored(self, step: int) -> None:
        """`step` was restored: later saves follow it and branch the job's history there."""
        with self._steps:
            self._last_step = self._rewind_to = step

    def reserve(self, state: Any) -> None:
        plan = plan_state(
            state, job=self.job, step=0, rank=self.rank, world_size=self.world_size,
            node=self.node, replicated=self._replicated,
        )  # fmt: skip
        self.snapshot.reserve(plan)

    def save(self, step: int, state: Any, *, blocking: bool) -> SaveHandle:
        """`Checkpointer.save` once the job is open (see there)."""
        with self._steps:
            last, rewind_to = self._last_step, self._rewind_to
        if last is not None and step <= last:
            raise ValueError(f"step {step} does not follow the last saved step {last}")
        newest = self._newest_saved
        if rewind_to is None and newest is not None and step <= newest:
            if not self._overwrite:
                raise StaleStepError(self.job, self.rank, step, newest)
            rewind_to = step - 1  # supersede every step from this one on (set once staged)
        t0 = time.perf_counter()
        plan = plan_state(
            state,
            job=self.job,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
            epoch=self.epoch,
            replicated=self._replicated,
        )
        slot = self._acquire(step)
        if slot is None:
            return self._saves.skipped(step, sorted(self.pool.busy().values()))
        copy = self.snapshot.prepare(slot, plan)
        handle = self._saves.start(step)
        if blocking:
            try:
                event = self.snapshot.copy(copy, started=t0, rewind_to=rewind_to)
            except BaseException as e:
                self._saves.failed(handle, e)
                raise
            self._hand_off(handle, event, wait=True)
            return handle
        try:
            self.snapshot.copy_soon(
                copy, started=t0, rewind_to=rewind_to, then=partial(self._copied, handle)
            )
        except BaseException as e:
            self._saves.failed(handle, e)
            raise
        return handle

    def _acquire(self, step: int) -> Slot | None:
        """A free slot, warning every `wait_warning_s` while none is (and what holds them)."""
        s = self.settings
        reminder = Reminder(s.wait_warning_s)

        def waiting(busy: list[int]) -> None:
            if reminder.due():
                log.warning("slot_wait_continued", job=self.job, rank=self.rank, step=step,
                            busy_steps=busy, waited_s=reminder.waited_s,
                            timeout_s=s.slot_wait_timeout_s, why=self._held_by(busy))  # fmt: skip

        try:
            return self.snapshot.acquire(
                wait=s.slot_policy == "wait", timeout_s=s.slot_wait_timeout_s, waiting=waiting
            )
        except SlotTimeoutError as e:
            raise SlotTimeoutError(
                self.job, self.rank, e.timeout_s, e.busy, why=self._held_by(e.busy)
            ) from None

    def _held_by(self, busy: list[int]) -> str:
        """Why this rank's slots stay busy (`slot_wait_reason`): from the node's record, the
        outbox and the agent's failure reports (a direct get each, short deadlines)."""
        bus = self._portal.bus
        try:
            state = self._portal.run(read_node, bus, self.settings, self.node, timeout=2)
        except TierpipeError:
            state = NodeState(self.node, None, unknown="NATS did not answer")
        failures = self._saves.troubles()
        if not any(step in failures for step in busy):
            subject = shard_subject(self.job, "failed", self.node, self.rank)
            try:
                newest = self._portal.run(bus.last_event, subject, timeout=2)
            except TierpipeError:
                newest = None
            if isinstance(newest, StageFailed) and newest.step is not None:
                failures[newest.step] = newest
        unpublished = self._outbox.trouble if self._outbox.pending() else ""
        return slot_wait_reason(
            busy, no_agent=state.absent(), unpublished=unpublished, failures=failures
        )

    def _copied(self, handle: SaveHandle, result: ShardStaged | BaseException) -> None:
        """The end of an overlapped copy (on the copier thread)."""
        if isinstance(result, BaseException):
            self._saves.failed(handle, result)
        else:
            self._hand_off(handle, result, wait=False)

    def _hand_off(self, handle: SaveHandle, event: ShardStaged, *, wait: bool) -> None:
        """Give a copied save's `staged` event to the outbox; `wait`: a blocking save, which
        waits for the first try and raises a failure with `save_errors = "raise"`."""
        s = self.settings
        raising = s.save_errors == "raise"
        # Every try must fall in the stream's duplicate window, so that the retries are one event.
        window = s.publish_timeout_s
        if not raising:
            window = max(window, min(s.save_retry_s, s.duplicate_window_s - s.publish_timeout_s))
        queued = self._outbox.pending()
        with self._steps:
            before = (self._last_step, self._rewind_to)
            self._last_step, self._rewind_to = handle.step, event.rewind_to
        done = partial(self._published, handle, event, before)
        future = self._outbox.put(event, window_s=window, done=done)
        if not wait or (queued and not raising):
            return  # (earlier saves still wait for NATS: this one does not wait behind them)
        try:
            outcome = future.result(None if raising else s.publish_timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            return  # (still trying in the background; the handle tells how it ends)
        if raising and isinstance(outcome, BaseException):
            raise outcome

    def _published(
        self,
        handle: SaveHandle,
        event: ShardStaged,
        before: tuple[int | None, int | None],
        outcome: Outcome,
    ) -> None:
        """How a save's `staged` event fared (on the bus thread)."""
        if not isinstance(outcome, BaseException):
            self._saves.staged(handle, event)
            return
        self.snapshot.unmark(event)  # (its slot is free for the next save)
        with self._steps:
            if self._last_step == handle.step:  # (no later save since: it may be redone)
                self._last_step, self._rewind_to = before
        self._saves.failed(handle, outcome)
