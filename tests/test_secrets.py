"""Secrets never appear in a log line or an event; NATS with TLS, user auth and per-role
permissions. Real agent processes, real nats-server (own instances), real SeaweedFS."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats.errors
import pytest
import structlog
import torch

from tests.conftest import Agent, Events, make_staged
from tests.test_deploy import per_role_block
from tierpipe.bus.client import Bus
from tierpipe.bus.connection import Connection, refusal
from tierpipe.dev import NatsServer
from tierpipe.errors import BusAuthError
from tierpipe.log import configure_logging
from tierpipe.names import stream_name
from tierpipe.schemas import ShardFlushed, ShardVerified, StageFailed
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parent.parent


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stream_bytes(settings: Settings, job: str) -> list[bytes]:
    """Every message stored in the job's stream: headers and body, raw."""

    async def read() -> list[bytes]:
        async with Bus(settings) as bus:
            last = (await bus.js.stream_info(stream_name(settings.stream, job))).state.last_seq
            out = []
            for seq in range(1, last + 1):
                msg = await bus.js.get_msg(stream_name(settings.stream, job), seq)
                out.append(repr(msg.headers).encode() + b"\n" + (msg.data or b""))
            return out

    return anyio.run(read)


# --- item 13: secrets in tracebacks and log lines


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_tracebacks_show_no_locals_and_known_secrets_are_masked(
    fmt: str, restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A logged traceback shows no frame locals, and a secret inside any value is `***`."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    secret = "pw-9f2c41d7-local"
    configure_logging("info", fmt, secrets=[secret])
    log = structlog.get_logger("test")

    def connect(password: str) -> None:
        token = password + "-derived"  # a local that must not be printed
        raise RuntimeError(f"login refused ({len(token)} chars)")

    try:
        connect(secret)
    except RuntimeError:
        log.exception("login_failed", url=f"nats://me:{secret}@127.0.0.1:4222")
    text = out.getvalue()
    assert "login_failed" in text and "RuntimeError" in text and "connect" in text
    assert secret not in text and "-derived" not in text
    assert "nats://me:***@127.0.0.1:4222" in text


def _crash_agent_script(tmp_path: Path) -> Path:
    """`tierpipe worker all` plus a stage whose handler crashes holding secrets, with a
    message that embeds them (the worst case for a `failed` event)."""
    script = tmp_path / "agent_with_crash.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from urllib.parse import urlsplit

        from contextlib import asynccontextmanager

        from tierpipe.cli import main as cli_main
        from tierpipe.stages import AGENT_STAGES

        class crash:
            STAGE = "crash"
            KINDS = ("verified",)

            @asynccontextmanager
            async def open(settings, bus):
                yield settings

            async def handle(settings, event, attempt):
                password = urlsplit(settings.nats_url).password
                s3_secret = settings.s3_secret_access_key
                raise RuntimeError(f"cannot log in with {password} or {s3_secret}")

        AGENT_STAGES["crash"] = crash
        sys.exit(cli_main(["worker", "all"]))
        """)
    )
    return script


@pytest.mark.slow
def test_secrets_never_reach_a_log_line_or_an_event(
    settings: Settings,
    job: str,
    uid: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    restore_logging: None,
) -> None:
    """A handler crash holding secrets, a nats-server restart and an S3 auth failure in a real
    agent: neither the NATS password nor the S3 secret key appears in any log line of the agent
    or the trainer, nor in any message of the stream."""
    configure_logging("debug", "json")  # the trainer's lines, into the captured stderr
    nats_password = f"nats-pw-{uid}-7Hq2"
    s3_secret = f"s3-secret-{uid}-Zx81"  # wrong: the store refuses it (an auth failure)
    auth = f'authorization {{ users: [ {{ user: tp, password: "{nats_password}" }} ] }}'
    with NatsServer(tmp_path / "nats", config=auth) as server:
        host = server.url.removeprefix("nats://")
        s = settings.replace(
            nats_url=f"nats://tp:{nats_password}@{host}",
            s3_secret_access_key=s3_secret,
            retry_base_s=0.1,
            retry_max_s=0.5,
        )
        log_path = tmp_path / "agent.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, str(_crash_agent_script(tmp_path))],
                # The script's own folder comes first on sys.path: name this checkout's.
                env={**os.environ, **s.as_env(), "PYTHONPATH": str(ROOT)},
                stdout=log,
                stderr=log,
                cwd=ROOT,
            )
        try:
            wait_until(lambda: b"agent_ready" in log_path.read_bytes(), what="the agent")
            events = Events(s, job)
            with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
                ckpt.save(1, {"w": torch.ones(1000)}).wait("verified", timeout=30)
                for stage, error in (("crash", "RuntimeError"), ("flush", "StorageAuthError")):
                    events.wait_for(
                        lambda e, st=stage, er=error: (
                            isinstance(e, StageFailed) and (e.stage, e.error) == (st, er)
                        ),
                        kind="failed",
                    )
                server.kill()
                server.start()  # same port and store
                ckpt.save(2, {"w": torch.ones(1000)}).wait("verified", timeout=30)
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
        messages = stream_bytes(s, job)
    agent_log = log_path.read_text()
    assert "handler_crashed" in agent_log and "bus_reconnected" in agent_log
    assert "StorageAuthError" in agent_log
    trainer_log = "".join(capfd.readouterr())
    assert "bus_reconnected" in trainer_log  # the trainer lived through the restart too
    for secret in (nats_password, s3_secret):
        assert secret not in agent_log
        assert secret not in trainer_log
        assert not [m for m in messages if secret.encode() in m]
    crash = [m for m in messages if b'"stage":"crash"' in m]
    assert crash and b"cannot log in with *** or ***" in crash[0]


# --- item 17: TLS, user auth, per-role permissions


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1, and a client certificate, made with openssl."""
    d = tmp_path_factory.mktemp("certs")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tierpipe-test-ca")  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{name}-key.pem", "-out", f"{name}.csr",
                "-subj", f"/CN=tierpipe-test-{name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")  # fmt: skip
    return d


