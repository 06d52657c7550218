"""The changes of a job-state fold: what the events folded since the coordinator last stored the
state changed (`tierpipe.control.jobstate.JobState.take_changes`), for its KV writer
(`tierpipe.control.kvstate`) and the object removals it makes."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierpipe.schemas.jobstate import StepRecord

__all__ = ("Changes",)


@dataclass
class Changes:
    """What the events folded since the last `take_changes()` changed, for the KV writer."""

    #: Steps whose record changed (to put) and steps that left the state (to delete).
    put: set[int] = field(default_factory=set)
    deleted: set[int] = field(default_factory=set)
    #: Steps whose objects are to be removed now (below the object-storage floor), with their
    #: record as it was (the ranks whose objects were confirmed in `s3`).
    s3_removed: dict[int, StepRecord] = field(default_factory=dict)
    #: Steps removed already whose objects of some ranks were confirmed only afterwards (an
    #: upload that completed as the step was removed), with their record, its `s3` naming those
    #: ranks alone: their objects are removed too (maybe again), and announced.
    s3_late: dict[int, StepRecord] = field(default_factory=dict)
    #: (step, chunk) whose `RankDigests` changed; steps that left, with their chunk count.
    digests: set[tuple[int, int]] = field(default_factory=set)
    digests_deleted: dict[int, int] = field(default_factory=dict)
    #: Steps that became complete in object storage (every rank's object confirmed): the
    #: coordinator writes their COMMIT manifest. Not those complete when the fold started (whoever
    #: folded them committed them); again for one a rewound run completes again (once per timeline).
    committed: set[int] = field(default_factory=set)
    head: bool = False
    floors: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.put
            or self.deleted
            or self.s3_removed
            or self.s3_late
            or self.digests
            or self.head
            or self.floors
            or self.committed
        )
