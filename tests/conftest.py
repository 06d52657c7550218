"""Fixtures: a real nats-server and S3 store (SeaweedFS) per session, isolated settings and buckets
per test, agent processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from tierpipe.bus.client import Bus
from tierpipe.dev import NatsServer, S3Server
from tierpipe.names import SUBJECT_ROOT, msg_id
from tierpipe.schemas import Event, NodeBatch, ShardStaged
from tierpipe.settings import Settings, load_settings


def make_staged(job: str, node: str, step: int = 1) -> ShardStaged:
    """A well-formed `staged` event for tests that exercise the bus and runner directly."""
    return ShardStaged(
        job=job,
        node=node,
        ts=time.time(),
        step=step,
        rank=0,
        world_size=1,
        staging_path="/dev/shm/x",
        slot=0,
        nbytes=4096,
        tensors=1,
        stall_s=0.0,
    )


@pytest.fixture(autouse=True)
def fresh_logging() -> Iterator[None]:
    """Each test starts from structlog's defaults: one that configures logging (a level, a CLI
    run in-process) must not filter out the lines another test captures."""
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


#: The only credentials the session's S3 server accepts.
S3_ACCESS_KEY = "tierpipe-test"
S3_SECRET_KEY = "tierpipe-test-secret"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS on loopback; tests may kill() and restart() it (same endpoint, same data)."""
    with S3Server(
        tmp_path_factory.mktemp("s3"),
        access_key=S3_ACCESS_KEY,
        secret_key=S3_SECRET_KEY,
        bucket="tierpipe-test",
    ) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server, uid: str) -> Iterator[str]:
    """A fresh bucket on the session's S3 server, deleted with its contents after the test."""
    import boto3  # here: only S3 tests need it

    s3_server.start()  # no-op unless an earlier test left it down
    name = f"test-{uid}"
    boto3.client("s3", **s3_server.client_kwargs()).create_bucket(Bucket=name)
    yield name
    s3_server.start()  # the test may have killed it
    # A new client: a killed server's connections are dead. SeaweedFS deletes a non-empty bucket
    # (objects, multipart uploads, its volumes), which keeps the session's disk use flat.
    boto3.client("s3", **s3_server.client_kwargs()).delete_bucket(Bucket=name)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def job(uid: str) -> str:
    return f"job-{uid}"


@pytest.fixture
def settings(
    nats_server: NatsServer, s3_server: S3Server, s3_bucket: str, tmp_path: Path, uid: str
) -> Iterator[Settings]:
    """Settings isolated per test: own node name (so own consumers), NVMe and staging roots,
    and own bucket."""
    staging = Path(f"/dev/shm/tierpipe-test-{uid}")
    yield load_settings(
        env={},
        nats_url=nats_server.url,
        s3_endpoint=s3_server.endpoint,
        s3_bucket=s3_bucket,
        s3_access_key_id=S3_ACCESS_KEY,
        s3_secret_access_key=S3_SECRET_KEY,
        s3_connect_timeout_s=1.0,
        s3_read_timeout_s=10.0,
        part_size_bytes=8 << 20,
        node=f"node-{uid}",
        kv_bucket=f"kv-{uid}",
        nvme_root=str(tmp_path / "nvme"),
        staging_root=str(staging),
        ack_wait_s=5.0,
        retry_base_s=0.1,
        retry_max_s=1.0,
        max_deliver=5,
        # A test's deadline, not a product figure (300 s): long enough for an agent that
        # starts slowly on a loaded machine; tests of the timeout itself set their own.
        slot_wait_timeout_s=60.0,
        drain_timeout_s=5.0,
        metrics_port=0,  # (any free port: tests run many agents at once)
        log_level="info",
        log_format="json",
    )
    # (and the roots of the other nodes a test derives from it: `<staging>-b`, `<staging>-a`)
    for root in [staging, *staging.parent.glob(f"{staging.name}-*")]:
        shutil.rmtree(root, ignore_errors=True)


