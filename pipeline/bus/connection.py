"""One NATS connection and its JetStream context: connected (with the settings' credentials and
TLS, retried while a server is not up yet), watched while up (disconnects, reconnects, refused
publishes) and closed. `tierpipe.bus.client.Bus` adds the streams and events on top of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Self

import anyio
import nats
import structlog
from nats.js import JetStreamContext

from tierpipe.bus.connect import ConnectOptions, connect_options, refusal
from tierpipe.errors import BusAuthError, BusUnavailableError
from tierpipe.log import register_secrets, scrub, settings_secrets
from tierpipe.names import redact_url
from tierpipe.settings import Settings

__all__ = ("Connection",)

log = structlog.get_logger(__name__)

#: A permissions violation as nats-py reports it: `... for Publish to "<subject>"`.
_DENIED = re.compile(r"Permissions Violation for (Publish|Subscription) to \"?([^\"']+)\"?", re.I)


class Connection:
    """Async context manager around one NATS connection and its JetStream context."""

    def __init__(
        self, settings: Settings, *, name: str = "tierpipe", connect_wait_s: float = 0.0
    ) -> None:
        self.settings = settings
        self.name = name
        self.connect_wait_s = connect_wait_s
        self._closing = False
        self._connected = False
        self._last_error: BaseException | None = None
        #: Set by the error callback when a server refused this client (while connecting).
        self._refused: anyio.Event | None = None
        #: Subjects the server refused a publish to (permissions), with its words.
        self._denied: dict[str, str] = {}
        #: Set while connected: publishes wait for it rather than queue up in nats-py's buffer.
        #: (An asyncio event: each disconnect clears it, and an `anyio.Event` cannot be cleared.)
        self._up = asyncio.Event()
        self.nc: nats.NATS | None = None
        self._js: JetStreamContext | None = None
        # Every process that talks to NATS masks these in its logs (see tierpipe.log).
        register_secrets(settings_secrets(settings))

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context (that of the last connection once closed).

        Raises:
            BusUnavailableError: never connected.
        """
        if self._js is None:
            raise BusUnavailableError("not connected to NATS (connect() first)")
        return self._js

    async def __aenter__(self) -> Self:
        await self.connect(wait_s=self.connect_wait_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def connect(self, *, wait_s: float = 0.0) -> None:
        """Connect (reconnects are unlimited once connected); retry the first connect for
        up to `wait_s` seconds so an agent may start before its server.

        Raises:
            BusUnavailableError: no server answered in time.
            BusAuthError: a server refused the credentials or the TLS handshake failed.
            ConfigError: a credentials, key or certificate file cannot be read.
        """
        s = self.settings
        servers = [u.strip() for u in s.nats_url.split(",") if u.strip()]
        options = connect_options(s)
        deadline = time.monotonic() + wait_s
        delay = 0.1
        while True:
            try:
                self.nc = await self._connect_once(servers, options)
                break
            except Exception as e:
                self.nc = None
                where = redact_url(s.nats_url)
                refused = refusal(self._last_error or e)
                if refused is not None:
                    raise BusAuthError(where, refused) from e
                if time.monotonic() + delay > deadline:
                    cause = self._last_error or e
                    raise BusUnavailableError(
                        f"cannot reach NATS at {where}: {scrub(str(cause) or type(cause).__name__)}"
                    ) from e
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.nc.options["max_reconnect_attempts"] = -1
        self._connected = True
        self._up.set()
        self._js = self.nc.jetstream(timeout=s.request_timeout_s)
        log.debug("bus_connected", url=redact_url(s.nats_url), name=self.name)

    async def _connect_once(self, servers: list[str], options: ConnectOptions) -> nats.NATS:
        """One round over `servers`. nats-py keeps retrying a server whose certificate it
        rejects instead of failing, so a refusal reported to the error callback ends it here."""
        s = self.settings
        self._last_error = None
        self._refused = refused_event = anyio.Event()
        self._up = asyncio.Event()
        nc = nats.NATS()
        connecting = asyncio.ensure_future(
            nc.connect(
                servers,
                name=self.name,
                connect_timeout=s.connect_timeout_s,  # type: ignore[arg-type]  # (seconds, float)
                # Bounded while connecting (so a dead address fails); unlimited once up.
                max_reconnect_attempts=1,
                reconnect_time_wait=0.5,  # type: ignore[arg-type]  # (nats-py annotates int)
                allow_reconnect=True,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
                **options,
            )
        )
        # asyncio's wait, not a task group: a connect that neither ends nor is refused is
        # cancelled and given 5 s to end, never awaited for longer (nats-py's may hang on).
        refused = asyncio.ensure_future(refused_event.wait())
        limit = 2 * len(servers) * (s.connect_timeout_s + 1.0)
        try:
            await asyncio.wait({connecting, refused}, timeout=limit, return_when="FIRST_COMPLETED")
        finally:
            refused.cancel()
        if connecting.done():
            connecting.result()  # raises what connecting raised
            return nc
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=5)  # its own end, without raising it here
        with contextlib.suppress(Exception):
            await nc.close()
        raise self._last_error or BusUnavailableError(f"no NATS server answered in {limit:g} s")

    async def aclose(self) -> None:
        nc, self.nc = self.nc, None
        if nc is None or nc.is_closed:
            return
        self._closing = True
        try:
            # Flush what was published, then close: a drain would wait out pending pull requests.
            await nc.flush(timeout=2)
        except Exception as e:  # closing must not fail on a dead server
            log.debug("bus_flush_failed", error=str(e) or type(e).__name__)
        await nc.close()

    # nats-py runs these callbacks inside its read loop: an exception escaping one (a log
    # write to a closed stream, say) would stop the connection's reading for good.

    async def _on_error(self, e: Exception) -> None:
        try:
            denied = _DENIED.search(str(e))
            if denied is not None:
                # The server drops a publish it does not permit and says so only here: remember
                # it, so the publish waiting for its ack fails as refused, not as an outage.
                if len(self._denied) > 1000:
                    self._denied.clear()
                self._denied[denied[2]] = f"not permitted to {denied[1].lower()} to {denied[2]}"
            if self._connected:  # failed first attempts are reported by connect() itself
                log.warning("bus_error", error=str(e) or type(e).__name__)
            else:
                self._last_error = e
                if refusal(e) is not None and self._refused is not None:
                    self._refused.set()
        except Exception:  # noqa: S110 (see above: never raise into nats-py)
            pass

    async def _on_disconnected(self) -> None:
        self._up.clear()
        # What nats-py buffered before it noticed the disconnect, it sends after the reconnect:
        # a publish already reported failed (its ack timed out) would land late. Every stream
        # publish here retries under its own msg id until its deadline, so dropping the buffer
        # loses nothing acknowledged. (A paused server can still read its socket late; the
        # agent refuses such a `staged` by its slot generation, see `staged_image.release`.)
        if self.nc is not None and hasattr(self.nc, "_pending"):
            self.nc._pending.clear()
            self.nc._pending_data_size = 0
        with contextlib.suppress(Exception):
            if not self._closing:
                log.warning("bus_disconnected", name=self.name)

    async def _on_reconnected(self) -> None:
        self._up.set()
        with contextlib.suppress(Exception):
            log.info("bus_reconnected", name=self.name)

    async def _until_connected(self, subject: str, deadline: float) -> None:
        if self.nc is None or self.nc.is_closed:
            raise BusUnavailableError(f"publish to {subject}: the connection is closed")
        if self._up.is_set():
            return
        try:
            with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                await self._up.wait()
        except TimeoutError as e:
            raise BusUnavailableError(
                f"publish to {subject}: disconnected from NATS at "
                f"{redact_url(self.settings.nats_url)} (reconnecting)"
            ) from e

    def _client(self) -> nats.NATS:
        if self.nc is None:
            raise BusUnavailableError(
                "not connected to NATS (connect() first; or the bus is closed)"
            )
        return self.nc
