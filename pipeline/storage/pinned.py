"""Page-locking host mappings for asynchronous copies between CUDA devices and host memory.

`cudaHostRegister` pins an existing mapping in place (a staging slot, a restore arena), so
copies from or to it can be non-blocking without a second, pinned host copy.

Two CUDA runtime details matter here. A refused registration leaves its error as the thread's
"last error", and PyTorch checks `cudaGetLastError()` after every kernel launch: the promised
fallback to pageable copies would turn into a failure of the trainer's next kernel, so the error
is cleared right away. And registration runs in the calling thread's current device context: a
helper thread's current device is 0, where the call would create a context (hundreds of MiB on
GPU 0 for every rank of the node), so callers name the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
from collections.abc import Callable, Iterator
from typing import Protocol

import structlog
import torch

__all__ = ("page_lock", "page_unlock")

log = structlog.get_logger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: usable from every context


def page_lock(mm: mmap.mmap, *, what: str, device: torch.device | None = None) -> bool:
    """Page-lock `mm` for asynchronous host-device copies; False (and a warning) if refused.

    Args:
        device: the CUDA device whose context registers it (default: the calling thread's
            current device; pass the target device from helper threads).
    """
    with _current(device):
        err = int(_cudart().cudaHostRegister(_address(mm), len(mm), _PORTABLE))
        if err != 0:
            cleared = _clear_last_error()
            log.warning(
                "pin_failed",
                what=what,
                error=err,
                error_cleared=cleared,
                hint="host-device copies fall back to synchronous pageable copies",
            )
            return False
    return True


def page_unlock(mm: mmap.mmap, *, device: torch.device | None = None) -> None:
    """Undo `page_lock` (with the same `device`)."""
    with _current(device):
        err = int(_cudart().cudaHostUnregister(_address(mm)))
        if err != 0:
            _clear_last_error()
            log.warning("unpin_failed", error=err)


@contextlib.contextmanager
def _current(device: torch.device | None) -> Iterator[None]:
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def _clear_last_error() -> bool:
    """Reset this thread's CUDA "last error"; False where the runtime's function is not found."""
    get_last_error = _cuda_get_last_error()
    if get_last_error is None:
        return False
    get_last_error()
    return True


@functools.cache
def _cuda_get_last_error() -> Callable[[], int] | None:
    """`cudaGetLastError` of the CUDA runtime this process loaded (PyTorch's bindings do not
    expose it): the shared libcudart where wheels ship one, else a library exporting it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = dict.fromkeys(
                line.split()[-1] for line in maps if "/lib" in line and ".so" in line
            )
    except OSError:
        return None
    ranked = sorted(paths, key=lambda p: ("cudart" not in p, "cuda" not in p))
    for path in ranked:
        if "cuda" not in path:
            break
        try:
            fn = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    return None


class _CudaRuntime(Protocol):
    """The two calls this module makes of torch's CUDA runtime binding (untyped in torch)."""

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int: ...
    def cudaHostUnregister(self, address: int) -> int: ...


def _cudart() -> _CudaRuntime:
    runtime: _CudaRuntime = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    return runtime


def _address(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view
