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

import pytest
import torch

from tierpipe import pinned

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
