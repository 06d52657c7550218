"""The peer endpoint's client: what an agent or a restoring trainer asks another node's endpoint.

`PeerClient` (one long-lived aiohttp session, the token in every request) asks a partner to
replicate a verified shard (`replicate`), streams a shard from a node (`chunks`, `read_range`)
and fetches one into a durable, verified file (`fetch`). `fetch_shard` is the same as one call,
for tools and benchmarks (`bench rpo` times a replica copy with it). HTTP statuses and the HTTP
clients' exceptions become the project's errors here: 401 `PeerAuthError`, 404
`ShardMissingError`, 422 `ShardFormatError` (the copy is bad), 503 or no answer
`PeerUnavailableError`.

`fetch` reads the file with the standard library's blocking `http.client` in a worker thread,
not aiohttp: its `readinto` receives straight into the writer's buffers (aiohttp's protocol
copies every byte twice more on the event loop, in pieces of 256 KiB, which made a replica copy
half as fast as a plain socket copy of the same file).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import aiohttp
import anyio
import msgspec

from tierpipe.errors import (
    PeerAuthError,
    PeerUnavailableError,
    PermanentError,
    ShardFormatError,
    ShardMissingError,
)
from tierpipe.names import validate_token
from tierpipe.peer.landing import ReadInto
from tierpipe.peer.replicas import Landed, Replicas
from tierpipe.schemas import ShardIdentity, ShardReplicated, ShardVerified
from tierpipe.storage.nvme import NvmeStore

__all__ = (
    "REPLICATE_PATH",
    "SHARDS_PATH",
    "PeerClient",
    "ReplicateRequest",
    "fetch_shard",
    "shard_url",
)

SHARDS_PATH = "/v1/shards"
REPLICATE_PATH = "/v1/replicate"
#: Bytes read from a response at a time.
_CHUNK_BYTES = 4 << 20


class ReplicateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/replicate`: copy `event`'s verified shard from the node at `source_url`."""

    event: ShardVerified
    source_url: str


def shard_url(
    base: str, job: str, step: int, world_size: int, rank: int, *, header_digest: str = ""
) -> str:
    """The URL of a shard on the endpoint at `base` (that very save, if `header_digest`)."""
    validate_token("job", job)
    url = f"{base.rstrip('/')}{SHARDS_PATH}/{job}/{int(step)}/{int(world_size)}/{int(rank)}"
    return f"{url}?digest={header_digest}" if header_digest else url


