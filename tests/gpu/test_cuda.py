"""The CUDA paths, on a real GPU: `make test-gpu` (skipped where CUDA is unavailable).

Save and restore of awkward CUDA tensors, overlapped saves checked bit for bit against the file,
the page-locking fallback, the restore arena registered on the target device, and device-to-host
bandwidth into a staging slot against a plain pinned-tensor copy. The whole module takes well
under 3 minutes on one GPU.
"""

from __future__ import annotations

import json
import mmap
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.conftest import Agent
from tierpipe.recovery.load import load_into, load_shard
from tierpipe.settings import Settings
from tierpipe.storage import pinned
from tierpipe.trainer.checkpointer import Checkpointer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def ckpt(settings: Settings, job: str, agent: Callable[..., Agent]) -> Iterator[Checkpointer]:
    agent("nvme-write", "verify", "evict").wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as c:
        yield c


def awkward_state(device: torch.device) -> dict[str, object]:
    torch.manual_seed(0)
    base = torch.randn(64, 48, device=device)
    big = torch.randn(4096, device=device)
    linear = torch.nn.Linear(16, 16).to(device)
    return {
        "transposed": base.t(),  # non-contiguous
        "offset_view": big[1000:1500],  # a view at an offset of a larger storage
        "strided": base[::2, 1::3],
        "bf16": torch.randn(33, 7, device=device).to(torch.bfloat16),
        "fp8": torch.randn(128, device=device).to(torch.float8_e4m3fn),
        "half": torch.randn(5, 5, device=device).half(),
        "scalar": torch.tensor(3.5, device=device),
        "empty": torch.empty(0, 3, device=device),
        "ints": torch.arange(100, device=device, dtype=torch.int32),
        "tied": {"a": linear.weight, "b": linear.weight},  # one storage, two names
        "bias": linear.bias,
    }


def _cpu(state: dict[str, object]) -> dict[str, object]:
    return {
        k: _cpu(v) if isinstance(v, dict) else v.detach().cpu().clone()  # type: ignore[union-attr]
        for k, v in state.items()
    }


def _assert_equal(got: object, want: object, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for k in want:
            _assert_equal(got[k], want[k], f"{path}/{k}")
        return
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), path
    assert got.dtype == want.dtype and got.shape == want.shape, path
    # Bitwise, via the raw bytes (fp8/bf16 have no exact CPU comparison for every value).
    a, b = got.detach().cpu().contiguous(), want.contiguous()
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), path


def test_awkward_cuda_tensors_round_trip(ckpt: Checkpointer) -> None:
    """Non-contiguous, offset, strided, bf16/fp8, 0-dim, empty and tied CUDA tensors are saved
    bit for bit and restore into fresh CUDA targets in place, tied ones still tied."""
    device = torch.device("cuda", torch.cuda.current_device())
    state = awkward_state(device)
    want = _cpu(state)
    verified = ckpt.save(1, state).result(timeout=60)
    _, on_disk = load_shard(verified.path)
    _assert_equal(on_disk, want)

    targets = {
        k: (
            {kk: torch.zeros_like(vv) for kk, vv in v.items()}
            if isinstance(v, dict)
            else torch.zeros_like(v)
        )
        for k, v in state.items()
    }
    targets["tied"]["b"] = targets["tied"]["a"]
    loaded = load_into(verified.path, targets)
    _assert_equal(loaded.state, want)
    assert loaded.state["tied"]["a"].data_ptr() == loaded.state["tied"]["b"].data_ptr()
    assert all(t.is_cuda for k, t in targets.items() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("guarded", [True, False])
def test_overlapped_save_matches_the_file_bit_for_bit(ckpt: Checkpointer, guarded: bool) -> None:
    """save(blocking=False) of a CUDA model: with the guard, the optimizer step right after it
    waits (on the GPU) for the copy; without it, the trainer waits with wait_staged(). Either
    way the file holds exactly the pre-step state."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(32, 1024, device="cuda")).square().mean().backward()
    opt.step()
    guard = ckpt.guard(opt) if guarded else None
    before = _cpu({"model": dict(model.state_dict())})
    handle = ckpt.save(2 if guarded else 3, {"model": model}, blocking=False)
    if not guarded:
        handle.wait_staged(timeout=60)
    model(torch.randn(32, 1024, device="cuda")).square().mean().backward()
    opt.step()
    torch.cuda.synchronize()
    verified = handle.result(timeout=60)
    _, on_disk = load_shard(verified.path)
    _assert_equal({"model": on_disk["model"]}, before)
    if guard is not None:
        guard.remove()


def test_refused_page_lock_leaves_no_error_for_the_next_kernel() -> None:
    """Registering a mapping twice is refused; page_lock falls back (False) and the next
    kernel launch and synchronise raise nothing."""
    mm = mmap.mmap(-1, 1 << 20)
    assert pinned.page_lock(mm, what="test") is True
    try:
        assert pinned.page_lock(mm, what="test again") is False
        x = torch.ones(1024, device="cuda") * 2  # PyTorch checks cudaGetLastError() here
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
    finally:
        pinned.page_unlock(mm)
        mm.close()


def test_restore_registers_its_arena_on_the_target_device(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore arena is page-locked from a helper thread with the target's device current,
    never device 0 by default (that would create a context on GPU 0 for every rank)."""
    from tierpipe.recovery import _read
    from tierpipe.storage.shardfile import write_shard

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    seen: list[int] = []
    real = _read.page_lock

    def spy(mm: mmap.mmap, *, what: str, device: torch.device | None = None) -> bool:
        with torch.cuda.device(device) if device is not None else torch.cuda.device(None):
            seen.append(torch.cuda.current_device())
        return real(mm, what=what, device=device)

    monkeypatch.setattr(_read, "page_lock", spy)
    path = tmp_path / "s.shard"
    write_shard(path, {"w": torch.randn(1 << 20)}, job="j", step=1)
    target = {"w": torch.zeros(1 << 20, device=device)}
    import threading

    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(load_into(str(path), target)))
    worker.start()
    worker.join()
    assert seen == [device.index]
    assert torch.equal(target["w"].cpu(), load_shard(path)[1]["w"])


def test_device_to_host_into_the_staging_slot_vs_pin_memory(ckpt: Checkpointer) -> None:
    """save() of 1 GiB of CUDA tensors blocks about as long as a plain copy into a pinned host
    tensor (the slot is page-locked in place); prints the ratio."""
    n = 64
    tensors = [torch.randn(4 << 20, device="cuda") for _ in range(n)]  # 64 x 16 MiB
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    state = {"w": tensors}
    ckpt.reserve(state)
    pinned_dst = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]

    def plain() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(pinned_dst, tensors, strict=True):
            d.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    stalls, baselines = [], []
    for step in range(1, 6):
        baselines.append(plain())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = ckpt.save(step, state)
        stalls.append(time.perf_counter() - t0)
        handle.result(timeout=120)
    stall, base = sorted(stalls)[2], sorted(baselines)[2]
    report = {
        "gpu_stall_s": stall,
        "pin_memory_copy_s": base,
        "stall_vs_pinned_copy": stall / base,
        "gib_s": nbytes / stall / 2**30,
        "nbytes": nbytes,
    }
    print("\ncuda d2h:", json.dumps(report))
    assert stall / base < 1.5, report
