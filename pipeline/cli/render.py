"""What `tierpipe status` and `ls` print, rendered from a job's state in KV and its
stream. What `tierpipe plan` prints is the plan's own (`tierpipe.recovery.kvplan.KvPlan`: the
restore planner's answer, said for operators).

Pure functions of the values the caller read (`JobView`, `RankDetail`): the CLI reads the KV, so
this module does no I/O and prints nothing. A job of any size prints one line per kept step by
default; per-rank detail is for one step at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from tierpipe.bus.consumer import Backlog
from tierpipe.control.bitmap import has_rank
from tierpipe.control.risk import Risk, RiskTier, TierLag
from tierpipe.schemas import StageFailed
from tierpipe.schemas.jobstate import (
    RANKS_PER_CHUNK,
    Floors,
    JobHead,
    Keep,
    Lease,
    RankDigests,
    StepRecord,
)

__all__ = (
    "JobRow",
    "JobView",
    "RankDetail",
    "backlog_json",
    "backlog_table",
    "jobs_table",
    "lag_note",
    "newest_confirmed",
    "newest_shown",
    "rank_details",
    "rank_json",
    "rank_table",
    "step_json",
    "step_table",
)

Complete = Literal["both", "nvme", "s3", "no"]


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's state as the CLI read it from KV."""

    job: str
    head: JobHead
    #: step -> its record, for the steps `head` lists (a missing one was removed meanwhile).
    records: Mapping[int, StepRecord]
    floors: Floors
    #: None: the job set no policy (the agents' settings apply).
    keep: Keep | None
    lease: Lease | None
    #: Stream sequence of the job's newest event (0: none or unknown).
    stream_seq: int = 0
    #: step -> why the job state does not back the head's claim of it (`tierpipe.control.confirm`).
    unconfirmed: Mapping[int, str] = field(default_factory=dict)
    #: What a restore would pick now (`KvPlan.summary`), or "none (why)".
    restore: str = ""
    #: The backlog of each stage consumer on its stream (`tierpipe.bus.consumer.backlogs`).
    backlog: Sequence[Backlog] = ()


def _count(bits: bytes, world_size: int) -> int:
    """Ranks below `world_size` in a bitmap (bit r % 8 of byte r // 8)."""
    return (int.from_bytes(bits, "little") & ((1 << world_size) - 1)).bit_count()


def _complete(rec: StepRecord) -> Complete:
    nvme = _count(rec.nvme, rec.world_size) == rec.world_size
    s3 = not rec.s3_removed and _count(rec.s3, rec.world_size) == rec.world_size
    return "both" if nvme and s3 else "nvme" if nvme else "s3" if s3 else "no"


def step_json(job: str, step: int, rec: StepRecord | None) -> dict[str, object]:
    """One step as a JSON-ready object (a line of `tierpipe status --json`); `world_size` and
    the counts are null for a step whose record went meanwhile."""
    if rec is None:
        return {"job": job, "step": step, "world_size": None, "epoch": None, "nvme_ranks": None,
                "s3_ranks": None, "s3_removed": None, "complete": "no"}  # fmt: skip
    return {
        "job": job,
        "step": step,
        "world_size": rec.world_size,
        "epoch": rec.epoch,
        "nvme_ranks": _count(rec.nvme, rec.world_size),
        "s3_ranks": _count(rec.s3, rec.world_size),
        "s3_removed": rec.s3_removed,
        "complete": _complete(rec),
    }


def step_table(view: JobView, *, now: float | None = None) -> str:
    """The job's header (newest complete steps, floors, policy, coordinator) and one line per
    step it keeps: world size, ranks on each tier, on which tier the step is complete; then
    its stages' backlog per node (`backlog_table`)."""
    rows = [("STEP", "WORLD", "NVME", "S3", "COMPLETE")]
    for step in view.head.steps:
        rec = view.records.get(step)
        if rec is None:
            rows.append((str(step), "-", "-", "-", "no (record removed meanwhile)"))
            continue
        w = rec.world_size
        s3 = "removed" if rec.s3_removed else f"{_count(rec.s3, w)}/{w}"
        rows.append((str(step), str(w), f"{_count(rec.nvme, w)}/{w}", s3, _complete(rec)))
    header = _header(view, time.time() if now is None else now)
    return "\n".join([*header, _table(rows), *backlog_table(view.backlog)])


