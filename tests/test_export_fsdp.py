"""`tierpipe export --to dcp` of an FSDP2 + tensor-parallel job (2x2 mesh, strided shards
included, AdamW state), saved by four ranks through the pipeline (`tests/dtensor_rank.py`):
`dcp.load` by four ranks into the same model and optimizer built with other values gives every
local shard bitwise as saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Agent
from tests.test_export import run_cli
from tierpipe.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent


def ranks(settings: Settings, module: str, args: list[str], store: Path) -> list[dict]:
    env = {**os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": "warning"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, args[0], args[1], str(rank), "4", str(store)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_an_fsdp2_tp_job_exports_to_dcp_that_loads_bitwise_into_its_model(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The four ranks' local shards after `dcp.load` of the export are the saved ones."""
    agent().wait_ready()
    saved = ranks(settings, "tests.dtensor_rank", ["save", job], tmp_path / "s1")
    out = run_cli(settings, "export", "--job", job, "--step", "2", "--to", "dcp",
                  str(tmp_path / "dcp"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    loaded = ranks(settings, "tests.test_export_fsdp", ["load", str(tmp_path / "dcp")],
                   tmp_path / "s2")  # fmt: skip
    for rank, (s, got) in enumerate(zip(saved, loaded, strict=True)):
        assert got["sums"] == s["sums"], rank


def _load(folder: str, rank: int, world: int, store: str) -> dict[str, Any]:
    """One of four ranks: the 2x2 FSDP2 + TP model and AdamW built with other values, the
    export loaded into them with `dcp.load`; the sums of the local shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dtensor_rank import build, sums, train

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        model, optimizer = build(mesh, 7)
        train(model, optimizer, 1, seed=8)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        optimizer.load_state_dict(state["optim"])
        return {"sums": sums({"model": model.state_dict(), "optim": optimizer.state_dict()})}
    finally:  # (no rank tears gloo down while another is still in a collective)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _, _mode, folder, rank, world, store = sys.argv
    print(json.dumps(_load(folder, int(rank), int(world), store)))
