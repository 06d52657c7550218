"""DDP through the integrations (2 processes, CPU, gloo): Lightning's `TierpipeCheckpoint` and the
Hugging Face `TierpipeCallback` store the model and the optimizer state once per job (rank 1's
shard holds none of their bytes, on NVMe and in object storage), and a resume gives every rank
the saved weights and optimizer state bit for bit and its own RNG state
(`tests/lightning_ddp_rank.py`, `tests/hf_ddp_rank.py`)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Events, finish_ranks, torchrun_env
from tierpipe.dev import free_ports
from tierpipe.errors import ConfigError
from tierpipe.names import shard_relpath
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings
from tierpipe.storage.reader import read_head

pytestmark = pytest.mark.timeout(600)  # (two gloo ranks on a loaded 2-core machine)

REPO = Path(__file__).parent.parent
WORLD = 2


def run(settings: Settings, module: str, *args: str) -> list[str]:
    """`WORLD` ranks of `python -m module args` as torchrun starts them; all exit 0. Their
    stderr (logs at warning and above), per rank."""
    port = free_ports(1)[0]
    with contextlib.ExitStack() as stack:
        # (files, not pipes: a full pipe would block a rank)
        errs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(WORLD)]

        def logs() -> list[str]:
            for err in errs:
                err.seek(0)
            return [err.read().decode(errors="replace") for err in errs]

        procs = [
            subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stderr=errs[rank],
                             env=torchrun_env(settings, rank, WORLD, port))
            for rank in range(WORLD)
        ]  # fmt: skip
        finish_ranks(procs, 300, lambda: "\n".join(x[-3000:] for x in logs()))
        return logs()


def held(settings: Settings, job: str, step: int) -> dict[int, dict[str, int]]:
    """Per rank, the bytes its NVMe shard of `step` holds under each top-level key."""
    out: dict[int, dict[str, int]] = {}
    for rank in range(WORLD):
        path = Path(settings.nvme_root).absolute() / shard_relpath(job, step, rank, WORLD)
        header = read_head(str(path)).header
        sums: dict[str, int] = {}
        for e in header.tensors:
            key = str(e.path[0])
            sums[key] = sums.get(key, 0) + header.blobs[e.blob].nbytes
        out[rank] = sums
    return out


def flushed(events: Events, step: int) -> dict[int, int]:
    """Per rank, the object-storage bytes of its shard of `step` (once both are uploaded)."""
    return {
        r: events.wait_for(
            lambda e, r=r: isinstance(e, ShardFlushed) and (e.step, e.rank) == (step, r),
            kind="flushed", timeout=120,
        ).nbytes  # type: ignore[attr-defined]
        for r in range(WORLD)
    }  # fmt: skip


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- Lightning


@pytest.mark.slow
def test_lightning_ddp_stores_the_model_once_and_resumes_every_rank(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path, events: Events
) -> None:
    """2 DDP ranks train 3 epochs, saving at each end (steps 4, 8, 12): rank 1's shard holds
    no bytes of `state_dict` and `optimizer_states`, rank 0's all, so object storage holds about
    one replica, where a run with `replicated=()` stores it twice; each rank holds its own RNG.
    A resume from step 8 (other initial weights) starts every rank with the saved weights and
    AdamW state bit for bit, and each rank's dropout draws what it drew in the first run (its
    own RNG came back), to the same final weights."""
    every = f"{job}-all"
    Path(settings.staging_root, every).mkdir(parents=True, exist_ok=True)
    agent()
    out = tmp_path / "first-"
    run(settings, "tests.lightning_ddp_rank", job, "3", str(out))
    first = [jsonl(Path(f"{out}{r}.jsonl")) for r in range(WORLD)]
    saved = [next(e for e in f if (e["when"], e["step"]) == ("epoch_end", 8)) for f in first]
    assert saved[0]["tensors"] == saved[1]["tensors"]  # (DDP: the same on every rank)
    assert saved[0]["rng"] != saved[1]["rng"]  # (each rank's dropout draws its own)

    # (the newest step: the flush stage may skip an older one a newer one supersedes)
    shards = held(settings, job, 12)
    replica = shards[0]["state_dict"] + shards[0]["optimizer_states"]
    assert shards[0]["state_dict"] > 0 and shards[0]["optimizer_states"] > 0
    assert shards[1]["state_dict"] == shards[1]["optimizer_states"] == 0
    assert shards[0]["tierpipe_rng"] == shards[1]["tierpipe_rng"] > 0
    once = flushed(events, 12)
    assert once[0] - once[1] >= replica

    # The same run with the override: every rank stores its own copy.
    run(settings, "tests.lightning_ddp_rank", every, "1", str(tmp_path / "all-"),
        "--no-replicated")  # fmt: skip
    shards_all = held(settings, every, 4)
    assert shards_all[1]["state_dict"] == shards[0]["state_dict"]
    twice = flushed(Events(settings, every), 4)
    assert sum(twice.values()) - sum(once.values()) >= replica
    print(json.dumps({"lightning_ddp_object_bytes_per_job": sum(once.values()),
                      "undeclared": sum(twice.values()), "replica_bytes": replica}))  # fmt: skip

    resumed = tmp_path / "resumed-"
    logs = run(settings, "tests.lightning_ddp_rank", job, "3", str(resumed), "--seed", "1",
               "--resume", "8")  # fmt: skip
    # (a replica restored without a target comes back whole: nothing to warn about)
    assert not [x for x in logs if "reshard_without_target" in x]
    for rank in range(WORLD):
        records = jsonl(Path(f"{resumed}{rank}.jsonl"))
        assert (records[0]["when"], records[0]["step"]) == ("start", 8)
        assert records[0]["tensors"] == saved[rank]["tensors"], rank
        batches = [(e["step"], e["rng"]) for e in records if e["when"] == "batch"]
        assert batches == [(e["step"], e["rng"]) for e in first[rank] if e["when"] == "batch"
                           and e["step"] >= 8], rank  # fmt: skip
        assert records[-1]["tensors"] == first[rank][-1]["tensors"], rank


def test_lightning_replicated_override_is_checked(settings: Settings, job: str) -> None:
    """`replicated` takes key names: a bare string is refused at once; the default rule
    declares DDP's keys only under DDP of more than one rank (not on a single device, nor
    under ModelParallelStrategy, whose DTensors describe their layout); an explicit choice
    wins."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import (
        DDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    from tierpipe.integrations.lightning import TierpipeCheckpoint

    with pytest.raises(ConfigError, match="key names"):
        TierpipeCheckpoint(job, settings=settings, replicated="state_dict")
    cb = TierpipeCheckpoint(job, settings=settings)
    ddp: Any = SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    assert cb._declared(ddp) == {"state_dict", "optimizer_states"}
    one: Any = SimpleNamespace(strategy=DDPStrategy(), world_size=1)
    assert cb._declared(one) == set()
    single: Any = SimpleNamespace(strategy=SingleDeviceStrategy(), world_size=1)
    assert cb._declared(single) == set()
    sharded: Any = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2)
    assert cb._declared(sharded) == set()
    assert TierpipeCheckpoint(job, settings=settings, replicated=())._declared(ddp) == set()
    mine = TierpipeCheckpoint(job, settings=settings, replicated=["state_dict"])
    assert mine._declared(single) == {"state_dict"}


