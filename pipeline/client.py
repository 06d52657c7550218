"""`Checkpointer`: the API training code uses.

`save()` copies the state into a staging slot in shared memory and publishes `staged`; the node
agent takes it from there. The trainer's only background activity is one small NATS client on a
daemon thread, publishing events and listening for this rank's progress events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
import structlog
import torch
from torch.utils.hooks import RemovableHandle

from tierpipe.bus import Bus
from tierpipe.catalog import Catalog
from tierpipe.errors import (
    BusUnavailableError,
    ConfigError,
    ShardFailedError,
    StaleStepError,
    TierpipeError,
)
from tierpipe.log import configure_logging
from tierpipe.names import CONTROL_FLUSH, SUBJECT_ROOT, node_name, shard_subject, validate_token
from tierpipe.recovery.agree import Restored, Restorer
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loader
from tierpipe.schemas import (
    Event,
    FlushControl,
    ShardEvent,
    ShardStaged,
    ShardVerified,
    StageFailed,
    decode_event,
)
from tierpipe.settings import Settings, load_settings
from tierpipe.stages.snapshot import Snapshot, StagedCopy
from tierpipe.staging import Slot, SlotPool
from tierpipe.state import StatePlan, plan_state

__all__ = ("Checkpointer", "SaveHandle", "SaveStats")

log = structlog.get_logger(__name__)

Milestone = Literal["staged", "written", "verified"]
_ORDER: dict[str, int] = {"staged": 0, "written": 1, "verified": 2}
_POLL_S = 1.0
T = TypeVar("T")


@dataclass(slots=True)
class SaveStats:
    """Counters of this Checkpointer's saves."""

    staged: int = 0
    skipped: int = 0
    failed: int = 0
    last_stall_s: float = 0.0


