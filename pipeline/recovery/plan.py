"""The restore planner: which step a restore picks, and which ranks read it from a peer's replica
or from object storage.

One pure function, `choose`, over per rank the candidate steps it can read from its own node's
NVMe and from object storage (`Steps`), and from a verified replica on a surviving node (the
`peer` tier): the newest step every rank has a copy of, each rank reading its NVMe copy where it
has one, else a replica, else its object. Its inputs come from the job state in KV, two ways:
- a restart: every node's local leader reads the candidates' records and checks each of its
  ranks' NVMe files on disk (`tierpipe.recovery.survey`), and rank 0 calls `choose` with every
  rank's `ready` report;
- `tierpipe plan`, `tierpipe status` and the demo: `recorded` reads the same records with an
  assumption about NVMe (every copy kept, every copy lost, or those of given ranks lost) instead
  of a look at the disks, and `tierpipe.recovery.kvplan.kv_plan` calls `choose` with them.
`unusable` and `counts` are what both read of a step's record.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from tierpipe.control.bitmap import bitmap, has_rank, ranks_of
from tierpipe.errors import NoCheckpointError
from tierpipe.schemas import RankSteps, SourceRef
from tierpipe.schemas.jobstate import StepRecord

__all__ = (
    "Choice", "Source", "Steps", "choose", "counts", "named_ranks", "recorded", "unusable",
)  # fmt: skip

#: Ranks named in a rejection reason (the rest are counted).
_NAMED_RANKS = 8

#: Where one rank reads its shard from (a tier, a node, a location; see `SourceRef`).
Source: TypeAlias = SourceRef

#: Why no rank can use a step whose record is gone.
NO_RECORD = "no record of the step in the job state (retention removed it?)"


class Steps(Protocol):
    """What one rank can restore (`RankSteps`, or a `RestoreReport` of its own)."""

    @property
    def local_steps(self) -> list[int]: ...
    @property
    def s3_steps(self) -> list[int]: ...
    @property
    def error(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Choice:
    """The planner's pick: the step, and which ranks read it from object storage (bitmap, as
    `RecoveryPlanned.from_s3`) and which from a peer's replica (bitmap; the others their own
    node's NVMe copy)."""

    step: int
    from_s3: bytes
    #: newer candidate step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)
    from_peer: bytes = b""


def choose(
    job: str,
    reports: Mapping[int, Steps],
    world_size: int,
    *,
    step: int | None = None,
    candidates: Sequence[int] | None = None,
    exclude: Mapping[int, str] = {},
    unusable: Mapping[int, str] = {},
    notes: Mapping[int, str] = {},
    passed: Mapping[int, str] = {},
    peer: Mapping[int, Collection[int]] = {},
) -> Choice:
    """The newest step every rank has a copy of (or exactly `step`): each rank reads its own
    NVMe copy where it has one, else a peer's replica, else the object (a pure function of the
    reports: a few candidate steps per rank, whatever the job's size).

    Args:
        peer: rank -> the steps it can read from a verified replica on a node that survives
            (none: no rank reads a peer).
        candidates: the steps to consider (default: every step some rank has).
        exclude: steps a rank found no loadable copy of in this restore (step -> its words).
        unusable: steps no rank can use (step -> why: no record, another world size).
        notes: step -> what to add to its rejection (its objects were removed, ...).
        passed: steps passed over before planning (step -> why), named when none is left.

    Raises:
        NoCheckpointError: no candidate step has a copy for every rank (says why, per step).
    """
    local = {r: set(rep.local_steps) for r, rep in reports.items()}
    replica = {r: set(peer.get(r, ())) for r in reports}
    anywhere = {r: local[r] | replica[r] | set(rep.s3_steps) for r, rep in reports.items()}
    if step is not None:
        steps: Collection[int] = [step]
    elif candidates is not None:
        steps = candidates
    else:
        steps = set().union(*anywhere.values())
    rejected: dict[int, str] = {}
    for s in sorted(steps, reverse=True):
        if s in unusable:
            rejected[s] = unusable[s]
            continue
        if s in exclude:
            rejected[s] = f"a rank found no loadable copy in this restore ({exclude[s]})"
            continue
        lacking = [r for r in range(world_size) if s not in anywhere.get(r, ())]
        if not lacking:
            remote = [r for r in range(world_size) if s not in local[r]]
            peers = [r for r in remote if s in replica[r]]
            s3 = [r for r in remote if s not in replica[r]]
            return Choice(s, bitmap(s3, world_size), rejected, bitmap(peers, world_size))
        rejected[s] = _lacking(lacking, reports, world_size) + notes.get(s, "")
    if not rejected and not passed:
        raise NoCheckpointError(
            f"job {job!r} has no checkpoints in its job state (never saved, or the state was "
            f"lost: `tierpipe reindex --job {job}` rebuilds it)"
        )
    detail = "; ".join(
        [f"step {s}: {why}" for s, why in passed.items()]
        + [f"step {s}: {why}" for s, why in rejected.items()]
    )
    raise NoCheckpointError(f"no restorable step of job {job!r} ({detail})")


