"""`tierpipe up`: the servers and this node's agent under one supervisor, as a user runs it."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest
import torch

from tests.conftest import Events
from tierpipe import Checkpointer
from tierpipe.dev import free_ports
from tierpipe.dev.process import port_free
from tierpipe.schemas import ShardFlushed, ShardVerified
from tierpipe.settings import Settings, load_settings


class Up:
    """A `tierpipe up` process and its output."""

    def __init__(self, data: Path, port: int, staging: str, *args: str, out: str = "") -> None:
        self.data, self.out = data, data.parent / f"{data.name}{out}.out"
        env = {**os.environ, "TIERPIPE_STAGING_ROOT": staging, "TIERPIPE_NODE": "up-node"}
        env = {k: v for k, v in env.items() if k not in ("TIERPIPE_NATS_URL", "TIERPIPE_CONFIG")}
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierpipe.cli", "up", "--data", str(data),
                 "--nats-port", str(port), *args],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while what not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no {what!r} in:\n{self.text()}"
            time.sleep(0.1)

    def settings(self) -> Settings:
        """The environment a trainer gets from `source <data>/env`."""
        return load_settings(path=None, env=_env_of(self.data))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def save_and_wait(settings: Settings, job: str, step: int) -> object:
    with Checkpointer(job, rank=0, world_size=1, settings=settings) as ckpt:
        return ckpt.save(step, {"w": torch.full((1000,), float(step))}).wait("verified", 60)


@pytest.mark.slow
def test_up_runs_the_servers_and_the_agent_and_keeps_them_running(
    tmp_path: Path, job: str, settings: Settings
) -> None:
    """`tierpipe up` prints the environment (secret masked) and writes it whole, mode 0600; a
    trainer with it saves to NVMe and S3; a killed agent is started again and said so; a
    second `up` on the same data or port is refused clearly; Ctrl-C stops everything."""
    port = free_ports(1)[0]
    up = Up(tmp_path / "up", port, settings.staging_root)
    try:
        up.wait_for("tierpipe up: ready")
        out = up.text()
        env_file = tmp_path / "up" / "env"
        assert env_file.stat().st_mode & 0o777 == 0o600
        s = up.settings()
        assert s.s3_secret_access_key and s.s3_secret_access_key not in out
        assert "TIERPIPE_S3_SECRET_ACCESS_KEY=***" in out
        assert s.nats_url == f"nats://127.0.0.1:{port}" and s.node == "up-node"
        assert isinstance(save_and_wait(s, job, 1), ShardVerified)
        Events(s, job).wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")

        agent = int((tmp_path / "up" / "agent.pid").read_text())
        os.kill(agent, signal.SIGKILL)
        up.wait_for("agent started again (restart 1)", timeout=30)
        assert "agent exited with -9; starting it again in 1 s" in up.text()
        assert isinstance(save_and_wait(s, job, 3), ShardVerified)

        again = subprocess.run(
            [sys.executable, "-m", "tierpipe.cli", "up", "--data", str(tmp_path / "up"),
             "--nats-port", str(free_ports(1)[0])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (
            again.returncode == 2
            and f"in use by another `tierpipe up` (pid {up.proc.pid})" in again.stderr
        )
        taken = subprocess.run(
            [sys.executable, "-m", "tierpipe.cli", "up", "--data", str(tmp_path / "other"),
             "--nats-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert taken.returncode == 2 and f"port {port} on 127.0.0.1 is taken" in taken.stderr

        assert up.stop() == 0
        assert "tierpipe up: stopped" in up.text()
        assert port_free(port)
        with pytest.raises(ProcessLookupError):
            os.kill(agent, 0)
    finally:
        up.kill()


@pytest.mark.slow
def test_a_killed_up_leaves_nothing_running(tmp_path: Path, settings: Settings) -> None:
    """`tierpipe up` killed with SIGKILL (no cleanup of its own) takes its servers and agent
    with it: nothing is left holding the ports or the data."""
    port = free_ports(1)[0]
    up = Up(tmp_path / "up", port, settings.staging_root, "--no-s3")
    try:
        up.wait_for("tierpipe up: ready")
        agent = int((tmp_path / "up" / "agent.pid").read_text())
        up.kill()
        deadline = time.monotonic() + 20
        while not port_free(port) or _alive(agent):
            assert time.monotonic() < deadline, "the servers or the agent outlived `tierpipe up`"
            time.sleep(0.1)
    finally:
        up.kill()


def _child(pid: int, name: str) -> int:
    """The child of process `pid` whose command is `name`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return int(child)
    raise AssertionError(f"no {name} under pid {pid}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


@pytest.mark.slow
def test_up_without_s3_keeps_checkpoints_on_nvme(
    tmp_path: Path, job: str, settings: Settings
) -> None:
    """`--no-s3`: no store started, no S3 in the environment, retention may remove copies
    never flushed (nothing would ever flush them), and saves still reach `verified`."""
    up = Up(tmp_path / "up", free_ports(1)[0], settings.staging_root, "--no-s3")
    try:
        up.wait_for("tierpipe up: ready")
        assert "S3" not in (tmp_path / "up" / "env").read_text()
        s = up.settings()
        assert s.evict_unflushed and s.s3_endpoint is None
        assert isinstance(save_and_wait(s, job, 1), ShardVerified)
        assert up.stop() == 0
    finally:
        up.kill()


def _env_of(data: Path) -> dict[str, str]:
    """`<data>/env` as the variables it exports."""
    env = {}
    for line in (data / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0]
    return env


@pytest.mark.slow
def test_up_killed_comes_back_at_once_with_the_same_endpoints_and_data(
    tmp_path: Path, job: str, settings: Settings, cpu_hog: None
) -> None:
    """`tierpipe up` killed with SIGKILL and started again at once on the same data (its store
    still stopping, ports in TIME-WAIT, SeaweedFS's socket files left in /tmp) waits for the
    last run's processes, comes back with the same environment, and a step saved before
    restores bit for bit from the restarted store."""
    port = free_ports(1)[0]
    up = Up(tmp_path / "up", port, settings.staging_root)
    again: Up | None = None
    weed = 0
    try:
        up.wait_for("tierpipe up: ready")
        before = _env_of(tmp_path / "up")
        s = up.settings()
        state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(7))}
        with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
            ckpt.save(1, state).wait("verified", 60)
        Events(s, job).wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
        weed = _child(up.proc.pid, "weed")
        os.kill(weed, signal.SIGSTOP)  # a store slow to stop: still there at the restart
        up.kill()
        again = Up(tmp_path / "up", port, settings.staging_root, out="again")
        again.wait_for("tierpipe up: ready", timeout=120)
        assert not _alive(weed), "two stores on one data directory"
        assert f"waiting for the last run's S3 store (pid {weed}) to stop" in again.text()
        assert _env_of(tmp_path / "up") == before
        # A replacement node (no NVMe copy) reads the step from the restarted store.
        other = s.replace(node="replacement", nvme_root=str(tmp_path / "replacement-nvme"))
        with Checkpointer(job, rank=0, world_size=1, settings=other) as ckpt:
            restored = ckpt.restore(step=1)
        assert restored.source.tier == "s3"
        assert torch.equal(restored.state["w"], state["w"])
        assert again.stop() == 0
    finally:
        up.kill()
        if again is not None:
            again.kill()
        if weed and _alive(weed):
            os.kill(weed, signal.SIGKILL)  # (stopped, it would never act on its SIGTERM)