class SaveHandle:
    """The fate of one `save()`: reads like a `concurrent.futures.Future` whose result is the
    `verified` event, plus `wait(milestone)` and `wait_staged()`."""

    def __init__(self, owner: Checkpointer | None, step: int, *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._owner = owner
        self._cond = threading.Condition()
        self._events: dict[str, Event] = {}
        self._error: BaseException | None = None
        self._staged = threading.Event()
        self._host_copied = threading.Event()
        self._cuda_events: list[tuple[torch.device, torch.cuda.Event]] = []
        if skipped:
            self._staged.set()
            self._host_copied.set()

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else "failed"
            if self._error
            else max(self._events, key=_ORDER.__getitem__, default="copying")
        )
        return f"<SaveHandle step={self.step} {state}>"

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the copy is complete and `staged` is published (overlapped mode).

        Raises:
            TimeoutError: not staged within `timeout`.
            TierpipeError: the copy or the publish failed.
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"step {self.step} not staged within {timeout} s")
        with self._cond:
            if self._error is not None and "staged" not in self._events:
                raise self._error

    def wait(self, until: Milestone = "verified", timeout: float | None = None) -> Event | None:
        """Block until the shard reached `until` (`staged`, `written` or `verified`).

        Returns:
            The event that proved it (None for a skipped save).

        Raises:
            TimeoutError: not reached within `timeout`.
            ShardFailedError: a stage failed permanently for this shard.
        """
        if until not in _ORDER:
            raise ValueError(f"until must be one of {list(_ORDER)} (got {until!r})")
        if self.skipped:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        want = _ORDER[until]
        while True:
            with self._cond:
                reached = [k for k in self._events if _ORDER[k] >= want]
                if reached:
                    return self._events[min(reached, key=_ORDER.__getitem__)]
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"step {self.step} not {until} within {timeout} s")
                self._cond.wait(_POLL_S if left is None else min(left, _POLL_S))
            if self._owner is not None and "staged" in self._events:
                self._owner._catch_up(self)  # events missed while disconnected

    def done(self) -> bool:
        with self._cond:
            return self.skipped or self._error is not None or "verified" in self._events

    def result(self, timeout: float | None = None) -> Event | None:
        """The `verified` event (None for a skipped save); raises what made the save fail."""
        return self.wait("verified", timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            return e
        return None

    def _on_event(self, event: Event) -> None:
        with self._cond:
            if isinstance(event, StageFailed):
                if not event.retryable and self._error is None:
                    self._error = ShardFailedError(event.stage, event.error, event.message)
            else:
                kind = type(event).__struct_config__.tag
                if kind in _ORDER:
                    self._events.setdefault(kind, event)
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._host_copied.set()
        self._staged.set()


class _BusThread:
    """A NATS client on its own event loop thread, so the trainer's threads never run it."""

    def __init__(self, settings: Settings, name: str) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="tierpipe-bus", daemon=True
        )
        self._thread.start()
        self.bus = Bus(settings, name=name)
        try:
            self.run(self.bus.connect(), settings.connect_timeout_s + 5)
        except BaseException:
            self.close()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run `coro` on the bus thread and return its result.

        Raises:
            BusUnavailableError: no answer within `timeout` (NATS down or unreachable: the
                client keeps reconnecting meanwhile), with the cause kept.
            TierpipeError: what the coroutine raised.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:  # (not `except TimeoutError`: the coroutine may raise a TimeoutError itself)
            future.cancel()
            nc = self.bus.nc
            state = "connected" if nc is not None and nc.is_connected else "not connected"
            raise BusUnavailableError(
                f"NATS did not answer within {timeout:g} s ({state})"
            ) from TimeoutError(f"bus call timed out after {timeout} s")
        return future.result()

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.run(self.bus.aclose(), 10)
            except (TimeoutError, TierpipeError) as e:
                log.debug("bus_close_failed", error=str(e))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class Checkpointer:
    """Asynchronous multi-tier checkpoints for one rank of a training job.

    Args:
        job: the job's name (`[A-Za-z0-9_-]{1,64}`): a subject token and a directory name.
        rank: this process's rank; default `$RANK` (torchrun), else 0.
        world_size: default `$WORLD_SIZE`, else 1.
        node: this node's name; default the settings' `node`, else the host name's first label.
            Must match the node agent's.
        settings: default `load_settings()` (TOML file + `TIERPIPE_*` environment).
        overwrite: this run starts the job over: its first save of a step the job already has
            (or an older one) supersedes that step and every later one saved before, on every
            tier (they are no longer restorable, and retention removes them). Without it, a
            process that did not `restore()` first may not save such a step (`StaleStepError`).

    Every Checkpointer starts a new epoch (a timeline). After `restore()` of step r, or once an
    `overwrite` save of step s happened, this rank's saves of later steps (after r; from s on)
    made by earlier epochs are superseded: a run that went back in its history branches it,
    and the abandoned branch is never restored again.

    Raises:
        InvalidNameError: job or node is not a safe name.
        BusUnavailableError: NATS cannot be reached.
        ConfigError: another process already stages this rank of this job on this node.
    """

    def __init__(
        self,
        job: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        node: str | None = None,
        settings: Settings | None = None,
        overwrite: bool = False,
    ) -> None:
        self.settings = settings or load_settings()
        configure_logging(
            self.settings.log_level, self.settings.log_format, only_if_unconfigured=True
        )
        self.job = validate_token("job", job)
        self.node = node_name(node or self.settings.node)
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} out of range for world_size {self.world_size}")
        self.stats = SaveStats()
        #: This process's timeline (see the class docstring).
        self.epoch = time.time_ns()
        self._overwrite = overwrite
        #: Set by `restore()` or the first `overwrite` save that goes back in the job's history:
        #: this rank's older epochs' saves after it are superseded.
        self._rewind_to: int | None = None
        #: The newest step this rank saved in this job before this process (None: none).
        self._newest_saved: int | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._handles: dict[int, SaveHandle] = {}
        self._last_step: int | None = None
        self._inflight: tuple[SaveHandle, concurrent.futures.Future[None]] | None = None
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._subject = f"{SUBJECT_ROOT}.{self.job}.{{kind}}.{self.node}.{self.rank}"
        self._pool = SlotPool(
            self.settings.staging_root, self.job, self.rank, self.settings.staging_slots
        )
        try:
            self._bus = _BusThread(self.settings, f"tierpipe-{self.job}-{self.node}-{self.rank}")
        except BaseException:
            self._pool.close()
            raise
        try:
            self._bus.run(self._start(), self.settings.request_timeout_s + 5)
        except BaseException:
            self._bus.close()
            self._pool.close()
            raise
        self._snapshot = Snapshot(self._pool)
        self._loader = Loader(
            self.settings,
            self._bus.bus,
            self._pool,
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
        )

    async def _start(self) -> None:
        bus = self._bus.bus
        await bus.ensure_stream(update=False)
        await bus.subscribe(self._subject.format(kind="*"), self._on_msg)
        await self._reclaim_slots()
        self._newest_saved = await self._newest_staged_step()

    async def _newest_staged_step(self) -> int | None:
        """The step of this rank's most recent `staged` event on any node (the newest message
        on each node's subject; a handful of messages, never a replay)."""
        found = await self._bus.bus.latest(shard_subject(self.job, "staged", "*", self.rank))
        newest = max(found, default=None, key=lambda item: item[0])
        return newest[1].step if newest is not None and isinstance(newest[1], ShardStaged) else None

    async def _reclaim_slots(self) -> None:
        """Drop staging markers no agent will release: never published, or verified, failed
        for good or superseded according to the stream. Three direct gets of this rank's
        newest events on this node, never a replay: a restart reads nothing that grows with
        the job's history."""
        bus = self._bus.bus
        newest: dict[str, tuple[int, Event]] = {}
        for kind in ("staged", "verified", "failed"):
            raw = await bus.last_raw(self._subject.format(kind=kind))
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
        self._pool.reclaim(
            published_up_to=published,
            verified_up_to=_step_of(verified, ShardVerified),
            failed=failed_step,
            pending=pending,
        )

    # --- saving

    def reserve(self, state: Any) -> None:
        """Allocate every free staging slot for a state like `state`, before training starts.

        Optional: otherwise a slot is allocated by the first save that uses it, which then
        blocks for the allocation too (about a second per GiB).
        """
        plan = plan_state(
            state, job=self.job, step=0, rank=self.rank, world_size=self.world_size, node=self.node
        )
        busy = self._pool.busy()
        for slot in self._pool.slots:
            if slot.index not in busy:
                self._snapshot.reserve(slot, plan)

    def save(self, step: int, state: Any, *, blocking: bool = True) -> SaveHandle:
        """Snapshot `state` at `step`; block only for the copy into shared memory.

        Args:
            step: the training step; must increase from save to save.
            state: nested dicts/lists/tuples of tensors and plain values, or objects with
                `state_dict()` (modules, optimizers, schedulers).
            blocking: False returns at once while the copy proceeds in the background; call
                `handle.wait_staged()` or `guard()` an optimizer before mutating the state.

        Returns:
            A handle; `handle.skipped` is True if policy `skip` found no free slot.

        Raises:
            SlotTimeoutError: policy `wait` and no slot freed up in time.
            UnsupportedStateError: the state holds a value that cannot be stored without pickle.
            BusUnavailableError: `staged` could not be published (the save is void).
            StaleStepError: the job already has this step or a newer one, and this process
                neither restored first nor passed `overwrite=True`.
        """
        if self._closed:
            raise ConfigError("save() on a closed Checkpointer")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int (got {step!r})")
        self._await_inflight()
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} does not follow the last saved step {self._last_step}")
        rewind_to = self._rewind_to
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
        )
        s = self.settings
        slot = self._pool.acquire(wait=s.slot_policy == "wait", timeout_s=s.slot_wait_timeout_s)
        if slot is None:
            self.stats.skipped += 1
            log.warning(
                "save_skipped",
                job=self.job,
                step=step,
                rank=self.rank,
                reason="no free staging slot",
                busy_steps=sorted(self._pool.busy().values()),
            )
            return SaveHandle(None, step, skipped=True)
        # `_last_step` moves only once the save is staged: a save that fails before (staging
        # full, a publish that failed) may be retried with the same step.
        dsts = self._snapshot.prepare(slot, plan)
        handle = SaveHandle(self, step)
        with self._lock:
            self._handles[step] = handle
        if blocking:
            try:
                self._snapshot.copy(slot, plan, dsts)
            except BaseException as e:
                self._abandon(handle, e)
                raise
            handle._host_copied.set()
            self._publish(
                handle,
                slot,
                plan,
                time.perf_counter() - t0,
                blocking=True,
                raise_errors=True,
                rewind_to=rewind_to,
            )
            return handle
        try:
            copy = self._snapshot.start_copy(slot, plan, dsts)
        except BaseException as e:
            self._abandon(handle, e)
            raise
        handle._cuda_events = copy.cuda_events
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierpipe-copy"
            )
        self._inflight = (
            handle,
            self._copier.submit(self._finish_copy, handle, copy, t0, rewind_to),
        )
        return handle

    def _finish_copy(
        self, handle: SaveHandle, copy: StagedCopy, t0: float, rewind_to: int | None
    ) -> None:
        try:
            copy.finish(handle._host_copied.set)
        except BaseException as e:
            self._abandon(handle, e)
            return
        self._publish(
            handle,
            copy.slot,
            copy.plan,
            time.perf_counter() - t0,
            blocking=False,
            raise_errors=False,
            rewind_to=rewind_to,
        )

    def _publish(
        self,
        handle: SaveHandle,
        slot: Slot,
        plan: StatePlan,
        stall_s: float,
        *,
        blocking: bool,
        raise_errors: bool,
        rewind_to: int | None,
    ) -> None:
        self._pool.mark(slot, handle.step)
        event = ShardStaged(
            job=self.job,
            node=self.node,
            ts=time.time(),
            step=handle.step,
            rank=self.rank,
            world_size=self.world_size,
            staging_path=str(slot.path),
            slot=slot.index,
            nbytes=plan.nbytes,
            tensors=len(plan.header.tensors),
            stall_s=round(stall_s, 6),
            blocking=blocking,
            generation=slot.generation,
            epoch=self.epoch,
            rewind_to=rewind_to,
        )
        try:
            published = self._bus.run(self._bus.bus.publish(event), self.settings.publish_timeout_s)
            if published.duplicate:
                raise ConfigError(
                    f"step {handle.step} of rank {self.rank} was already staged moments ago "
                    "(duplicate event); this save is void"
                )
        except (TierpipeError, TimeoutError) as e:
            self._pool.unmark(slot, handle.step)
            self._abandon(handle, e)
            if raise_errors:
                raise
            return
        self._last_step = handle.step
        self._rewind_to = rewind_to
        handle._on_event(event)
        handle._staged.set()
        self.stats.staged += 1
        self.stats.last_stall_s = stall_s
        log.debug(
            "shard_staged",
            job=self.job,
            step=handle.step,
            rank=self.rank,
            nbytes=plan.nbytes,
            stall_s=round(stall_s, 6),
            blocking=blocking,
        )

    def _abandon(self, handle: SaveHandle, error: BaseException) -> None:
        self.stats.failed += 1
        log.error(
            "save_failed",
            job=self.job,
            step=handle.step,
            rank=self.rank,
            error=str(error) or type(error).__name__,
        )
        handle._fail(error)
        with self._lock:
            self._handles.pop(handle.step, None)

    def _await_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight[1].result()  # errors are recorded on the handle

    def guard(self, target: torch.optim.Optimizer | torch.nn.Module) -> RemovableHandle:
        """Make `target` wait for an overlapped copy before it may mutate the state.

        An optimizer waits before `step()`; a module (e.g. one with BatchNorm buffers) waits
        before `forward()`. CUDA copies are awaited on the GPU (the current stream waits for the
        copy stream), CPU copies on the host.

        Returns:
            A handle whose `remove()` undoes the guard.
        """
        if isinstance(target, torch.optim.Optimizer):
            return target.register_step_pre_hook(lambda *_: self._barrier())
        if isinstance(target, torch.nn.Module):
            return target.register_forward_pre_hook(lambda *_: self._barrier())
        raise TypeError(f"guard() takes an optimizer or a module (got {type(target).__qualname__})")

    def _barrier(self) -> None:
        inflight = self._inflight
        if inflight is None:
            return
        handle = inflight[0]
        for device, event in handle._cuda_events:
            torch.cuda.current_stream(device).wait_event(event)  # ordered on the GPU, no host wait
        handle._host_copied.wait()

    # --- restoring

    def restore(
        self, into: Any = None, *, step: int | None = None, restart: str | None = None
    ) -> Restored:
        """Load the newest checkpoint every rank can reach (or exactly `step`); all ranks call it.

        Rank 0 plans from the event stream (each rank reads its own node's NVMe copy if that
        survived, else the object-storage copy) and publishes the plan on `tp.<job>.plan` (and
        broadcasts it with torch.distributed when that is initialised for this job); every
        digest is checked before bytes reach a tensor; a bad copy falls back to the next source,
        and if a rank has none left, all ranks move to an older step together. A shard read from
        object storage is staged again afterwards, so this node's NVMe gets its copy back.

        Args:
            into: objects to restore into in place, shaped like what was saved (e.g.
                `{"model": model, "optim": optimizer}`); tensors without a matching target come
                back as new CPU tensors in `Restored.state`.
            step: restore this step instead of the newest restorable one.
            restart: an id every rank of this restart shares; default from torchelastic
                (`TORCHELASTIC_RUN_ID`-`TORCHELASTIC_RESTART_COUNT`), else stream order.

        Raises:
            NoCheckpointError: nothing restorable (the message says why, step by step).
            WorldSizeMismatchError: the checkpoint was saved by another number of ranks.
            RestoreTimeoutError: the other ranks (or rank 0's plan) did not show up in time.
        """
        self._await_inflight()
        restorer = Restorer(
            self._bus.bus,
            self.settings,
            self._loader,
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            node=self.node,
            restart=restart,
            into=into,
            collective=(
                Collective.from_torch(self.rank, self.world_size)
                if self.settings.restore_use_torch_distributed
                else None
            ),
        )
        restored = self._bus.run(restorer.run(step=step), self.settings.restore_timeout_s + 60)
        self._last_step = restored.step
        # Saves from here on branch the job's history at the restored step: this rank's older
        # epochs' saves of later steps are superseded (a normal restart has none that count).
        self._rewind_to = restored.step
        log.info(
            "checkpoint_restored",
            job=self.job,
            rank=self.rank,
            step=restored.step,
            tier=restored.source.tier,
            seconds=round(restored.seconds, 3),
            rounds=restored.rounds,
        )
        return restored

    def latest_step(self) -> int | None:
        """The newest step complete on some tier (every rank verified), from the event stream."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps complete on NVMe or object storage, ascending."""

        async def fold() -> list[int]:
            catalog = await Catalog.replay(self._bus.bus, self.job)
            return catalog.complete_steps(self.job, ("nvme", "s3"))

        return self._bus.run(fold(), self.settings.request_timeout_s + 30)

    # --- object-storage uploads (the flush stage), e.g. around network-heavy phases

    def pause_flush(self, *, this_node_only: bool = False) -> None:
        """Hold uploads to object storage (every node's, or this node's) until `resume_flush()`."""
        self._control(FlushControl(action="pause", ts=time.time()), this_node_only)

    def resume_flush(self, *, this_node_only: bool = False) -> None:
        self._control(FlushControl(action="resume", ts=time.time()), this_node_only)

    def set_flush_rate(self, bytes_per_s: int, *, this_node_only: bool = False) -> None:
        """Limit uploads to `bytes_per_s` (0: unlimited), on every node or this node."""
        control = FlushControl(action="rate", rate_bytes_per_s=bytes_per_s, ts=time.time())
        self._control(control, this_node_only)

    def _control(self, control: FlushControl, this_node_only: bool) -> None:
        subject = f"{CONTROL_FLUSH}.{self.node}" if this_node_only else CONTROL_FLUSH
        data = msgspec.json.encode(control)
        self._bus.run(self._bus.bus.publish_raw(subject, data), self.settings.publish_timeout_s)

    # --- progress

    async def _on_msg(self, msg: Any) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        step = getattr(event, "step", None)
        if getattr(event, "epoch", self.epoch) != self.epoch:
            return  # another run's save of the same step (a write-back, an older epoch)
        with self._lock:
            handle = self._handles.get(step) if step is not None else None
            if handle is not None and _terminal(event):
                self._handles.pop(step, None)
        if handle is not None:
            handle._on_event(event)

    def _catch_up(self, handle: SaveHandle) -> None:
        """Look up the newest events of this rank directly (after a reconnect gap)."""
        for kind in ("verified", "written", "failed"):
            try:
                event = self._bus.run(self._bus.bus.last_event(self._subject.format(kind=kind)), 5)
            except (TierpipeError, TimeoutError):
                return
            if (
                isinstance(event, ShardEvent | StageFailed)
                and event.step == handle.step
                and event.epoch == self.epoch
            ):
                handle._on_event(event)

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Block until every save so far is verified on NVMe (or failed)."""
        self._await_inflight()
        with self._lock:
            pending = list(self._handles.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait("verified", left)
            except TierpipeError:
                pass

    def close(self) -> None:
        """Finish an overlapped copy, stop the bus client and unmap the slots (idempotent).

        Staged shards are not waited for: the node agent writes them out regardless.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._await_inflight()
            self._bus.run(self._loader.written_back(), None)  # a restore's NVMe write-back
            self._bus.run(self._loader.aclose(), 30)
        finally:
            if self._copier is not None:
                self._copier.shutdown(wait=True)
            self._bus.close()
            self._snapshot.close()
            self._pool.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_of(found: tuple[int, Event] | None, kind: type[ShardEvent]) -> int | None:
    return found[1].step if found is not None and isinstance(found[1], kind) else None


def _terminal(event: Event) -> bool:
    return type(event).__struct_config__.tag == "verified" or (
        isinstance(event, StageFailed) and not event.retryable
    )
