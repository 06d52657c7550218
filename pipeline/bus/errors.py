"""nats-py's errors as the bus's: which mean an outage (`UNAVAILABLE`: retry later) rather
than a refusal, and `translate`, which raises JetStream's errors as the error tree's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import nats.errors
import nats.js.errors

from tierpipe.errors import BusError, BusUnavailableError

__all__ = ("UNAVAILABLE", "text", "translate")

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
        raise BusUnavailableError(f"{what}: {text(e)}") from e


def text(e: BaseException) -> str:
    """An error's message, or its class name when it has none."""
    return str(e) or type(e).__name__
