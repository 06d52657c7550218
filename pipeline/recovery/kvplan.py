"""What a restore would pick now, from the job state in KV alone (`tierpipe plan`).

A pure function of the head's candidate steps and their records (`kv_plan`), with the steps the
rest of the job state does not confirm passed over and shown as such (`tierpipe.control.confirm`,
`confirmed_plan`, reads the digests and calls it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierpipe.control.bitmap import ranks_of
from tierpipe.errors import NoCheckpointError
from tierpipe.schemas.jobstate import StepRecord

__all__ = ("ASSUME_NVME_KEPT", "ASSUME_NVME_LOST", "KvPlan", "kv_plan")

#: Ranks named in a rejection reason (the rest are counted).
_NAMED_RANKS = 8

ASSUME_NVME_KEPT = (
    "assumes every rank's node still holds its NVMe copy; a restart also checks each rank's "
    "file on its own disk (size, header, digest) and sends a rank without a good one to "
    "object storage"
)
ASSUME_NVME_LOST = "assumes every NVMe copy is lost (--nvme-lost): every rank reads object storage"


@dataclass(frozen=True, slots=True)
class KvPlan:
    """The step a restore would pick from the job state alone, and where its ranks read."""

    job: str
    step: int
    world_size: int
    #: Ranks that read object storage (the others their own node's NVMe copy), ascending.
    s3_ranks: list[int]
    #: The candidate steps considered, newest first.
    candidates: list[int]
    #: newer candidate step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)
    nvme_lost: bool = False
    #: newer candidate step -> why the job state does not back what its head says of it.
    unconfirmed: dict[int, str] = field(default_factory=dict)

    @property
    def from_nvme(self) -> int:
        return self.world_size - len(self.s3_ranks)

    def describe(self) -> str:
        """For operators: the step, the count per tier, the rejected steps, the assumption."""
        lines = [
            f"restore step {self.step} of job {self.job!r} ({self.world_size} ranks): "
            f"{self.from_nvme} from NVMe, {len(self.s3_ranks)} from object storage"
        ]
        if 0 < len(self.s3_ranks) < self.world_size:
            lines.append(f"  from object storage: {_named(self.s3_ranks)}")
        for step, why in sorted(self.unconfirmed.items(), reverse=True):
            lines.append(f"  step {step} unconfirmed (not planned): {why}")
        for step, why in sorted(self.rejected.items(), reverse=True):
            lines.append(f"  step {step} rejected: {why}")
        lines.append(f"  candidates: {', '.join(map(str, self.candidates))}")
        lines.append(f"  note: {ASSUME_NVME_LOST if self.nvme_lost else ASSUME_NVME_KEPT}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """`tierpipe plan --json`."""
        return {
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "from_nvme": self.from_nvme,
            "from_s3": len(self.s3_ranks),
            "s3_ranks": self.s3_ranks,
            "candidates": self.candidates,
            "rejected": {str(s): why for s, why in self.rejected.items()},
            "unconfirmed": {str(s): why for s, why in self.unconfirmed.items()},
            "assumes": "nvme_lost" if self.nvme_lost else "nvme_kept",
        }


def kv_plan(
    job: str,
    candidates: Sequence[int],
    records: Mapping[int, StepRecord],
    *,
    nvme_lost: bool = False,
    unconfirmed: Mapping[int, str] | None = None,
) -> KvPlan:
    """The newest of `candidates` (newest first, as a restart considers them) on which every
    rank has a copy on some tier, as the records say: each rank reads NVMe where the record has
    its copy there (unless `nvme_lost`), else object storage. The world size is the newest
    candidate's (a restart of another size would be refused); steps of another size are
    rejected. `unconfirmed` (step -> why): candidates passed over, whatever their records say
    (the job state does not back them: `tierpipe.control.confirm`).

    Raises:
        NoCheckpointError: no candidate has a copy of every rank (says why, per step).
    """
    doubted = dict(unconfirmed or {})
    newest = next((records[s] for s in candidates if s in records and s not in doubted), None)
    if newest is None:
        why = [f"step {s}: unconfirmed: {w}" for s, w in doubted.items() if s in candidates]
        raise NoCheckpointError(
            f"job {job!r} has no {'confirmed ' if doubted else ''}step record in its job state"
            + (f" (candidates: {', '.join(map(str, candidates))})" if candidates else "")
            + (f" ({'; '.join(why)})" if why else "")
        )
    world = newest.world_size
    everyone = (1 << world) - 1
    rejected: dict[int, str] = {}
    passed = {s: w for s, w in doubted.items() if s in candidates}
    for s in candidates:
        if s in passed:
            continue
        rec = records.get(s)
        if rec is None:
            rejected[s] = "no record of the step in the job state (retention removed it?)"
            continue
        if rec.world_size != world:
            rejected[s] = f"saved with world size {rec.world_size}"
            continue
        nvme = 0 if nvme_lost else int.from_bytes(rec.nvme, "little") & everyone
        s3 = 0 if rec.s3_removed else int.from_bytes(rec.s3, "little") & everyone
        lacking = everyone & ~(nvme | s3)
        if not lacking:
            return KvPlan(job, s, world, _ranks(everyone & ~nvme), list(candidates), rejected,
                          nvme_lost, passed)  # fmt: skip
        missing = _ranks(lacking)
        rejected[s] = f"{len(missing)} of {world} ranks have no copy ({_named(missing)})" + (
            " (objects removed by retention)" if rec.s3_removed else ""
        )
    detail = "; ".join(
        [f"step {s}: unconfirmed: {why}" for s, why in passed.items()]
        + [f"step {s}: {why}" for s, why in rejected.items()]
    )
    raise NoCheckpointError(f"no restorable step of job {job!r} ({detail})")


def _ranks(bits: int) -> list[int]:
    """The ranks set in a bitmap read as one little-endian integer, ascending."""
    return ranks_of(bits.to_bytes((bits.bit_length() + 7) // 8, "little"))


def _named(ranks: Sequence[int]) -> str:
    named = ", ".join(f"rank {r}" for r in ranks[:_NAMED_RANKS])
    more = f" and {len(ranks) - _NAMED_RANKS} more" if len(ranks) > _NAMED_RANKS else ""
    return named + more
