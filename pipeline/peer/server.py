"""The agent's peer endpoint: where other agents and restoring trainers get this node's copies,
and where partners send this node the shards it keeps replicas of.

Routes (every one behind `Authorization: Bearer <peer_token>` when a token is set, compared in
constant time):

- `GET /v1/shards/{job}/{step}/{world_size}/{rank}[?digest=<header digest>]`: the node's own
  NVMe copy of the shard, else the replica it holds (the same file either way), only if it holds
  that save when `digest` is given; ranged GETs work (`Range: bytes=a-b`).
- `POST /v1/replicate` (`client.ReplicateRequest`: a `verified` event and the source's URL):
  the node pulls the file from the source's GET, writes it durably and checks every digest
  (`replicas.Replicas.land`), publishes its own `replicated` event and answers with it. A replica
  of that save already here is answered (and published) again without a copy: a redelivered
  request costs nothing.

Errors answer JSON (`{"error": <class>, "message": ...}`): 400 a bad name or body, 401 no or
a wrong token, 404 no such copy here (or at the source), 422 the received copy failed a check
(it was removed, nothing published), 503 the NVMe is full or the source did not answer.

Why aiohttp: it is installed already (aioboto3 depends on it), runs on the agent's asyncio loop
beside the bus (no thread, no second server process), and its `web.FileResponse` sends files
with `sendfile(2)`, so the sealed file goes from the page cache to the socket without passing
through Python, and answers ranged GETs itself; TLS is one `ssl` context away where a
deployment wants it. Bytes never go through NATS nor object storage.
"""

from __future__ import annotations

import contextvars
import hmac
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType

import anyio
import msgspec
import structlog
from aiohttp import web
from anyio.abc import TaskStatus

from tierpipe.bus.client import Bus
from tierpipe.errors import (
    ConfigError,
    IntegrityError,
    NoSpaceError,
    PeerAuthError,
    RetryableError,
    ShardFormatError,
    ShardMissingError,
)
from tierpipe.names import validate_token
from tierpipe.peer.client import (
    REPLICATE_PATH,
    SHARDS_PATH,
    PeerClient,
    ReplicateRequest,
    shard_url,
)
from tierpipe.peer.replicas import Landed, Replicas
from tierpipe.schemas import ShardReplicated
from tierpipe.settings import Settings

__all__ = ("PeerServer", "check_bind", "endpoint_url", "serve")

