"""Which steps a job's head names that the rest of its job state backs.

The head (`<job>.head`) is what readers look at first, but it is one KV value: whoever may write
the bucket may write it (a forged head, or one a bug left behind). So a reader reports a step of
the head only once the step's own keys confirm it (`check_step`): its record exists and names the
step, is complete on a tier the head says it is complete on (or, for a step the head lists
without a claim, on some tier), and holds the rank digests of the ranks asked about (every rank
by default: those a restore checks each copy against). What does not confirm is shown as
unconfirmed, with why. A restore never needed this: it reads each copy it uses against those
digests; listings and plans (`tierpipe.recovery.kvplan.confirmed_plan`) now read what a
restore would.

What KV write permission can forge consistently (a record and digests as well), only a
restore's digest checks against the files and objects themselves catch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from tierpipe.control.bitmap import is_full
from tierpipe.control.kvstate import JobStore, digests_key
from tierpipe.schemas import Tier
from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, JobHead, RankDigests, StepRecord

__all__ = (
    "Confirmed",
    "check_step",
    "claims",
    "confirmed_list",
    "confirmed_steps",
)

log = structlog.get_logger(__name__)

_digests = msgspec.json.Decoder(RankDigests)
_TIER_NAMES = {"nvme": "NVMe", "s3": "object storage", "peer": "peers", "ram": "RAM"}


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The steps a head claims complete, sorted into those its job state backs and not."""

    #: Confirmed, ascending.
    steps: list[int] = field(default_factory=list)
    #: step -> why it is not confirmed.
    unconfirmed: dict[int, str] = field(default_factory=dict)


def claims(head: JobHead, step: int) -> tuple[Tier, ...]:
    """The tiers `head` says `step` is complete on (none: it only lists the step)."""
    tiers: list[Tier] = []
    if step in head.nvme_steps:
        tiers.append("nvme")
    if step in head.s3_steps:
        tiers.append("s3")
    if step in head.peer_steps:
        tiers.append("peer")
    return tuple(tiers)


async def check_step(
    store: JobStore,
    job: str,
    rec: StepRecord | None,
    step: int,
    *,
    tiers: Sequence[Tier] | None = (),
    ranks: Iterable[int] | None = None,
) -> str:
    """Why `step` of `job` is not confirmed ("" if it is): `rec` is its record as read (None:
    none); `tiers` those it is claimed complete on (empty: on some tier; None: not checked, the
    caller checks coverage itself); `ranks` those whose digests must be there (None: every
    rank). A read of each digest chunk needed.

    Raises:
        BusUnavailableError, BusError: the KV could not be read.
    """
    if rec is None:
        return "no record of the step in the job state"
    if rec.step != step:
        return f"its record is of step {rec.step}"
    world = rec.world_size
    if tiers is not None:
        complete = {
            "nvme": is_full(rec.nvme, world),
            "s3": is_full(rec.s3, world) and not rec.s3_removed,
            "peer": is_full(rec.peer, world),
        }
        if not any(complete[t] for t in tiers or complete):
            said = " or ".join(_TIER_NAMES[t] for t in tiers)
            return f"its record is not complete on {said or 'any tier'}"
    wanted = range(world) if ranks is None else sorted({r for r in ranks if 0 <= r < world})
    by_chunk: dict[int, list[int]] = {}
    for r in wanted:
        by_chunk.setdefault(r // RANKS_PER_CHUNK, []).append(r)
    for chunk, of in sorted(by_chunk.items()):
        value = await store.value(digests_key(job, step, chunk))
        try:
            found = None if value is None else _digests.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return f"the rank digests of ranks {of[0]}-{of[-1]} do not decode"
        if found is None or found.step != step or found.first != chunk * RANKS_PER_CHUNK:
            return f"no rank digests of ranks {of[0]}-{of[-1]}"
        lacking = [r for r in of if found.of(r) is None]
        if lacking:
            more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
            return f"no digest of rank {lacking[0]}{more}"
    return ""


async def confirmed_steps(
    store: JobStore, job: str, head: JobHead, *, ranks: Iterable[int] | None = None
) -> Confirmed:
    """The steps `head` (`job`'s, as read) says are complete on NVMe or in object storage, each
    checked against its record and the digests of `ranks` (None: every rank; see
    `check_step`): what `Checkpointer.all_steps()` reports. A record read per step, and a
    digest chunk per step and chunk of `ranks`.

    Raises:
        BusUnavailableError, BusError: the KV could not be read.
    """
    out = Confirmed()
    wanted = None if ranks is None else list(ranks)
    for step in sorted(set(head.nvme_steps) | set(head.s3_steps)):
        try:
            rec = await store.record(job, step)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            out.unconfirmed[step] = f"its record does not decode ({e})"
            continue
        why = await check_step(store, job, rec, step, tiers=claims(head, step), ranks=wanted)
        if why:
            out.unconfirmed[step] = why
        else:
            out.steps.append(step)
    return out


async def confirmed_list(
    store: JobStore, job: str, head: JobHead | None, *, rank: int | None = None
) -> list[int]:
    """The steps of `job` complete on some tier that the job state confirms, ascending (none
    without a head): `Checkpointer.all_steps()`, with `rank`'s digests checked (None: every
    rank's). See `confirmed_steps`; an unconfirmed step is logged."""
    if head is None:
        return []
    found = await confirmed_steps(store, job, head, ranks=None if rank is None else [rank])
    for step, why in found.unconfirmed.items():
        log.warning("step_unconfirmed", job=job, step=step, reason=why)
    return found.steps
