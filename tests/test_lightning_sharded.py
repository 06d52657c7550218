"""The Lightning integration with `ModelParallelStrategy` (FSDP2 + tensor parallel, DTensor
state) on CPU over gloo: 2 ranks save through `TierpipeCheckpoint`, 2 ranks on the same mesh
resume in place, 1 rank and a 1x2 tensor-parallel mesh resume resharded, 1 rank validates the
newest step; every restored model and optimizer tensor gathers to the saved one bit for bit
(`tests/lightning_rank.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import finish_ranks, torchrun_env
from tierpipe.dev import free_ports
from tierpipe.errors import ConfigError
from tierpipe.settings import Settings

pytest.importorskip(
    "lightning", reason="the tierpipe[lightning] extra is not installed (pip install lightning)"
)

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).parent.parent
EPOCHS = 2  # 2 batches an epoch (every rank reads all): saves at steps 2 and 4


def run(
    settings: Settings, job: str, world: int, epochs: int, out: Path, tp: int = 1, *extra: str
) -> None:
    """`world` ranks of tests/lightning_rank.py as torchrun starts them; all exit 0."""
    port = free_ports(1)[0]
    procs = []
    for rank in range(world):
        env = torchrun_env(settings, rank, world, port)
        args = ["--job", job, "--world", str(world), "--tp", str(tp), "--epochs", str(epochs)]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.lightning_rank", *args, "--out", str(out), *extra],
                env=env,
                cwd=REPO,
            )
        )
    finish_ranks(procs, 150)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_model_parallel_saves_and_resumes_in_place_and_resharded(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path
) -> None:
    agent()
    first = tmp_path / "first.jsonl"
    run(settings, job, 2, EPOCHS, first)
    (start, end) = records(first)
    assert (start["epoch"], start["step"]) == (0, 0)
    assert (end["step"], end["world"]) == (4, 2)
    assert len(end["tensors"]) == 4 * 4  # 4 parameters; AdamW's step, exp_avg, exp_avg_sq each

    # Each run resumes the previous one's last save and trains one more epoch: on the same
    # mesh (in place), on one rank (resharded), on a 1x2 tensor-parallel mesh (resharded).
    for world, tp in ((2, 1), (1, 1), (2, 2)):
        epochs = end["epoch"]  # (at the end of fit: the number of epochs trained)
        out = tmp_path / f"resume-{world}-{tp}.jsonl"
        run(settings, job, world, epochs + 1, out, tp=tp)
        resumed, last = records(out)
        assert resumed["when"] == "start"
        assert (resumed["epoch"], resumed["step"]) == (epochs, end["step"])
        assert resumed["world"] == world
        assert resumed["lr"] == end["lr"]
        assert resumed["tensors"] == end["tensors"], (world, tp)
        assert last["step"] == end["step"] + 2
        end = last

    # Validation of the newest step on one rank: the weights only (no optimizer outside fit).
    out = tmp_path / "validate.jsonl"
    run(settings, job, 1, 1, out, 1, "--validate")
    (validated,) = records(out)
    weights = {k: v for k, v in end["tensors"].items() if "/" not in k}
    assert validated["tensors"] == weights


def test_fsdp1_and_deepspeed_are_refused_with_the_reason(settings: Settings, job: str) -> None:
    """FSDPStrategy (FSDP1) is refused at setup, naming why and what to use instead (Lightning
    builds no FSDPStrategy Trainer on CPU: the strategy alone stands for it), and so is a
    ModelParallelStrategy that would save full state dicts on rank 0 only."""
    from types import SimpleNamespace

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import (
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
    )

    from tierpipe.integrations.lightning import TierpipeCheckpoint
    from tierpipe.integrations.model_parallel import refusal

    cb = TierpipeCheckpoint(job, settings=settings)
    trainer: Any = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ConfigError, match=r"FSDP1.*ShardedTensor.*ModelParallelStrategy"):
        cb.setup(trainer, pl.LightningModule(), "fit")
    assert cb._checkpointer is None  # refused before anything was opened
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(save_distributed_checkpoint=False))
    with pytest.raises(ConfigError, match="save_distributed_checkpoint=True"):
        cb.setup(trainer, pl.LightningModule(), "fit")
    # (DeepSpeed itself is not installed: an uninitialised strategy object stands for it)
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    assert "ZeRO-partitioned" in refusal(deepspeed)
