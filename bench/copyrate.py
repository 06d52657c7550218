"""`bench rpo`'s copy rates: a replica copy (`tierpipe.peer.client.fetch_shard`, from an agent's
peer endpoint) against a plain copy of the same file over a loopback TCP socket.

`measure` starts a cluster of its own, quiet: one nats-server and one node agent (`tierpipe
worker all`, replicas on), with nothing else to do; writes a sealed shard of `COPY_BYTES` into
the agent's NVMe and copies it `pairs` times each way, interleaved (socket then replica, then
the other way round: `bench.paired.run_pairs`). Every timed copy comes right after an untimed copy
of the same kind (`WARMUP_COPIES`).

Why a cluster of its own, and the untimed copies (measured on this 2-core VM, 2026-12-02):
- Inside a `bench rpo` trial the four agents' upload backlogs, replicas and restores compete
  for the cores and the disk at moments that differ from run to run, and the two copies of a
  pair did not see the same load: two runs' intervals of `replica_vs_socket` missed each other
  (1.20 [1.13, 1.96] against 0.77 [0.57, 1.04]).
- The copies write new files, and how fast a page-cache write of fresh pages runs on this VM
  depends on what wrote just before: 1 GiB written by one process right after the same process
  wrote (and removed) 1 GiB takes 0.19-0.23 s; after another process did, or after 3 s idle,
  0.57-1.1 s. The replica copy writes in this process, the socket copy in a receiver
  process, so a replica copy right after a socket copy paid that and a socket copy mostly
  did not: at 1 GiB the replica copy ran at 0.45x the socket copy when it followed one and
  at 0.9-1.3x when it followed a replica copy (the landing's own times: `pwritev` 1.6-1.9 s
  against 0.2 s; the reads and the digests the same). An untimed copy of the same kind first
  puts both copies in the same state.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import SHM, log
from bench.paired import run_pairs

__all__ = [
    "COPY_BYTES",
    "COPY_PAIRS",
    "Copies",
    "ReplicasUnavailableError",
    "measure",
    "replica_copy_s",
    "socket_copy_s",
]

#: The size of the shard the copy rates are measured with: a run's own shards (a few MiB in
#: `bench rpo`) would measure a request's fixed cost, not a copy's rate (real shards are GiB).
COPY_BYTES = 128 << 20
#: Timed copies of each kind, in pairs.
COPY_PAIRS = 9
#: Untimed copies of the same kind before each timed copy (see the module docstring).
WARMUP_COPIES = 1
#: How long the agent may take to advertise its peer endpoint.
READY_TIMEOUT_S = 60.0
_JOB = "copyrate"


class ReplicasUnavailableError(RuntimeError):
    """This build has no peer transport to copy a replica with."""


@dataclass
class Copies:
    """Seconds of each timed copy, pair by pair, and the bytes each copied (0: none ran)."""

    socket_s: list[float] = field(default_factory=list)
    replica_s: list[float] = field(default_factory=list)
    nbytes: int = 0


_RECEIVER = """
import os, socket, sys
s = socket.create_server(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
buf = bytearray(1 << 20)
view = memoryview(buf)
while n := c.recv_into(buf):
    os.write(fd, view[:n])
os.fsync(fd)
os.close(fd)
c.sendall(b"ok")
"""


def socket_copy_s(path: Path, dest: Path) -> float:
    """Seconds to copy `path` to `dest` over a loopback TCP socket between this process
    (`socket.sendfile`) and a receiver process (writes, fsyncs, then acknowledges); the
    receiver's start is untimed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, str(dest)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as sock, open(path, "rb") as f:
            t0 = time.perf_counter()
            sock.sendfile(f)
            sock.shutdown(socket.SHUT_WR)
            if sock.recv(2) != b"ok":
                raise RuntimeError("the socket copy's receiver did not acknowledge")
            seconds = time.perf_counter() - t0
        if proc.wait(30) != 0 or dest.stat().st_size != path.stat().st_size:
            raise RuntimeError(f"the socket copy of {path} is incomplete")
        return seconds
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        dest.unlink(missing_ok=True)


def replica_copy_s(
    base_url: str, shard: Any, dest: Path, *, token: str | None = None, direct_io: bool = True
) -> float:
    """Seconds to copy the verified shard of `shard` (a `ShardVerified` event) from the peer
    endpoint at `base_url` (an agent: another process) into `dest`, as a replica is copied
    (`tierpipe.peer.client.fetch_shard`: streamed, every digest checked as the bytes arrive,
    written durably; `direct_io` is accepted and no longer changes anything).
    Raises ReplicasUnavailableError where this build has no peer transport."""
    import anyio

    try:
        from tierpipe.peer.client import fetch_shard
    except ImportError as e:
        raise ReplicasUnavailableError(
            "replicas not available in this build (no tierpipe.peer.client)"
        ) from e

    async def copy() -> float:
        t0 = time.perf_counter()
        await fetch_shard(
            base_url, shard.job, shard.step, shard.world_size, shard.rank, dest,
            nbytes=shard.nbytes, header_digest=shard.header_digest, token=token,
            direct_io=direct_io,
        )  # fmt: skip
        return time.perf_counter() - t0

    try:
        return anyio.run(copy)
    finally:
        dest.unlink(missing_ok=True)


def measure(
    s3_env: dict[str, str], work: Path, *, pairs: int = COPY_PAIRS, nbytes: int = COPY_BYTES
) -> Copies:
    """`pairs` socket and replica copies of a shard of about `nbytes`, on a quiet cluster of one
    agent started here (its files under `work`, its settings from `s3_env` and the defaults);
    the socket copies alone (and a log line saying why) where this build has no peer transport.
    """
    from tierpipe.dev.cluster import Node
    from tierpipe.dev.nats import NatsServer
    from tierpipe.settings import load_settings

    with ExitStack() as stack:
        shm = Path(tempfile.mkdtemp(prefix="tierpipe-bench-copyrate-", dir=SHM))
        stack.callback(shutil.rmtree, shm, True)
        nats = stack.enter_context(NatsServer(work / "nats"))
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TIERPIPE_")}, **s3_env,
            "TIERPIPE_NATS_URL": nats.url, "TIERPIPE_PEER_REPLICAS": "1",
            "TIERPIPE_LOG_LEVEL": "warning", "TIERPIPE_METRICS_PORT": "0",
        }  # fmt: skip
        node = Node("copyrate-n0", work / "nvme", shm / "n0")
        (node.staging / _JOB).mkdir(parents=True)  # (the agent serves the jobs it finds here)
        stack.callback(node.stop)
        node.start(env, work / "agent.log")
        settings = load_settings(path=None, env={k: v for k, v in env.items()
                                                 if k.startswith("TIERPIPE_")})  # fmt: skip
        shard = _shard(node.nvme, node.name, nbytes)

        def socket_copy() -> float:
            return _after_warmup(socket_copy_s, Path(shard.path), work / "socket.copy")

        try:
            url = _peer_url(settings, node)

            def replica_copy() -> float:
                return _after_warmup(replica_copy_s, url, shard, work / "replica.copy",
                                     direct_io=settings.direct_io)  # fmt: skip

            socket_s, replica_s = run_pairs(socket_copy, replica_copy, pairs=pairs)
        except ReplicasUnavailableError as e:
            log(f"  replica copy: {e}")
            return Copies([socket_copy() for _ in range(pairs)], [], shard.nbytes)
        return Copies(socket_s, replica_s, shard.nbytes)


