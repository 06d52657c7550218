"""A torchdata `StatefulDataLoader` in the saved state resumes its own position: the README's
example, with a real agent (what "objects with state_dict() / load_state_dict()" means)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.conftest import Agent
from tierpipe import Checkpointer
from tierpipe.settings import Settings

stateful = pytest.importorskip(
    "torchdata.stateful_dataloader", reason="torchdata is not installed (pip install torchdata)"
)


def loader(data: TensorDataset) -> object:
    # Shuffled, with a generator of its own and worker processes: the position, the order and
    # the workers' progress all live in the loader's state_dict().
    return stateful.StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3),
        num_workers=2,
    )  # fmt: skip


def test_a_stateful_dataloader_resumes_mid_epoch_from_a_checkpoint(
    settings: Settings, job: str, agent: Callable[..., Agent]
) -> None:
    """Saved after 5 batches of an epoch and restored into a fresh loader, the loader yields
    exactly the batches the first one yielded after the save, in the same order."""
    agent("nvme-write", "verify").wait_ready()
    data = TensorDataset(torch.arange(64).float().unsqueeze(1))
    first = loader(data)
    it = iter(first)
    for _ in range(5):
        next(it)
    with Checkpointer(job, settings=settings) as ckpt:
        ckpt.save(5, {"loader": first, "step": 5}).result(timeout=60)
        expected = [b[0].flatten().tolist() for b in it]  # the rest of the epoch
        again = loader(data)
        restored = ckpt.restore({"loader": again})
    assert restored.step == 5 and restored.state["step"] == 5
    got = [b[0].flatten().tolist() for b in again]
    assert got == expected and len(got) == 11
