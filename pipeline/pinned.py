"""Page-locking host mappings for asynchronous copies between CUDA devices and host memory.

`cudaHostRegister` pins an existing mapping in place (a staging slot, a restore arena), so
copies from or to it can be non-blocking without a second, pinned host copy.
"""

from __future__ import annotations

import ctypes
import mmap

import structlog
import torch

__all__ = ["page_lock", "page_unlock"]

log = structlog.get_logger(__name__)


def page_lock(mm: mmap.mmap, *, what: str) -> bool:
    """Page-lock `mm` for asynchronous host-device copies; False (and a warning) if refused."""
    err = torch.cuda.cudart().cudaHostRegister(_address(mm), len(mm), 1)  # 1: portable
    if int(err) != 0:
        log.warning(
            "pin_failed",
            what=what,
            error=int(err),
            hint="host-device copies fall back to synchronous pageable copies",
        )
        return False
    return True


def page_unlock(mm: mmap.mmap) -> None:
    torch.cuda.cudart().cudaHostUnregister(_address(mm))


def _address(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view
