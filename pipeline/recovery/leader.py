"""The restore protocol's leader: rank 0 counting reports, choosing, publishing plans.

Rank 0 counts the ranks every node's `ready` covers (`await_reports`: only the newest message
on each report subject counts, as when the stream is read at one moment), picks the newest step
every rank has a copy of (`plan`: the restore planner, `tierpipe.recovery.plan.choose`: each
rank its own NVMe, else a peer's replica, else object storage), publishes the plan, loads its
own shard, and counts the `loaded`/`failed` answers of that round; when all loaded it publishes
the plan again as `final`, and when one had no good copy left it picks an older step (a new
round). `lead` runs those rounds on the stream.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.bus.history import Stored, Watch
from tierpipe.control.bitmap import ranks_of
from tierpipe.errors import ConfigError, NoCheckpointError, RestoreTimeoutError
from tierpipe.names import plan_subject
from tierpipe.recovery._short import resource_failure
from tierpipe.recovery.follower import Load
from tierpipe.recovery.load import Loaded
from tierpipe.recovery.plan import Choice, Source, choose
from tierpipe.schemas import RankSteps, RecoveryPlanned, RestoreReport, decode_event
from tierpipe.settings import Settings
from tierpipe.waits import Reminder, missing_ranks

__all__ = (
    "Leader",
    "abandon",
    "await_reports",
    "by_rank",
    "last_final_plan",
    "lead",
    "plan",
    "stop_if_short",
)

log = structlog.get_logger(__name__)


class Leader(Protocol):
    """What rank 0's part needs of its restore (`tierpipe.recovery.agree.Restorer`)."""

    bus: Bus
    job: str
    rank: int
    restart: str
    world_size: int
    settings: Settings

    @property
    def deadline(self) -> float: ...
    async def load_planned(self, plan: RecoveryPlanned, round_: int) -> Load: ...
    def plan_event(
        self, round_: int, plan: Choice | None, *, final: bool, error: str = ""
    ) -> RecoveryPlanned: ...
    def still_waiting(
        self, reminder: Reminder, waiting_for: str, missing: Iterable[int] = ()
    ) -> None: ...


def plan(
    job: str,
    reports: Mapping[int, RankSteps],
    world_size: int,
    step: int | None,
    excluded: Mapping[int, str],
    round_: int,
) -> Choice:
    """Rank 0's pick from every rank's steps (as the `ready` reports say them: its own NVMe,
    a peer's replica, object storage), logged."""
    peer = {r: rep.peer_steps for r, rep in reports.items() if rep.peer_steps}
    choice = choose(job, reports, world_size, step=step, exclude=excluded, peer=peer)
    log.info(
        "recovery_planned",
        job=job,
        step=choice.step,
        round=round_,
        from_s3=len(ranks_of(choice.from_s3)),
        from_peer=len(ranks_of(choice.from_peer)),
        rejected={str(k): v for k, v in choice.rejected.items()},
    )
    return choice


async def last_final_plan(bus: Bus, job: str) -> int:
    """Stream seq of the last confirmed plan: reports before it belong to an older restart."""
    found = await bus.last_raw(plan_subject(job))
    if found is None:
        return 0
    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
        planned = decode_event(found[1])
        if isinstance(planned, RecoveryPlanned) and planned.final:
            return found[0]
    return 0