def _header(view: JobView, now: float) -> list[str]:
    head, floors = view.head, view.floors

    lines = [
        f"job {view.job}: world size {head.world_size}, newest complete step: NVMe "
        f"{newest_shown(head.nvme_steps, view.unconfirmed)}, object storage "
        f"{newest_shown(head.s3_steps, view.unconfirmed)}",
        f"floors: NVMe {floors.nvme}, object storage {floors.s3}"
        + (f", kept below them: {', '.join(map(str, floors.keep))}" if floors.keep else ""),
        "keep: "
        + (
            "not set (the agents' settings apply)"
            if view.keep is None
            else f"{view.keep.nvme_keep_latest_k} on NVMe, {view.keep.s3_keep_latest_k} in object"
            f" storage, period {view.keep.s3_keep_period or 'off'}, evict unflushed: "
            f"{'yes' if view.keep.evict_unflushed else 'no'}"
        ),
        "coordinator: " + _lease(view.lease, now),
    ]
    if view.restore:
        lines.append(f"restore now: {view.restore}")
    lines += [f"step {step} unconfirmed: {why}" for step, why in sorted(view.unconfirmed.items())]
    note = lag_note(head.seq, view.stream_seq)
    return lines + ([note] if note else [])


def newest_confirmed(steps: Sequence[int], unconfirmed: Mapping[int, str]) -> int | None:
    """The newest of `steps` (a head's, ascending) that is not in `unconfirmed`."""
    return next((s for s in reversed(steps) if s not in unconfirmed), None)


def newest_shown(steps: Sequence[int], unconfirmed: Mapping[int, str]) -> str:
    """The newest confirmed of `steps`, and a newer one the head claims unconfirmed: `2 (999
    unconfirmed)`."""
    newest = newest_confirmed(steps, unconfirmed)
    shown = "none" if newest is None else str(newest)
    claimed = steps[-1] if steps else None
    return shown if claimed == newest else f"{shown} ({claimed} unconfirmed)"


def lag_note(folded_seq: int, stream_seq: int) -> str:
    """What to tell operators when the job state has not folded the job's newest event ("" if
    it has)."""
    if stream_seq <= folded_seq:
        return ""
    return (
        f"note: the job state has folded the job's events up to stream seq {folded_seq}, its "
        f"newest is seq {stream_seq} (no live coordinator folds them: an agent's evict stage "
        "does, and so does a restart)"
    )


def _lease(lease: Lease | None, now: float) -> str:
    if lease is None:
        return "none (no agent has led the job)"
    left = lease.expires - now
    when = f"expires in {left:.0f} s" if left >= 0 else f"expired {-left:.0f} s ago"
    return f"{lease.holder} (term {lease.term}), {when}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


# --- every job (`tierpipe ls`)


@dataclass(frozen=True, slots=True)
class JobRow:
    """One job as `tierpipe ls` read it."""

    job: str
    #: Its state in KV (None: none yet, or lost: `tierpipe reindex`).
    head: JobHead | None
    #: The stream seq of its newest event the coordinator folds (0: none).
    stream_seq: int
    lease: Lease | None
    #: Its newest `failed` event.
    failed: StageFailed | None
    #: step -> why the job state does not back the head's claim of it (`tierpipe.control.confirm`).
    unconfirmed: Mapping[int, str] = field(default_factory=dict)
    #: How far each tier trails the newest save, and the steps a node's loss would cost now
    #: (None: no state).
    risk: Risk | None = None
    #: The backlog of each stage consumer on its stream (`tierpipe.bus.consumer.backlogs`).
    backlog: Sequence[Backlog] = ()

    @property
    def lag(self) -> int:
        """Events the job state has not folded yet (by stream sequence)."""
        return max(0, self.stream_seq - (self.head.seq if self.head else 0))

    def as_json(self) -> dict[str, object]:
        head, f = self.head, self.failed
        return {
            "job": self.job,
            "world_size": head.world_size if head else None,
            "newest_nvme": newest_confirmed(head.nvme_steps, self.unconfirmed) if head else None,
            "newest_s3": newest_confirmed(head.s3_steps, self.unconfirmed) if head else None,
            "newest_peer": newest_confirmed(head.peer_steps, self.unconfirmed) if head else None,
            **(self.risk.as_json() if self.risk else {
                "newest_saved": None, "tiers": {}, "safe": -1, "steps_at_risk": 0,
            }),
            "steps": head.steps if head else [],
            "unconfirmed": {str(k): v for k, v in sorted(self.unconfirmed.items())},
            "lag": self.lag,
            "coordinator": self.lease.holder if self.lease else None,
            "last_error": None if f is None else {
                "ts": f.ts, "stage": f.stage, "node": f.node, "step": f.step, "rank": f.rank,
                "error": f.error, "message": f.message, "retryable": f.retryable,
            },
            "backlog": [backlog_json(b) for b in self.backlog],
        }  # fmt: skip


