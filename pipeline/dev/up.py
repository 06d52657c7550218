"""`tierpipe up`: everything one machine needs to checkpoint through tierpipe, under one supervisor.

Starts an embedded nats-server (JetStream) and SeaweedFS S3 store on loopback, unless
`--nats-url` / `--s3-endpoint` name real ones (`--no-s3`: NVMe only), then this node's agent
(`tierpipe worker`), and keeps them running: a process that exits is started again with backoff,
and the supervisor says so. It writes the environment a trainer needs to `<data>/env` (mode
0600: it holds the store's credentials) and prints it with the secret masked, so another shell
does `source .tierpipe/env` and runs `torchrun ...`. Ctrl-C (or SIGTERM) drains the agent, then
stops the servers.

Everything lives under the data directory (`./.tierpipe` by default, 0700): the servers' data, the
node's NVMe root, the agent's log, the ports and credentials of the embedded servers (kept across
runs, so the environment stays the same; the nats-server refuses clients without them). One
`tierpipe up` per data directory (a lock says which process holds it); a run after a crash
first waits until the last run's processes are gone, then starts on the same ports; ports that
something else listens on are refused up front, with what to do about it.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from tierpipe.dev.datadir import Children, kept, private_dir
from tierpipe.dev.nats import NatsServer
from tierpipe.dev.process import port_free, start_agent, terminate
from tierpipe.dev.s3 import S3Server
from tierpipe.errors import ConfigError, TierpipeError
from tierpipe.names import node_name, redact_url
from tierpipe.settings import SECRET_FIELDS, Settings

__all__ = ("DEFAULT_DATA", "DEFAULT_NATS_PORT", "run_up")

DEFAULT_DATA = ".tierpipe"
DEFAULT_NATS_PORT = 4222
#: The embedded store's bucket.
BUCKET = "tierpipe"
#: A process that ran this long before it exited starts again at once (the backoff resets).
STABLE_S = 60.0
BACKOFF_MAX_S = 30.0
POLL_S = 0.2


def run_up(
    settings: Settings,
    *,
    data: str = DEFAULT_DATA,
    nats_url: str | None = None,
    nats_port: int = DEFAULT_NATS_PORT,
    s3_endpoint: str | None = None,
    no_s3: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """Run until SIGINT/SIGTERM; 0 after a clean stop.

    Raises:
        ConfigError: the data directory is in use, a port is taken, or the options conflict.
    """
    if no_s3 and s3_endpoint:
        raise ConfigError("--no-s3 and --s3-endpoint exclude each other")
    say = partial(_say, out)
    root = private_dir(Path(data).absolute(), say)
    stop = _Stop()
    with ExitStack() as stack:
        stack.enter_context(_lock(root / "up.lock"))
        children = Children(root / "children.json")
        # Killed with SIGKILL, the last run could not stop its servers and agent: they got
        # SIGTERM from the kernel and may still be stopping (SeaweedFS takes up to 13 s), on
        # the ports and data this run is about to use.
        grace_s = {"agent": settings.drain_timeout_s + 10, "S3 store": 5.0}
        children.stop_leftovers(lambda name: grace_s.get(name, 10.0), say)
        private_dir(root / "nvme", say)
        env = _node_env(settings, root, no_s3=no_s3)
        servers = _Servers(stack, root, say, children)
        env.update(servers.nats(settings, nats_url, nats_port))
        if not no_s3:
            env.update(servers.s3(settings, s3_endpoint))
        _write_env(root / "env", env)
        stages = ["nvme-write", "verify", "replicate", "evict"] if no_s3 else ["all"]
        agent = _Supervised(
            "agent",
            lambda: _start_agent(env, stages, root / "agent.log", children),
            stop_s=settings.drain_timeout_s + 10,
        )
        stack.callback(agent.stop)
        agent.start()
        stop.install()  # (before `ready`: a script that stops us on that line is a clean stop)
        say(_ready(root, env, settings))
        while not stop.requested:
            for name, what in (("agent", agent), *servers.running):
                note = what.check()
                if note:
                    say(f"tierpipe up: {name} {note}")
            time.sleep(POLL_S)
        say(f"tierpipe up: stopping ({stop.signal}): draining the agent, then the servers")
    say("tierpipe up: stopped")
    return 0


# --- the environment


def _node_env(settings: Settings, root: Path, *, no_s3: bool) -> dict[str, str]:
    env = {
        "TIERPIPE_NODE": node_name(settings.node),
        "TIERPIPE_NVME_ROOT": str(root / "nvme"),
        "TIERPIPE_STAGING_ROOT": str(Path(settings.staging_root).absolute()),
    }
    if no_s3:
        # No object storage: retention may remove NVMe copies that were never flushed.
        env["TIERPIPE_EVICT_UNFLUSHED"] = "true"
    return env


def _write_env(path: Path, env: dict[str, str]) -> None:
    """`export` lines a shell sources; 0600 (the store's secret is in it), written whole."""
    text = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _ready(root: Path, env: dict[str, str], settings: Settings) -> str:
    secret_vars = {f"TIERPIPE_{name.upper()}" for name in SECRET_FIELDS}
    lines = [
        f"tierpipe up: ready (node {env['TIERPIPE_NODE']}, data {root})",
        f"  agent log: {root / 'agent.log'} (pid in {root / 'agent.pid'})",
        f"  in another shell:  source {root / 'env'}   (then run your trainer, e.g. torchrun)",
    ]
    for k, v in sorted(env.items()):
        shown = "***" if k in secret_vars else shlex.quote(v)
        if k == "TIERPIPE_NATS_URL":
            shown = shlex.quote(redact_url(v))  # (a `--nats-url` may carry credentials)
        lines.append(f"  export {k}={shown}")
    return "\n".join(lines)


def _say(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


# --- the servers


@dataclass
class _Servers:
    stack: ExitStack
    root: Path
    say: Callable[[str], None]
    children: Children
    #: The servers it started, by name.
    running: list[tuple[str, _Supervised]] = field(default_factory=list)

    def nats(self, settings: Settings, url: str | None, port: int) -> dict[str, str]:
        if url:
            return _given(settings, {"TIERPIPE_NATS_URL": url}, _NATS_CREDENTIALS)
        if not port_free(port):
            raise ConfigError(
                f"port {port} on 127.0.0.1 is taken (another nats-server, or another `tierpipe "
                "up`?): pass --nats-port for another one, or --nats-url to use a running server"
            )
        # Any local process could reach an open server (and create jobs on it): only clients
        # with these credentials may connect. The password is in the 0600 config file, not on
        # the command line.
        keys = kept(self.root / "nats-credentials.json", lambda: {
            "user": "tierpipe", "password": secrets.token_urlsafe(24),
        })  # fmt: skip
        auth = (
            f"authorization {{\n  user: {json.dumps(keys['user'])}\n"
            f"  password: {json.dumps(keys['password'])}\n}}"
        )
        server = NatsServer(
            private_dir(self.root / "nats", self.say), sync_always=True, config=auth
        )
        server.ports = (port, -1)  # (the monitoring port: any free one)
        self._run("nats-server", server, timeout_s=15.0)
        return {
            "TIERPIPE_NATS_URL": server.url,
            "TIERPIPE_NATS_USER": keys["user"],
            "TIERPIPE_NATS_PASSWORD": keys["password"],
        }

    def s3(self, settings: Settings, endpoint: str | None) -> dict[str, str]:
        if endpoint:
            env = {"TIERPIPE_S3_ENDPOINT": endpoint, "TIERPIPE_S3_BUCKET": settings.s3_bucket}
            return _given(settings, env, ("s3_access_key_id", "s3_secret_access_key"))
        keys = kept(self.root / "s3-credentials.json", lambda: {
            "access_key": "tierpipe-" + secrets.token_hex(4),
            "secret_key": secrets.token_urlsafe(24),
        })  # fmt: skip
        server = S3Server(
            private_dir(self.root / "s3", self.say), access_key=keys["access_key"],
            secret_key=keys["secret_key"], bucket=BUCKET,
        )  # fmt: skip
        ports_file = self.root / "s3-ports.json"
        if ports_file.exists():
            server.ports = {k: int(v) for k, v in json.loads(ports_file.read_text()).items()}
            taken = sorted(p for p in server.ports.values() if not port_free(p))
            if taken:
                raise ConfigError(
                    f"the S3 store's ports from the last run {taken} on 127.0.0.1 are taken "
                    f"(something listens on them): stop it, or remove {ports_file} to choose "
                    "new ones (trainers then need the new environment)"
                )
        self._run("S3 store", server, timeout_s=60.0)
        ports_file.write_text(json.dumps(server.ports))
        return {
            "TIERPIPE_S3_ENDPOINT": server.endpoint,
            "TIERPIPE_S3_BUCKET": server.bucket,
            "TIERPIPE_S3_ACCESS_KEY_ID": server.access_key,
            "TIERPIPE_S3_SECRET_ACCESS_KEY": server.secret_key,
        }

    def _run(self, name: str, server: NatsServer | S3Server, *, timeout_s: float) -> None:
        self.say(f"tierpipe up: starting {name} ({server.__class__.__name__})")
        server.on_spawn = lambda pid: self.children.record(name, pid)
        supervised = _Supervised(
            name, lambda: server.start(timeout_s=timeout_s), alive=lambda: _alive(server),
            stop_fn=server.stop,
        )  # fmt: skip
        supervised.start()
        self.stack.callback(supervised.stop)
        self.running.append((name, supervised))


def _alive(server: NatsServer | S3Server) -> bool:
    proc = server.proc
    return proc is not None and proc.poll() is None


#: The settings that let a client into a NATS server the user runs (`--nats-url`).
_NATS_CREDENTIALS = (
    "nats_user", "nats_password", "nats_token", "nats_creds_file", "nats_nkey_seed_file",
    "nats_tls_ca_file", "nats_tls_cert_file", "nats_tls_key_file",
)  # fmt: skip


def _given(settings: Settings, env: dict[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """`env` and the settings `names` that are set, for a server the user runs: the trainers
    need its credentials as much as the agent does."""
    for name in names:
        value = getattr(settings, name)
        if value:
            env[f"TIERPIPE_{name.upper()}"] = value
    return env


# --- supervision


class _Supervised:
    """One process kept running: started again with backoff when it exits."""

    def __init__(
        self,
        name: str,
        start: Callable[[], Any],
        *,
        alive: Callable[[], bool] | None = None,
        stop_fn: Callable[[], None] | None = None,
        stop_s: float = 30.0,
    ) -> None:
        self.name, self._start, self._alive, self._stop_fn = name, start, alive, stop_fn
        self.stop_s = stop_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._started = 0.0
        self._backoff = 1.0
        self._retry_at: float | None = None

    def start(self) -> None:
        started = self._start()
        if isinstance(started, subprocess.Popen):
            self.proc = started
        self._started = time.monotonic()

    def alive(self) -> bool:
        if self._alive is not None:
            return self._alive()
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> str | None:
        """Start it again if it exited and its backoff is over; what to tell the user."""
        now = time.monotonic()
        if self._retry_at is not None:
            if now < self._retry_at:
                return None
            self._retry_at = None
            try:
                self.start()
            except TierpipeError as e:
                return self._later(now, f"did not start again ({e})")
            self.restarts += 1
            return f"started again (restart {self.restarts})"
        if self.alive():
            return None
        code = self.proc.returncode if self.proc is not None else None
        if now - self._started >= STABLE_S:
            self._backoff = 1.0
        how = f"exited with {code}" if code is not None else "exited"
        return self._later(now, how)

    def _later(self, now: float, what: str) -> str:
        delay = self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        self._retry_at = now + delay
        return f"{what}; starting it again in {delay:g} s"

    def stop(self) -> None:
        self._retry_at = None
        if self._stop_fn is not None:
            self._stop_fn()
        elif self.proc is not None and self.proc.poll() is None:
            terminate(self.proc, self.stop_s)


def _start_agent(
    env: dict[str, str], stages: list[str], log: Path, children: Children
) -> subprocess.Popen[bytes]:
    """The agent, logging to `log`; its pid in `agent.pid` next to it."""
    proc = start_agent({**os.environ, **env}, stages, log)
    children.record("agent", proc.pid)
    log.with_name("agent.pid").write_text(f"{proc.pid}\n")
    return proc


class _Stop:
    """SIGINT/SIGTERM ask the supervisor loop to stop."""

    def __init__(self) -> None:
        self.requested = False
        self.signal = ""

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on)

    def _on(self, signum: int, frame: object) -> None:
        self.requested = True
        self.signal = signal.Signals(signum).name


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Hold `path` (flock) for as long as this `tierpipe up` runs; refuse if another does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                f"{path.parent} is in use by another `tierpipe up` (pid {holder}): stop it, or "
                "pass --data for another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)
