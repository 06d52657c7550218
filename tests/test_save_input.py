"""What `save()` takes as a step: any integer (Python, numpy, a 0-dim torch integer tensor), as a
plain int, and never a bool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tierpipe.schemas import ShardStaged
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer


@pytest.mark.parametrize("step", [True, False, np.bool_(True), torch.tensor(True)])
def test_a_bool_step_is_refused(settings: Settings, job: str, step: object) -> None:
    """A bool is not a step: save() refuses it before anything is copied or marked."""
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        with pytest.raises(ValueError, match="bool"):
            ckpt.save(step, {"w": torch.ones(4)})  # type: ignore[arg-type]
        rank_dir = Path(settings.staging_root) / job / "rank-00000"
        assert list(rank_dir.glob("slot-*.step-*")) == []


@pytest.mark.parametrize(
    "step",
    [np.int64(2), np.int32(2), np.uint16(2), torch.tensor(2), torch.tensor(2, dtype=torch.int32)],
    ids=["np.int64", "np.int32", "np.uint16", "torch.int64", "torch.int32"],
)
def test_an_integral_step_is_saved_as_an_int(settings: Settings, job: str, step: object) -> None:
    """numpy integers and 0-dim torch integer tensors are steps: the `staged` event says 2."""
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        staged = ckpt.save(step, {"w": torch.ones(4)}).wait("staged", timeout=30)  # type: ignore[arg-type]
    assert isinstance(staged, ShardStaged)
    assert staged.step == 2 and type(staged.step) is int


@pytest.mark.parametrize("step", [2.0, "2", torch.tensor(2.0), torch.tensor([2]), -1])
def test_a_step_that_is_no_integer_is_refused(settings: Settings, job: str, step: object) -> None:
    """Floats, strings, tensors of more than one value and negative numbers are refused by
    name."""
    with (
        Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt,
        pytest.raises(ValueError, match="step must be a non-negative integer"),
    ):
        ckpt.save(step, {"w": torch.ones(4)})  # type: ignore[arg-type]
