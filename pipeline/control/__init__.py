"""The control plane: each job's compacted state, folded from its events and kept in JetStream KV,
and the one coordinator per job that writes it.

- `jobstate`: `JobState`, one job's state folded from its events (steps, tiers, floors).
- `changes`: `Changes`, what a fold changed since its state was last stored.
- `ledger`: the copies of the steps the fold still reads from their events, with the evidence rules.
- `bitmap`: rank bitmaps, one bit per rank of a step, and `StepBits`, a step's bitmaps per tier.
- `kvstate`: `JobStore`, the job state in KV: reading it, and writing it as its one writer.
- `coordinator`: `Coordinator`, one per job, elected with a lease: folds, retention, shares.
- `confirm`: which steps a job's head names that the rest of its job state backs.
- `folded`: a job's head once its coordinator folded the newest event a reader could see.
- `location`: the object-store location bound to a job.
- `advert`: a node's record: what its agent tells the trainers of its node.
- `pins`: the steps an in-progress restore keeps from retention.
- `shares`: a job's admission budgets divided among its active nodes.
- `upload`: the step a job names for object storage now (its upload target), and its safe step.
- `holder`: whether the agent holding a job's lease is gone (a restart takes the lease at once).
- `risk`: a job's exposure: each tier's lag behind the newest save, the steps a node's loss costs.
"""

from tierpipe.control.changes import Changes
from tierpipe.control.coordinator import Coordinator
from tierpipe.control.jobstate import JobState
from tierpipe.control.kvstate import JobStore

__all__ = ("Changes", "Coordinator", "JobState", "JobStore")
