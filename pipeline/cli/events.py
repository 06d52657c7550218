"""What `tierpipe events` shows of a job's stream: which messages its filters keep, each event as
one readable line (time, kind, step, rank, node, tier, size, duration, and what else it says) or
as one JSON object.

A node's batch (`NodeBatch`) is shown as the events it carries, and a fact its rank's own
subject carried too is shown once (`Seen`). Pure functions of the messages the caller read: no
I/O, nothing printed.
"""

from __future__ import annotations

import datetime
import json
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from tierpipe.bus.history import Raw
from tierpipe.names import job_subjects, msg_id, shard_subject
from tierpipe.schemas import (
    Event,
    NodeBatch,
    RecoveryPlanned,
    RestoreReport,
    ShardEvicted,
    ShardFlushed,
    ShardReplicated,
    ShardStaged,
    ShardVerified,
    ShardWritten,
    StageFailed,
    decode_event,
)

__all__ = ("EVENT_KINDS", "Filter", "Seen", "Shown", "event_json", "event_line", "shown")

#: What `tierpipe events --kind` takes: the kinds of `tierpipe.schemas.Event`.
EVENT_KINDS = (
    "staged", "written", "verified", "replicated", "flushed", "evicted", "failed", "batch",
    "restore", "plan",
)  # fmt: skip

#: Kinds published on `tp.<job>.<kind>.<node>.<rank>` alone (never inside a node's batch).
_RANK_ONLY = frozenset({"staged", "replicated", "failed", "restore"})


@dataclass(frozen=True, slots=True)
class Shown:
    """One event as `tierpipe events` shows it: the stored message it came in, and the event
    (None: a body no schema of this version reads)."""

    raw: Raw
    event: Event | None
    #: It came inside a node's batch (`raw` is the batch).
    in_batch: bool = False


@dataclass(frozen=True, slots=True)
class Filter:
    """The events `tierpipe events` keeps: each given field must match (None: any)."""

    kinds: frozenset[str] | None = None
    step: int | None = None
    rank: int | None = None
    node: str | None = None

    def subject(self, job: str) -> str:
        """The narrowest subject that holds every event kept: one kind's subjects when that
        kind is never batched, else the whole job's."""
        (kind,) = self.kinds if self.kinds is not None and len(self.kinds) == 1 else (None,)
        if kind not in _RANK_ONLY:
            return job_subjects(job)
        return shard_subject(job, kind, self.node or "*", "*" if self.rank is None else self.rank)

    def keeps(self, shown: Shown) -> bool:
        """Whether `shown` matches every field given (an unreadable body: only when none is)."""
        e = shown.event
        if e is None:
            return self == Filter()
        if self.kinds is not None and _kind(e) not in self.kinds:
            return False
        if self.node is not None and e.node != self.node:
            return False
        if self.step is not None and getattr(e, "step", None) != self.step:
            return False
        return self.rank is None or getattr(e, "rank", None) == self.rank


