"""A rank that ran out of a resource while loading stops the restore on every rank.

Memory, memory mappings, file descriptors or threads running out in one rank's process says
nothing about any copy, and every other source and older step would need the same: so the rank
tries no other source, its `failed` report says what ran out (`short_report`), and rank 0, on
finding such a report among a round's answers (`resource_failure`), ends the restore with that
error on every rank instead of planning an older step. No copy is marked bad.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierpipe.errors import ResourceExhaustedError
from tierpipe.schemas import RestoreReport

__all__: tuple[str, ...] = ()  # private to tierpipe.recovery

#: How a rank's `failed` report begins when it ran out of a resource (what ran out follows).
_PREFIX = "ResourceExhaustedError: "


def short_report(e: ResourceExhaustedError) -> str:
    """The `error` of this rank's `failed` report for `e`."""
    return _PREFIX + e.resource


def resource_failure(reports: Iterable[RestoreReport]) -> ResourceExhaustedError | None:
    """What a rank of these `failed` reports ran out of (the lowest such rank), if any."""
    for r in sorted(reports, key=lambda r: r.rank):
        if r.error.startswith(_PREFIX):
            where = f"rank {r.rank} of job {r.job!r} (node {r.node})"
            return ResourceExhaustedError(where, r.error.removeprefix(_PREFIX))
    return None
