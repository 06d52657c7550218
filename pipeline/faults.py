"""Fault injection for the fault suite: a process kills itself (SIGKILL) at a named commit point.

`settings.fault_point` names at most one point; production leaves it empty and every call is a
string comparison. The points of the nvme-write stage, in the order a write passes them:

- `nvme-write:mid-write`: after the first data chunk reached the temp file;
- `nvme-write:after-fsync`: the temp file is complete and fsynced, not yet linked into place;
- `nvme-write:after-link`: the final file is linked, the directory not yet fsynced;
- `nvme-write:before-ack`: `written` is published, the message not yet acked.

And one point where a stage raises an unexpected exception instead (`maybe_fail`):

- `evict:on-failed`: evict's handler, given a `failed` event (a message no stage but evict
  consumes, which once crashed the whole agent).
"""

from __future__ import annotations

import os
import signal

import structlog

__all__ = ("FAIL_POINTS", "POINTS", "maybe_die", "maybe_fail")

log = structlog.get_logger(__name__)

POINTS = (
    "nvme-write:mid-write",
    "nvme-write:after-fsync",
    "nvme-write:after-link",
    "nvme-write:before-ack",
)
#: Points where `maybe_fail` raises.
FAIL_POINTS = ("evict:on-failed",)


def maybe_die(point: str, configured: str) -> None:
    """SIGKILL this process if `configured` (the `fault_point` setting) names `point`.

    SIGKILL, not an exception or exit: nothing may run after it (no finally blocks, no flush of
    buffers), exactly like a power cut or the OOM killer at that instant.
    """
    if configured and configured == point:
        log.warning("fault_point_reached", point=point, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_fail(point: str, configured: str) -> None:
    """Raise an unexpected (non-tierpipe) error if `configured` names `point`."""
    if configured and configured == point:
        log.warning("fault_point_reached", point=point, pid=os.getpid())
        raise RuntimeError(f"injected fault at {point}")