TLS_USER_PASSWORD = "tls-user-pw-51c0"


@pytest.fixture
def tls_server(tmp_path: Path, certs: Path) -> Iterator[NatsServer]:
    """A nats-server that requires TLS with a client certificate, and a user and password."""
    config = textwrap.dedent(f"""
        tls {{
          cert_file: "{certs / "server.pem"}"
          key_file: "{certs / "server-key.pem"}"
          ca_file: "{certs / "ca.pem"}"
          verify: true
        }}
        authorization {{ users: [ {{ user: tp, password: "{TLS_USER_PASSWORD}" }} ] }}
    """)
    with NatsServer(tmp_path / "tls-nats", config=config) as server:
        yield server


def tls_settings(settings: Settings, server: NatsServer, certs: Path, **changes: Any) -> Settings:
    tls = {
        "nats_url": server.url,
        "nats_user": "tp",
        "nats_password": TLS_USER_PASSWORD,
        "nats_tls_ca_file": str(certs / "ca.pem"),
        "nats_tls_cert_file": str(certs / "client.pem"),
        "nats_tls_key_file": str(certs / "client-key.pem"),
    }
    return settings.replace(**{**tls, **changes})


@pytest.mark.slow
def test_an_agent_and_a_trainer_work_over_tls_with_user_auth(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    tls_server: NatsServer,
    certs: Path,
) -> None:
    """With the credentials, CA and client certificate from the settings, an agent process and
    a Checkpointer reach a server that requires all three, and a save is verified."""
    assert tls_server.url.startswith("tls://")
    s = tls_settings(settings, tls_server, certs)
    agent("nvme-write", "verify", "evict", settings=s).wait_ready()
    with Checkpointer(job, rank=0, world_size=1, settings=s) as ckpt:
        verified = ckpt.save(1, {"w": torch.ones(100)}).wait("verified", timeout=30)
    assert isinstance(verified, ShardVerified)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"nats_password": "not-the-password-3e1"}, "nats_password"),
        ({"nats_tls_ca_file": None}, "nats_tls_ca_file"),
        ({"nats_tls_cert_file": None, "nats_tls_key_file": None}, "nats_tls_cert_file"),
    ],
)
async def test_refused_credentials_or_tls_fail_fast_and_clearly(
    settings: Settings,
    tls_server: NatsServer,
    certs: Path,
    changes: dict[str, Any],
    says: str,
) -> None:
    """A wrong password, a missing CA or a missing client certificate fails at once with a
    BusAuthError naming the setting to check, never the password."""
    s = tls_settings(settings, tls_server, certs, connect_timeout_s=2.0, **changes)
    t0 = time.monotonic()
    with pytest.raises(BusAuthError) as err:
        async with Bus(s, connect_wait_s=30.0):
            pass
    assert time.monotonic() - t0 < 5.0  # refused, not retried for connect_wait_s
    assert says in str(err.value) and tls_server.url in str(err.value)
    for secret in (TLS_USER_PASSWORD, "not-the-password-3e1"):
        assert secret not in str(err.value)


