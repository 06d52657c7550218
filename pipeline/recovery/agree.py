"""Ranks agreeing on a restore: each node reports, rank 0 plans, all load, all confirm.

No rank replays the job's history, and no rank polls a subject per rank. The ranks of a node
share the survey: the node's local leader (torchrun's `LOCAL_RANK` 0; without it every rank is
its own group) reads the job's state in KV once it has folded the node's newest events
(`current_head`: the coordinator's work; with none alive, the leader folds the short suffix
itself), checks each of the node's ranks' copies of a few candidate steps (`survey`: each record
and digest chunk read once), and publishes one `ready` for them: per rank the steps it can read
from NVMe and from object storage (at most `READY_RANKS` ranks a report). Rank 0 counts the
ranks covered, picks the newest step every rank has (`choose`), and publishes a compact plan on
`tp.<job>.plan`: the step and a bitmap of the ranks that read it from object storage. The other
ranks take plans from a core NATS subscription opened before anything they publish (no consumer
per rank), and catch up on one published before it (or lost in a reconnect) with a direct get
of the newest plan when none came for `restore_plan_poll_s`. Ranks that did not survey read only the
plan step's record and digest chunk. Every rank loads its shard from its first good source
(`Loader`) and reports `loaded` or `failed`. When all loaded, rank 0 publishes the plan again as
`final`; when one had no good copy left, rank 0 picks an older step (a new round) and all ranks
load again. Every wait is under the restore's deadline. With a `collective`
(torch.distributed), every rank surveys its own copies, the reports are gathered and the plans
broadcast through it instead, and still published on the stream for operators.

Which plan counts: one that arrives on the subscription (published after this rank started
listening) of this restart; a stored one (the catch-up), on a leader, only if published after
its `ready`; on another rank, if the restart is named (torchelastic), or, in an anonymous
restart, if it is not final (a stale plan of an older, unfinished restart is replaced by the
current one, which always arrives later; rank 0 counts only reports of its own plan's step).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import structlog
from nats.aio.msg import Msg

from tierpipe.bus.client import Bus
from tierpipe.bus.history import Stored, Watch
from tierpipe.control.bitmap import has_rank, ranks_of
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    BusUnavailableError,
    ConfigError,
    NoCheckpointError,
    ResourceExhaustedError,
    RestoreTimeoutError,
    WorldSizeMismatchError,
)
from tierpipe.names import plan_subject, shard_subject
from tierpipe.recovery._short import resource_failure
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loaded, Loader
from tierpipe.recovery.plan import Choice, Source, choose
from tierpipe.recovery.survey import (
    Reads,
    Survey,
    current_head,
    own_events,
    sources,
    survey,
)
from tierpipe.schemas import (
    READY_RANKS,
    RankSteps,
    RecoveryPlanned,
    RestoreReport,
    decode_event,
    deflated_bitmap,
)
from tierpipe.settings import Settings
from tierpipe.storage.s3.store import S3Store
from tierpipe.waits import Reminder, missing_ranks

__all__ = ("Restored", "Restorer")

log = structlog.get_logger(__name__)

#: The restart id when neither torchelastic nor the caller names one: ranks then match up by
#: stream order (a report counts only if published after this rank's `ready`).
_ANONYMOUS = "anonymous"


#: The catch-up reads of a rank waiting for a plan back off to this many `restore_plan_poll_s`.
_POLL_BACKOFF = 8


@dataclass(frozen=True, slots=True)
class Restored:
    """What `Checkpointer.restore()` returns."""

    step: int
    state: Any
    #: Where this rank's shard came from.
    source: Source
    #: The plan's bitmap of the ranks rank 0 sent to object storage (`from_s3` lists them).
    s3_bitmap: bytes
    seconds: float
    #: Plans it took (more than 1: a copy was bad and every rank moved to an older step).
    rounds: int
    #: How the ranks agreed: "nats" (reports and plans on the stream) or "torch.distributed".
    agreement: str = "nats"

    @property
    def from_s3(self) -> list[int]:
        """The ranks rank 0 sent to object storage (the others read their own node's NVMe):
        listed on demand, as a rank of a large job seldom needs every other rank's source."""
        return ranks_of(self.s3_bitmap)


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
        self._deadline = 0.0
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
        self._deadline = time.monotonic() + self.settings.restore_timeout_s
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
                    window = await self._last_final_plan()
                    await self._ready()
                    restored = await self._lead(reports, step, window, t0)
            else:
                async with _Plans(self.bus, plan_subject(self.job)) as plans:
                    since = 0
                    if self.group:  # (the plan answers the `ready`: listen before it)
                        await self._survey(step)
                        since = await self._ready()
                    restored = await self._follow(plans, since, t0)
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
            deadline=self._deadline - min(30.0, self.settings.restore_timeout_s / 4), own=own,
            ranks=self.group,
        )  # fmt: skip
        if head is not None:
            self._reads.add(head)
        steps = ([] if step is None else [step]) if head is None else head.candidates(step)
        self._surveys = await survey(
            self._reads, steps, ranks=self.group, world_size=self.world_size, node=self.node,
            locate_nvme=self._loader.nvme.locate,
        )  # fmt: skip
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

    def _plan(
        self,
        reports: dict[int, RankSteps],
        step: int | None,
        excluded: dict[int, str],
        round_: int,
    ) -> Choice:
        """Rank 0's pick from every rank's steps (as the `ready` reports say them)."""
        choice = choose(self.job, reports, self.world_size, step=step, exclude=excluded)
        log.info(
            "recovery_planned",
            job=self.job,
            step=choice.step,
            round=round_,
            from_s3=len(ranks_of(choice.from_s3)),
            rejected={str(k): v for k, v in choice.rejected.items()},
        )
        return choice

    async def _run_collective(
        self, collective: Collective, step: int | None, t0: float
    ) -> Restored:
        """The same protocol through torch.distributed collectives: every rank takes part in
        each gather and broadcast, so all ranks see the same reports and decide alike. Reports
        and plans are still published on the stream, for operators."""
        (found,) = self._surveys.values()
        _, ready = await self._report("ready", covers=[_steps(self.rank, found)])
        reports = _by_rank(await collective.gather(ready))
        excluded: dict[int, str] = {}
        for round_ in itertools.count(1):
            planned, error = None, None
            if self.rank == 0:
                try:
                    plan = self._plan(reports, step, excluded, round_)
                    planned = self._planned(round_, plan, final=False)
                except (NoCheckpointError, ConfigError) as e:
                    planned, error = (
                        self._planned(round_, None, final=True, error=f"{type(e).__name__}: {e}"),
                        e,
                    )
                await self.bus.publish(planned)
            planned = await collective.share(planned)
            if error is not None:
                raise error
            if planned.error:
                _raise_plan_error(planned)
            mine, report = await self._load_planned(planned, round_)
            failed = [r for r in await collective.gather(report) if r.phase == "failed"]
            await self._stop_if_short(failed, round_)
            if not failed and mine is not None:
                if self.rank == 0:
                    await self.bus.publish(msgspec.structs.replace(planned, final=True))
                return self._restored(planned, mine, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[planned.step] = self._abandon(planned.step, failed)
        raise AssertionError("unreachable")

    async def _last_final_plan(self) -> int:
        """Stream seq of the last confirmed plan: reports before it belong to an older restart."""
        found = await self.bus.last_raw(plan_subject(self.job))
        if found is None:
            return 0
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            plan = decode_event(found[1])
            if isinstance(plan, RecoveryPlanned) and plan.final:
                return found[0]
        return 0

    async def _lead(self, watch: Watch, step: int | None, window: int, t0: float) -> Restored:
        newest: dict[str, Stored] = {}  # the newest message on each report subject
        found = await self._await_reports(watch, newest, window, round_=0)
        reports = _by_rank(found.values())
        excluded: dict[int, str] = {}
        for round_ in itertools.count(1):
            try:
                plan = self._plan(reports, step, excluded, round_)
            except (NoCheckpointError, ConfigError) as e:  # tell the other ranks, then give up
                await self.bus.publish(
                    self._planned(round_, None, final=True, error=f"{type(e).__name__}: {e}")
                )
                raise
            planned = self._planned(round_, plan, final=False)
            published = await self.bus.publish(planned)
            mine, _ = await self._load_planned(planned, round_)
            answers = await self._await_reports(
                watch, newest, published.seq, round_=round_, step=plan.step
            )
            failed = [r for r in answers.values() if r.phase == "failed"]
            await self._stop_if_short(failed, round_)
            if not failed and mine is not None:
                await self.bus.publish(msgspec.structs.replace(planned, final=True))
                return self._restored(planned, mine, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[plan.step] = self._abandon(plan.step, failed)
        raise AssertionError("unreachable")

    async def _stop_if_short(self, failed: list[RestoreReport], round_: int) -> None:
        """Stop the restore on every rank if a rank ran out of a resource (no copy is to blame
        and an older step would need the same): rank 0 says so in a final plan."""
        if (short := resource_failure(failed)) is None:
            return
        if self.rank == 0:
            error = f"{type(short).__name__}: {short.where}: {short.resource}"
            await self.bus.publish(self._planned(round_, None, final=True, error=error))
        raise short

    def _abandon(self, step: int, failed: list[RestoreReport]) -> str:
        """Why every rank moves on from `step` (the failed ranks' own words), logged."""
        log.warning(
            "recovery_step_abandoned", step=step, failed_ranks=sorted(r.rank for r in failed)
        )
        return "; ".join(f"rank {r.rank}: {r.error}" for r in sorted(failed, key=lambda r: r.rank))

    async def _follow(self, plans: _Plans, since: int, t0: float) -> Restored:
        """Take rank 0's plans (see the module docstring for which count), load each new one,
        and return at the final plan of the one loaded."""
        held: RecoveryPlanned | None = None  # the plan this rank loaded
        mine = None
        jitter = random.random()  # noqa: S311 (spreading reads, not secrets)
        first = self._plan_poll_s * (1.0 if self.group else 1.0 + jitter)
        poll_at, every = time.monotonic() + first, self._plan_poll_s
        reminder = Reminder(self.settings.wait_warning_s)
        while True:
            live = await plans.next(
                min(poll_at, self._deadline, reminder.next_at) - time.monotonic()
            )
            got: tuple[RecoveryPlanned, int | None] | None = None
            if live is not None:
                got = (live, None)
            elif reminder.due():
                self._still_waiting(reminder, "rank 0's plan" if held is None else "rank 0's word")
            elif time.monotonic() >= self._deadline:
                raise RestoreTimeoutError(
                    self.job, self.restart, self.settings.restore_timeout_s, "no plan from rank 0"
                )
            elif time.monotonic() >= poll_at:
                # (backing off: a long restore of many ranks is not also a stream of reads)
                every = min(every * 2, self._plan_poll_s * _POLL_BACKOFF)
                poll_at = time.monotonic() + every
                stored = await plans.newest()
                if stored is not None:
                    got = (stored[1], stored[0])
            if got is None or not self._counts(*got, since=since, held=held):
                continue
            plan = got[0]
            if plan.error:
                _raise_plan_error(plan)
            key = (plan.round, plan.step)
            if plan.final:
                if held is not None and mine is not None and key == (held.round, held.step):
                    return self._restored(plan, mine, plan.round, t0)
                continue  # (an older restart's, or one this rank did not load: not its answer)
            if held is not None and key == (held.round, held.step):
                continue  # (the same plan again: live and stored)
            held = plan
            mine, _ = await self._load_planned(plan, plan.round)

    def _counts(
        self, plan: RecoveryPlanned, seq: int | None, *, since: int, held: RecoveryPlanned | None
    ) -> bool:
        """Whether `plan` (stream seq `seq`; None: it came on the subscription) is one of this
        restart's this rank must act on."""
        if plan.restart != self.restart or plan.world_size != self.world_size:
            return False
        if seq is None:
            return True
        if self.group:
            return seq > since
        if held is not None:
            return plan.round >= held.round
        return self.restart != _ANONYMOUS or not plan.final

    async def _load_planned(
        self, plan: RecoveryPlanned, round_: int
    ) -> tuple[tuple[Source, Loaded] | None, RestoreReport]:
        """This rank's shard from its first good source (None if none), and its report."""
        step = plan.step
        from_s3 = has_rank(plan.s3_bitmap(), self.rank)
        found = self._surveys.get(self.rank)
        if found is None or step not in found.candidates:
            # Sent to object storage, a rank its leader surveyed has nothing to check first:
            # the leader found its object confirmed (no record read; the loader checks the
            # object against the recorded digest).
            found = Survey([step], remote={step}) if from_s3 else await self._survey_step(step)
        srcs = await sources(
            self._reads, found, rank=self.rank, world_size=self.world_size, step=step,
            nvme=not from_s3,
            locate_object=S3Store(self.settings).locate,
        )  # fmt: skip
        got = await self._loader.first_good(
            srcs, self._into, step=step, attempt=round_, deadline=self._deadline
        )
        if isinstance(got, str):
            if not srcs:
                got = found.missing.get(step) or got
            _, report = await self._report("failed", round_=round_, step=step, error=got)
            return None, report
        _, report = await self._report("loaded", round_=round_, step=step, tier=got[0].tier)
        return got, report

    async def _survey_step(self, step: int) -> Survey:
        """This rank's own copies of the planned `step` (a rank its leader surveyed for): the
        step's record and digest chunk, and its disk."""
        found = await survey(
            self._reads, [step], ranks=[self.rank], world_size=self.world_size, node=self.node,
            locate_nvme=self._loader.nvme.locate,
        )  # fmt: skip
        await self._report_bad(found)
        return found[self.rank]

    async def _report(
        self,
        phase: Literal["hold", "ready", "loaded", "failed"],
        *,
        round_: int = 0,
        rank: int | None = None,
        **fields: Any,
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

    async def _await_reports(
        self,
        watch: Watch,
        newest: dict[str, Stored],
        since: int,
        *,
        round_: int,
        step: int | None = None,
    ) -> dict[str, RestoreReport]:
        """Every rank's newest report of this restart for `round_` (`ready` for round 0; else
        `loaded` or `failed` of `step`), published after stream seq `since`, by subject. As
        when the stream is read at one moment, only the newest message on each report subject
        counts: `newest` holds them, kept current from `watch` (counted as they come, not
        re-read: a restart of many ranks stays linear). A `ready` counts for every rank it
        covers."""

        def counts(s: Stored) -> bool:
            e = s.event
            return (
                isinstance(e, RestoreReport)
                and e.restart == self.restart
                and e.world_size == self.world_size
                and s.seq > since
                and (
                    e.phase == "ready"
                    if round_ == 0
                    else e.phase in ("loaded", "failed") and e.round == round_ and e.step == step
                )
            )

        found: dict[str, Stored] = {}  # report subject -> its newest message, if that counts
        ranks: Counter[int] = Counter()  # rank -> the reports in `found` that cover it

        def note(s: Stored) -> None:
            newest[s.subject] = s
            old = found.pop(s.subject, None)
            if old is not None:
                for r in _covered(old):
                    ranks[r] -= 1
                    if not ranks[r]:
                        del ranks[r]
            if counts(s):
                found[s.subject] = s
                ranks.update(_covered(s))

        for s in list(newest.values()):
            note(s)
        reminder = Reminder(self.settings.wait_warning_s)
        while len(ranks) < self.world_size:
            waiting = f"{len(ranks)} of {self.world_size} ranks reported"
            note(await self._next(watch, waiting, reminder, lambda: list(ranks)))
        by_subject: dict[str, RestoreReport] = {}
        for subject, s in found.items():
            assert isinstance(s.event, RestoreReport)
            by_subject[subject] = s.event
        return by_subject

    async def _next(
        self, watch: Watch, waiting_for: str, reminder: Reminder, reported: Callable[[], list[int]]
    ) -> Stored:
        """The watch's next message (one already there even past the deadline); warns every
        `reminder` naming the ranks not `reported` yet.

        Raises:
            RestoreTimeoutError: none came before the restore's deadline.
        """
        while True:
            stored = await watch.next(min(self._deadline, reminder.next_at) - time.monotonic())
            if stored is not None:
                return stored
            if time.monotonic() > self._deadline:
                raise RestoreTimeoutError(
                    self.job, self.restart, self.settings.restore_timeout_s, waiting_for
                )
            if reminder.due():
                self._still_waiting(
                    reminder, waiting_for, missing_ranks(reported(), self.world_size)
                )

    def _still_waiting(
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

    def _planned(
        self, round_: int, plan: Choice | None, *, final: bool, error: str = ""
    ) -> RecoveryPlanned:
        """The event for `plan`; without one, the final word that rank 0 gave up (`error`)."""
        from_s3, from_s3_z = deflated_bitmap(plan.from_s3 if plan else b"")
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
        )

    def _restored(
        self, plan: RecoveryPlanned, mine: tuple[Source, Loaded], rounds: int, t0: float
    ) -> Restored:
        (source, loaded), seconds = mine, time.perf_counter() - t0
        agreement = "nats" if self._collective is None else "torch.distributed"
        bits = plan.s3_bitmap()
        return Restored(plan.step, loaded.state, source, bits, seconds, rounds, agreement)


class _Plans:
    """Rank 0's plans for one rank: live from a core NATS subscription to the plan subject (no
    JetStream consumer per rank: a job's ranks would be tens of thousands), and the newest
    stored one on demand (`newest`, a direct get)."""

    def __init__(self, bus: Bus, subject: str) -> None:
        self._bus, self._subject = bus, subject
        self._queue: deque[RecoveryPlanned] = deque()
        self._arrived = asyncio.Event()
        self._sub: Any = None

    async def __aenter__(self) -> _Plans:
        self._sub = await self._bus.subscribe(self._subject, self._on_msg)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):  # a closed connection has no subscription left
            await self._sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        plan = _decode_plan(msg.data)
        if plan is not None:
            self._queue.append(plan)
            self._arrived.set()

    async def next(self, timeout: float) -> RecoveryPlanned | None:
        """The next plan that arrived (None: none within `timeout` seconds)."""
        if not self._queue and timeout > 0:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)
        return self._queue.popleft() if self._queue else None

    async def newest(self) -> tuple[int, RecoveryPlanned] | None:
        """(stream seq, plan) of the newest stored plan, or None (none, or no answer: the
        subscription may still bring it, and the next catch-up asks again)."""
        try:
            found = await self._bus.last_raw(self._subject)
        except BusUnavailableError as e:
            log.warning("restore_plan_catch_up_failed", subject=self._subject, error=str(e))
            return None
        plan = None if found is None else _decode_plan(found[1])
        return None if found is None or plan is None else (found[0], plan)


def _decode_plan(data: bytes) -> RecoveryPlanned | None:
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        event = decode_event(data)
        if isinstance(event, RecoveryPlanned):
            return event
    return None


def _steps(rank: int, found: Survey) -> RankSteps:
    """`rank`'s entry of its node's `ready`."""
    why = "; ".join(f"step {s}: {w}" for s, w in list(found.missing.items())[:2])
    return RankSteps(
        rank=rank,
        local_steps=sorted(found.local, reverse=True),
        s3_steps=sorted(found.remote, reverse=True),
        error=why[:300],
    )


def _covered(s: Stored) -> list[int]:
    """The ranks a stored report speaks for."""
    assert isinstance(s.event, RestoreReport)
    return [c.rank for c in s.event.covers] if s.event.covers else [s.event.rank]


def _by_rank(reports: Iterable[RestoreReport]) -> dict[int, RankSteps]:
    """Every rank's steps from `ready` reports (in order: a later report wins)."""
    out: dict[int, RankSteps] = {}
    for r in reports:
        for steps in r.covers or [
            RankSteps(rank=r.rank, local_steps=r.local_steps, s3_steps=r.s3_steps, error=r.error)
        ]:
            out[steps.rank] = steps
    return out


def _restart_from_env() -> str:
    run, count = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"{run}-{count}" if run and count is not None else _ANONYMOUS


def _raise_plan_error(plan: RecoveryPlanned) -> None:
    """Raise on another rank the error rank 0 met while planning."""
    kind, _, message = (plan.error or "").partition(": ")
    if kind == "ResourceExhaustedError":
        where, _, resource = message.partition(": ")
        raise ResourceExhaustedError(where, resource)
    error = WorldSizeMismatchError if kind == "WorldSizeMismatchError" else NoCheckpointError
    raise error(f"rank 0: {message}")
