"""One restore planner: what `tierpipe plan` tells an operator is what a restart then restores."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import Agent, Events
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer


def plan_json(settings: Settings, job: str, *args: str) -> dict[str, object]:
    """`tierpipe plan --job JOB --json ARGS`, as an operator runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", "plan", "--job", job, "--json", *args],
        env={**os.environ, **settings.as_env()},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout)
    assert isinstance(found, dict)
    return found


def agrees(plan: dict[str, object], restored: dict[int, tuple[int, str]]) -> None:
    """Every rank restored the plan's step, from the tier the plan gave it (object storage, a
    peer's replica, else its own NVMe)."""
    s3_ranks, peer_ranks = plan["s3_ranks"], plan["peer_ranks"]
    assert isinstance(s3_ranks, list) and isinstance(peer_ranks, list)
    tier = {**{r: "s3" for r in s3_ranks}, **{r: "peer" for r in peer_ranks}}
    expected = {r: (plan["step"], tier.get(r, "nvme")) for r in restored}
    assert restored == expected, f"plan {plan} but restored {restored}"


@pytest.mark.slow
def test_plan_with_a_lost_node_is_what_the_restart_restores(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A job saved on two nodes loses one with its NVMe: `tierpipe plan --lost-node` names the
    step and each rank's tier that the restart (one rank on a survivor, one on an empty
    replacement) then restores."""
    s = settings.replace(lease_ttl_s=2.0, coordinator_flush_s=0.05)
    nodes = {
        n: s.replace(
            node=f"{s.node}-{n}",
            nvme_root=str(tmp_path / f"nvme-{n}"),
            staging_root=f"{s.staging_root}-{n}",
        )
        for n in ("a", "b", "c")
    }
    agents = {n: agent(settings=nodes[n]).wait_ready() for n in ("a", "b")}
    on = {0: nodes["a"], 1: nodes["b"]}
    for step in (1, 2):
        for rank, ns in on.items():
            with Checkpointer(job, rank=rank, world_size=2, settings=ns) as c:
                c.save(step, {"w": torch.full((256,), float(step * 10 + rank))})
                c.wait_until_finished(timeout=60)
    events = Events(s, job)
    for rank in on:
        events.wait_for(
            lambda e, r=rank: isinstance(e, ShardFlushed) and e.step == 2 and e.rank == r,
            kind="flushed",
        )
    # Node b is lost: its agent killed, its NVMe gone; node c (empty) replaces it.
    agents["b"].stop(signal.SIGKILL)
    shutil.rmtree(nodes["b"].nvme_root)
    shutil.rmtree(nodes["b"].staging_root, ignore_errors=True)
    agent(settings=nodes["c"]).wait_ready()

    plan = plan_json(nodes["a"], job, "--lost-node", nodes["b"].node)
    assert plan["assumes"] == "nodes_lost" and plan["lost_nodes"] == [nodes["b"].node]
    # (rank 1 reads elsewhere: a replica on node a where the job replicates, else its object)
    assert isinstance(plan["s3_ranks"], list) and isinstance(plan["peer_ranks"], list)
    assert (plan["step"], sorted(plan["s3_ranks"] + plan["peer_ranks"])) == (2, [1])

    def restore(rank: int, ns: Settings) -> tuple[int, str]:
        with Checkpointer(job, rank=rank, world_size=2, settings=ns) as c:
            got = c.restore()
            assert torch.equal(got.state["w"], torch.full((256,), float(got.step * 10 + rank)))
            return got.step, got.source.tier

    after = {0: nodes["a"], 1: nodes["c"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {r: pool.submit(restore, r, ns) for r, ns in after.items()}
        restored = {r: f.result(timeout=120) for r, f in futures.items()}
    agrees(plan, restored)
    # The check fails on a plan the restart did not follow (it is not vacuous).
    with pytest.raises(AssertionError):
        agrees({**plan, "s3_ranks": [], "peer_ranks": []}, restored)
    with pytest.raises(AssertionError):
        agrees({**plan, "step": 1}, restored)
