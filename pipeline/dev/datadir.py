"""`tierpipe up`'s data directory: folders only its owner can read, values kept across runs (the
embedded servers' credentials), and the processes a run started.

The data directory holds the model weights (`nvme/`), the object store (`s3/`), the event store
(`nats/`) and the credentials, so it is 0700 and the files with secrets 0600. A run records the
processes it starts, so that the next one, after this one was SIGKILLed (its servers then get
SIGTERM from the kernel and take seconds to stop), waits until they are gone before it starts
servers of its own on the same data and ports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tierpipe.errors import ConfigError

__all__ = ("Children", "kept", "private_dir")

#: How long a process gets to exit after SIGKILL (it only waits for the kernel).
_KILL_WAIT_S = 10.0


def private_dir(path: Path, say: Callable[[str], None]) -> Path:
    """`path` as a folder only its owner can read (0700): created so, or made so (and said)
    when others could read it; a folder we do not own stays as it is, with a warning."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        try:
            path.chmod(0o700)
        except PermissionError:
            say(f"tierpipe up: warning: others can read {path} ({mode:04o}) and it is not ours")
        else:
            say(f"tierpipe up: made {path} private (0700; it was {mode:04o})")
    return path


def kept(path: Path, make: Callable[[], dict[str, str]]) -> dict[str, str]:
    """The value stored at `path` (0600), made and stored on first use."""
    if path.exists():
        found: dict[str, str] = json.loads(path.read_text())
        return found
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    return value


class Children:
    """The processes a run started, by name, in `path`: `{name: [pid, start time]}` (the start
    time in clock ticks since boot, from /proc, so a pid the kernel gave to another process
    since is not taken for ours)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._started: dict[str, list[int]] = {}

    def record(self, name: str, pid: int) -> None:
        """`name` is now process `pid` (written whole: a kill mid-write leaves the last record)."""
        ticks = _start_ticks(pid)
        if ticks is None:
            return  # gone already
        self._started[name] = [pid, ticks]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._started))
        os.replace(tmp, self.path)

    def stop_leftovers(self, grace_s: Callable[[str], float], say: Callable[[str], None]) -> None:
        """Wait until the processes the last run recorded are gone: each gets SIGTERM (again:
        the kernel sent one when that run died, unless it died before the child asked for it),
        then SIGKILL after `grace_s(name)`. Call it holding the data directory's lock: the run
        that started them is then gone, so nobody else stops them."""
        try:
            last: dict[str, list[int]] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        waiting: dict[int, tuple[str, float]] = {}  # pidfd -> (name, SIGKILL deadline)
        for name, (pid, ticks) in last.items():
            fd = _pidfd(pid)
            if fd is None:
                continue
            if _start_ticks(pid) != ticks:  # (checked with the pid held by the fd)
                os.close(fd)
                continue
            say(f"tierpipe up: waiting for the last run's {name} (pid {pid}) to stop")
            _signal(fd, signal.SIGTERM)
            _signal(fd, signal.SIGCONT)  # a stopped one handles SIGTERM now
            waiting[fd] = (name, time.monotonic() + grace_s(name))
        try:
            _wait_gone(waiting, say)
        finally:
            for fd in waiting:
                os.close(fd)
        self.path.unlink(missing_ok=True)


def _wait_gone(waiting: dict[int, tuple[str, float]], say: Callable[[str], None]) -> None:
    """Until every pidfd in `waiting` says its process exited, SIGKILL at its deadline."""
    pending = dict(waiting)
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLIN)  # (readable once its process exited)
    while pending:
        now = time.monotonic()
        for fd, (name, deadline) in list(pending.items()):
            if now < deadline:
                continue
            if deadline - waiting[fd][1] >= _KILL_WAIT_S:
                raise ConfigError(f"the last run's {name} does not exit, even after SIGKILL")
            say(f"tierpipe up: the last run's {name} did not stop in time: killing it")
            _signal(fd, signal.SIGKILL)
            pending[fd] = (name, deadline + _KILL_WAIT_S)
        timeout_s = min(deadline for _, deadline in pending.values()) - now
        for fd, _ in poller.poll(max(1, int(timeout_s * 1000))):
            poller.unregister(fd)
            del pending[fd]


def _signal(pidfd: int, sig: signal.Signals) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        pass  # exited meanwhile


def _pidfd(pid: int) -> int | None:
    """A handle on process `pid` that stays its own even after it exits (None: no such process,
    or not Linux)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None when it is gone (or a zombie:
    it holds no port and no file any more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # (the name in parentheses may hold spaces)
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
