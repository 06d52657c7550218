"""`tierpipe import --from dcp`: a job started from a torch.distributed.checkpoint checkpoint
(saved by two gloo ranks holding DTensors) restores as step S of the job, bit for bit; a job
that already has steps is refused unless the step is newer; a folder that is no checkpoint, a
`.metadata` or a value that would run code when unpickled, a data file name outside the
folder and a truncated data file are refused with exit status 2, and nothing they hold runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Agent
from tierpipe import Checkpointer
from tierpipe.dev.process import free_ports
from tierpipe.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """`tierpipe <args>` as an operator runs it (conftest's, with room for a loaded machine:
    an export or import reads and writes whole checkpoints)."""
    return subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", *args],
        env={**os.environ, **settings.as_env()},
        capture_output=True,
        text=True,
        timeout=240,
    )


def full_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g),
                  "h": torch.randn(3, 5, generator=g).to(torch.bfloat16)},
        "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": [0, 1]}]},
        "step": 41,
    }  # fmt: skip


def save_dcp_by_two_ranks(folder: Path) -> dict[str, Any]:
    """`dcp.save` by two gloo processes: w sharded by rows, h by columns, b replicated."""
    port = free_ports(1)[0]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_import_dcp", str(folder)],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for r in range(2)
    ]
    for p in procs:
        output, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "dcp saved" in output, output
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    return full_state()


def same_state(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b), (list(a), list(b))
        for k in a:
            same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_state(x, y)
    else:
        assert a == b


def test_a_dcp_checkpoint_imports_as_a_step_that_restores_bit_for_bit(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The two ranks' DTensor shards come back as the full tensors, the values as saved; the
    job then refuses an import at the same step, and takes one at a newer step (here as two
    ranks that each hold the full state)."""
    agent().wait_ready()
    want = save_dcp_by_two_ranks(tmp_path / "ckpt")
    out = run_cli(settings, "import", "--from", "dcp", str(tmp_path / "ckpt"), "--job", job)
    assert out.returncode == 0, out.stderr
    assert f"as step 0 of {job} (1 ranks, 3 tensors" in out.stdout and "verified" in out.stdout
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        restored = ckpt.restore()
    assert restored.step == 0
    same_state(restored.state, want)

    out = run_cli(settings, "import", "--from", "dcp", str(tmp_path / "ckpt"), "--job", job)
    assert out.returncode == 2 and "already has steps up to 0" in out.stderr, out.stderr
    out = run_cli(settings, "import", "--from", "dcp", str(tmp_path / "ckpt"), "--job", job,
                  "--step", "5", "--world", "2")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"as step 5 of {job} (2 ranks" in out.stdout
    out = run_cli(settings, "status", "--job", job, "--json")
    steps = {s["step"]: s for s in map(json.loads, out.stdout.splitlines())}
    assert (steps[5]["world_size"], steps[5]["nvme_ranks"]) == (2, 2), steps


class RunsCode:
    """An object whose unpickling runs a shell command (what a crafted checkpoint holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_what_is_no_safe_dcp_checkpoint_is_refused_and_runs_nothing(
    settings: Settings, job: str, agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """An error with the reason, for: no folder, no `.metadata` (usage errors, exit status 2), a
    `.metadata` naming a callable, a data file outside the folder, a truncated data file, a
    value that unpickles by running code (a bad checkpoint, 1); the job gets no step and no
    crafted code ran."""
    import torch.distributed.checkpoint as dcp

    agent().wait_ready()
    marker = tmp_path / "ran"

    def refused(folder: Path, why: str) -> None:
        out = run_cli(settings, "import", "--from", "dcp", str(folder), "--job", job)
        usage = why.startswith(("no such", "not a DCP"))
        assert out.returncode == (2 if usage else 1), out.stdout + out.stderr
        assert why in out.stderr, out.stderr
        assert not marker.exists()

    refused(tmp_path / "none", "no such directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "not a DCP checkpoint (no .metadata in it)")

    good = tmp_path / "good"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(good), no_dist=True)
    metadata = pickle.loads((good / ".metadata").read_bytes())  # (our own file: trusted)

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    refused(hostile, "which no DCP metadata holds")

    outside = tmp_path / "outside"
    outside.mkdir()
    for info in metadata.storage_data.values():
        info.relative_path = "../good/__0_0.distcp"
    (outside / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(outside, "a data file name outside the folder")

    short = tmp_path / "short"
    dcp.save({"w": torch.ones(300)}, checkpoint_id=str(short), no_dist=True)
    data = short / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-200])
    refused(short, "past its")

    code = tmp_path / "code"
    dcp.save({"w": torch.ones(3), "x": RunsCode(marker)}, checkpoint_id=str(code), no_dist=True)
    refused(code, "its data does not load")
    out = run_cli(settings, "status", "--job", job)
    assert out.returncode == 1, out.stdout  # (no step, no job state: not found)


def _save(folder: str) -> None:
    """One of two gloo ranks: `dcp.save` of the state with DTensors on a 1-d mesh of 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    state = full_state()
    model = state["model"]
    model["w"] = distribute_tensor(model["w"], mesh, [Shard(0)])
    model["b"] = distribute_tensor(model["b"], mesh, [Replicate()])
    model["h"] = distribute_tensor(model["h"], mesh, [Shard(1)])
    dcp.save(state, checkpoint_id=folder)
    dist.barrier()
    dist.destroy_process_group()
    print("dcp saved")


if __name__ == "__main__":
    _save(sys.argv[1])
