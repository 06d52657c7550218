"""Connecting to NATS: nats-py connect options from the settings (credentials, TLS), what a
refusal means, and which nats-py exceptions mean an outage rather than a refusal (`translate`
raises JetStream's as the bus's errors)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Iterator
from typing import TypedDict

import nats
import nats.errors
import nats.js.errors

from tierpipe.errors import BusError, BusUnavailableError, ConfigError
from tierpipe.settings import Settings

__all__ = ("UNAVAILABLE", "ConnectOptions", "connect_options", "refusal", "translate")

#: nats-py exceptions that mean NATS is down, unreachable or not answering (retry later).
UNAVAILABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoServersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    OSError,
)


@contextlib.contextmanager
def translate(what: str, *, keep: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Raise nats-py's errors from a JetStream request about `what` (named first in the message)
    as the bus's: an outage, JetStream's "unavailable" (503) included, as `BusUnavailableError`;
    any other API error (a refusal) as `BusError`. Errors in `keep` (a caller's answers, e.g. a
    missing key) pass through as they are."""
    try:
        yield
    except keep:
        raise
    except nats.js.errors.APIError as e:
        if isinstance(e, nats.js.errors.ServiceUnavailableError):
            raise BusUnavailableError(f"{what}: JetStream unavailable") from e
        raise BusError(f"{what}: {e.description or e}") from e
    except UNAVAILABLE as e:
        raise BusUnavailableError(f"{what}: {e or type(e).__name__}") from e


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
