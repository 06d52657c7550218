"""The partner rule: every node computes the same partners from the same records, never itself,
outside its failure domain when it can be, and only as many as the job has other nodes."""

from __future__ import annotations

import random

from tierpipe.peer.ring import partners, replica_count


def test_the_ring_is_the_next_node_by_name_whatever_the_order_given() -> None:
    """Partners follow the nodes sorted by name, wrapping around, in any input order."""
    nodes = [("n3", ""), ("n1", ""), ("n2", ""), ("n4", "")]
    for _ in range(5):
        random.shuffle(nodes)
        assert partners(nodes, "n1", 1) == ["n2"]
        assert partners(nodes, "n4", 1) == ["n1"]
        assert partners(nodes, "n2", 2) == ["n3", "n4"]


def test_each_node_is_the_partner_of_exactly_one_other() -> None:
    """With one replica each, every node holds the replicas of exactly one other node."""
    nodes = [(f"node-{i}", "") for i in range(7)]
    holders = [partners(nodes, name, 1)[0] for name, _ in nodes]
    assert sorted(holders) == sorted(name for name, _ in nodes)


def test_a_node_is_never_its_own_partner() -> None:
    """Even asked for more partners than the job has other nodes."""
    nodes = [("a", ""), ("b", "")]
    assert partners(nodes, "a", 2) == ["b"]
    assert partners([("a", "")], "a", 1) == []
    assert partners([], "a", 1) == []


def test_a_node_not_listed_still_has_its_place_in_the_ring() -> None:
    """A node whose own record is missing takes the place its name sorts to."""
    assert partners([("a", ""), ("c", "")], "b", 1) == ["c"]
    assert partners([("a", ""), ("c", "")], "d", 1) == ["a"]


def test_partners_skip_the_nodes_of_the_same_failure_domain() -> None:
    """The next nodes outside the node's rack come first; its rack-mates only if need be."""
    nodes = [("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2"), ("e", "r1")]
    assert partners(nodes, "a", 1) == ["c"]
    assert partners(nodes, "c", 1) == ["e"]
    assert partners(nodes, "a", 2) == ["c", "d"]
    assert partners(nodes, "a", 3) == ["c", "d", "b"]


def test_all_in_one_domain_falls_back_to_any_other_node() -> None:
    """When every node shares the rack, the ring order decides."""
    nodes = [("a", "r1"), ("b", "r1"), ("c", "r1")]
    assert partners(nodes, "b", 1) == ["c"]


def test_an_unlabelled_node_skips_no_one() -> None:
    """No label is no failure domain: the plain ring."""
    assert partners([("a", ""), ("b", "r1"), ("c", "")], "a", 1) == ["b"]


def test_replica_count_defaults_to_one_from_two_nodes_on() -> None:
    """`peer_replicas` None: 1 with two nodes or more, 0 alone; never more than the others."""
    assert replica_count(None, 1) == 0
    assert replica_count(None, 2) == 1
    assert replica_count(None, 8) == 1
    assert replica_count(0, 8) == 0
    assert replica_count(2, 8) == 2
    assert replica_count(2, 2) == 1
    assert replica_count(1, 1) == 0
