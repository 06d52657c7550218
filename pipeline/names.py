"""Validated names and everything derived from them: subjects, message ids, shard paths.

Job and node names become NATS subject tokens and path parts, so they are checked once, here,
against `[A-Za-z0-9_-]{1,64}`; every other name is built from checked parts.
"""

from __future__ import annotations

import os
import re
import socket
import typing
from pathlib import PurePosixPath
from urllib.parse import urlsplit, urlunsplit

import xxhash

from tierpipe import schemas as ev
from tierpipe.errors import InvalidNameError
from tierpipe.schemas import TOKEN_PATTERN, Event

__all__ = (
    "CONTROL_FLUSH",
    "SUBJECT_ROOT",
    "batch_subject",
    "consumer_name",
    "event_subject",
    "filter_subject",
    "flush_control_subject",
    "job_dirs",
    "job_subjects",
    "local_jobs",
    "msg_id",
    "node_name",
    "plan_subject",
    "redact_url",
    "shard_relpath",
    "shard_subject",
    "state_subjects",
    "stream_name",
    "subject_job",
    "validate_token",
)

SUBJECT_ROOT = "tp"
#: Run-time commands for the flush stage (`FlushControl`); `.<node>` addresses one node.
CONTROL_FLUSH = f"{SUBJECT_ROOT}.ctl.flush"
#: Job names that would collide with control subjects.
_RESERVED_JOBS = frozenset({"ctl"})
_TOKEN = re.compile(TOKEN_PATTERN)


def validate_token(what: str, value: object) -> str:
    """Return `value` if it is a safe job/node name.

    Raises:
        InvalidNameError: it is not a str matching `[A-Za-z0-9_-]{1,64}`.
    """
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise InvalidNameError(what, value)
    if what == "job" and value in _RESERVED_JOBS:
        raise InvalidNameError(what, value, reserved=True)
    return value


def job_dirs(root: str | os.PathLike[str]) -> set[str]:
    """The jobs with a directory under `root` (a staging or NVMe root: `<root>/<job>/...`);
    other entries, and a root not made yet, count for nothing."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return set()
    return {
        e.name
        for e in entries
        if _TOKEN.fullmatch(e.name) and e.name not in _RESERVED_JOBS and e.is_dir()
    }


def local_jobs(staging_root: str | os.PathLike[str], nvme_root: str | os.PathLike[str]) -> set[str]:
    """The jobs a node takes part in: a folder of theirs is under its staging root (a trainer
    there staged a save, or holds slots) or its NVMe root (the node holds copies). Local and
    cheap: thousands of agents never ask the server which jobs exist."""
    return job_dirs(staging_root) | job_dirs(nvme_root)


def stream_name(base: str, job: str) -> str:
    """The stream of one job's subjects (`tp.<job>.>`): `<base>_<job>` (`base`: the `stream`
    setting). Each job has its own, with its own limits, so one job's history never pushes out
    another's; the run-time commands (`tp.ctl.>`) have `<base>_ctl`."""
    return f"{base}_{job}"


def subject_job(subject: str) -> str:
    """The job whose stream holds `subject` (`tp.<job>.…`; `ctl` for the run-time commands).

    Raises:
        InvalidNameError: `subject` names no single job (a wildcard in its place, say).
    """
    root, _, rest = subject.partition(".")
    job = rest.partition(".")[0]
    if root != SUBJECT_ROOT or not _TOKEN.fullmatch(job):
        raise InvalidNameError("the job of subject", subject)
    return job


def redact_url(url: str) -> str:
    """A server URL fit for logs: credentials removed."""
    parts = []
    for u in url.split(","):
        s = urlsplit(u.strip())
        host = s.hostname or ""
        netloc = f"***@{host}" if s.username or s.password else host
        parts.append(urlunsplit(s._replace(netloc=f"{netloc}:{s.port}" if s.port else netloc)))
    return ",".join(parts)


def node_name(configured: str | None) -> str:
    """The configured node name, else the host name's first label (validated either way)."""
    return validate_token("node", configured or socket.gethostname().split(".")[0])


def event_subject(event: Event) -> str:
    """`tp.<job>.<kind>.<node>.<rank>`; `_` stands for an unknown rank; plans go to
    `tp.<job>.plan`."""
    if isinstance(event, ev.RecoveryPlanned):
        return plan_subject(event.job)
    if isinstance(event, ev.NodeBatch):
        return batch_subject(event.job, event.node, event.batch)
    rank = getattr(event, "rank", None)
    return f"{SUBJECT_ROOT}.{event.job}.{_kind(event)}.{event.node}.{'_' if rank is None else rank}"


def plan_subject(job: str) -> str:
    return f"{SUBJECT_ROOT}.{job}.plan"


def shard_subject(job: str, kind: str, node: str, rank: int | str) -> str:
    """`tp.<job>.<kind>.<node>.<rank>`; `*` in any part is a wildcard."""
    return f"{SUBJECT_ROOT}.{job}.{kind}.{node}.{rank}"