def _after_warmup(copy: Any, *args: Any, **kwargs: Any) -> float:
    """The seconds of `copy(...)` run after `WARMUP_COPIES` untimed runs of it."""
    for _ in range(WARMUP_COPIES):
        copy(*args, **kwargs)
    return float(copy(*args, **kwargs))


def _shard(root: Path, node: str, nbytes: int) -> Any:
    """A sealed shard of about `nbytes` on the NVMe at `root`, and its identity as
    `replica_copy_s` reads it (a `ShardVerified` event's fields)."""
    import torch

    from tierpipe.storage.reader import read_head
    from tierpipe.storage.shardfile import write_shard

    path = root / _JOB / f"step-{1:012d}" / "rank-00000-of-00001.shard"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_shard(path, {"w": torch.rand(nbytes // 4)}, job=_JOB, step=1, rank=0, world_size=1,
                node=node)  # fmt: skip
    head = read_head(path)
    return types.SimpleNamespace(
        job=_JOB, step=1, world_size=1, rank=0, path=str(path), node=node,
        nbytes=path.stat().st_size, header_digest=head.header_digest.hex(),
    )  # fmt: skip


def _peer_url(settings: Any, node: Any) -> str:
    """The peer endpoint `node`'s agent advertises, once it does.

    Raises:
        ReplicasUnavailableError: this build has no peer transport.
        RuntimeError: the agent exited, or advertised no endpoint in time.
    """
    import anyio

    try:
        import tierpipe.peer.client  # noqa: F401
    except ImportError as e:
        raise ReplicasUnavailableError(
            "replicas not available in this build (no tierpipe.peer.client)"
        ) from e
    from tierpipe.bus.client import Bus
    from tierpipe.control.advert import read_node

    async def advertised() -> str:
        async with Bus(settings, name="bench-copyrate") as bus:
            record = (await read_node(bus, settings, node.name)).record
        return str(getattr(record, "peer_url", "") or "")

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (url := anyio.run(advertised)):
        if node.agent is not None and node.agent.poll() is not None:
            raise RuntimeError(f"the copy rates' agent exited with {node.agent.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node.name} advertised no peer endpoint in {READY_TIMEOUT_S:g} s")
        time.sleep(0.2)
    return url