log = structlog.get_logger(__name__)
_IGNORED = anyio.TASK_STATUS_IGNORED
_DIGEST = re.compile(r"[0-9a-f]{32}")
_BASE_URL = re.compile(r"https?://[^/\s?#]+")
#: The URL of the endpoint this agent runs ("": none), for the replicate stage (set by the
#: runner before it starts the stages).
endpoint_url: contextvars.ContextVar[str] = contextvars.ContextVar(
    "tierpipe_peer_endpoint", default=""
)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def check_bind(settings: Settings) -> None:
    """Refuse an endpoint that anyone on the network could use: a non-loopback bind needs a
    token.

    Raises:
        ConfigError: `peer_bind_host` is not loopback and `peer_token` is not set.
    """
    host = settings.peer_bind_host
    if not settings.peer_token and not _loopback(host):
        raise ConfigError(
            f"the peer endpoint binds {host!r}, which is not loopback, and no peer_token is set: "
            "anyone who reaches it could read every checkpoint; set peer_token "
            "(TIERPIPE_PEER_TOKEN) on every agent, or bind 127.0.0.1"
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerServer:
    """The endpoint (an async context manager): bound on entry, its address in `url`."""

    def __init__(self, settings: Settings, bus: Bus, *, node: str) -> None:
        check_bind(settings)
        self.settings, self.bus, self.node = settings, bus, node
        self.url = ""
        self.replicas = Replicas.from_settings(settings)
        self.client = PeerClient(token=settings.peer_token)
        self._token = f"Bearer {settings.peer_token}".encode() if settings.peer_token else None
        self._receiving: dict[Path, anyio.Lock] = {}
        app = web.Application(middlewares=[self._guard])
        app.router.add_get(SHARDS_PATH + "/{job}/{step}/{world_size}/{rank}", self._get_shard)
        app.router.add_post(REPLICATE_PATH, self._replicate)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def __aenter__(self) -> PeerServer:
        s = self.settings
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, s.peer_bind_host, s.peer_bind_port, reuse_address=True)
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ConfigError(
                f"the peer endpoint cannot bind {s.peer_bind_host}:{s.peer_bind_port}: {e}"
            ) from e
        port = self._runner.addresses[0][1]
        self.url = s.peer_advertise_url or f"http://{_host(s.peer_bind_host)}:{port}"
        log.info("peer_endpoint_started", url=self.url, bind=f"{s.peer_bind_host}:{port}",
                 token=bool(s.peer_token))  # fmt: skip
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self._runner.cleanup()
            await self.client.aclose()
            self.replicas.close()

    # --- routes

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Check the token, then turn the project's errors into statuses."""
        if self._token is not None:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, self._token):
                log.warning("peer_request_refused", path=request.path, remote=request.remote)
                return _error(401, "Unauthorized", "a valid peer token is required")
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
            return _error(400, type(e).__name__, str(e))
        except ShardMissingError as e:
            return _error(404, type(e).__name__, str(e))
        except (IntegrityError, ShardFormatError) as e:
            return _error(422, type(e).__name__, str(e))
        except (RetryableError, NoSpaceError, PeerAuthError) as e:
            return _error(503, type(e).__name__, str(e))

    async def _get_shard(self, request: web.Request) -> web.StreamResponse:
        job, step, world_size, rank = _identity(request.match_info)
        digest = request.query.get("digest", "")
        if digest and not _DIGEST.fullmatch(digest):
            raise ValueError(f"digest must be 32 hex digits (got {digest!r})")
        own = Path(self.replicas.nvme.locate(job, step, rank, world_size))
        for path in (own, self.replicas.path(job, step, rank, world_size)):
            held = await anyio.to_thread.run_sync(self.replicas.digest_at, path)
            if held is not None and (not digest or held == digest):
                return web.FileResponse(path, headers={"X-Header-Digest": held})
        raise ShardMissingError(
            f"{job}/{step}/{rank}-of-{world_size}",
            f"node {self.node} holds no copy" + (f" of save {digest}" if digest else ""),
        )

    async def _replicate(self, request: web.Request) -> web.StreamResponse:
        req = msgspec.json.decode(await request.read(), type=ReplicateRequest)
        event = req.event
        if event.node == self.node:
            raise ValueError(f"node {self.node} holds its own copy, not a replica of it")
        if not _BASE_URL.fullmatch(req.source_url):
            raise ValueError(f"source_url must be http(s)://host:port (got {req.source_url!r})")
        final = self.replicas.path(event.job, event.step, event.rank, event.world_size)
        lock = self._receiving.setdefault(final, anyio.Lock())
        async with lock:
            held = await anyio.to_thread.run_sync(self.replicas.digest_at, final)
            if held == event.header_digest:
                landed = Landed(final, event.nbytes, 0.0, True)
            else:
                url = shard_url(req.source_url, event.job, event.step, event.world_size,
                                event.rank, header_digest=event.header_digest)  # fmt: skip
                landed = await self.client.fetch(
                    url, self.replicas, final, nbytes=event.nbytes,
                    header_digest=event.header_digest, identity=event,
                )  # fmt: skip
        if not lock.statistics().tasks_waiting:
            self._receiving.pop(final, None)
        replicated = event.follow(
            ShardReplicated, node=self.node, source=event.node, path=str(final),
            nbytes=landed.nbytes, header_digest=event.header_digest,
            seconds=round(landed.seconds, 6),
        )  # fmt: skip
        await self.bus.publish(replicated)
        log.info("shard_replicated", job=event.job, step=event.step, rank=event.rank,
                 source=event.node, nbytes=landed.nbytes, seconds=round(landed.seconds, 6),
                 existed=landed.existed)  # fmt: skip
        return web.Response(body=msgspec.json.encode(replicated), content_type="application/json")


async def serve(
    settings: Settings, bus: Bus, *, node: str, task_status: TaskStatus[str] = _IGNORED
) -> None:
    """Run the endpoint until cancelled; started with its URL (`tg.start`)."""
    async with PeerServer(settings, bus, node=node) as server:
        task_status.started(server.url)
        await anyio.sleep_forever()


def _identity(info: Mapping[str, str]) -> tuple[str, int, int, int]:
    """(job, step, world size, rank) of a route's parts, validated (a bad one: ValueError)."""
    job = validate_token("job", info.get("job"))
    step, world_size, rank = (_int(info.get(k), k) for k in ("step", "world_size", "rank"))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    return job, step, world_size, rank


def _int(text: str | None, what: str) -> int:
    if text is None or not text.isdigit() or len(text) > 12:
        raise ValueError(f"{what} must be a non-negative integer (got {text!r})")
    return int(text)


def _host(bind: str) -> str:
    """The host part of the URL advertised for a bind address (no `peer_advertise_url`)."""
    if bind in ("0.0.0.0", "::", ""):  # noqa: S104 (naming the wildcard binds, not binding)
        return socket.gethostname()
    return f"[{bind}]" if ":" in bind else bind


def _error(status: int, error: str, message: str) -> web.Response:
    return web.json_response({"error": error, "message": message}, status=status)