@pytest.mark.slow
def test_up_keeps_its_data_directory_private(tmp_path: Path, settings: Settings) -> None:
    """The data directory and its `nvme/`, `s3/` and `nats/` folders are 0700, and the files
    holding secrets (the environment, credentials, the server's configuration) 0600."""
    up = Up(tmp_path / "up", free_ports(1)[0], settings.staging_root)
    try:
        up.wait_for("tierpipe up: ready")
        root = tmp_path / "up"
        for folder in (root, root / "nvme", root / "s3", root / "nats"):
            assert folder.stat().st_mode & 0o777 == 0o700, folder
        for secret in ("env", "s3-credentials.json", "nats-credentials.json", "nats/nats.conf"):
            assert (root / secret).stat().st_mode & 0o777 == 0o600, secret
        assert up.stop() == 0
    finally:
        up.kill()


@pytest.mark.slow
def test_up_tightens_an_existing_data_directory(tmp_path: Path, settings: Settings) -> None:
    """A data directory that others could read (0755, from an earlier version) is made 0700,
    and `tierpipe up` says so."""
    root = tmp_path / "up"
    (root / "nvme").mkdir(parents=True)
    root.chmod(0o755)
    (root / "nvme").chmod(0o755)
    up = Up(root, free_ports(1)[0], settings.staging_root, "--no-s3")
    try:
        up.wait_for("tierpipe up: ready")
        assert root.stat().st_mode & 0o777 == 0o700
        assert (root / "nvme").stat().st_mode & 0o777 == 0o700
        assert f"made {root} private (0700; it was 0755)" in up.text()
        assert up.stop() == 0
    finally:
        up.kill()


