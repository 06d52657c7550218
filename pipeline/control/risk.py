"""A job's exposure: how far each tier trails the newest save, and what a node's loss would cost.

Per job, from its head and floors in KV and the newest event of a few subjects (no history is
folded): the newest saved step (the newest `verified` event; the newest step complete on NVMe
where that is newer), and per tier (NVMe, peer replicas, object storage) its newest complete
step and how far it trails the newest save, in steps and in seconds (the newest save's time
less that of the tier's newest copy: its newest `verified`, `replicated` or `flushed` event,
0 once the tier holds the newest saved step); and the steps at risk if a node were lost now:
the newest saved step less the newest step that survives any one node's loss (`Floors.safe`,
or the newest complete in object storage where that is newer; none: every step is at risk).

`tierpipe ls` and the agents' metrics show it (`read_risk`); the agent that coordinates a job
warns while it has more steps at risk than `risk_warn_steps` (`watch`: a warning at most once
a minute per job, an info when it clears).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import anyio
import structlog

from tierpipe.errors import TierpipeError
from tierpipe.names import local_jobs, shard_subject
from tierpipe.schemas import Event
from tierpipe.schemas.jobstate import Floors, JobHead

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus
    from tierpipe.control.kvstate import JobStore
    from tierpipe.settings import Settings

__all__ = (
    "RISK_CHECK_S", "TIER_KINDS", "WARN_EVERY_S", "Risk", "RiskTier", "TierLag", "coordinated",
    "read_risk", "risk_of", "watch",
)  # fmt: skip

log = structlog.get_logger(__name__)

#: How often an agent looks at its jobs' risk.
RISK_CHECK_S = 10.0
#: The most often a job's risk is warned about while it lasts.
WARN_EVERY_S = 60.0

RiskTier = Literal["nvme", "peer", "s3"]
#: Each tier, and the kind of event that says a copy reached it.
TIER_KINDS: tuple[tuple[RiskTier, str], ...] = (
    ("nvme", "verified"), ("peer", "replicated"), ("s3", "flushed"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TierLag:
    """One tier's newest complete step and how far it trails the newest save."""

    tier: RiskTier
    #: None: no step is complete there.
    newest: int | None
    #: Steps behind the newest save (None: nothing saved yet; with no step there, the newest
    #: saved step + 1: every step).
    lag_steps: int | None
    #: Seconds behind the newest save (None: not known: no save, or no copy there yet).
    lag_s: float | None

    def as_json(self) -> dict[str, object]:
        lag_s = None if self.lag_s is None else round(self.lag_s, 3)
        return {"newest": self.newest, "lag_steps": self.lag_steps, "lag_s": lag_s}


@dataclass(frozen=True, slots=True)
class Risk:
    """A job's exposure now."""

    job: str
    #: The newest step a rank saved (verified), None: none yet.
    saved: int | None
    tiers: tuple[TierLag, ...]
    #: The newest step that survives any one node's loss (-1: none).
    safe: int
    #: Steps lost if a node were lost now: `saved - safe` (every step, with none safe).
    at_risk: int

    def tier(self, name: RiskTier) -> TierLag:
        return next(t for t in self.tiers if t.tier == name)

    def as_json(self) -> dict[str, object]:
        return {
            "newest_saved": self.saved,
            "tiers": {t.tier: t.as_json() for t in self.tiers},
            "safe": self.safe,
            "steps_at_risk": self.at_risk,
        }


