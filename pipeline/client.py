"""`Checkpointer`: the API training code uses.

`save()` has the snapshot stage (`tierpipe.stages.snapshot`) copy the state into a staging slot
in shared memory and publishes the `staged` event it returns; the node agent takes it from there,
and `Saves` (`tierpipe.handle`) hands this rank's progress events to the save's handle. The
trainer's only background activity is one small NATS client on its own event-loop thread
(`tierpipe.portal`), and the copier thread of an overlapped save.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import msgspec
import structlog
import torch
from torch.utils.hooks import RemovableHandle

from tierpipe.errors import ConfigError, StaleStepError, TierpipeError
from tierpipe.handle import SaveHandle, Saves, SaveStats
from tierpipe.kvstate import JobStore
from tierpipe.log import configure_logging
from tierpipe.names import flush_control_subject, node_name, shard_subject, validate_token
from tierpipe.portal import BusPortal
from tierpipe.recovery.agree import Restored, Restorer
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loader
from tierpipe.recovery.survey import current_head, own_events
from tierpipe.schemas import Event, FlushControl, ShardStaged
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings, load_settings
from tierpipe.stages.snapshot import Snapshot, newest_staged_step, reclaim_slots
from tierpipe.staging import SlotPool
from tierpipe.state import plan_state

__all__ = ("Checkpointer",)

log = structlog.get_logger(__name__)


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
        keep: the job's retention policy (complete steps kept on NVMe and in object storage,
            the period rule); rank 0 stores it for the job's coordinator. Default: the node
            agents' settings.
        local_rank, local_world_size: this rank's place among the ranks of its node, which are
            `rank - local_rank` to `rank - local_rank + local_world_size - 1`: at restore the
            node's local rank 0 checks the copies of all of them. Default `$LOCAL_RANK` and
            `$LOCAL_WORLD_SIZE` (torchrun) where both are set, else a node of its own.

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
        keep: Keep | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
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
        self.local_rank, self.local_world_size = _local_group(
            self.rank, self.world_size, local_rank, local_world_size
        )
        #: This process's timeline (see the class docstring).
        self.epoch = time.time_ns()
        self._overwrite = overwrite
        self._keep = keep
        #: Set by `restore()` or the first `overwrite` save that goes back in the job's history:
        #: this rank's older epochs' saves after it are superseded.
        self._rewind_to: int | None = None
        #: The newest step this rank saved in this job before this process (None: none).
        self._newest_saved: int | None = None
        self._closed = False
        self._saves = Saves(job=self.job, rank=self.rank, epoch=self.epoch, newest=self._newest)
        self.stats: SaveStats = self._saves.stats
        self._last_step: int | None = None
        self._pool = SlotPool(
            self.settings.staging_root, self.job, self.rank, self.settings.staging_slots
        )
        self._snapshot = Snapshot(self._pool, node=self.node)
        try:
            self._bus = BusPortal(self.settings, f"tierpipe-{self.job}-{self.node}-{self.rank}")
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
        # Rank 0 makes sure the stream and the job-state bucket exist; the other ranks start
        # without a JetStream API request (tens of thousands would overflow the server's queue).
        if self.rank == 0:
            await bus.ensure_stream(self.job, update=False)
        else:
            bus.ensure_stream_on_first_miss()
        await bus.subscribe(shard_subject(self.job, "*", self.node, self.rank), self._saves.on_msg)
        await reclaim_slots(bus, self._pool, job=self.job, node=self.node, rank=self.rank)
        self._jobstore = JobStore(bus.js, self.settings)
        if self.rank == 0:  # the job's coordinators learn of it, with its retention policy
            await self._jobstore.open()
            await self._jobstore.register(self.job, self._keep)
        else:
            self._jobstore.bind()
        self._newest_saved = await newest_staged_step(bus, job=self.job, rank=self.rank)

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
            return self._saves.skipped(step, sorted(self._pool.busy().values()))
        # `_last_step` moves only once the save is staged: a save that fails before (staging
        # full, a publish that failed) may be retried with the same step.
        copy = self._snapshot.prepare(slot, plan)
        handle = self._saves.start(step)
        if blocking:
            try:
                event = self._snapshot.copy(copy, started=t0, rewind_to=rewind_to)
            except BaseException as e:
                self._saves.failed(handle, e)
                raise
            self._publish(handle, event, raise_errors=True)
            return handle
        try:
            self._snapshot.copy_soon(
                copy, started=t0, rewind_to=rewind_to, then=partial(self._copied, handle)
            )
        except BaseException as e:
            self._saves.failed(handle, e)
            raise
        return handle

    def _copied(self, handle: SaveHandle, result: ShardStaged | BaseException) -> None:
        """The end of an overlapped copy (on the copier thread)."""
        if isinstance(result, BaseException):
            self._saves.failed(handle, result)
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
            self._saves.failed(handle, e)
            if raise_errors:
                raise
            return
        self._last_step = handle.step
        self._rewind_to = event.rewind_to
        self._saves.staged(handle, event)

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
            ResourceExhaustedError: a rank ran out of memory, mappings, file descriptors or
                threads while loading (no copy is marked bad: free some and restore again).
        """
        self._snapshot.wait()
        collective = None
        if self.settings.restore_use_torch_distributed:
            collective = Collective.from_torch(self.rank, self.world_size)
        restorer = Restorer(
            self._bus.bus, self.settings, self._jobstore, self._loader, restart=restart,
            into=into, collective=collective, local_rank=self.local_rank,
            local_world_size=self.local_world_size,
        )  # fmt: skip
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
        """The newest step complete on some tier (every rank verified), from the job state."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps complete on NVMe or in object storage and still kept, ascending (the job
        state in KV: one read, whatever the history)."""

        async def read() -> list[int]:
            head = await current_head(
                self._bus.bus,
                self._jobstore,
                self.settings,
                job=self.job,
                holder=f"{self.node}-rank-{self.rank}",
                deadline=time.monotonic() + self.settings.lease_ttl_s + 5,
                own=own_events(self.job, self.node, self.rank),
                ranks=[self.rank],
            )
            return [] if head is None else sorted(set(head.nvme_steps) | set(head.s3_steps))

        return self._bus.run(read, timeout=self.settings.request_timeout_s + 30)

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

    def _newest(self, kind: str) -> Event | None:
        """This rank's newest event of `kind` on this node, from the stream."""
        subject = shard_subject(self.job, kind, self.node, self.rank)
        return self._bus.run(self._bus.bus.last_event, subject, timeout=5)

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Block until every save so far is verified on NVMe (or failed)."""
        self._snapshot.wait()
        pending = self._saves.pending()
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


def _local_group(
    rank: int, world_size: int, local_rank: int | None, local_world_size: int | None
) -> tuple[int, int]:
    """(local rank, local world size): as given, else from torchrun's environment where both
    are set and fit the world, else a node of its own (0, 1).

    Raises:
        ConfigError: the given values do not fit the world.
    """
    if local_rank is None and local_world_size is None:
        env_rank, env_size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        if env_rank is None or env_size is None:
            return 0, 1
        local_rank, local_world_size = int(env_rank), int(env_size)
        if not _fits(rank, world_size, local_rank, local_world_size):
            log.warning("local_group_ignored", rank=rank, world_size=world_size,
                        local_rank=local_rank, local_world_size=local_world_size)  # fmt: skip
            return 0, 1
        return local_rank, local_world_size
    local_rank = 0 if local_rank is None else local_rank
    local_world_size = 1 if local_world_size is None else local_world_size
    if not _fits(rank, world_size, local_rank, local_world_size):
        raise ConfigError(
            f"local rank {local_rank} of {local_world_size} does not fit rank {rank} of "
            f"world size {world_size}"
        )
    return local_rank, local_world_size


def _fits(rank: int, world_size: int, local_rank: int, local_world_size: int) -> bool:
    first = rank - local_rank
    return 0 <= local_rank < local_world_size and 0 <= first <= world_size - local_world_size
