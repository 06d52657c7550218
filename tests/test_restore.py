"""Loading shards into live training objects, in place, verified first."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pipeline.errors import IntegrityError
from pipeline.restore import load_into
from pipeline.state import write_shard
from pipeline.storage.nvme import read_head


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    return model, opt


def test_restore_into_model_and_optimizer_in_place(tmp_path: Path) -> None:
    """A fresh model and optimizer end up bit-identical to the saved ones; model tensors are
    written in place (same storage as before), the optimizer is loaded with its state."""
    model, opt = trained(0)
    path = tmp_path / "s.shard"
    write_shard(
        path, {"model": model, "optim": opt, "step": 2, "py": random.getstate()}, job="j", step=2
    )
    fresh, fresh_opt = trained(1)
    before = {k: v.data_ptr() for k, v in fresh.state_dict().items()}
    loaded = load_into(str(path), {"model": fresh, "optim": fresh_opt})
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
        assert fresh.state_dict()[k].data_ptr() == before[k]
    saved, restored = opt.state_dict(), fresh_opt.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    for idx, st in saved["state"].items():
        for name, t in st.items():
            assert torch.equal(restored["state"][idx][name], t), (idx, name)
    assert loaded.state["step"] == 2 and loaded.in_place >= len(before)


def test_restore_without_targets_returns_new_tensors(tmp_path: Path) -> None:
    """With no targets, the state comes back as new CPU tensors."""
    state = {
        "a": torch.randn(1000),
        "b": torch.arange(10),
        "c": [torch.ones(3, dtype=torch.bfloat16)],
    }
    write_shard(tmp_path / "s.shard", state, job="j", step=1)
    loaded = load_into(str(tmp_path / "s.shard"))
    assert torch.equal(loaded.state["a"], state["a"]) and torch.equal(loaded.state["b"], state["b"])
    assert torch.equal(loaded.state["c"][0], state["c"][0]) and loaded.in_place == 0


def test_mismatched_target_gets_a_new_tensor(tmp_path: Path) -> None:
    """A target of another shape is left alone and the saved tensor comes back new."""
    write_shard(tmp_path / "s.shard", {"w": torch.ones(4)}, job="j", step=1)
    target = torch.zeros(5)
    loaded = load_into(str(tmp_path / "s.shard"), {"w": target})
    assert torch.equal(loaded.state["w"], torch.ones(4)) and torch.equal(target, torch.zeros(5))


def test_corrupt_tensor_never_reaches_its_target(tmp_path: Path) -> None:
    """A flipped byte stops the load with IntegrityError before that tensor's target changes."""
    path = tmp_path / "s.shard"
    write_shard(path, {"w": torch.ones(100_000)}, job="j", step=1)
    head = read_head(path)
    raw = bytearray(path.read_bytes())
    raw[head.data_offset + 5000] ^= 1
    path.write_bytes(raw)
    target = torch.zeros(100_000)
    with pytest.raises(IntegrityError, match="tensor w"):
        load_into(str(path), {"w": target})
    assert torch.equal(target, torch.zeros(100_000))