class Agent:
    """A `tierpipe worker ...` process, as operators run it."""

    def __init__(self, settings: Settings, stages: tuple[str, ...], log_path: Path) -> None:
        self.settings, self.stages, self.log_path = settings, stages, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        env = {**os.environ, **self.settings.as_env()}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierpipe.cli", "worker", *self.stages],
                env=env,
                stdout=log,
                stderr=log,
            )
        return self

    def wait_ready(self, timeout: float = 30.0) -> Agent:
        """Until the log says every stage bound its consumer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if b"agent_ready" in self.log_path.read_bytes():
                return self
            assert self.proc is not None and self.proc.poll() is None, self.log()
            time.sleep(0.02)
        raise AssertionError(f"agent not ready in {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def torchrun_env(settings: Settings, rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun gives `rank` of `world` on one node (gloo's rendezvous on
    loopback `port`, one thread), with `settings` and logs at warning and above."""
    return {
        **os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": "warning",
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip


def gloo_ranks(
    settings: Settings,
    module: str,
    args: list[str],
    world: int,
    tmp_path: Path,
    *,
    log_level: str = "warning",
    log_format: str | None = None,
) -> list[tuple[str, str]]:
    """`python -m <module> <args[0]> RANK WORLD STORE_FILE <args[1:]>` as `world` processes of
    one gloo group (a file store under `tmp_path`), with `settings`; each rank's stdout and
    stderr once every rank exited 0 (else the test fails with the rank's stderr)."""
    env = {**os.environ, **settings.as_env(), "TIERPIPE_LOG_LEVEL": log_level}
    if log_format is not None:
        env["TIERPIPE_LOG_FORMAT"] = log_format
    store = tmp_path / f"gloo-{uuid.uuid4().hex[:6]}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, args[0], str(r), str(world), str(store), *args[1:]],
            env=env,
            cwd=Path(__file__).parent.parent,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stderr[-3000:]
        out.append((stdout, stderr))
    return out


def finish_ranks(
    procs: list[subprocess.Popen[bytes]], timeout: float, says: Callable[[], str] = str
) -> None:
    """Every rank exits 0 within `timeout`. Else those still running get SIGUSR1 (a rank that
    registered faulthandler for it dumps its threads' stacks to stderr), all are killed, and
    the test fails; `says()`: what a failure shows (the ranks' logs)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        hung = [q for q in procs if q.poll() is None]
        for q in hung:
            q.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        pytest.fail(f"{len(hung)} rank(s) still running after {timeout} s\n{says()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), says()


def run_bench(*args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """`python -m bench args` from the repository: it exits 0 and its stdout is one JSON line;
    (that line's figures, its stderr)."""
    out = subprocess.run([sys.executable, "-m", "bench", *args], cwd=Path(__file__).parent.parent,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout  # (stdout carries only the JSON line)
    figures: dict[str, Any] = json.loads(lines[0])
    return figures, out.stderr


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """Each phase's report on its test (`item.rep_call`): fixtures see whether it failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def agent(
    settings: Settings, tmp_path: Path, job: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Agent]]:
    """Start node-agent processes: `agent("nvme-write", "verify")`, default all stages. The
    test's job has its staging folder on the agent's node, as its trainers there make it (an
    agent serves the jobs it finds on its node): tests that publish its events themselves
    stand in for those trainers. A test that failed shows each agent's log tail (stderr)."""
    started: list[Agent] = []

    def start(*stages: str, settings: Settings = settings) -> Agent:
        Path(settings.staging_root, job).mkdir(parents=True, exist_ok=True)
        a = Agent(settings, stages or ("all",), tmp_path / f"agent-{len(started)}.log")
        started.append(a.start())
        return a

    yield start
    for a in started:
        if a.proc is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()
    call = getattr(request.node, "rep_call", None)
    if call is not None and call.failed:
        for a in started:
            print(f"--- {a.log_path.name} ({a.stages}), its tail:\n{a.log()[-6000:]}",
                  file=sys.stderr)  # fmt: skip


class Events:
    """Reads a job's events back from the stream (what recovery and operators see)."""

    def __init__(self, settings: Settings, job: str) -> None:
        self.settings, self.job = settings, job

    def all(self, kind: str = "*") -> list[Event]:
        """Events of one kind (`*`: every kind; `plan`: rank 0's recovery plans; `batch`: the
        nodes' batches as they are), each fact once: the per-rank events in stream order, then
        what only a node's batch reported (the coordinator's object removals)."""

        async def replay() -> list[Event]:
            async with self._bus() as bus:
                return await self._replay(bus, kind)

        return anyio.run(replay)

    def wait_for(
        self, predicate: Callable[[Event], bool], *, kind: str = "*", timeout: float = 30.0
    ) -> Event:
        """The first event of `kind` that `predicate` accepts, read over one connection, looking
        again less often the longer it takes (each look replays the subject: on a loaded
        machine, tight polling would be the load)."""

        async def wait() -> Event:
            deadline = time.monotonic() + timeout
            pause = 0.05
            async with self._bus() as bus:
                while True:
                    found = await self._replay(bus, kind)
                    for event in found:
                        if predicate(event):
                            return event
                    if time.monotonic() > deadline:
                        raise AssertionError(f"no matching {kind} event in {timeout} s: {found}")
                    await anyio.sleep(pause)
                    pause = min(pause * 1.5, 0.5)

        return anyio.run(wait)

    def _bus(self) -> Bus:
        # A loaded machine may take seconds to connect: ride it out as an agent does.
        return Bus(self.settings, name="tests-events", connect_wait_s=60.0)

    async def _replay(self, bus: Bus, kind: str) -> list[Event]:
        root = f"{SUBJECT_ROOT}.{self.job}."
        found = await bus.history(root + ("plan" if kind == "plan" else f"{kind}.>"))
        if kind in ("plan", "batch"):
            return found
        batches = await bus.history(root + f"batch.*.{kind}")
        out = [e for e in found if not isinstance(e, NodeBatch)]
        seen = {msg_id(e) for e in out}
        for b in batches:
            if isinstance(b, NodeBatch):
                out += [e for e in b.events if msg_id(e) not in seen]
                seen.update(msg_id(e) for e in b.events)
        return out


@pytest.fixture
def events(settings: Settings, job: str) -> Events:
    return Events(settings, job)


def run_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """`tierpipe <args>` as an operator runs it, with `settings` in its environment."""
    return subprocess.run(
        [sys.executable, "-m", "tierpipe.cli", *args],
        env={**os.environ, **settings.as_env()},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """Another process spinning on every core for the test's length: races hide on an idle
    machine (a 2-core CI box under load is where they showed)."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for p in hogs:
            p.kill()
            p.wait()
