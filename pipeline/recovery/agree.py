"""The restore: one rank's part of a restart (`Restorer`), the frame of the ranks' agreement.

Each node reports, rank 0 plans (`tierpipe.recovery.leader`), the others take its plans
(`tierpipe.recovery.follower`), all load, all confirm. This module holds what every rank does:
the survey and its `ready`, loading a plan's shard, the reports, and the collective variant.

No rank replays the job's history, and no rank polls a subject per rank. The ranks of a node
share the survey: the node's local leader (torchrun's `LOCAL_RANK` 0; without it every rank is
its own group) reads the job's state in KV once it has folded the node's newest events
(`current_head`: the coordinator's work; with none alive, the leader folds the short suffix
itself), checks each of the node's ranks' copies of a few candidate steps (`survey`: each record
and digest chunk read once), and publishes one `ready` for them: per rank the steps it can read
from NVMe, from a peer's replica (the job state counts one) and from object storage (at most
`READY_RANKS` ranks a report). Rank 0 counts the ranks covered, picks the newest step every rank
has (`choose`), and publishes a compact plan on `tp.<job>.plan`: the step and bitmaps of the
ranks that read it from object storage and from a replica (a replaced node's ranks). The other
ranks take plans from a core NATS subscription opened before anything they publish (no consumer
per rank), and catch up on one published before it (or lost in a reconnect) with a direct get
of the newest plan when none came for `restore_plan_poll_s`. Ranks that did not survey read
only the plan step's record and digest chunk. Every rank loads its shard from its first good source
(`Loader`: a rank sent to a replica reads it from a holder its `replicated` event names, then
object storage) and reports `loaded` or `failed`. When all loaded, rank 0 publishes the plan
again as `final`; when one had no good copy left, rank 0 picks an older step (a new round) and
all ranks load again. Every wait is under the restore's deadline. With a `collective`
(torch.distributed), every rank surveys its own copies, the reports are gathered and the plans
broadcast through it instead, and still published on the stream for operators.

Which plan counts: one that arrives on the subscription (published after this rank started
listening) of this restart; a stored one (the catch-up), on a leader, only if published after
its `ready`; on another rank, if the restart is named (torchelastic), or, in an anonymous
restart, if it is not final (a stale plan of an older, unfinished restart is replaced by the
current one, which always arrives later; rank 0 counts only reports of its own plan's step).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.bitmap import has_rank, ranks_of
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    ConfigError,
    NoCheckpointError,
    ResourceExhaustedError,
    WorldSizeMismatchError,
)
from tierpipe.names import plan_subject, shard_subject
from tierpipe.recovery.branch import pass_over_branched
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.follower import ANONYMOUS, Plans, follow
from tierpipe.recovery.leader import abandon, by_rank, last_final_plan, lead, plan, stop_if_short
from tierpipe.recovery.load import Loaded, Loader
from tierpipe.recovery.plan import Choice, Source
from tierpipe.recovery.survey import (
    Reads,
    Survey,
    current_head,
    own_events,
    replica_sources,
    sources,
    survey,
)
from tierpipe.schemas import (
    READY_RANKS,
    RankSteps,
    RecoveryPlanned,
    RestoreReport,
    deflated_bitmap,
)
from tierpipe.settings import Settings
from tierpipe.storage.s3.store import S3Store
from tierpipe.waits import Reminder

__all__ = ("Restored", "Restorer")

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Restored:
    """What `Checkpointer.restore()` returns."""

    #: The step restored.
    step: int
    #: What was restored: the targets given, filled in place, and the values (and tensors with
    #: no target) as saved.
    state: Any
    #: Where this rank's shard came from.
    source: Source
    #: The plan's bitmap of the ranks rank 0 sent to object storage (`from_s3` lists them).
    s3_bitmap: bytes
    #: How long the restore took on this rank, planning and agreement included.
    seconds: float
    #: Plans it took (more than 1: a copy was bad and every rank moved to an older step).
    rounds: int
    #: How the ranks agreed: "nats" (reports and plans on the stream) or "torch.distributed".
    agreement: str = "nats"
    #: The plan's bitmap of the ranks rank 0 sent to a peer's replica (`from_peer` lists them).
    peer_bitmap: bytes = b""

    @property
    def from_s3(self) -> list[int]:
        """The ranks rank 0 sent to object storage (the others read their own node's NVMe or a
        replica): listed on demand, as a rank of a large job seldom needs every other rank's
        source."""
        return ranks_of(self.s3_bitmap)

    @property
    def from_peer(self) -> list[int]:
        """The ranks rank 0 sent to a peer's replica (a replaced node's ranks)."""
        return ranks_of(self.peer_bitmap)


class Restorer:
    """Runs one rank's part of a restart on the bus thread's event loop (see the module
    docstring), as `loader`'s rank (job, rank, world size, node); `into` are the targets the
    shard is loaded into, as for `load_into`.

    `restart` is an id every rank of this restart shares; default from torchelastic
    (`TORCHELASTIC_RUN_ID`-`TORCHELASTIC_RESTART_COUNT`), else ranks match up by stream order.
    `local_rank`, `local_world_size`: this rank's place among its node's ranks, which are
    `rank - local_rank` to `rank - local_rank + local_world_size - 1` (torchrun's `LOCAL_RANK`,
    `LOCAL_WORLD_SIZE`); the node's local rank 0 surveys for all of them. Default: a group of
    its own.

    Raises:
        ConfigError: the node's ranks would not lie within the world.
    """

    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        store: JobStore,
        loader: Loader,
        *,
        restart: str | None = None,
        into: Any = None,
        collective: Collective | None = None,
        local_rank: int = 0,
        local_world_size: int = 1,
    ) -> None:
        self.bus, self.settings, self.store = bus, settings, store
        self.job, self.rank, self.node = loader.job, loader.rank, loader.node
        self.world_size = loader.world_size
        self.restart = restart or _restart_from_env()
        self._loader, self._into = loader, into
        self._collective = collective
        first = self.rank - local_rank
        if collective is not None:  # (every rank takes part in the gather: each its own)
            first, local_rank, local_world_size = self.rank, 0, 1
        if not (
            0 <= local_rank < local_world_size and 0 <= first <= self.world_size - local_world_size
        ):
            raise ConfigError(
                f"local rank {local_rank} of {local_world_size} on a node does not fit rank "
                f"{self.rank} of world size {self.world_size}"
            )
        #: The node's ranks this rank surveys for (none unless it is the local leader).
        self.group = range(first, first + local_world_size) if local_rank == 0 else range(0)
        self._plan_poll_s = settings.restore_plan_poll_s
        #: When the restore gives up (`time.monotonic()`), set by `run`.
        self.deadline = 0.0
        self._reads = Reads(store, self.job)
        self._surveys: dict[int, Survey] = {}

    async def run(self, *, step: int | None = None) -> Restored:
        """Agree with the other ranks on a step and load this rank's shard of it.

        Raises:
            NoCheckpointError: nothing restorable (on every rank, with rank 0's reasons).
            ResourceExhaustedError: a rank ran out of memory, mappings, file descriptors or
                threads while loading (on every rank; no copy was marked bad).
            WorldSizeMismatchError: the checkpoint was saved by another number of ranks.
            RestoreTimeoutError: the other ranks (or rank 0's plan) did not show up in time.
        """
        t0 = time.perf_counter()
        self.deadline = time.monotonic() + self.settings.restore_timeout_s
        restored: Restored | None = None
        try:
            if self.rank == 0:
                # Retention holds still from rank 0's `hold` until its plan: say it before
                # reading the job state (which waits until the coordinator has folded it), so
                # no copy the survey finds goes before the plan pins its step.
                await self._report("hold")
            if self._collective is not None:
                await self._survey(step)
                restored = await self._run_collective(self._collective, step, t0)
            elif self.rank == 0:
                await self._survey(step)
                async with self.bus.watch(shard_subject(self.job, "restore", "*", "*")) as reports:
                    window = await last_final_plan(self.bus, self.job)
                    await self._ready()
                    final, mine, rounds = await lead(self, reports, step, window)
                    restored = self._restored(final, mine, rounds, t0)
            else:
                async with Plans(self.bus, plan_subject(self.job)) as plans:
                    since = 0
                    if self.group:  # (the plan answers the `ready`: listen before it)
                        await self._survey(step)
                        since = await self._ready()
                    final, mine = await follow(
                        self, plans, since, self._plan_poll_s, _raise_plan_error
                    )
                    restored = self._restored(final, mine, final.round, t0)
            return restored
        finally:
            self._loader.settle(None if restored is None else restored.step)

    async def _survey(self, step: int | None) -> None:
        """The local leader's survey of its node's ranks (the job's head, once it folded the
        node's newest events; then the candidates' records and the ranks' disks)."""
        own = None  # (rank 0: everything the coordinator folds)
        if self.rank != 0:
            own = own_events(self.job, self.node, self.rank if len(self.group) == 1 else "*")
        head = await current_head(
            self.bus, self.store, self.settings, job=self.job,
            holder=f"{self.node}-rank-{self.rank}",
            deadline=self.deadline - min(30.0, self.settings.restore_timeout_s / 4), own=own,
            ranks=self.group,
        )  # fmt: skip
        if head is not None:
            self._reads.add(head)
        steps = ([] if step is None else [step]) if head is None else head.candidates(step)
        self._surveys = await survey(
            self._reads, steps, ranks=self.group, world_size=self.world_size, node=self.node,
            locate_nvme=self._loader.nvme.locate,
        )  # fmt: skip
        await pass_over_branched(self.bus, self.job, self._reads, self._surveys)
        await self._report_bad(self._surveys)

    async def _report_bad(self, surveys: dict[int, Survey]) -> None:
        """Report every NVMe copy the survey proved bad (the job state stops counting it)."""
        for rank, found in surveys.items():
            for bad_step, error in found.bad.items():
                log.warning("restore_source_failed", job=self.job, rank=rank, step=bad_step,
                            tier="nvme", error=str(error), corrupt=True)  # fmt: skip
                await self._loader.report("nvme", bad_step, error, rank=rank)

    async def _ready(self) -> int:
        """Publish the node's `ready`: per rank of the group the candidate steps it can read,
        per tier (`READY_RANKS` ranks a report). Returns the stream seq of the last one."""
        covers = [_steps(rank, self._surveys[rank]) for rank in self.group]
        seq = 0
        for i in range(0, len(covers), READY_RANKS):
            part = covers[i : i + READY_RANKS]
            seq, _ = await self._report("ready", rank=part[0].rank, covers=part)
        return seq

    async def _run_collective(
        self, collective: Collective, step: int | None, t0: float
    ) -> Restored:
        """The same protocol through torch.distributed collectives: every rank takes part in
        each gather and broadcast, so all ranks see the same reports and decide alike. Reports
        and plans are still published on the stream, for operators."""
        (found,) = self._surveys.values()
        _, ready = await self._report("ready", covers=[_steps(self.rank, found)])
        reports = by_rank(await collective.gather(ready))
        excluded: dict[int, str] = {}
        for round_ in itertools.count(1):
            planned, error = None, None
            if self.rank == 0:
                try:
                    choice = plan(self.job, reports, self.world_size, step, excluded, round_)
                    planned = self.plan_event(round_, choice, final=False)
                except (NoCheckpointError, ConfigError) as e:
                    planned, error = (
                        self.plan_event(round_, None, final=True, error=f"{type(e).__name__}: {e}"),
                        e,
                    )
                await self.bus.publish(planned)
            planned = await collective.share(planned)
            if error is not None:
                raise error
            if planned.error:
                _raise_plan_error(planned)
            mine, report = await self.load_planned(planned, round_)
            failed = [r for r in await collective.gather(report) if r.phase == "failed"]
            await stop_if_short(self, failed, round_)
            if not failed and mine is not None:
                if self.rank == 0:
                    await self.bus.publish(msgspec.structs.replace(planned, final=True))
                return self._restored(planned, mine, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[planned.step] = abandon(planned.step, failed)
        raise AssertionError("unreachable")

    async def load_planned(
        self, plan: RecoveryPlanned, round_: int
    ) -> tuple[tuple[Source, Loaded] | None, RestoreReport]:
        """This rank's shard from its first good source (None if none), and its report: its
        NVMe copy unless the plan sends it elsewhere; sent to a peer, the replicas its holders
        announced, then its object; sent to object storage, its object."""
        step = plan.step
        from_s3 = has_rank(plan.s3_bitmap(), self.rank)
        from_peer = has_rank(plan.peer_bitmap(), self.rank)
        found = self._surveys.get(self.rank)
        if found is None or step not in found.candidates:
            # Sent to object storage, a rank its leader surveyed has nothing to check first:
            # the leader found its object confirmed (no record read; the loader checks the
            # object against the recorded digest).
            # Sent to a peer, it does not read (nor check) its own NVMe copy: its leader
            # proved it bad, or it is gone.
            found = (
                Survey([step], remote={step})
                if from_s3
                else await self._survey_step(step, disk=not from_peer)
            )
        srcs = await sources(
            self._reads, found, rank=self.rank, world_size=self.world_size, step=step,
            nvme=not (from_s3 or from_peer),
            locate_object=S3Store(self.settings).locate,
        )  # fmt: skip
        if from_peer:
            srcs[:0] = await replica_sources(
                self.bus, self._reads, step=step, rank=self.rank, world_size=self.world_size
            )
        got = await self._loader.first_good(
            srcs, self._into, step=step, attempt=round_, deadline=self.deadline
        )
        if isinstance(got, str):
            if not srcs and from_peer:
                got = "the job state counts a replica, but no holder of it announced one"
            elif not srcs:
                got = found.missing.get(step) or got
            _, report = await self._report("failed", round_=round_, step=step, error=got)
            return None, report
        _, report = await self._report("loaded", round_=round_, step=step, tier=got[0].tier)
        return got, report

    async def _survey_step(self, step: int, *, disk: bool = True) -> Survey:
        """This rank's own copies of the planned `step` (a rank its leader surveyed for): the
        step's record and digest chunk, and its disk (unless `disk` is False)."""
        found = await survey(
            self._reads, [step], ranks=[self.rank], world_size=self.world_size, node=self.node,
            locate_nvme=self._loader.nvme.locate if disk else None,
        )  # fmt: skip
        await self._report_bad(found)
        return found[self.rank]

    async def _report(
        self,
        phase: Literal["hold", "ready", "loaded", "failed"],
        *,
        round_: int = 0,
        rank: int | None = None,
        **fields: Any,  # RestoreReport fields, as its constructor checks them
    ) -> tuple[int, RestoreReport]:
        report = RestoreReport(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            rank=self.rank if rank is None else rank,
            world_size=self.world_size,
            phase=phase,
            round=round_,
            **fields,
        )
        return (await self.bus.publish(report)).seq, report

    def still_waiting(
        self, reminder: Reminder, waiting_for: str, missing: Iterable[int] = ()
    ) -> None:
        """Warn that this restore still waits (see `tierpipe.waits`)."""
        log.warning(
            "restore_wait_continued", job=self.job, rank=self.rank, restart=self.restart,
            waiting_for=waiting_for, missing_ranks=list(missing), waited_s=reminder.waited_s,
            timeout_s=self.settings.restore_timeout_s,
            hint="every rank of the job must call restore(): one that never does (not started, "
            "crashed, another job name or world size) holds the others until the timeout",
        )  # fmt: skip

    def plan_event(
        self, round_: int, plan: Choice | None, *, final: bool, error: str = ""
    ) -> RecoveryPlanned:
        """The event for `plan`; without one, the final word that rank 0 gave up (`error`)."""
        from_s3, from_s3_z = deflated_bitmap(plan.from_s3 if plan else b"")
        from_peer, from_peer_z = deflated_bitmap(plan.from_peer if plan else b"")
        return RecoveryPlanned(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            round=round_,
            step=plan.step if plan else 0,
            world_size=self.world_size,
            rejected=plan.rejected if plan else {},
            final=final,
            error=error,
            from_s3=from_s3,
            from_s3_z=from_s3_z,
            from_peer=from_peer,
            from_peer_z=from_peer_z,
        )

    def _restored(
        self, plan: RecoveryPlanned, mine: tuple[Source, Loaded], rounds: int, t0: float
    ) -> Restored:
        (source, loaded), seconds = mine, time.perf_counter() - t0
        agreement = "nats" if self._collective is None else "torch.distributed"
        bits, peer = plan.s3_bitmap(), plan.peer_bitmap()
        return Restored(plan.step, loaded.state, source, bits, seconds, rounds, agreement, peer)


def _steps(rank: int, found: Survey) -> RankSteps:
    """`rank`'s entry of its node's `ready`."""
    why = "; ".join(f"step {s}: {w}" for s, w in list(found.missing.items())[:2])
    return RankSteps(
        rank=rank,
        local_steps=sorted(found.local, reverse=True),
        s3_steps=sorted(found.remote, reverse=True),
        error=why[:300],
        peer_steps=sorted(found.peer, reverse=True),
    )


def _restart_from_env() -> str:
    run, count = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"{run}-{count}" if run and count is not None else ANONYMOUS


def _raise_plan_error(plan: RecoveryPlanned) -> None:
    """Raise on another rank the error rank 0 met while planning."""
    kind, _, message = (plan.error or "").partition(": ")
    if kind == "ResourceExhaustedError":
        where, _, resource = message.partition(": ")
        raise ResourceExhaustedError(where, resource)
    error = WorldSizeMismatchError if kind == "WorldSizeMismatchError" else NoCheckpointError
    raise error(f"rank 0: {message}")
