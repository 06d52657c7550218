"""A job's admission budgets divided among its active nodes (the coordinator's `<job>.shares`).

The retention coordinator (`tierpipe.control.coordinator`) counts the nodes that reported one of the
job's newest checkpoints (`ActiveNodes`, O(1) per batch) and stores each one's part of the job's
`Budget` (`divide`) whenever the budget or the count changes; each flush stage and restoring rank
paces itself at the lower of its own limit and its part.
"""

from __future__ import annotations

import bisect
from collections import Counter

from tierpipe.schemas import NodeBatch
from tierpipe.schemas.facts import BatchFact
from tierpipe.schemas.jobstate import Budget, Shares

__all__ = ("ACTIVE_STEPS", "ActiveNodes", "divide")

#: A node is active (has a part of the job's budgets) while it has reported one of the job's
#: newest `ACTIVE_STEPS` checkpoints: a node that missed two in a row is gone.
ACTIVE_STEPS = 2


def divide(budget: Budget, nodes: int, term: int = 0) -> Shares:
    """Each of `nodes` nodes' part of `budget`: rounded down, so the parts never add up to
    more than the budget, but never 0 where the budget is set (0 would mean "no cap")."""
    n = max(nodes, 1)
    return Shares(
        flush_bytes_per_s_per_node=max(1, budget.flush_bytes_per_s // n)
        if budget.flush_bytes_per_s
        else 0,
        restore_gets_per_node=max(1, budget.restore_gets // n) if budget.restore_gets else 0,
        nodes=nodes,
        term=term,
    )


class ActiveNodes:
    """The nodes of one job that reported (`written` or `verified`) one of its newest
    `ACTIVE_STEPS` checkpoints, counted as the coordinator folds the nodes' batches: O(1) per
    batch and per count, whatever the number of nodes. Checkpoints are ordered by (epoch,
    step), so a rewound run's saves are the newest ones."""

    def __init__(self, steps: int = ACTIVE_STEPS) -> None:
        self._steps = steps
        #: node -> the newest (epoch, step) it reported.
        self._newest: dict[str, tuple[int, int]] = {}
        #: (epoch, step) -> how many nodes have it as their newest.
        self._count: Counter[tuple[int, int]] = Counter()
        #: The newest `steps` checkpoints reported, ascending.
        self._recent: list[tuple[int, int]] = []

    def note(self, batch: NodeBatch | BatchFact) -> None:
        """Take a node's batch into account (any kind other than written/verified: ignored)."""
        if batch.batch not in ("written", "verified") or not batch.events:
            return
        key = max((e.epoch, e.step) for e in batch.events)
        old = self._newest.get(batch.node)
        if old is not None and old >= key:
            return
        self._newest[batch.node] = key
        if old is not None and self._count.get(old):
            self._count[old] -= 1
        self._count[key] += 1
        if key in self._recent or (len(self._recent) >= self._steps and key < self._recent[0]):
            return
        bisect.insort(self._recent, key)
        if len(self._recent) > self._steps:
            del self._recent[0]
            # Nodes whose newest report is older are no longer counted (nor kept count of).
            for gone in [k for k in self._count if k < self._recent[0]]:
                del self._count[gone]

    def __len__(self) -> int:
        return sum(self._count[k] for k in self._recent)
