"""`Checkpointer`: the API training code uses.

`save()` copies the state into a staging slot in shared memory and publishes `staged`; the node
agent takes it from there. The trainer's only background activity is one small NATS client on a
daemon thread, publishing events and listening for this rank's progress events.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar, TypeVarTuple

import msgspec
import structlog
import torch
from anyio.from_thread import start_blocking_portal
from nats.aio.msg import Msg
from torch.utils.hooks import RemovableHandle

from tierpipe.bus import Bus
from tierpipe.catalog import Catalog
from tierpipe.errors import BusUnavailableError, ConfigError, StaleStepError, TierpipeError
from tierpipe.handle import SaveHandle, SaveStats
from tierpipe.log import configure_logging
from tierpipe.names import flush_control_subject, node_name, shard_subject, validate_token
from tierpipe.recovery.agree import Restored, Restorer
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loader
from tierpipe.schemas import Event, FlushControl, ShardEvent, ShardStaged, StageFailed, decode_event
from tierpipe.settings import Settings, load_settings
from tierpipe.stages.snapshot import Snapshot, reclaim_slots
from tierpipe.staging import SlotPool
from tierpipe.state import plan_state

__all__ = ("Checkpointer", "SaveHandle", "SaveStats")

log = structlog.get_logger(__name__)

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")
#: The bus loop runs on uvloop where it is installed (as the node agent does).
_LOOP_OPTIONS = {"use_uvloop": True} if importlib.util.find_spec("uvloop") else {}


class _BusPortal:
    """A NATS client on its own event-loop thread (an anyio blocking portal), so the trainer's
    threads never run it; every call has a deadline."""

    def __init__(self, settings: Settings, name: str) -> None:
        self._stack: contextlib.ExitStack | None = contextlib.ExitStack()
        self.portal = self._stack.enter_context(
            start_blocking_portal("asyncio", _LOOP_OPTIONS, name="tierpipe-bus")
        )
        self.bus = Bus(settings, name=name)
        try:
            self.run(self.bus.connect, timeout=settings.connect_timeout_s + 5)
        except BaseException:
            self.close()
            raise

    def run(
        self,
        func: Callable[[*PosArgsT], Awaitable[T]],
        *args: *PosArgsT,
        timeout: float | None,
    ) -> T:
        """Run `func(*args)` on the bus thread and return its result.

        Raises:
            BusUnavailableError: no answer within `timeout` (NATS down or unreachable: the
                client keeps reconnecting meanwhile), with the cause kept; the call is cancelled.
            TierpipeError: what the coroutine raised.
        """
        future = self.portal.start_task_soon(func, *args)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:  # (not `except TimeoutError`: the coroutine may raise a TimeoutError itself)
            future.cancel()  # cancels the call's task on the bus thread
            nc = self.bus.nc
            state = "connected" if nc is not None and nc.is_connected else "not connected"
            raise BusUnavailableError(
                f"NATS did not answer within {timeout:g} s ({state})"
            ) from TimeoutError(f"bus call timed out after {timeout} s")
        return future.result()

    def close(self) -> None:
        """Close the client, then stop the loop, cancelling what is left, and join its thread
        (idempotent). A loop that does not stop within 10 s is left to its daemon thread."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            self.run(self.bus.aclose, timeout=10)
        except (TimeoutError, TierpipeError) as e:
            log.debug("bus_close_failed", error=str(e))
        stopped = self.portal.start_task_soon(self.portal.stop, True)
        if concurrent.futures.wait([stopped], 10).done:
            stack.close()  # joins the loop's thread


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
        self._pool = SlotPool(
            self.settings.staging_root, self.job, self.rank, self.settings.staging_slots
        )
        self._snapshot = Snapshot(self._pool, node=self.node)
        try:
            self._bus = _BusPortal(self.settings, f"tierpipe-{self.job}-{self.node}-{self.rank}")
        except BaseException:
            self._pool.close()
            raise
        try:
            self._bus.run(self._start, timeout=self.settings.request_timeout_s + 5)
        except BaseException:
            self._bus.close()
            self._pool.close()
            raise
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
        await bus.subscribe(shard_subject(self.job, "*", self.node, self.rank), self._on_msg)
        await reclaim_slots(bus, self._pool, job=self.job, node=self.node, rank=self.rank)
        self._newest_saved = await self._newest_staged_step()

    async def _newest_staged_step(self) -> int | None:
        """The step of this rank's most recent `staged` event on any node (the newest message
        on each node's subject; a handful of messages, never a replay)."""
        found = await self._bus.bus.latest(shard_subject(self.job, "staged", "*", self.rank))
        newest = max(found, default=None, key=lambda item: item[0])
        return newest[1].step if newest is not None and isinstance(newest[1], ShardStaged) else None

    # --- saving

    def reserve(self, state: Any) -> None:
        """Allocate every free staging slot for a state like `state`, before training starts.

        Optional: otherwise a slot is allocated by the first save that uses it, which then
        blocks for the allocation too (about a second per GiB).
        """
        plan = plan_state(
            state, job=self.job, step=0, rank=self.rank, world_size=self.world_size, node=self.node
        )
        self._snapshot.reserve(plan)

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
        self._snapshot.wait()
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
        slot = self._snapshot.acquire(wait=s.slot_policy == "wait", timeout_s=s.slot_wait_timeout_s)
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
            return SaveHandle(step, skipped=True)
        # `_last_step` moves only once the save is staged: a save that fails before (staging
        # full, a publish that failed) may be retried with the same step.
        dsts = self._snapshot.prepare(slot, plan)
        handle = SaveHandle(step, catch_up=self._catch_up)
        with self._lock:
            self._handles[step] = handle
        if blocking:
            try:
                event = self._snapshot.copy(slot, plan, dsts, started=t0, rewind_to=rewind_to)
            except BaseException as e:
                self._abandon(handle, e)
                raise
            self._publish(handle, event, raise_errors=True)
            return handle
        try:
            self._snapshot.copy_soon(
                slot,
                plan,
                dsts,
                started=t0,
                rewind_to=rewind_to,
                then=partial(self._copied, handle),
            )
        except BaseException as e:
            self._abandon(handle, e)
            raise
        return handle

    def _copied(self, handle: SaveHandle, result: ShardStaged | BaseException) -> None:
        """The end of an overlapped copy (on the copier thread)."""
        if isinstance(result, BaseException):
            self._abandon(handle, result)
        else:
            self._publish(handle, result, raise_errors=False)

    def _publish(self, handle: SaveHandle, event: ShardStaged, *, raise_errors: bool) -> None:
        try:
            published = self._bus.run(
                self._bus.bus.publish, event, timeout=self.settings.publish_timeout_s
            )
            if published.duplicate:
                raise ConfigError(
                    f"step {handle.step} of rank {self.rank} was already staged moments ago "
                    "(duplicate event); this save is void"
                )
        except (TierpipeError, TimeoutError) as e:
            self._snapshot.unmark(event)
            self._abandon(handle, e)
            if raise_errors:
                raise
            return
        self._last_step = handle.step
        self._rewind_to = event.rewind_to
        handle._on_event(event)
        handle._staged.set()
        self.stats.staged += 1
        self.stats.last_stall_s = event.stall_s
        log.debug(
            "shard_staged",
            job=self.job,
            step=handle.step,
            rank=self.rank,
            nbytes=event.nbytes,
            stall_s=event.stall_s,
            blocking=event.blocking,
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

    def guard(self, target: torch.optim.Optimizer | torch.nn.Module) -> RemovableHandle:
        """Make `target` wait for an overlapped copy before it may mutate the state.

        An optimizer waits before `step()`; a module (e.g. one with BatchNorm buffers) waits
        before `forward()`. CUDA copies are awaited on the GPU (the current stream waits for the
        copy stream), CPU copies on the host.

        Returns:
            A handle whose `remove()` undoes the guard.
        """
        if isinstance(target, torch.optim.Optimizer):
            return target.register_step_pre_hook(lambda *_: self._snapshot.barrier())
        if isinstance(target, torch.nn.Module):
            return target.register_forward_pre_hook(lambda *_: self._snapshot.barrier())
        raise TypeError(f"guard() takes an optimizer or a module (got {type(target).__qualname__})")

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
        self._snapshot.wait()
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
        restored = self._bus.run(
            partial(restorer.run, step=step), timeout=self.settings.restore_timeout_s + 60
        )
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

        return self._bus.run(fold, timeout=self.settings.request_timeout_s + 30)

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
        subject = flush_control_subject(self.node if this_node_only else None)
        data = msgspec.json.encode(control)
        self._bus.run(
            self._bus.bus.publish_raw, subject, data, timeout=self.settings.publish_timeout_s
        )

    # --- progress

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        # (events without a step, e.g. restore reports, concern no save)
        step = event.step if isinstance(event, ShardEvent | StageFailed) else None
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
                subject = shard_subject(self.job, kind, self.node, self.rank)
                event = self._bus.run(self._bus.bus.last_event, subject, timeout=5)
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
        self._snapshot.wait()
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
            self._snapshot.wait()
            self._bus.run(self._loader.written_back, timeout=None)  # a restore's NVMe write-back
            self._bus.run(self._loader.aclose, timeout=30)
        finally:
            self._snapshot.close()  # (an overlapped copy publishes before the bus closes)
            self._bus.close()
            self._pool.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _terminal(event: Event) -> bool:
    return type(event).__struct_config__.tag == "verified" or (
        isinstance(event, StageFailed) and not event.retryable
    )