def batch_subject(job: str, node: str, kind: str) -> str:
    """`tp.<job>.batch.<node>.<kind>`, a node's `NodeBatch` of one kind; `*` is a wildcard."""
    return f"{SUBJECT_ROOT}.{job}.batch.{node}.{kind}"


def filter_subject(kind: str, *, node: str, job: str = "*") -> str:
    """Subject filter for one event kind on one node (all jobs by default): the node's batches
    of a kind agents report per node (`BatchKind`), else every rank's events of that kind; `*`
    for `node` matches every node."""
    if kind in typing.get_args(ev.BatchKind):
        return batch_subject(job, node, kind)
    return f"{SUBJECT_ROOT}.{job}.{kind}.{node}.*"


def job_subjects(job: str) -> str:
    """Every subject of one job (`tp.<job>.>`): its events, plans and restore reports."""
    return f"{SUBJECT_ROOT}.{job}.>"


def state_subjects(job: str) -> list[str]:
    """What the job's coordinator folds (`tierpipe.control.coordinator`): the nodes' batches, every
    failure, every replica made (`replicated`: no batch carries them), the plans and restore
    reports; not the per-rank copies of what batches say."""
    return [
        batch_subject(job, "*", "*"),
        shard_subject(job, "failed", "*", "*"),
        shard_subject(job, "replicated", "*", "*"),
        plan_subject(job),
        shard_subject(job, "restore", "*", "*"),
    ]


def flush_control_subject(node: str | None = None) -> str:
    """Where `FlushControl` commands go: `tp.ctl.flush` for every node, or `.<node>` for one."""
    return CONTROL_FLUSH if node is None else f"{CONTROL_FLUSH}.{node}"


def msg_id(event: Event) -> str:
    """The `Nats-Msg-Id` that lets the server drop a republished duplicate.

    `<job>/<step>/<rank>/<kind>/<node>/<epoch>[/...]`: the node is part of it, since two nodes'
    copies of one shard (a write-back after a restore) are two facts, not one; a failure names
    its stage, attempt and input message, so every attempt is recorded once.
    """
    # Restore coordination: every attempt is new, even with the same restart id.
    if isinstance(event, ev.RecoveryPlanned):
        kind = "final" if event.final else "plan"
        return f"{event.job}/plan/{event.restart}/{event.round}/{kind}/{round(event.ts * 1e6)}"
    if isinstance(event, ev.RestoreReport):
        return (
            f"{event.job}/restore/{event.restart}/{event.rank}/{event.phase}/{event.round}/"
            f"{round(event.ts * 1e6)}"
        )
    if isinstance(event, ev.NodeBatch):
        inner = xxhash.xxh3_64_hexdigest("|".join(msg_id(e) for e in event.events).encode())
        return f"{event.job}/batch/{event.batch}/{event.node}/{inner}"
    if isinstance(event, ev.StageFailed):
        if event.step is None:
            return f"{event.job}/poison/{event.stage}/{event.node}/{event.stream_seq}"
        base = (
            f"{event.job}/{event.step}/{event.rank}/failed/{event.node}/{event.stage}/"
            f"{event.attempt}"
        )
        # Two messages about one shard (a `verified` and a `failed`) failing in one stage are
        # two reports; a redelivery of the same message at the same attempt is one. A report
        # of no message (a restore finding a copy bad, verify's rewrite) is its own each time.
        tail = round(event.ts * 1e6) if event.stream_seq is None else event.stream_seq
        return f"{base}/{tail}"
    assert isinstance(event, ev.ShardEvent)
    base = f"{event.job}/{event.step}/{event.rank}/{_kind(event)}/{event.node}/{event.epoch}"
    if isinstance(event, ev.ShardEvicted):
        return f"{base}/{event.tier}"
    if isinstance(event, ev.ShardWritten | ev.ShardVerified | ev.ShardFlushed):
        # Another save of the same step is new content, not a duplicate; so is a copy rewritten
        # after a restore found it bad.
        base = f"{base}/{event.header_digest[:12]}"
        if not isinstance(event, ev.ShardFlushed) and event.staged_ts:
            # A copy written again from a new staging (a second repair within the window) is
            # new too; the same staging delivered again is not.
            base = f"{base}/{round(event.staged_ts * 1e6)}"
    elif isinstance(event, ev.ShardStaged):
        base = f"{base}/{round(event.ts * 1e6)}"  # each save() is its own event
    origin = getattr(event, "origin", "save")
    return f"{base}/restore" if origin == "restore" else base


def consumer_name(stage: str, node: str) -> str:
    """Durable consumer of a stage on a node, e.g. `nvme-write_node-a` (no `.`, `*`, `>`)."""
    return f"{stage}_{node}"


def shard_relpath(job: str, step: int, rank: int, world_size: int) -> PurePosixPath:
    """`<job>/step-<step:012d>/rank-<rank:05d>-of-<world:05d>.shard`, the key on every tier."""
    validate_token("job", job)
    if step < 0 or not 0 <= rank < world_size:
        raise ValueError(f"bad shard identity step={step} rank={rank} world_size={world_size}")
    return PurePosixPath(job, f"step-{step:012d}", f"rank-{rank:05d}-of-{world_size:05d}.shard")


def _kind(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]