@pytest.mark.anyio
async def test_a_refusal_is_what_the_connect_reports_whatever_error_follows(
    settings: Settings,
) -> None:
    """Over TLS, nats-py reports the server's "Authorization Violation" and then, as the server
    closes, a broken pipe, which the connect raises. The refusal is what counts: under a CPU
    hog the test above saw the broken pipe alone and retried for connect_wait_s."""
    conn = Connection(settings)
    await conn._on_error(nats.errors.Error("nats: 'Authorization Violation'"))
    await conn._on_error(BrokenPipeError(32, "Broken pipe"))
    assert conn._last_error is not None and refusal(conn._last_error) is not None


@pytest.mark.slow
def test_the_per_role_permissions_example_carries_a_save_and_stops_forgery(
    settings: Settings,
    job: str,
    agent: Callable[..., Agent],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under deploy/nats-server.conf's per-role permissions, a trainer and an agent carry a
    save through every stage, and the trainer cannot publish a `verified` event."""
    node = settings.node or ""
    block = per_role_block(job, node, settings.kv_bucket)
    monkeypatch.setenv("TIERPIPE_TRAINER_PASSWORD", "trainer-pw-0a7")
    monkeypatch.setenv("TIERPIPE_AGENT_PASSWORD", "agent-pw-c3d")
    with NatsServer(tmp_path / "perm-nats", config=block) as server:
        base = settings.replace(nats_url=server.url)
        as_agent = base.replace(nats_user=f"agent-{node}", nats_password="agent-pw-c3d")
        as_trainer = base.replace(
            nats_user=f"trainer-{job}", nats_password="trainer-pw-0a7", request_timeout_s=2.0
        )
        agent(settings=as_agent).wait_ready()
        with Checkpointer(job, rank=0, world_size=1, settings=as_trainer) as ckpt:
            ckpt.save(1, {"w": torch.ones(100)}).wait("verified", timeout=30)
            assert ckpt.all_steps() == [1]  # replays work for the trainer
        events = Events(as_agent, job)
        events.wait_for(lambda e: isinstance(e, ShardFlushed), kind="flushed")
        forged = make_staged(job, node, step=7)

        async def forge() -> None:
            async with Bus(as_trainer) as bus:
                verified = ShardVerified(
                    job=job, node=node, ts=time.time(), step=7, rank=0, world_size=1,
                    path="/x", nbytes=1, header_digest="0" * 32, seconds=0.0,
                )  # fmt: skip
                with pytest.raises(BusAuthError, match="not permitted to publish"):
                    await bus.publish(verified)
                await bus.publish(forged)  # its own job's `staged`: allowed

        anyio.run(forge)
        assert [e.step for e in events.all("verified")] == [1]
        assert 7 in [e.step for e in events.all("staged")]
