"""`tierpipe export`: a step written as torch, safetensors and DCP checkpoints, each loaded back
with that format's own loader and compared bit for bit with what was saved; from NVMe, and from
object storage once the NVMe copy is gone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Agent, Events, run_cli
from tierpipe import Checkpointer
from tierpipe.names import shard_relpath
from tierpipe.schemas import ShardFlushed
from tierpipe.settings import Settings

pytestmark = pytest.mark.slow


def saved_state() -> dict[str, Any]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "step": 7,
        "note": "hello",
        "rng": torch.get_rng_state(),
        "half": torch.randn(5, dtype=torch.bfloat16),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {
            k: v for key, value in state.items() for k, v in flat(value, f"{prefix}{key}.").items()
        }
    if isinstance(state, list | tuple):
        return {
            k: v for i, value in enumerate(state) for k, v in flat(value, f"{prefix}{i}.").items()
        }
    return {prefix[:-1]: state}


def check(loaded: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(loaded) == set(want), set(loaded) ^ set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert same(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def load_each(out: Path, fmt: str) -> dict[str, Any]:
    """What each format's own loader gives back, flattened to dotted keys."""
    if fmt == "torch":
        return flat(torch.load(out / "rank-00000-of-00001.pt", weights_only=True))
    if fmt == "safetensors":
        from safetensors import safe_open

        with safe_open(out / "rank-00000-of-00001.safetensors", framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert json.loads(meta["tierpipe.checkpoint"])["step"] == 1
        return {**tensors, **json.loads(meta["tierpipe.values"])}
    import torch.distributed.checkpoint as dcp

    template = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                for k, v in flat(_dcp_shape(saved_state())).items()}  # fmt: skip
    nested = _nest(template)
    dcp.load(nested, checkpoint_id=str(out / "rank-00000-of-00001"), no_dist=True)
    return flat(nested)


def _dcp_shape(state: Any) -> Any:
    if isinstance(state, dict):
        return {str(k): _dcp_shape(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return {str(i): _dcp_shape(v) for i, v in enumerate(state)}
    return state


def _nest(flat_state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat_state.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def test_a_step_exports_to_torch_safetensors_and_dcp_bit_for_bit(
    settings: Settings, job: str, agent: Callable[..., Agent], events: Events, tmp_path: Path
) -> None:
    agent().wait_ready()
    state = saved_state()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        ckpt.save(1, state).wait("verified", timeout=30)
    events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
    want = flat(state)
    for fmt in ("torch", "safetensors", "dcp"):
        out = run_cli(settings, "export", "--job", job, "--to", fmt, str(tmp_path / fmt))
        assert out.returncode == 0, out.stderr
        assert f"exported step 1 of {job} (1 ranks) as {fmt}" in out.stdout
        loaded = load_each(tmp_path / fmt, fmt)
        check(loaded, want)  # (every format by dotted key path: lists by index)

    Path(settings.nvme_root, shard_relpath(job, 1, 0, 1)).unlink()  # (object storage then)
    out = run_cli(settings, "export", "--job", job, "--step", "1", "--to", "torch",
                  str(tmp_path / "from-s3"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    check(
        flat(torch.load(tmp_path / "from-s3" / "rank-00000-of-00001.pt", weights_only=True)), want
    )

    out = run_cli(settings, "export", "--job", job, "--step", "9", "--to", "torch", str(tmp_path))
    assert out.returncode == 2 and "step 9" in out.stderr and "no record" in out.stderr