class PeerClient:
    """Requests to peer endpoints, over one session (an async context manager)."""

    def __init__(self, *, token: str | None, timeout_s: float = 60.0) -> None:
        # (identity: a file is never sent gzipped, which `FileResponse` would if asked)
        self._headers = {"Accept-Encoding": "identity"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # (a large read buffer: the 64 KiB default pauses the socket every 64 KiB)
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=self._timeout, auto_decompress=False,
                read_bufsize=_CHUNK_BYTES,
            )  # fmt: skip
        return self._session

    async def replicate(
        self, partner_url: str, event: ShardVerified, *, source_url: str
    ) -> ShardReplicated:
        """Ask the endpoint at `partner_url` to copy `event`'s shard from `source_url`; the
        `replicated` event it published.

        Raises:
            PeerUnavailableError: the partner did not answer, or could not copy now.
            PeerAuthError: it refused the token.
            ShardMissingError: the source no longer has that save.
            ShardFormatError: the copy it received failed a check (not published).
        """
        url = partner_url.rstrip("/") + REPLICATE_PATH
        body = msgspec.json.encode(ReplicateRequest(event=event, source_url=source_url))
        with _translated(url):
            async with self.session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                await _check(resp, url)
                return msgspec.json.decode(await resp.read(), type=ShardReplicated)

    @contextlib.asynccontextmanager
    async def chunks(self, url: str, *, start: int = 0) -> AsyncIterator[AsyncIterator[bytes]]:
        """The bytes at `url` from `start` on, as they arrive (raises as `replicate` does)."""
        headers = {"Range": f"bytes={start}-"} if start else {}
        with _translated(url):
            async with self.session.get(url, headers=headers) as resp:
                await _check(resp, url)
                yield _body(resp, url)

    async def read_range(self, url: str, start: int, into: memoryview) -> None:
        """Fill `into` with the bytes at `url` from `start` on (a ranged GET).

        Raises:
            ShardFormatError: the file is shorter.
            (and as `replicate` does)
        """
        end = start + len(into) - 1
        with _translated(url):
            async with self.session.get(url, headers={"Range": f"bytes={start}-{end}"}) as resp:
                await _check(resp, url)
                at = 0
                async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
                    if at + len(chunk) > len(into):
                        raise ShardFormatError(url, f"more than the {len(into)} bytes asked for")
                    into[at : at + len(chunk)] = chunk
                    at += len(chunk)
                if at != len(into):
                    raise ShardFormatError(url, f"{at} bytes from {start}, {len(into)} expected")

    async def fetch(
        self,
        url: str,
        replicas: Replicas,
        final: Path,
        *,
        nbytes: int,
        header_digest: str,
        identity: ShardIdentity | None = None,
    ) -> Landed:
        """Copy the shard at `url` into `final`, durably, every digest checked as the bytes
        arrive (`Replicas.land`; raises as `replicate` does)."""
        conn, resp = await anyio.to_thread.run_sync(self._get, url)
        try:
            return await replicas.land(
                _reader(resp, url), final, nbytes=nbytes, header_digest=header_digest,
                identity=identity, abort=lambda: _shut(conn),
            )  # fmt: skip
        finally:
            conn.close()

    def _get(self, url: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A blocking GET of `url` whose status was a success (its body not read yet)."""
        parts = urlsplit(url)
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=self._timeout_s,
                context=ssl.create_default_context(),
            )  # fmt: skip
        else:
            conn = http.client.HTTPConnection(
                parts.hostname or "", parts.port, timeout=self._timeout_s
            )
        try:
            with _translated(url):
                conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                             headers=self._headers)  # fmt: skip
                resp = conn.getresponse()
                if resp.status >= 300:
                    raise _status_error(resp.status, resp.read(), resp.reason, url)
        except BaseException:
            conn.close()
            raise
        return conn, resp


async def fetch_shard(
    base_url: str,
    job: str,
    step: int,
    world_size: int,
    rank: int,
    dest: Path,
    *,
    nbytes: int,
    header_digest: str,
    token: str | None = None,
    direct_io: bool = True,
) -> Landed:
    """Copy one shard from the endpoint at `base_url` into the file `dest` as a replica is
    copied (streamed, every digest checked on the bytes received, written durably, then placed:
    `Replicas.land`). `bench rpo` times this against a plain socket copy. `direct_io` is the
    NVMe store's setting (the copy itself no longer re-reads the file).

    Raises:
        as `PeerClient.replicate` does, and NoSpaceError.
    """
    url = shard_url(base_url, job, step, world_size, rank, header_digest=header_digest)
    async with PeerClient(token=token) as client:
        replicas = Replicas(NvmeStore(dest.parent, direct_io=direct_io))
        try:
            return await client.fetch(url, replicas, dest, nbytes=nbytes,
                                      header_digest=header_digest)  # fmt: skip
        finally:
            replicas.close()


async def _body(resp: aiohttp.ClientResponse, url: str) -> AsyncIterator[bytes]:
    with _translated(url):
        async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
            yield chunk


async def _check(resp: aiohttp.ClientResponse, url: str) -> None:
    """Raise the project's error for a response that is no success."""
    if resp.status < 300:
        return
    try:
        body = await resp.read()
    except aiohttp.ClientError:
        body = b""
    raise _status_error(resp.status, body, resp.reason or "", url)


def _status_error(status: int, body: bytes, reason: str, url: str) -> Exception:
    """The project's error for a response that is no success (its JSON body says why)."""
    try:
        said = msgspec.json.decode(body)
        message = f"{said.get('error', '')}: {said.get('message', '')}"
    except (msgspec.DecodeError, AttributeError):
        message = reason
    if status == 401:
        return PeerAuthError(url)
    if status == 404:
        return ShardMissingError(url, message)
    if status == 422:
        return ShardFormatError(url, message)
    if status >= 500 or status == 429:
        return PeerUnavailableError(url, f"{status} {message}")
    return PermanentError(f"peer endpoint {url}: {status} {message}")


def _reader(resp: http.client.HTTPResponse, url: str) -> ReadInto:
    """`resp`'s body read into a buffer, the project's errors raised."""

    def read_into(view: memoryview) -> int:
        with _translated(url):
            return resp.readinto(view)

    return read_into


def _shut(conn: http.client.HTTPConnection) -> None:
    """Make a read blocked on `conn` in another thread return (the copy failed or stopped)."""
    if conn.sock is not None:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    try:
        yield
    except (
        TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError,
        http.client.HTTPException,
    ) as e:  # fmt: skip
        raise PeerUnavailableError(url, f"{type(e).__name__}: {e}") from e