def _lacking(ranks: list[int], reports: Mapping[int, Steps], world_size: int) -> str:
    def label(r: int) -> str:
        error = reports[r].error if r in reports else ""
        return f"rank {r}" + (f" [{error}]" if error else "")

    return f"{len(ranks)} of {world_size} ranks have no copy ({named_ranks(ranks, label)})"


def named_ranks(ranks: Sequence[int], label: Callable[[int], str] = "rank {}".format) -> str:
    """The first few of `ranks` named (`label`), the rest counted: `rank 1, rank 4 and 9 more`."""
    named = ", ".join(label(r) for r in ranks[:_NAMED_RANKS])
    return named + (f" and {len(ranks) - _NAMED_RANKS} more" if len(ranks) > _NAMED_RANKS else "")


def unusable(rec: StepRecord | None, world_size: int) -> str:
    """Why no rank of a restart of `world_size` ranks can use the step `rec` records ("" if
    they may: see `counts` for each rank)."""
    if rec is None:
        return NO_RECORD
    if rec.world_size != world_size:
        return f"saved with world size {rec.world_size}"
    return ""


def counts(rec: StepRecord, rank: int) -> tuple[bool, bool, bool]:
    """Whether the job state counts `rank`'s copy of `rec`'s step (NVMe: verified, not evicted
    or proven bad; object storage: confirmed by the store, not removed by retention; peer: a
    verified replica on another node than the one that saved it)."""
    return (
        has_rank(rec.nvme, rank),
        has_rank(rec.s3, rank) and not rec.s3_removed,
        has_rank(rec.peer, rank),
    )


def recorded(
    candidates: Sequence[int],
    records: Mapping[int, StepRecord],
    world_size: int,
    *,
    nvme_lost: bool | Collection[int] = False,
    replicas_lost: Collection[int] = (),
) -> tuple[dict[int, RankSteps], dict[int, str], dict[int, str], dict[int, list[int]]]:
    """Every rank's steps among `candidates` as the job state records them, with no look at
    any disk: each rank can read NVMe where the record counts its copy (`counts`), unless its
    NVMe copies are lost (`nvme_lost`: True for every rank, else the ranks whose node is gone);
    a peer's replica where the record counts one, unless it may be on a lost node (with every
    NVMe lost, every replica is: they live on NVMe; else `replicas_lost`, the ranks whose
    replica a lost node holds: a replica is never on the node that saved its copy, so a rank
    of a lost node reads it from a survivor); and object storage where the record counts its
    object. Returns (reports, unusable, notes, peer) for `choose`: by rank, step -> why no
    rank can use it (`unusable`) or what to add to its rejection (its objects were removed by
    retention), and rank -> the steps it can read from a replica."""
    everyone = (1 << world_size) - 1
    lost = everyone if nvme_lost is True else _bits(nvme_lost or (), world_size)
    no_peer = everyone if nvme_lost is True else _bits(replicas_lost, world_size)
    local: dict[int, list[int]] = {r: [] for r in range(world_size)}
    replica: dict[int, list[int]] = {r: [] for r in range(world_size)}
    remote: dict[int, list[int]] = {r: [] for r in range(world_size)}
    bad: dict[int, str] = {}
    notes: dict[int, str] = {}
    for s in sorted(candidates, reverse=True):
        rec = records.get(s)
        why = unusable(rec, world_size)
        if why or rec is None:
            bad[s] = why
            continue
        nvme = int.from_bytes(rec.nvme, "little") & everyone & ~lost
        s3 = 0 if rec.s3_removed else int.from_bytes(rec.s3, "little") & everyone
        for r in _ranks(nvme):
            local[r].append(s)
        for r in _ranks(s3):
            remote[r].append(s)
        for r in _ranks(int.from_bytes(rec.peer, "little") & everyone & ~no_peer):
            replica[r].append(s)
        if rec.s3_removed:
            notes[s] = " (objects removed by retention)"
    reports = {
        r: RankSteps(rank=r, local_steps=local[r], s3_steps=remote[r]) for r in range(world_size)
    }
    return reports, bad, notes, {r: steps for r, steps in replica.items() if steps}


def _bits(ranks: Collection[int], world_size: int) -> int:
    """`ranks` below `world_size` as a bitmap read as one little-endian integer."""
    return int.from_bytes(bitmap([r for r in ranks if r < world_size], world_size), "little")


def _ranks(bits: int) -> list[int]:
    """The ranks set in a bitmap read as one little-endian integer, ascending."""
    return ranks_of(bits.to_bytes((bits.bit_length() + 7) // 8, "little"))