async def lead(
    r: Leader, watch: Watch, step: int | None, window: int
) -> tuple[RecoveryPlanned, tuple[Source, Loaded], int]:
    """Rank 0's rounds on the stream (see the module docstring): the final plan, this rank's
    shard of it, and the rounds it took. `window`: reports up to this stream seq belong to an
    older restart."""
    newest: dict[str, Stored] = {}  # the newest message on each report subject
    found = await await_reports(r, watch, newest, window, round_=0)
    reports = by_rank(found.values())
    excluded: dict[int, str] = {}
    for round_ in itertools.count(1):
        try:
            choice = plan(r.job, reports, r.world_size, step, excluded, round_)
        except (NoCheckpointError, ConfigError) as e:  # tell the other ranks, then give up
            await r.bus.publish(
                r.plan_event(round_, None, final=True, error=f"{type(e).__name__}: {e}")
            )
            raise
        planned = r.plan_event(round_, choice, final=False)
        published = await r.bus.publish(planned)
        mine, _ = await r.load_planned(planned, round_)
        answers = await await_reports(
            r, watch, newest, published.seq, round_=round_, step=choice.step
        )
        failed = [a for a in answers.values() if a.phase == "failed"]
        await stop_if_short(r, failed, round_)
        if not failed and mine is not None:
            final = msgspec.structs.replace(planned, final=True)
            await r.bus.publish(final)
            return final, mine, round_
        # An explicit `step` stays the only candidate: the next plan then says why it failed.
        excluded[choice.step] = abandon(choice.step, failed)
    raise AssertionError("unreachable")


async def stop_if_short(r: Leader, failed: list[RestoreReport], round_: int) -> None:
    """Stop the restore on every rank if a rank ran out of a resource (no copy is to blame
    and an older step would need the same): rank 0 says so in a final plan."""
    if (short := resource_failure(failed)) is None:
        return
    if r.rank == 0:
        error = f"{type(short).__name__}: {short.where}: {short.resource}"
        await r.bus.publish(r.plan_event(round_, None, final=True, error=error))
    raise short


def abandon(step: int, failed: list[RestoreReport]) -> str:
    """Why every rank moves on from `step` (the failed ranks' own words), logged."""
    log.warning("recovery_step_abandoned", step=step, failed_ranks=sorted(f.rank for f in failed))
    return "; ".join(f"rank {f.rank}: {f.error}" for f in sorted(failed, key=lambda f: f.rank))


async def await_reports(
    r: Leader,
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
            and e.restart == r.restart
            and e.world_size == r.world_size
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
            for k in _covered(old):
                ranks[k] -= 1
                if not ranks[k]:
                    del ranks[k]
        if counts(s):
            found[s.subject] = s
            ranks.update(_covered(s))

    for s in list(newest.values()):
        note(s)
    reminder = Reminder(r.settings.wait_warning_s)
    while len(ranks) < r.world_size:
        waiting = f"{len(ranks)} of {r.world_size} ranks reported"
        note(await _next(r, watch, waiting, reminder, lambda: list(ranks)))
    by_subject: dict[str, RestoreReport] = {}
    for subject, s in found.items():
        assert isinstance(s.event, RestoreReport)
        by_subject[subject] = s.event
    return by_subject


async def _next(
    r: Leader, watch: Watch, waiting_for: str, reminder: Reminder, reported: Callable[[], list[int]]
) -> Stored:
    """The watch's next message (one already there even past the deadline); warns every
    `reminder` naming the ranks not `reported` yet.

    Raises:
        RestoreTimeoutError: none came before the restore's deadline.
    """
    while True:
        stored = await watch.next(min(r.deadline, reminder.next_at) - time.monotonic())
        if stored is not None:
            return stored
        if time.monotonic() > r.deadline:
            raise RestoreTimeoutError(r.job, r.restart, r.settings.restore_timeout_s, waiting_for)
        if reminder.due():
            r.still_waiting(reminder, waiting_for, missing_ranks(reported(), r.world_size))


def _covered(s: Stored) -> list[int]:
    """The ranks a stored report speaks for."""
    assert isinstance(s.event, RestoreReport)
    return [c.rank for c in s.event.covers] if s.event.covers else [s.event.rank]


def by_rank(reports: Iterable[RestoreReport]) -> dict[int, RankSteps]:
    """Every rank's steps from `ready` reports (in order: a later report wins)."""
    out: dict[int, RankSteps] = {}
    for rep in reports:
        for steps in rep.covers or [
            RankSteps(
                rank=rep.rank,
                local_steps=rep.local_steps,
                s3_steps=rep.s3_steps,
                error=rep.error,
                peer_steps=rep.peer_steps,
            )
        ]:
            out[steps.rank] = steps
    return out
