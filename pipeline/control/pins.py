"""What an in-progress restore keeps: the steps retention may not remove while it lasts.

The retention coordinator (`tierpipe.control.coordinator`) and each node's evict stage note the
job's restore reports and plans (`RestorePins`) and hold the floors, or the planned step, for as
long as the restore can still read it.
"""

from __future__ import annotations

import time

from tierpipe.schemas import Event, RecoveryPlanned, RestoreReport

__all__ = ("RestorePins",)

#: Rank 0's reports that hold retention still until its plan.
_HOLDING = ("hold", "ready")


class RestorePins:
    """Per job, what its in-progress restore needs kept: from rank 0's `hold` (or `ready`) until its
    first plan, everything (retention holds still while rank 0 plans from a snapshot of the
    job); then the step the newest plan reads, until the restore ends (rank 0's final plan, or
    its error). Either times out `timeout_s` after it began."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._plans: dict[str, RecoveryPlanned] = {}
        #: job -> when rank 0 of its newest restart said `ready`.
        self._ready: dict[str, float] = {}

    def note(self, event: Event) -> None:
        """Take a plan or rank 0's `ready` into account (anything else, or an older plan,
        changes nothing)."""
        if isinstance(event, RestoreReport) and event.rank == 0 and event.phase in _HOLDING:
            self._ready[event.job] = max(event.ts, self._ready.get(event.job, 0.0))
        if not isinstance(event, RecoveryPlanned):
            return
        known = self._plans.get(event.job)
        if known is None or event.ts >= known.ts:
            self._plans[event.job] = event

    def held(self, job: str, *, now: float | None = None) -> bool:
        """Rank 0 of a restart is planning: no copy of `job` may go now."""
        ready = self._ready.get(job)
        plan = self._plans.get(job)
        now = time.time() if now is None else now
        return (
            ready is not None
            and (plan is None or plan.ts < ready)
            and now <= ready + self._timeout_s
        )

    def steps(self, job: str, *, now: float | None = None) -> set[int]:
        """Steps of `job` no copy of which may go now (see `held` too)."""
        plan = self._plans.get(job)
        if plan is None or plan.final or plan.error:
            return set()
        if (time.time() if now is None else now) > plan.ts + self._timeout_s:
            return set()  # the restore timed out
        return {plan.step}
