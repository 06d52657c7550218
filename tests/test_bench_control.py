"""`python -m bench control` at a small size, as a test of the control plane's invariants: no
message over the limit, deliveries per node per checkpoint bounded, the KV equal to the fold of
the job's events, the restart state bounded whatever the history."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import control
from bench.common import REPO

RANKS_PER_NODE = 8
#: JetStream deliveries per checkpoint per node: each rank's `staged` to nvme-write, the node's
#: batches of `written` (verify) and `verified` (flush, evict); to the coordinator the node's
#: batches of `written`, `verified`, `flushed` and NVMe `evicted` (4, a fifth now and then); and
#: each floor change to every floor watch (at most 2 a checkpoint). Issue 10: 24 at 8 ranks.
DELIVERIES_BOUND = RANKS_PER_NODE + 3 + 5 + 2


#: The CI size of `bench control` (issue 10: `--nodes 64`).
NODES = 64


@pytest.mark.slow
def test_control_plane_invariants() -> None:
    """At 64 nodes: no message over the limit, deliveries per node per checkpoint bounded, the
    KV equal to the fold of the events, a bounded restart read, and a restart through the real
    agreement protocol (nodes' leaders report, ranks in two processes) in which every rank
    gets the same plan."""
    # (the restart's simulated ranks in two processes, as from 1,000 nodes on)
    r = control.run(NODES, RANKS_PER_NODE, 4, history_steps=(2, 12), restart_procs=2)
    assert r["max_msg_bytes"] <= control.MSG_LIMIT
    assert r["kv_equals_fold"] is True
    assert 0 < r["deliveries_per_ckpt_per_node"] <= DELIVERIES_BOUND
    # The coordinator reads the nodes' batches, not the per-rank events (steady state: a batch
    # of each of written, verified, flushed and NVMe evicted per node and checkpoint).
    # (a node's NVMe removals of one checkpoint may span two steps: a fifth, now and then)
    assert r["coordinator_deliveries_per_ckpt"] <= 5 * r["nodes"]
    assert r["fold_us_per_rank_event"] > 0
    over = r["coordinator_cpu_over_receive"]  # (per checkpoint, paired: an interval)
    assert (
        over is None
        or r["coordinator_cpu_over_receive_lo"] <= over <= r["coordinator_cpu_over_receive_hi"]
    )
    # Steady state: one step leaves object storage per checkpoint (steps 1..3 of 4).
    assert r["objects_removed_steps"] == 3
    # Restart state: the head, and the records and a digest chunk of a few candidate steps,
    # whatever the history.
    assert r["restart_records"] <= control.KEEP_NVME + control.KEEP_S3
    assert set(r["restart_s_history"]) == {"2", "12"}
    # The restart: every rank planned, all alike, in one round, from the newest step complete
    # in object storage (no NVMe copy is on this machine: every rank reads object storage).
    restart = r["restart"]
    assert restart["ranks_planned"] == r["world_size"] and restart["same_plan"] is True
    assert restart["processes"] == 2
    # Each node's local leader reports for its ranks: a `ready` of 8 ranks, a compact plan.
    assert restart["ready_msg_bytes"] < 2048 and restart["plan_msg_bytes"] < 1024
    assert (restart["step"], restart["rounds"], restart["final_plan"]) == (4, 1, True)
    assert restart["from_s3_ranks"] == r["world_size"]
    assert 0 < r["plan_s"] <= restart["restore_s"]
    # Requests per node, whatever the world size: before the plan, the leader's head (which
    # carries the candidates' records: none read on their own here), its own newest events and
    # one `ready`; after it, each rank's digest chunk and `loaded` (a
    # rank sent to object storage reads no record). (A leader whose fold lagged reads the head
    # again: slack of half a read a node.)
    req, before = restart["requests_per_node"], restart["requests_per_node_before_plan"]
    assert r["restart_records"] == 0
    assert before["get"] <= 1.5
    assert before["publish"] <= 1 + 2 / NODES  # (and rank 0's `hold` and plan)
    assert req["get"] - before["get"] <= RANKS_PER_NODE + 1 / NODES


def test_cli_refuses_bad_sizes_and_control_options_elsewhere() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "bench", "control", "--nodes", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr
    other = subprocess.run(
        [sys.executable, "-m", "bench", "plan", "--steps", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert other.returncode == 2 and "control only" in other.stderr