# --- Hugging Face


@pytest.mark.slow
def test_hf_ddp_stores_the_model_once_and_resumes_every_rank(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path, events: Events
) -> None:
    """2 DDP ranks of a Trainer save steps 2 and 4: rank 1's shard holds no bytes of `model`
    and `optimizer`, its `rng` its own. `resume_dir()` writes every rank a folder with the
    saved weights and optimizer state bit for bit and that rank's own RNG state, from which the
    Trainer trains on."""
    pytest.importorskip("transformers")
    agent()
    out = tmp_path / "saved-"
    run(settings, "tests.hf_ddp_rank", job, str(out), "save")
    saved = [json.loads(Path(f"{out}{r}.json").read_text()) for r in range(WORLD)]
    assert saved[0]["tensors"] == saved[1]["tensors"]
    assert saved[0]["rng"] != saved[1]["rng"]

    shards = held(settings, job, 4)
    assert shards[0]["model"] > 0 and shards[0]["optimizer"] > 0
    assert shards[1]["model"] == shards[1]["optimizer"] == 0
    assert shards[0]["rng"] == shards[1]["rng"] > 0
    sizes = flushed(events, 4)
    assert sizes[0] - sizes[1] >= shards[0]["model"] + shards[0]["optimizer"]

    resumed = tmp_path / "resumed-"
    logs = run(settings, "tests.hf_ddp_rank", job, str(resumed), "resume")
    assert not [x for x in logs if "reshard_without_target" in x]
    for rank in range(WORLD):
        got = json.loads(Path(f"{resumed}{rank}.json").read_text())
        assert got["folder"] == f"step-4-rank-{rank}"
        assert got["tensors"] == saved[rank]["tensors"], rank
        assert got["rng"] == saved[rank]["rng"], rank
        assert got["step"] == 6


def test_hf_replicated_override_is_checked(tmp_path: Path) -> None:
    """`replicated` names keys of the callback's save; anything else is refused at once."""
    pytest.importorskip("transformers")
    from tierpipe.integrations.hf import TierpipeCallback

    with pytest.raises(ConfigError, match=r"does not have: \['weights'\]"):
        TierpipeCallback("j", replicated=("model", "weights"))
    with pytest.raises(ConfigError, match="key names"):
        TierpipeCallback("j", replicated="model")
    TierpipeCallback("j", replicated=())