def jobs_table(rows: Sequence[JobRow], *, now: float | None = None) -> str:
    """A line per job: world size, newest saved step, newest complete step per tier (NVMe,
    peer replicas, object storage) with how far it trails the newest save (steps, seconds),
    the steps at risk if a node were lost now, kept steps, fold lag, the events its stages
    have not been delivered yet (all nodes: `tierpipe status` shows them per node), who
    coordinates it, its newest failure."""
    now = time.time() if now is None else now
    out = [("JOB", "WORLD", "SAVED", "NVME", "PEER", "S3", "AT RISK", "KEPT", "LAG", "BACKLOG",
            "COORDINATOR", "LAST ERROR")]  # fmt: skip
    for r in rows:
        h, risk = r.head, r.risk
        complete: dict[RiskTier, list[int]] = {
            "nvme": h.nvme_steps if h else [], "peer": h.peer_steps if h else [],
            "s3": h.s3_steps if h else [],
        }  # fmt: skip
        tiers = {
            tier: _tier_cell(steps, r.unconfirmed, risk.tier(tier) if risk else None)
            for tier, steps in complete.items()
        }

        error = "-"
        if r.failed is not None:
            f = r.failed
            where = f"step {f.step} rank {f.rank} " if f.step is not None else ""
            error = f"{_ago(now - f.ts)} ago {f.stage} {where}{f.error}: {f.message}"[:100]
        coordinator = "-" if r.lease is None else r.lease.holder
        if r.lease is not None and r.lease.expires < now:
            coordinator += " (expired)"
        out.append((
            r.job, str(h.world_size) if h else "-",
            "-" if risk is None or risk.saved is None else str(risk.saved),
            tiers["nvme"], tiers["peer"], tiers["s3"], "-" if risk is None else str(risk.at_risk),
            str(len(h.steps)) if h else "no state", str(r.lag),
            str(sum(b.pending for b in r.backlog)) if r.backlog else "-", coordinator, error,
        ))  # fmt: skip
    return _table(out) if rows else "no jobs"


#: Consumers `backlog_table` lists whatever their backlog; past that, those with one only.
BACKLOG_ROWS = 40


def backlog_json(b: Backlog) -> dict[str, object]:
    """One stage consumer's backlog as a JSON-ready object (in `tierpipe ls --json`)."""
    stage, _, node = b.durable.partition("_")
    return {"stage": stage, "node": node, "consumer": b.durable, "pending": b.pending,
            "ack_pending": b.ack_pending, "redelivered": b.redelivered}  # fmt: skip


def backlog_table(backlog: Sequence[Backlog]) -> list[str]:
    """A job's stages' backlog per node, what `nats consumer info` shows of each consumer: the
    events not yet delivered to it (pending), delivered and not yet acknowledged (unacked),
    and delivered more than once (redelivered). Past `BACKLOG_ROWS` consumers, only those
    with a backlog (no lines: the job has no stage consumer)."""
    if not backlog:
        return []
    busy = [b for b in backlog if b.pending or b.ack_pending or b.redelivered]
    shown = backlog if len(backlog) <= BACKLOG_ROWS else busy
    out = [("STAGE", "NODE", "PENDING", "UNACKED", "REDELIVERED")]
    for b in shown:
        stage, _, node = b.durable.partition("_")
        out.append((stage, node, str(b.pending), str(b.ack_pending), str(b.redelivered)))
    lines = ["backlog of each stage per node:", _table(out) if shown else "  none"]
    if len(shown) < len(backlog):
        lines.append(f"({len(backlog) - len(shown)} more consumers have no backlog: `tierpipe "
                     "ls --json` lists them all)")  # fmt: skip
    return lines


