"""Ranks agreeing on a restore: every rank reports, rank 0 plans, all load, all confirm.

No rank replays the job's history. Each reads the job's state in KV once it has folded the
rank's own newest event (`_current`: the coordinator's work; with none alive, the rank folds the
short suffix itself), checks its own copies of a few candidate steps (`survey`), and publishes
`ready` with the steps it can read from NVMe and from object storage: a record of a few
integers. Rank 0 waits for all of them, picks the newest step every rank has (`choose`), and
publishes a compact plan on `tp.<job>.plan`: the step and a bitmap of the ranks that read it
from object storage. Every rank loads its shard from its first good source (`Loader`) and
reports `loaded` or `failed`. When all loaded, rank 0 publishes the plan again as `final`; when
one had no good copy left, rank 0 picks an older step (a new round) and all ranks load again.
Ranks wait on watches of the stream opened before they publish, each wait under the restore's
deadline. With a `collective` (torch.distributed), the reports are gathered and the plans
broadcast through it instead, and still published on the stream for operators.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import structlog

from tierpipe.bus import Bus
from tierpipe.errors import (
    ConfigError,
    NoCheckpointError,
    RestoreTimeoutError,
    WorldSizeMismatchError,
)
from tierpipe.history import Stored, Watch
from tierpipe.jobstate import has_rank, ranks_of
from tierpipe.kvstate import JobStore
from tierpipe.names import plan_subject, shard_subject
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Loaded, Loader
from tierpipe.recovery.plan import Choice, Source, choose
from tierpipe.recovery.survey import Survey, current_head, own_events, survey
from tierpipe.schemas import (
    RecoveryPlanned,
    RestoreReport,
    decode_event,
)
from tierpipe.settings import Settings
from tierpipe.storage.s3 import S3Store

__all__ = ("Restored", "Restorer")

log = structlog.get_logger(__name__)

#: The restart id when neither torchelastic nor the caller names one: ranks then match up by
#: stream order (a report counts only if published after this rank's `ready`).
_ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Restored:
    """What `Checkpointer.restore()` returns."""

    step: int
    state: Any
    #: Where this rank's shard came from.
    source: Source
    #: The ranks rank 0 sent to object storage (the others read their own node's NVMe).
    from_s3: list[int]
    seconds: float
    #: Plans it took (more than 1: a copy was bad and every rank moved to an older step).
    rounds: int
    #: How the ranks agreed: "nats" (reports and plans on the stream) or "torch.distributed".
    agreement: str = "nats"


class Restorer:
    """Runs one rank's part of a restart on the bus thread's event loop (see the module
    docstring), as `loader`'s rank (job, rank, world size, node); `into` are the targets the
    shard is loaded into, as for `load_into`.

    `restart` is an id every rank of this restart shares; default from torchelastic
    (`TORCHELASTIC_RUN_ID`-`TORCHELASTIC_RESTART_COUNT`), else ranks match up by stream order.
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
    ) -> None:
        self.bus, self.settings, self.store = bus, settings, store
        self.job, self.rank, self.node = loader.job, loader.rank, loader.node
        self.world_size = loader.world_size
        self.restart = restart or _restart_from_env()
        self._loader, self._into = loader, into
        self._collective = collective
        self._deadline = 0.0
        self._survey = Survey([])

    async def run(self, *, step: int | None = None) -> Restored:
        """Agree with the other ranks on a step and load this rank's shard of it.

        Raises:
            NoCheckpointError: nothing restorable (on every rank, with rank 0's reasons).
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
            self._survey = await survey(
                self.store,
                await current_head(
                    self.bus, self.store, self.settings, job=self.job,
                    holder=f"{self.node}-rank-{self.rank}",
                    deadline=self._deadline - min(30.0, self.settings.restore_timeout_s / 4),
                    own=None if self.rank == 0 else own_events(self.job, self.node, self.rank),
                ),
                job=self.job, rank=self.rank,
                world_size=self.world_size, node=self.node, step=step,
                locate_nvme=self._loader.nvme.locate,
                locate_object=S3Store(self.settings).locate,
            )  # fmt: skip
            for bad_step, error in self._survey.bad.items():
                log.warning("restore_source_failed", job=self.job, rank=self.rank, step=bad_step,
                            tier="nvme", error=str(error), corrupt=True)  # fmt: skip
                await self._loader.report("nvme", bad_step, error)
            if self._collective is not None:
                restored = await self._run_collective(self._collective, step, t0)
            elif self.rank == 0:
                async with self.bus.watch(shard_subject(self.job, "restore", "*", "*")) as reports:
                    window = await self._last_final_plan()
                    await self._ready()
                    restored = await self._lead(reports, step, window, t0)
            else:
                async with self.bus.watch(plan_subject(self.job), each_subject=False) as plans:
                    since, _ = await self._ready()
                    restored = await self._follow(plans, since, t0)
            return restored
        finally:
            self._loader.settle(None if restored is None else restored.step)

    async def _ready(self) -> tuple[int, RestoreReport]:
        """Publish this rank's `ready`: the candidate steps it can read, per tier."""
        found = self._survey
        why = "; ".join(f"step {s}: {w}" for s, w in list(found.missing.items())[:2])
        return await self._report(
            "ready", local_steps=sorted(found.local, reverse=True),
            s3_steps=sorted(found.remote, reverse=True), error=why[:300],
        )  # fmt: skip

    def _plan(
        self,
        reports: list[RestoreReport],
        step: int | None,
        excluded: dict[int, str],
        round_: int,
    ) -> Choice:
        """Rank 0's pick from every rank's `ready` report."""
        choice = choose(
            self.job, {r.rank: r for r in reports}, self.world_size, step=step, exclude=excluded
        )
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
        _, ready = await self._ready()
        reports = await collective.gather(ready)
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
        reports = list((await self._await_reports(watch, newest, window, round_=0)).values())
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
            answers = await self._await_reports(watch, newest, published.seq, round_=round_)
            failed = [r for r in answers.values() if r.phase == "failed"]
            if not failed and mine is not None:
                await self.bus.publish(msgspec.structs.replace(planned, final=True))
                return self._restored(planned, mine, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[plan.step] = self._abandon(plan.step, failed)
        raise AssertionError("unreachable")

    def _abandon(self, step: int, failed: list[RestoreReport]) -> str:
        """Why every rank moves on from `step` (the failed ranks' own words), logged."""
        log.warning(
            "recovery_step_abandoned", step=step, failed_ranks=sorted(r.rank for r in failed)
        )
        return "; ".join(f"rank {r.rank}: {r.error}" for r in sorted(failed, key=lambda r: r.rank))

    async def _follow(self, watch: Watch, since: int, t0: float) -> Restored:
        round_, mine = 0, None
        while True:
            seq, plan = await self._await_plan(watch, since, round_)
            if plan.error:
                _raise_plan_error(plan)
            if plan.final and plan.round == round_:
                assert mine is not None
                return self._restored(plan, mine, round_, t0)
            round_ = plan.round
            mine, _ = await self._load_planned(plan, round_)
            since = max(since, seq)

    async def _load_planned(
        self, plan: RecoveryPlanned, round_: int
    ) -> tuple[tuple[Source, Loaded] | None, RestoreReport]:
        """This rank's shard from its first good source (None if none), and its report."""
        step = plan.step
        sources = self._survey.sources(step, nvme=not has_rank(plan.from_s3, self.rank))
        found = await self._loader.first_good(
            sources, self._into, step=step, attempt=round_, deadline=self._deadline
        )
        if isinstance(found, str):
            _, report = await self._report("failed", round_=round_, step=step, error=found)
            return None, report
        _, report = await self._report("loaded", round_=round_, step=step, tier=found[0].tier)
        return found, report

    async def _report(
        self,
        phase: Literal["hold", "ready", "loaded", "failed"],
        *,
        round_: int = 0,
        **fields: Any,
    ) -> tuple[int, RestoreReport]:
        report = RestoreReport(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            rank=self.rank,
            world_size=self.world_size,
            phase=phase,
            round=round_,
            **fields,
        )
        return (await self.bus.publish(report)).seq, report

    async def _await_reports(
        self, watch: Watch, newest: dict[str, Stored], since: int, *, round_: int
    ) -> dict[int, RestoreReport]:
        """Every rank's newest report of this restart for `round_` (any phase for round 0),
        published after stream seq `since`. As when the stream is read at one moment, only the
        newest message on each report subject counts: `newest` holds them, kept current from
        `watch` (counted as they come, not re-read: a restart of many ranks stays linear)."""

        def counts(s: Stored) -> bool:
            e = s.event
            return (
                isinstance(e, RestoreReport)
                and e.restart == self.restart
                and e.world_size == self.world_size
                and e.phase != "hold"
                and (round_ == 0 or e.round == round_)
                and s.seq > since
            )

        found: dict[str, Stored] = {}  # report subject -> its newest message, if that counts
        ranks: Counter[int] = Counter()  # rank -> its subjects in `found`

        def note(s: Stored) -> None:
            newest[s.subject] = s
            old = found.pop(s.subject, None)
            if old is not None:
                ranks[_rank(old)] -= 1
                if not ranks[_rank(old)]:
                    del ranks[_rank(old)]
            if counts(s):
                found[s.subject] = s
                ranks[_rank(s)] += 1

        for s in list(newest.values()):
            note(s)
        while len(ranks) < self.world_size:
            note(await self._next(watch, f"{len(ranks)} of {self.world_size} ranks reported"))
        by_rank: dict[int, RestoreReport] = {}
        for s in sorted(found.values(), key=lambda s: s.seq):  # a rank's newest report wins
            assert isinstance(s.event, RestoreReport)
            by_rank[s.event.rank] = s.event
        return by_rank

    async def _await_plan(
        self, watch: Watch, since: int, round_: int
    ) -> tuple[int, RecoveryPlanned]:
        """The next plan of this restart published after `since` that moves past `round_`."""
        while True:
            s = await self._next(watch, "no plan from rank 0")
            plan = s.event
            if (
                s.seq > since
                and isinstance(plan, RecoveryPlanned)
                and plan.restart == self.restart
                and (plan.round > round_ or (plan.final and plan.round == round_) or plan.error)
            ):
                return s.seq, plan

    async def _next(self, watch: Watch, waiting_for: str) -> Stored:
        """The watch's next message (one already there even past the deadline).

        Raises:
            RestoreTimeoutError: none came before the restore's deadline.
        """
        while True:
            stored = await watch.next(self._deadline - time.monotonic())
            if stored is not None:
                return stored
            if time.monotonic() > self._deadline:
                raise RestoreTimeoutError(
                    self.job, self.restart, self.settings.restore_timeout_s, waiting_for
                )

    def _planned(
        self, round_: int, plan: Choice | None, *, final: bool, error: str = ""
    ) -> RecoveryPlanned:
        """The event for `plan`; without one, the final word that rank 0 gave up (`error`)."""
        return RecoveryPlanned(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            round=round_,
            step=plan.step if plan else 0,
            world_size=self.world_size,
            from_s3=plan.from_s3 if plan else b"",
            rejected=plan.rejected if plan else {},
            final=final,
            error=error,
        )

    def _restored(
        self, plan: RecoveryPlanned, mine: tuple[Source, Loaded], rounds: int, t0: float
    ) -> Restored:
        (source, loaded), seconds = mine, time.perf_counter() - t0
        agreement = "nats" if self._collective is None else "torch.distributed"
        return Restored(
            plan.step, loaded.state, source, ranks_of(plan.from_s3), seconds, rounds, agreement
        )


def _restart_from_env() -> str:
    run, count = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"{run}-{count}" if run and count is not None else _ANONYMOUS


def _rank(s: Stored) -> int:
    assert isinstance(s.event, RestoreReport)
    return s.event.rank


def _raise_plan_error(plan: RecoveryPlanned) -> None:
    """Raise on another rank the error rank 0 met while planning."""
    kind, _, message = (plan.error or "").partition(": ")
    error = WorldSizeMismatchError if kind == "WorldSizeMismatchError" else NoCheckpointError
    raise error(f"rank 0: {message}")