class Seen:
    """The facts shown lately, by message id: a fact both its rank's subject and its node's
    batch carried is shown once. Bounded (a `--follow` runs for days): only the newest
    `limit` ids are kept, far more than one save's events of a node."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def first(self, event: Event) -> bool:
        """Whether `event` is shown for the first time (and remember it)."""
        key = msg_id(event)
        if key in self._ids:
            return False
        self._ids[key] = None
        if len(self._ids) > self._limit:
            self._ids.popitem(last=False)
        return True


def shown(raw: Raw, *, batches: bool = False) -> list[Shown]:
    """The events a stored message carries: a batch's events one by one (with `batches`: the
    batch itself), else the event, or an unreadable body (event None)."""
    try:
        event = decode_event(raw.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return [Shown(raw, None)]
    if isinstance(event, NodeBatch) and not batches:
        return [Shown(raw, e, in_batch=True) for e in event.events]
    return [Shown(raw, event)]


def event_line(s: Shown) -> str:
    """`seq  time  kind  step  rank  node  tier  size  duration  detail`, `-` for what the
    event does not say; the time is when the stream stored it (UTC)."""
    stored = _time(s.raw.time, timespec="milliseconds")
    e = s.event
    if e is None:
        body = s.raw.data.decode(errors="replace")
        return f"{s.raw.seq:>8}  {stored}  {'?':<10} {s.raw.subject}: {body[:200]}"
    step, rank = getattr(e, "step", None), getattr(e, "rank", None)
    nbytes, seconds = getattr(e, "nbytes", None), getattr(e, "seconds", None)
    cells = (
        f"{s.raw.seq:>8}",
        stored,
        f"{_kind(e):<10}",
        f"step {'-' if step is None else step:<4}",
        f"rank {'-' if rank is None else rank:<4}",
        f"{e.node:<12}",
        f"{_tier(e) or '-':<4}",
        f"{'-' if nbytes is None else _size(nbytes):>9}",
        f"{'-' if seconds is None else f'{seconds:.2f} s':>8}",
    )
    detail = _detail(e) + (" (in its node's batch)" if s.in_batch else "")
    return "  ".join(cells) + (f"  {detail}" if detail else "")


def event_json(s: Shown) -> str:
    """One JSON object: seq, time (ISO, UTC), subject, and the event's body as stored (or
    `body` when it is not JSON); an event from a node's batch is its part of the batch's body,
    with `in_batch` true."""
    out: dict[str, object] = {
        "seq": s.raw.seq, "time": _time(s.raw.time), "subject": s.raw.subject,
    }  # fmt: skip
    if s.in_batch and s.event is not None:
        out["event"] = msgspec.to_builtins(s.event)
        out["in_batch"] = True
        return json.dumps(out)
    try:
        out["event"] = json.loads(s.raw.data)
    except ValueError:
        out["body"] = s.raw.data.decode(errors="replace")
    return json.dumps(out)


def _time(ts: float, *, timespec: str = "auto") -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec=timespec)


def _kind(event: Event) -> str:
    return str(type(event).__struct_config__.tag)


def _tier(e: Event) -> str | None:
    match e:
        case ShardStaged():
            return "ram"
        case ShardWritten() | ShardVerified():
            return "nvme"
        case ShardReplicated():
            return "peer"
        case ShardFlushed():
            return "s3"
        case ShardEvicted() | StageFailed() | RestoreReport():
            return e.tier
    return None


def _detail(e: Event) -> str:
    """What else the event says, briefly."""
    match e:
        case ShardStaged():
            how = "" if e.blocking else ", async"
            return f"slot {e.slot}, stalled {e.stall_s:.2f} s{how}" + _origin(e.origin)
        case ShardWritten():
            return f"{e.tensors} tensors" + _origin(e.origin)
        case ShardVerified():
            return ("rewritten" if e.rewritten else "") + _origin(e.origin)
        case ShardFlushed():
            return f"s3://{e.bucket}/{e.key}" + ("" if e.origin == "flush" else f" ({e.origin})")
        case ShardReplicated():
            return f"from {e.source}"
        case ShardEvicted():
            return f"{e.reason}: {e.location}"
        case StageFailed():
            how = "retryable" if e.retryable else "permanent"
            return f"{e.stage} {e.error}: {e.message} (attempt {e.attempt}, {how})"
        case RecoveryPlanned():
            said = "final" if e.final else f"round {e.round}"
            return f"restart {e.restart} {said}: world size {e.world_size}" + (
                f", error {e.error}" if e.error else ""
            )
        case RestoreReport():
            return f"restart {e.restart} {e.phase}" + (f": {e.error}" if e.error else "")
        case NodeBatch():
            return f"{len(e.events)} {e.batch} events"
    return ""


def _origin(origin: str) -> str:
    return "" if origin == "save" else f" ({origin})"


def _size(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{nbytes} B"
