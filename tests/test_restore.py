"""Loading shards into live training objects, in place, verified first."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from tierpipe.errors import IntegrityError, ShardFormatError
from tierpipe.recovery.load import load_into
from tierpipe.storage import layout
from tierpipe.storage.reader import read_head
from tierpipe.storage.shardfile import write_shard


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


def _shard(tmp_path: Path, sizes: list[int]) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(len(sizes))
    state = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
             for i, n in enumerate(sizes)}  # fmt: skip
    path = tmp_path / f"{uuid.uuid4().hex}.shard"  # hypothesis reuses tmp_path
    write_shard(path, state, job="j", step=1)
    return path, state


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=hs.lists(hs.integers(0, 70_000), min_size=1, max_size=12),
    with_target=hs.lists(hs.booleans(), min_size=12, max_size=12),
    depth=hs.integers(1, 4),
    chunk_pages=hs.integers(1, 5),
    direct_io=hs.booleans(),
)
def test_arena_laps_and_chunks_restore_exactly(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sizes: list[int],
    with_target: list[bool],
    depth: int,
    chunk_pages: int,
    direct_io: bool,
) -> None:
    """Blobs of any size, some into targets (through a tiny arena that wraps many times), some
    returned new, read at any depth and chunk size: every tensor comes back bit-exact."""
    monkeypatch.setattr(layout, "ARENA_MIN_BYTES", 4096)
    path, state = _shard(tmp_path, sizes)
    into = {
        k: torch.zeros_like(v) for (k, v), t in zip(state.items(), with_target, strict=False) if t
    }
    loaded = load_into(
        str(path), into, direct_io=direct_io, queue_depth=depth, chunk_bytes=4096 * chunk_pages
    )
    for k, v in state.items():
        assert torch.equal(loaded.state[k], v), k
        if k in into:
            assert torch.equal(into[k], v), k  # the caller's own tensor, written in place
    assert loaded.in_place == len(into)


def test_corrupt_blob_in_the_arena_stops_before_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier blobs (verified) reach their targets; the corrupt one and all after it do not."""
    monkeypatch.setattr(layout, "ARENA_MIN_BYTES", 4096)
    path, state = _shard(tmp_path, [50_000, 30_000, 90_000, 10_000])
    head = read_head(path)
    bad = head.header.blobs[2]
    raw = bytearray(path.read_bytes())
    raw[head.data_offset + bad.offset + bad.nbytes - 1] ^= 0x40
    path.write_bytes(raw)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(IntegrityError, match="tensor t2"):
        load_into(str(path), into, queue_depth=3, chunk_bytes=8192)
    assert torch.equal(into["t0"], state["t0"]) and torch.equal(into["t1"], state["t1"])
    assert not into["t2"].any() and not into["t3"].any()


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    path, state = _shard(tmp_path, [50_000, 30_000])
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 5000)
    with pytest.raises(ShardFormatError):
        load_into(str(path), {k: torch.zeros_like(v) for k, v in state.items()})
