"""The upload target: which step a job names for object storage now, and its safe step.

A step in object storage is useful only once every rank has it there, so every node uploads the
same step: the one the job's coordinator names in `Floors.upload`. Once that target is settled
(complete in object storage, or dropped below the object-storage floor, or never to complete: some
rank has a copy on no tier any more), the next target is the newest step complete on NVMe at
that moment, at least `Keep.s3_every_steps` after the last one and named at least
`Keep.s3_every_s` seconds after it (`Floors.upload_ts`, kept in KV so a coordinator taking over
keeps the cadence). A target never goes down (but a lost one's replacement: a rewound run's
newest step is lower), and the steps in between are never uploaded (but for those
`Keep.s3_keep_period` keeps: `tierpipe.retention.kept.upload_wanted`).

`Floors.safe` is the newest step that survives the loss of any one node: complete in object
storage, or complete on the peer tier (a verified replica of every rank on a partner node).

Pure (no I/O, no clock: the time is the newest folded event's, so a fold of the same events
names the same targets), called by the job state
(`tierpipe.control.jobstate`) whenever its floors move. A node's side of it, `Later`: the
shards of steps newer than the target its flush stage holds back until the floors name them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from tierpipe.schemas import ShardVerified, Tier
from tierpipe.schemas.jobstate import Floors, Keep

__all__ = ("Later", "next_upload", "safe_step", "settled", "targets")

#: The tiers on which a complete step survives the loss of any one node.
_SAFE: tuple[Tier, ...] = ("s3", "peer")


def settled(
    target: int, floors: Floors, complete: Mapping[Tier | None, Sequence[int]], restored: int = -1
) -> bool:
    """Whether the job is done with upload target `target` (-1: none yet): complete in object
    storage, below the object-storage floor (its objects go, or went), never to complete (some
    rank has a copy on neither NVMe nor object storage: lost, evicted or corrupt; a dropped step
    has none), or no newer than the step a restart restored (`restored`): a node lost with the
    target's upload in flight leaves its NVMe copies counted, since no event says they went, and
    its replacement's ranks read the restored step from a peer or object storage without
    uploading it, so the job would wait for them for ever; the restarted run's steps are newer
    (`next_upload` keeps the target named until one is complete on NVMe)."""
    return (
        target < 0
        or target in complete.get("s3", ())
        or target < floors.s3
        or target <= restored
        or target not in complete.get(None, ())
    )


def next_upload(
    last: Floors, floors: Floors, complete: Mapping[Tier | None, Sequence[int]], keep: Keep,
    now: float, restored: int = -1,
) -> tuple[int, float]:  # fmt: skip
    """(target, when it was named): `last`'s while it is not `settled` under the new `floors`
    or the cadence holds it, else the newest step complete on NVMe: never lower, but for a
    target that can never complete (a copy lost, or its timeline rewound), replaced at once."""
    target, named = last.upload, last.upload_ts
    nvme = complete.get("nvme", ())
    newest = nvme[-1] if nvme else -1
    if newest in (-1, target) or not settled(target, floors, complete, restored):
        return target, named
    if target >= 0 and (target not in complete.get(None, ()) or target <= restored):
        return newest, now  # (lost, or superseded by a rewind: at once, lower if need be)
    if target >= 0 and newest < target + keep.s3_every_steps:
        return target, named
    if now < named + keep.s3_every_s:
        return target, named
    return newest, now


def safe_step(complete: Mapping[Tier | None, Sequence[int]]) -> int:
    """The newest step complete in object storage or on the peer tier; -1 if none."""
    done = [steps[-1] for tier in _SAFE if (steps := complete.get(tier))]
    return max(done, default=-1)


def targets(
    floors: Floors, last: Floors, complete: Mapping[Tier | None, Sequence[int]], keep: Keep,
    now: float, restored: int = -1,
) -> Floors:  # fmt: skip
    """`floors` with the upload target (`next_upload` after `last`) and the safe step set."""
    upload, named = next_upload(last, floors, complete, keep, now, restored)
    return msgspec.structs.replace(floors, upload=upload, upload_ts=named, safe=safe_step(complete))


class Later:
    """This node's `verified` shards of steps its job does not want uploaded now, kept (in
    memory) until the floors name their step, or a newer target: at most the steps saved
    while one target is uploaded."""

    def __init__(self) -> None:
        self._held: dict[str, dict[int, dict[int, ShardVerified]]] = {}
        #: job -> the target its floors named last.
        self._named: dict[str, int] = {}

    def hold(self, event: ShardVerified) -> None:
        self._held.setdefault(event.job, {}).setdefault(event.step, {})[event.rank] = event

    def take(self, event: ShardVerified) -> bool:
        """Take `event` back; whether it was still held (no one else took it)."""
        ranks = self._held.get(event.job, {}).get(event.step, {})
        if ranks.get(event.rank) is not event:
            return False
        del ranks[event.rank]
        return True

    def named(self, job: str) -> int | None:
        """The target the floors of `job` named last (None: none seen yet)."""
        return self._named.get(job)

    def due(self, job: str, floors: Floors) -> list[ShardVerified]:
        """The shards of the step `floors` name for upload, taken; if that is a new target,
        those below it dropped (not before: a rewound run's steps may be named next)."""
        steps = self._held.get(job, {})
        due = steps.pop(floors.upload, {})
        if self._named.get(job) != floors.upload:
            self._named[job] = floors.upload
            for step in [t for t in steps if t < floors.upload]:
                del steps[step]
        return list(due.values())

    def __len__(self) -> int:
        return sum(len(ranks) for steps in self._held.values() for ranks in steps.values())