def _tier_cell(steps: Sequence[int], doubts: Mapping[int, str], lag: TierLag | None) -> str:
    """A tier's newest complete step and how far it trails the newest save: `13 (-46, 47s)`
    (steps, seconds), `-` for none; nothing more when it holds the newest save."""
    shown = newest_shown(steps, doubts).replace("none", "-")
    if lag is None or not lag.lag_steps:
        return shown
    seconds = "" if lag.lag_s is None else f", {_ago(lag.lag_s)}"
    return f"{shown} (-{lag.lag_steps}{seconds})"


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


# --- one step, rank by rank


@dataclass(frozen=True, slots=True)
class RankDetail:
    """One rank of one step, as the job state has it."""

    rank: int
    nvme: bool
    s3: bool
    #: Header digest and size of its verified copy (None: none recorded).
    header_digest: str | None
    nbytes: int | None
    #: Where its copy is on NVMe (on the node that saved it) and in object storage.
    nvme_path: str
    object_key: str


#: (job, step, rank, world size) -> where that shard is on a tier.
Locate = Callable[[str, int, int, int], str]


def rank_details(
    job: str,
    rec: StepRecord,
    chunks: Mapping[int, RankDigests],
    ranks: Iterable[int],
    *,
    locate_nvme: Locate,
    locate_object: Locate,
) -> list[RankDetail]:
    """`ranks` of `rec`'s step; `chunks`: the step's `RankDigests` by chunk index (a missing
    chunk: no digest for its ranks)."""
    out = []
    for r in ranks:
        chunk = chunks.get(r // RANKS_PER_CHUNK)
        found = None if chunk is None else chunk.of(r)
        w, s = rec.world_size, rec.step
        out.append(
            RankDetail(
                rank=r,
                nvme=has_rank(rec.nvme, r),
                s3=has_rank(rec.s3, r) and not rec.s3_removed,
                header_digest=found[0] if found else None,
                nbytes=found[1] if found else None,
                nvme_path=locate_nvme(job, s, r, w),
                object_key=locate_object(job, s, r, w),
            )
        )
    return out


def rank_table(job: str, rec: StepRecord, details: Sequence[RankDetail]) -> str:
    """One step's ranks: on which tier each has a good copy, its digest, size and locations."""
    w = rec.world_size
    lines = [
        f"job {job} step {rec.step}: world size {w}, epoch {rec.epoch}, NVMe "
        f"{_count(rec.nvme, w)}/{w}, object storage "
        + ("removed" if rec.s3_removed else f"{_count(rec.s3, w)}/{w}")
        + f", complete: {_complete(rec)}"
    ]
    rows = [("RANK", "NVME", "S3", "HEADER DIGEST", "BYTES", "NVME PATH", "OBJECT")]
    for d in details:
        rows.append((
            str(d.rank), "yes" if d.nvme else "no", "yes" if d.s3 else "no",
            d.header_digest or "-", "-" if d.nbytes is None else str(d.nbytes),
            d.nvme_path, d.object_key,
        ))  # fmt: skip
    return "\n".join([*lines, _table(rows)])


def rank_json(job: str, rec: StepRecord, d: RankDetail) -> dict[str, object]:
    """One rank of one step as a JSON-ready object (`tierpipe status --step N --json`)."""
    return {
        "job": job,
        "step": rec.step,
        "world_size": rec.world_size,
        "rank": d.rank,
        "nvme": d.nvme,
        "s3": d.s3,
        "header_digest": d.header_digest,
        "nbytes": d.nbytes,
        "nvme_path": d.nvme_path,
        "object_key": d.object_key,
    }
