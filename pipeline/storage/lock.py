"""One agent per node: the per-stage lock beside the NVMe root, and the temp files it guards.

Each agent stage holds `<root>/.agent-<stage>.lock` (flock) for its whole life, so two agents
started with the same node name and NVMe root cannot both write, verify or evict there. Writers
name their temp files `.<name>.<stage>.<pid>-<instance>.tmp` beside the final path (the
instance is a random token per process: a restarted container reuses PIDs); the lock holder
sweeps what dead writers left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import structlog

from tierpipe.errors import AgentLockedError

__all__ = ("INSTANCE", "stage_lock", "sweep_dead_temps", "temp_path")

log = structlog.get_logger(__name__)

#: `.<name>.<stage>.<pid>-<instance>.tmp`; `.<name>.<pid>.tmp` from older versions.
_TMP = re.compile(
    r"^\..+?(?:\.(?P<stage>[a-z-]+)\.(?P<pid>\d+)-(?P<inst>[0-9a-f]+)|\.(?P<old>\d+))\.tmp$"
)
#: This process's instance token in temp names: a PID alone is reused by the next container.
INSTANCE = secrets.token_hex(6)
#: A poll interval while another agent holds a stage lock (no event to wait on: flock has none).
_LOCK_POLL_S = 0.1


def temp_path(final: Path, stage: str) -> Path:
    """Where `stage` of this process writes `final` before placing it."""
    return final.with_name(f".{final.name}.{stage}.{os.getpid()}-{INSTANCE}.tmp")


def sweep_dead_temps(root: Path, stage: str) -> list[str]:
    """Remove temp files under `root` left by writers that died mid-write. Returns what was removed.

    Call it holding `stage`'s lock: then a temp of `stage` from another instance is dead for
    sure (one live holder per stage), even when its PID is ours (a restarted container).
    Temps of other stages go only once their PID is dead.
    """
    removed = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            m = _TMP.match(name)
            if m is None:
                continue
            if m["old"] is not None:
                dead = not _pid_alive(int(m["old"]))
            elif m["stage"] == stage:
                dead = m["inst"] != INSTANCE
            else:
                dead = not _pid_alive(int(m["pid"]))
            if dead:
                path = os.path.join(dirpath, name)
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
    if removed:
        log.info("temp_files_swept", count=len(removed), root=str(root), stage=stage)
    return removed


@contextlib.asynccontextmanager
async def stage_lock(root: Path, stage: str, *, timeout_s: float) -> AsyncIterator[None]:
    """Hold `<root>/.agent-<stage>.lock` exclusively while the block runs.

    The holder writes "pid, host, start time" into the file. While another process holds
    it, this logs `agent_lock_busy` once and polls for up to `timeout_s` (a rolling
    update's old agent may still be draining).

    Raises:
        AgentLockedError: still held by another process after `timeout_s`.
    """
    os.makedirs(root, exist_ok=True)  # once, at agent start: not worth a thread
    path = root / f".agent-{stage}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        logged = False
        while not _try_flock(fd):
            holder = _read_holder(fd)
            if time.monotonic() >= deadline:
                raise AgentLockedError(str(path), holder)
            if not logged:
                log.warning(
                    "agent_lock_busy",
                    path=str(path),
                    holder=holder,
                    timeout_s=timeout_s,
                )
                logged = True
            await anyio.sleep(_LOCK_POLL_S)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        holder = f"pid {os.getpid()}, host {socket.gethostname()}, started {started}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode() + b"\n", 0)
        log.info("agent_lock_acquired", path=str(path), holder=holder)
        yield
    finally:
        os.close(fd)  # drops the flock


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _read_holder(fd: int) -> str:
    """Who holds a stage lock, as the holder wrote it ("unknown" before it wrote)."""
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown holder"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
