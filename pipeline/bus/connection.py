"""One NATS connection and its JetStream context: connected (nats-py's connect options from the
settings: credentials, TLS; retried while a server is not up yet; what a refusal means), watched
while up (disconnects, reconnects, refused publishes) and closed. `tierpipe.bus.client.Bus` adds
the streams and events on top of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from typing import Self, TypedDict

import anyio
import nats
import nats.errors
import structlog
from nats.js import JetStreamContext

from tierpipe.errors import BusAuthError, BusUnavailableError, ConfigError
from tierpipe.log import register_secrets, scrub, settings_secrets
from tierpipe.names import redact_url
from tierpipe.settings import Settings

__all__ = ("ConnectOptions", "Connection", "connect_options", "refusal")

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
            elif self._last_error is None or refusal(self._last_error) is None:
                # (a refusal stays: the broken pipe of the server closing follows it over TLS)
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


class ConnectOptions(TypedDict, total=False):
    """The nats-py `connect` keywords the settings give (credentials and TLS)."""

    user: str
    password: str
    token: str
    user_credentials: str
    nkeys_seed: str
    tls: ssl.SSLContext


def connect_options(s: Settings) -> ConnectOptions:
    """nats-py `connect` keywords for the credentials and TLS in the settings."""
    options = ConnectOptions()
    if s.nats_user is not None:
        options["user"] = s.nats_user
    if s.nats_password is not None:
        options["password"] = s.nats_password
    if s.nats_token is not None:
        options["token"] = s.nats_token
    if s.nats_creds_file is not None:
        _check_readable("nats_creds_file", s.nats_creds_file)
        options["user_credentials"] = s.nats_creds_file
    if s.nats_nkey_seed_file is not None:
        _check_readable("nats_nkey_seed_file", s.nats_nkey_seed_file)
        options["nkeys_seed"] = s.nats_nkey_seed_file
    if s.nats_tls_ca_file or s.nats_tls_cert_file or s.nats_tls_key_file:
        options["tls"] = _tls_context(s)
    return options


def _tls_context(s: Settings) -> ssl.SSLContext:
    """A client TLS context: the server is checked against the CA (the system's when none is
    set) and the host name of the URL it was reached at; the client certificate, if any, is
    offered for mutual TLS."""
    if bool(s.nats_tls_cert_file) != bool(s.nats_tls_key_file):
        raise ConfigError("nats_tls_cert_file and nats_tls_key_file go together (mutual TLS)")
    for field in ("nats_tls_ca_file", "nats_tls_cert_file", "nats_tls_key_file"):
        if getattr(s, field):
            _check_readable(field, getattr(s, field))
    try:
        context = ssl.create_default_context(cafile=s.nats_tls_ca_file)
        if s.nats_tls_cert_file and s.nats_tls_key_file:
            context.load_cert_chain(s.nats_tls_cert_file, s.nats_tls_key_file)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"cannot load the NATS TLS files: {e}") from e
    return context


def _check_readable(field: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path}: {e.strerror}") from e


def refusal(e: BaseException) -> str | None:
    """Why the server refused this client (credentials, TLS), or None for an outage."""
    if isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower():
        return (
            "the server refused the credentials (authorization violation): check nats_user / "
            "nats_password, nats_token, nats_creds_file or nats_nkey_seed_file"
        )
    if isinstance(e, nats.errors.InvalidUserCredentialsError):
        return f"invalid credentials file: {e}"
    if isinstance(e, ssl.SSLCertVerificationError):
        return (
            f"the server's TLS certificate was not accepted ({e.verify_message}): check "
            "nats_tls_ca_file and that the URL's host name is in the certificate"
        )
    if isinstance(e, ssl.SSLError):
        return f"TLS handshake failed ({e.reason or e}): check nats_tls_cert_file / key / CA"
    if isinstance(e, nats.errors.SecureConnRequiredError):
        return "the server requires TLS: use a tls:// URL or set nats_tls_ca_file"
    return None