@pytest.mark.slow
def test_up_nats_refuses_clients_without_its_credentials(
    tmp_path: Path, job: str, settings: Settings
) -> None:
    """The embedded nats-server refuses a client without credentials (authorization error);
    the trainer with the environment `tierpipe up` wrote saves; the password is in neither its
    output nor the server's command line."""
    port = free_ports(1)[0]
    up = Up(tmp_path / "up", port, settings.staging_root, "--no-s3")
    try:
        up.wait_for("tierpipe up: ready")
        s = up.settings()
        assert s.nats_user and s.nats_password
        assert "TIERPIPE_NATS_PASSWORD=***" in up.text() and s.nats_password not in up.text()

        async def connect_without_credentials() -> None:
            nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
            await nc.close()

        with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
            anyio.run(connect_without_credentials)
        assert isinstance(save_and_wait(s, job, 1), ShardVerified)
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                assert s.nats_password.encode() not in cmdline
        assert up.stop() == 0
    finally:
        up.kill()


@pytest.mark.slow
def test_up_with_a_nats_url_generates_no_nats_credentials(
    tmp_path: Path, settings: Settings
) -> None:
    """`--nats-url`: the user's server, with the credentials in its URL: `tierpipe up` adds
    none of its own to the environment and does not print the URL's password."""
    url = settings.nats_url.replace("nats://", "nats://someone:pw-in-the-url@")
    up = Up(tmp_path / "up", free_ports(1)[0], settings.staging_root, "--no-s3",
            "--nats-url", url)  # fmt: skip
    try:
        up.wait_for("tierpipe up: ready")
        env = _env_of(tmp_path / "up")
        assert env["TIERPIPE_NATS_URL"] == url and "pw-in-the-url" not in up.text()
        assert "TIERPIPE_NATS_USER" not in env and "TIERPIPE_NATS_PASSWORD" not in env
        assert not (tmp_path / "up" / "nats-credentials.json").exists()
        assert up.stop() == 0
    finally:
        up.kill()


def test_a_port_in_time_wait_is_free(tmp_path: Path) -> None:
    """A port whose last server was killed mid-connection (TIME-WAIT) can be bound again by a
    server (SO_REUSEADDR, as nats-server and SeaweedFS bind), so it counts as free."""
    port = free_ports(1)[0]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its end of the port goes to TIME-WAIT
    client.recv(1)
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError, match="Address already in use"):
        plain.bind(("127.0.0.1", port))  # (what the old check did)
    assert port_free(port)


def test_a_stale_seaweedfs_socket_file_does_not_take_a_port() -> None:
    """A `/tmp/seaweedfs-*-<port>.sock` nobody listens on (a killed server's) leaves the port
    free; one a live server listens on does not."""
    port = free_ports(1)[0]
    path = Path(f"/tmp/seaweedfs-s3-{port}.sock")
    try:
        with socket.socket(socket.AF_UNIX) as live:
            live.bind(str(path))
            live.listen()
            assert not port_free(port)
        assert path.exists()  # closed, not removed: what a killed weed leaves
        assert port_free(port)
    finally:
        path.unlink(missing_ok=True)


class _SigintOnReady:
    """`tierpipe up`'s output; a Ctrl-C arrives the moment it says it is ready."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        if "tierpipe up: ready" in s:
            os.kill(os.getpid(), signal.SIGINT)
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.slow
def test_a_ctrl_c_the_moment_up_says_ready_is_a_clean_stop(
    tmp_path: Path, settings: Settings
) -> None:
    """The signal handlers are in place before `ready` is said: a Ctrl-C right after it (a
    script that waits for the line, then stops it) stopped `up` with KeyboardInterrupt (exit
    130) instead of draining the agent (exit 0), when it came before the handlers."""
    from tierpipe.dev.up import run_up

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out = _SigintOnReady()
    try:
        code = run_up(settings, data=str(tmp_path / "up"), nats_url=settings.nats_url,
                      no_s3=True, out=out)  # type: ignore[arg-type]  # fmt: skip
    except KeyboardInterrupt:
        pytest.fail(f"the Ctrl-C after `ready` was not handled:\n{out.text}")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 0 and "tierpipe up: stopping (SIGINT)" in out.text, out.text
