"""The partner rule: which nodes hold replicas of a node's verified shards.

A pure function every node computes the same way from the same inputs (the job's nodes as their
records list them): a ring over the job's nodes sorted by name, a node's partners being the
next ones after it, skipping nodes in its own failure domain (e.g. its rack) when it has a label,
and taking any other node when too few are left outside it. A node is never its own partner.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ("partners", "replica_count")


def replica_count(setting: int | None, nodes: int) -> int:
    """How many partners a node of a job of `nodes` nodes copies to: `peer_replicas`, or
    (None) 1 where the job has two nodes or more, else 0; never more than the other nodes."""
    wanted = (1 if nodes >= 2 else 0) if setting is None else setting
    return max(0, min(wanted, nodes - 1))


def partners(job_nodes: Iterable[tuple[str, str]], node: str, n: int) -> list[str]:
    """The `n` partners of `node` among `job_nodes` ((name, failure domain) pairs; `node` need
    not be among them), nearest first.

    The ring is the nodes sorted by name; from `node` on, the next nodes outside `node`'s failure
    domain come first (when it has one: "" is no label), then, if those are too few, the others
    in ring order. Fewer than `n` when the job has fewer other nodes.
    """
    domains = dict(job_nodes)
    domain = domains.pop(node, "")
    ring = sorted(domains)
    # Ring order starting right after `node` (where it would sort, if it is not listed).
    start = sum(1 for name in ring if name < node)
    order = ring[start:] + ring[:start]
    if domain:
        apart = [name for name in order if domains[name] != domain]
        order = apart + [name for name in order if domains[name] == domain]
    return order[: max(0, n)]