def risk_of(
    job: str, head: JobHead | None, floors: Floors | None, newest: dict[str, Event | None]
) -> Risk:
    """The job's exposure from its head, floors and the newest event of each kind of
    `TIER_KINDS` (`newest`: kind -> event, None: none). Pure."""
    complete: dict[RiskTier, list[int]] = {
        "nvme": head.nvme_steps if head else [],
        "peer": head.peer_steps if head else [],
        "s3": head.s3_steps if head else [],
    }
    verified = newest.get("verified")
    steps = [s for s in (_step(verified), *(c[-1] for c in complete.values() if c)) if s >= 0]
    saved = max(steps) if steps else None
    saved_ts = verified.ts if verified is not None and _step(verified) == saved else None
    tiers = []
    for tier, kind in TIER_KINDS:
        top = complete[tier][-1] if complete[tier] else None
        lag_steps = None if saved is None else saved - (-1 if top is None else top)
        event = newest.get(kind)
        if lag_steps == 0:
            lag_s: float | None = 0.0
        elif saved_ts is None or event is None:
            lag_s = None
        else:
            lag_s = max(0.0, saved_ts - event.ts)
        tiers.append(TierLag(tier, top, lag_steps, lag_s))
    safe = max(floors.safe if floors else -1, complete["s3"][-1] if complete["s3"] else -1)
    at_risk = 0 if saved is None else max(0, saved - safe)
    return Risk(job, saved, tuple(tiers), safe, at_risk)


def _step(event: Event | None) -> int:
    step = getattr(event, "step", None)
    return step if isinstance(step, int) else -1


async def read_risk(bus: Bus, store: JobStore, job: str, *, head: JobHead | None = None) -> Risk:
    """`risk_of` the job as KV and its stream have it now (`head`: already read)."""
    head = head or await store.head(job)
    newest = {
        kind: await bus.last_event(shard_subject(job, kind, "*", "*")) for _, kind in TIER_KINDS
    }
    return risk_of(job, head, await store.floors(job), newest)


async def coordinated(store: JobStore, job: str, node: str) -> bool:
    """Whether `node`'s agent holds the job's coordinator lease: the one agent of the job that
    reads its risk (the newest events are wildcard lookups the server answers by scanning the
    job's subjects: one reader a job, not one a node)."""
    lease = await store.lease(job)
    return lease is not None and lease.holder == node and lease.expires > time.time()


async def watch(
    settings: Settings,
    bus: Bus,
    store: JobStore,
    node: str,
    *,
    every_s: float = RISK_CHECK_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Until cancelled, every `every_s`: for each job of this node (a folder of it under the
    staging or NVMe root) that this agent coordinates (`coordinated`) with more steps at risk
    than `risk_warn_steps`, warn (`steps_at_risk`, at most once every `WARN_EVERY_S` while it
    lasts); say when it clears (`steps_at_risk_cleared`, also when this agent no longer
    coordinates it: the next one warns). A read that fails is tried again at the next look."""
    warned: dict[str, float] = {}
    while True:
        for job in sorted(local_jobs(settings.staging_root, settings.nvme_root) | set(warned)):
            try:
                risk = await read_risk(bus, store, job) if await coordinated(
                    store, job, node
                ) else None  # fmt: skip
            except TierpipeError as e:
                log.debug("risk_unread", job=job, error=str(e))
                continue
            if risk is None:
                if warned.pop(job, None) is not None:
                    log.info("steps_at_risk_cleared", job=job, reason="not coordinated here")
            elif risk.at_risk > settings.risk_warn_steps:
                if clock() - warned.get(job, -math.inf) >= WARN_EVERY_S:
                    warned[job] = clock()
                    log.warning("steps_at_risk", job=job, **_fields(risk),
                                risk_warn_steps=settings.risk_warn_steps)  # fmt: skip
            elif job in warned:
                del warned[job]
                log.info("steps_at_risk_cleared", job=job, **_fields(risk))
        await anyio.sleep(every_s)


def _fields(risk: Risk) -> dict[str, object]:
    """A risk as log fields."""
    out: dict[str, object] = {"steps_at_risk": risk.at_risk, "newest_saved": risk.saved,
                              "safe": risk.safe}  # fmt: skip
    for t in risk.tiers:
        out[f"newest_{t.tier}"] = t.newest
        out[f"{t.tier}_lag_steps"] = t.lag_steps
        out[f"{t.tier}_lag_s"] = None if t.lag_s is None else round(t.lag_s, 1)
    return out
