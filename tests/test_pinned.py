"""Page-locking: a refused registration falls back without leaving a CUDA error behind.

The CPU build of torch has no CUDA runtime, so a tiny stand-in runtime (compiled here, loaded
into this process like libcudart) plays the part: its `cudaHostRegister` refuses and records the
error, its `cudaGetLastError` returns and resets it, exactly as the real runtime's contract says.
The real thing is checked by tests/gpu.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tierpipe.storage import pinned

_FAKE_RUNTIME = r"""
static int last_error = 0;
int cudaHostRegister(void *ptr, unsigned long size, unsigned int flags) {
    last_error = 712; /* cudaErrorHostMemoryAlreadyRegistered */
    return last_error;
}
int cudaHostUnregister(void *ptr) { return 0; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
int cudaPeekAtLastError(void) { return last_error; }
"""


@pytest.fixture
def fake_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the stand-in CUDA runtime")
    src = tmp_path / "fake.c"
    src.write_text(_FAKE_RUNTIME)
    lib_path = tmp_path / "libcudart.so.99"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib_path), str(src)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetLastError"):
        getattr(lib, name).restype = ctypes.c_int

    class Runtime:  # what torch.cuda.cudart() returns, backed by the stand-in library
        @staticmethod
        def cudaHostRegister(ptr: int, size: int, flags: int) -> int:
            return lib.cudaHostRegister(ctypes.c_void_p(ptr), ctypes.c_ulong(size), flags)

        @staticmethod
        def cudaHostUnregister(ptr: int) -> int:
            return lib.cudaHostUnregister(ctypes.c_void_p(ptr))

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    pinned._cuda_get_last_error.cache_clear()
    yield lib
    pinned._cuda_get_last_error.cache_clear()


def test_refused_registration_falls_back_and_clears_the_cuda_error(
    fake_runtime: ctypes.CDLL,
) -> None:
    """page_lock reports the refusal (False: copies stay synchronous) and leaves no "last error"
    that PyTorch's next kernel-launch check would raise."""
    import mmap

    mm = mmap.mmap(-1, 1 << 16)
    try:
        assert pinned.page_lock(mm, what="test") is False
        assert fake_runtime.cudaPeekAtLastError() == 0
    finally:
        mm.close()


def test_restore_arena_is_unlocked_on_the_device_that_locked_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With targets on two GPUs the arena is registered in the lowest device's context and must
    be unregistered in that same context (not in whichever device a loop visited last)."""
    from tierpipe.recovery import _read
    from tierpipe.recovery.load import load_into
    from tierpipe.storage.shardfile import write_shard

    path = tmp_path / "shard"
    write_shard(path, {"w": torch.arange(1 << 16, dtype=torch.float32)}, job="j", step=1)
    calls: list[tuple[str, torch.device | None]] = []
    monkeypatch.setattr(
        _read, "page_lock", lambda mm, *, what, device=None: calls.append(("lock", device)) or True
    )
    monkeypatch.setattr(
        _read, "page_unlock", lambda mm, *, device=None: calls.append(("unlock", device))
    )

    class _Stream:
        def synchronize(self) -> None:
            pass

    class _OnTwoGpus(_read.Match):
        """Matched as if every blob went into targets on GPUs 1 and 0 (none are needed here)."""

        def __init__(self, header: Any, into: Any) -> None:
            super().__init__(header, into)
            self.staged = [True] * len(header.blobs)
            self.cuda_devices = {torch.device("cuda", 1), torch.device("cuda", 0)}

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(_read, "Match", _OnTwoGpus)
    load_into(str(path))
    assert calls == [("lock", torch.device("cuda", 0)), ("unlock", torch.device("cuda", 0))]
