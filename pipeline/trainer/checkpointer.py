"""`Checkpointer`: the API training code uses.

`save()` has the snapshot stage (`tierpipe.trainer.snapshot`) copy the state into a staging slot
in shared memory and publishes the `staged` event it returns; the node agent takes it from there,
and `Saves` (`tierpipe.trainer.handle`) hands this rank's progress events to the save's handle. The
trainer's only background activity is one small NATS client on its own event-loop thread
(`tierpipe.bus.portal`), and the copier thread of an overlapped save.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from functools import partial
from typing import Any

import msgspec
import structlog
import torch
from torch.utils.hooks import RemovableHandle

from tierpipe.bus.portal import BusPortal
from tierpipe.control.advert import HINT, NodeState, adopt, read_node
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import ConfigError, NoCheckpointError, TierpipeError, UnavailableError
from tierpipe.log import configure_logging
from tierpipe.names import flush_control_subject, node_name, shard_subject, validate_token
from tierpipe.recovery.agree import Restored, Restorer
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loader
from tierpipe.reshard.restore import Resharder, ValueRank, restore_or_reshard
from tierpipe.schemas import Event, FlushControl
from tierpipe.schemas.jobstate import Keep
from tierpipe.settings import Settings, load_settings
from tierpipe.trainer.handle import SaveHandle, Saves, SaveStats
from tierpipe.trainer.jobs import (
    as_step,
    complete_steps,
    known_job,
    local_group,
    open_job,
    unknown_job,
)
from tierpipe.trainer.outbox import Outbox
from tierpipe.trainer.saving import Saver

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
        local_rank: this rank's place among its node's ranks, which are `rank - local_rank` to
            `rank - local_rank + local_world_size - 1` (at restore, local rank 0 checks them all).
        local_world_size: its node's rank count. Default for both: `$LOCAL_RANK` and
            `$LOCAL_WORLD_SIZE` (torchrun) where both are set, else a node of its own (0, 1).
        replicated: top-level keys of the state equal on every rank (DDP's `("model", "optim")`):
            their tensors are stored once per job, by rank 0, and restored from its shard; a
            value declared so that differs restores as rank 0's (`tierpipe.storage.sharding`).

    Every Checkpointer starts a new epoch (a timeline). After `restore()` of step r, or once an
    `overwrite` save of step s happened, this rank's saves of later steps (after r; from s on)
    made by earlier epochs are superseded: a run that went back in its history branches it,
    and the abandoned branch is never restored again.

    Raises:
        InvalidNameError: job or node is not a safe name.
        BusUnavailableError: NATS cannot be reached (within `connect_timeout_s`): nothing is
            lost yet, and without NATS a restart could not tell whether to restore.
        ConfigError: the rank does not fit the world size.

    Opening creates nothing: the job's stream, its retention policy and its staging folder
    come with its first `save()` (`tierpipe.trainer.jobs`). The first save or restore also reads the
    node's record (`tierpipe.control.advert`): it warns at once when no agent serves the node, and
    takes the agent's staging and NVMe roots and object store for whichever of those the
    settings did not set.
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
        replicated: Collection[str] = (),
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
        self.local_rank, self.local_world_size = local_group(
            self.rank, self.world_size, local_rank, local_world_size
        )
        #: This process's timeline (see the class docstring).
        self.epoch = time.time_ns()
        self._overwrite, self._replicated = overwrite, frozenset(replicated)
        self._keep = keep
        self._closed = False
        self._saves = Saves(job=self.job, rank=self.rank, epoch=self.epoch, newest=self._newest)
        self.stats: SaveStats = self._saves.stats
        # Made when first needed, once the node's record is read (`_learn_node`).
        self._node: NodeState | None = None
        self._saver: Saver | None = None
        self._restore_loader: Loader | None = None
        self._opened = False  # the job is made (by its first save)
        self._agent_checked = float("-inf")
        self._bus = BusPortal(self.settings, f"tierpipe-{self.job}-{self.node}-{self.rank}")
        try:
            self._bus.run(self._start, timeout=self.settings.request_timeout_s + 5)
        except BaseException:
            self._bus.close()
            raise
        self._outbox = Outbox(self._bus, publish_timeout_s=self.settings.publish_timeout_s)

    async def _start(self) -> None:
        bus = self._bus.bus
        await bus.subscribe(shard_subject(self.job, "*", self.node, self.rank), self._saves.on_msg)
        self._jobstore = JobStore(bus.js, self.settings).bind()

    def _learn_node(self) -> NodeState:
        """This node's record (read until one is found); the first one found lends this
        process the agent's roots and store, unless its settings set them (`adopt`)."""
        if self._node is None or self._node.record is None:
            try:
                node = self._bus.run(read_node, self._bus.bus, self.settings, self.node, timeout=5)
            except TierpipeError as e:  # (a slow answer: nothing is known, nothing claimed)
                node = NodeState(self.node, None, unknown=str(e))
            if node.record is not None and self._saver is None:
                self.settings, _ = adopt(self.settings, node.record)
            self._node = node
        return self._node

    def _local(self) -> Saver:
        """This rank's saves and slots (its folder under the staging root), made once."""
        if self._saver is None:
            self._learn_node()
            self._saver = Saver(
                self.settings, self._bus, self._saves, self._outbox, job=self.job,
                rank=self.rank, world_size=self.world_size, node=self.node, epoch=self.epoch,
                overwrite=self._overwrite, replicated=self._replicated,
            )  # fmt: skip
        return self._saver

    def _open(self) -> Saver:
        """Make the job, on its first save (stream, policy, staging slots), and learn where
        this rank's saves left off."""
        saver = self._local()
        if not self._opened:

            async def make() -> None:
                await open_job(
                    self._bus.bus, self._jobstore, job=self.job, rank=self.rank, keep=self._keep
                )
                await saver.open()

            self._bus.run(make, timeout=self.settings.request_timeout_s + 5)
            self._opened = True
            self._warn_if_unserved(self._learn_node())
        else:
            self._check_agent()
        return saver

    def _warn_if_unserved(self, node: NodeState) -> None:
        why = node.absent()
        if why:
            log.warning("node_agent_missing", job=self.job, rank=self.rank, node=self.node,
                        why=why, hint=HINT)  # fmt: skip

    def _check_agent(self) -> None:
        """Have the bus thread read the node's record (at most every `wait_warning_s`) and warn
        if no agent serves the node; the save does not wait for it."""
        now = time.monotonic()
        if now - self._agent_checked >= self.settings.wait_warning_s:
            self._agent_checked = now

            async def check() -> None:
                self._warn_if_unserved(await read_node(self._bus.bus, self.settings, self.node))

            self._bus.portal.start_task_soon(check)

    # --- saving

    def reserve(self, state: Any) -> None:
        """Allocate every free staging slot for a state like `state`, before training starts.

        Optional: otherwise a slot is allocated by the first save that uses it, which then
        blocks for the allocation too (about a second per GiB).
        """
        self._local().reserve(state)

    def save(self, step: int, state: Any, *, blocking: bool = True) -> SaveHandle:
        """Snapshot `state` at `step`; block only for the copy into shared memory.

        A save that cannot be taken never stops training (`save_errors = "report"`, the
        default, as DCP's `async_save`): its handle and the log (`save_failed`) say why, its
        slot is free again, and the next save tries anew. While NATS is down, its `staged`
        event is tried again in the background for `save_retry_s`; a blocking save waits for
        the first try (`publish_timeout_s`), or none if earlier saves still wait for NATS.

        Args:
            step: the training step (an int, a numpy or 0-dim torch integer; not a bool); it
                must increase from save to save.
            state: nested dicts/lists/tuples of tensors and plain values, or objects with
                `state_dict()` (modules, optimizers, schedulers).
            blocking: False returns at once while the copy proceeds in the background; call
                `handle.wait_staged()` or `guard()` an optimizer before mutating the state.

        Returns:
            A handle; `handle.skipped` is True if policy `skip` found no free slot.

        Raises:
            ValueError: `step` is no integer, or does not follow the last saved step.
            SlotTimeoutError: policy `wait` and no slot freed up in time (it says why).
            UnsupportedStateError: the state holds a value that cannot be stored without pickle.
            BusUnavailableError: only with `save_errors = "raise"`: `staged` could not be
                published (the save is void).
            StaleStepError: the job already has this step or a newer one, and this process
                neither restored first nor passed `overwrite=True`.
            ConfigError: another process already stages this rank of this job on this node.
        """
        if self._closed:
            raise ConfigError("save() on a closed Checkpointer")
        step = as_step(step)
        if self._saver is not None:
            self._saver.snapshot.wait()
        try:
            saver = self._open()
        except UnavailableError as e:  # (NATS down at the first save: the next one tries again)
            if self.settings.save_errors == "raise":
                raise
            handle = self._saves.start(step)
            self._saves.failed(handle, e)
            return handle
        return saver.save(step, state, blocking=blocking)

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
        if self._saver is not None:
            self._saver.snapshot.barrier()

    # --- restoring

    def restore(
        self, into: Any = None, *, step: int | None = None, restart: str | None = None,
        value_rank: ValueRank = None,
    ) -> Restored:  # fmt: skip
        """Load the newest checkpoint every rank can reach (or exactly `step`); all ranks call it.

        Rank 0 plans from the event stream (each rank reads its own node's NVMe copy if that
        survived, else the object-storage copy) and publishes the plan on `tp.<job>.plan` (and
        broadcasts it with torch.distributed when that is initialised for this job); every
        digest is checked before bytes reach a tensor; a bad copy falls back to the next source,
        and if a rank has none left, all ranks move to an older step together. A shard read from
        object storage is staged again afterwards, so this node's NVMe gets its copy back. DTensor
        targets of another world size or mesh are resharded (`tierpipe.reshard.restore`).

        Args:
            into: objects to restore into in place, shaped like what was saved (e.g.
                `{"model": model, "optim": optimizer}`); tensors without a matching target come
                back as new CPU tensors in `Restored.state`.
            step: restore this step instead of the newest restorable one.
            restart: an id every rank of this restart shares; default from torchelastic
                (`TORCHELASTIC_RUN_ID`-`TORCHELASTIC_RESTART_COUNT`), else stream order.
            value_rank: when resharding, the saved rank whose values (all but DTensors) this
                rank takes, or a function of this rank (default: `rank % saved world size`).

        Raises:
            NoCheckpointError: nothing restorable (the message says why, step by step); at
                once for a job without any state (naming jobs of similar names).
            WorldSizeMismatchError: saved by another number of ranks, and no DTensor target nor
                `value_rank` says how to reshard it.
            LayoutMismatchError: a saved tensor does not fit its DTensor target.
            RestoreTimeoutError: the other ranks (or rank 0's plan) did not show up in time.
            ResourceExhaustedError: a rank ran out of memory, mappings, file descriptors or
                threads while loading (no copy is marked bad: free some and restore again).
        """
        step = None if step is None else as_step(step)
        if self._saver is not None:
            self._saver.snapshot.wait()
        self._warn_if_unserved(self._learn_node())
        bus, store = self._bus.bus, self._jobstore
        if not self._bus.run(known_job, bus, store, self.job, timeout=30):
            unknown = partial(unknown_job, store, self.settings, self.job, rank=self.rank)
            raise NoCheckpointError(self._bus.run(unknown, timeout=30))
        collective = None
        if self.settings.restore_use_torch_distributed:
            collective = Collective.from_torch(self.rank, self.world_size)
        restorer = Restorer(
            self._bus.bus, self.settings, self._jobstore, self._loader(), restart=restart,
            into=into, collective=collective, local_rank=self.local_rank,
            local_world_size=self.local_world_size,
        )  # fmt: skip
        resharder = partial(Resharder, bus, self.settings, store, self.job, self.rank,
                            self.world_size, self.node, collective)  # fmt: skip
        run = partial(restore_or_reshard, partial(restorer.run, step=step), resharder, into,
                      step=step, value_rank=value_rank, replicated=self._replicated)  # fmt: skip
        restored = self._bus.run(run, timeout=2 * self.settings.restore_timeout_s + 60)
        # Saves from here on branch the job's history at the restored step: this rank's older
        # epochs' saves of later steps are superseded (a normal restart has none that count).
        self._local().restored(restored.step)
        log.info("checkpoint_restored", job=self.job, rank=self.rank, step=restored.step,
                 tier=restored.source.tier, seconds=round(restored.seconds, 3),
                 rounds=restored.rounds)  # fmt: skip
        return restored

    def _loader(self) -> Loader:
        if self._restore_loader is None:
            pool = self._local().pool  # (a shard read from object storage is staged again)
            self._restore_loader = Loader(
                self.settings, self._bus.bus, pool, job=self.job, rank=self.rank,
                world_size=self.world_size, node=self.node,
            )  # fmt: skip
        return self._restore_loader

    def latest_step(self) -> int | None:
        """The newest step complete on some tier (every rank verified), from the job state;
        None for a job without state (a warning names jobs of similar names, if any)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps complete on NVMe or in object storage and still kept, ascending (the job
        state in KV: one read, whatever the history)."""
        self._learn_node()
        return self._bus.run(
            partial(
                complete_steps, self._bus.bus, self._jobstore, self.settings, job=self.job,
                node=self.node, rank=self.rank,
            ),
            timeout=self.settings.request_timeout_s + 30,
        )  # fmt: skip

    # --- object-storage uploads (the flush stage), e.g. around network-heavy phases

    def pause_flush(self, *, this_node_only: bool = False) -> None:
        """Hold uploads to object storage (every node's, or this node's) until `resume_flush()`."""
        self._control(FlushControl(action="pause", ts=time.time()), this_node_only)

    def resume_flush(self, *, this_node_only: bool = False) -> None:
        """Let uploads held by `pause_flush()` go again (every node's, or this node's)."""
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
        if self._saver is not None:
            self._saver.snapshot.wait()
        pending = self._saves.pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait("verified", left)
            except TierpipeError:
                pass

    def close(self) -> None:
        """Finish an overlapped copy and publish the `staged` events still on their way (for
        up to their `save_retry_s` while NATS is down: a process that exits right after a
        save loses nothing), then stop the bus client and unmap the slots (idempotent).

        Staged shards are not waited for: the node agent writes them out regardless.
        """
        if self._closed:
            return
        self._closed = True
        saver, loader = self._saver, self._restore_loader
        try:
            if saver is not None:
                saver.snapshot.wait()
            if not self._outbox.flush():
                log.warning("staged_publish_abandoned", job=self.job, rank=self.rank)
            if loader is not None:
                self._bus.run(loader.written_back, timeout=None)  # a restore's NVMe write-back
                self._bus.run(loader.aclose, timeout=30)
        finally:
            if saver is not None:
                saver.snapshot.close()  # (an overlapped copy hands off before the bus closes)
            self._bus.close()
            if saver is not None:
                saver.pool.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
