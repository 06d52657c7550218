"""Where a job's objects live: the object-store location bound to the job in KV.

Any agent whose node takes part in a job may coordinate it, and agents of different teams may
share a NATS account; their object stores need not be the same. So the first agent to write an
object of a job binds the job to its own store (`<job>.location`, a `StoreLocation`: endpoint,
bucket, prefix; created atomically, so of agents racing, one binds), and every later object
write or delete of the job first checks that its agent's store is that one
(`bind_location`): an agent configured for another store refuses (`StoreMismatchError`,
naming both) instead of writing the job's COMMIT manifests into, or deleting keys from, a
bucket that is not the job's.

Endpoints compare as URLs: scheme and host in any case, with or without a trailing slash or the
scheme's default port, are the same endpoint; none (AWS's default) is only itself.
"""

from __future__ import annotations

import urllib.parse

import msgspec
import structlog

from tierpipe.control.kvstate import JobStore, location_key
from tierpipe.errors import StoreMismatchError
from tierpipe.schemas.jobstate import StoreLocation
from tierpipe.settings import Settings

__all__ = (
    "bind_location",
    "check_location",
    "location_of",
    "normal_endpoint",
    "same_location",
    "stored_location",
)

log = structlog.get_logger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443}
_json = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(StoreLocation)


def normal_endpoint(url: str | None) -> str:
    """`url` as locations compare it: "" for none (AWS's default endpoint); scheme and host
    lower-cased, credentials, the scheme's default port, a query and trailing slashes dropped.
    A value that is not a URL with a host is compared as written (trailing slashes dropped)."""
    text = (url or "").strip()
    if not text:
        return ""
    parts = urllib.parse.urlsplit(text)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # (a port that is not a number)
        host = port = None
    if not parts.scheme or not host:
        return text.rstrip("/")
    scheme = parts.scheme.lower()
    host = f"[{host}]" if ":" in host else host  # (IPv6)
    netloc = host if port in (None, _DEFAULT_PORTS.get(scheme)) else f"{host}:{port}"
    return urllib.parse.urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


def location_of(settings: Settings) -> StoreLocation:
    """The object store an agent with `settings` writes to (as `S3Store` addresses it)."""
    s = settings
    here = StoreLocation(endpoint=s.s3_endpoint or "", bucket=s.s3_bucket, prefix=s.s3_prefix)
    return _normal(here)


def same_location(a: StoreLocation | str, b: StoreLocation | str) -> bool:
    """Whether `a` and `b` are one object store (endpoints compared normalised; an unreadable
    location, a `str`, is none)."""
    if isinstance(a, str) or isinstance(b, str):
        return False
    return _normal(a) == _normal(b)


def _normal(location: StoreLocation) -> StoreLocation:
    return StoreLocation(
        endpoint=normal_endpoint(location.endpoint),
        bucket=location.bucket,
        prefix=location.prefix.strip("/"),
    )


async def stored_location(store: JobStore, job: str) -> StoreLocation | str | None:
    """The location `job` is bound to; None if it is bound to none yet; a description of the
    value if it does not decode (a location no store can match).

    Raises:
        BusUnavailableError, BusError: the KV could not be read.
    """
    value = await store.value(location_key(job))
    if value is None:
        return None
    try:
        return _decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"an unreadable location ({e})"


async def bind_location(
    store: JobStore, job: str, here: StoreLocation | None = None
) -> StoreLocation:
    """Check that `job`'s objects live in `here` (default: `store`'s settings' object store),
    binding the job to it if it is bound to none yet: call before writing or deleting any
    object of the job. The location the job is bound to.

    Raises:
        StoreMismatchError: the job is bound to another store (logged by the caller).
        BusUnavailableError, BusError: the KV could not be read or written.
    """
    here = location_of(store.settings) if here is None else _normal(here)
    for _ in range(3):  # (created and deleted again in between: look again)
        bound = await stored_location(store, job)
        if bound is None:
            if await store.create(location_key(job), _json.encode(here)):
                log.info("job_location_bound", job=job, location=str(here))
                return here
            continue  # another agent bound it first: check against that
        if not same_location(bound, here):
            raise StoreMismatchError(job, str(bound), str(here))
        return here
    raise StoreMismatchError(job, "a location that keeps changing", str(here))


async def check_location(store: JobStore, job: str) -> None:
    """Check, binding nothing, that `job`'s objects are not bound to a store other than
    `store`'s settings' (operators' tools, `tierpipe gc` and `rm`: they list and remove, never
    bind; a job bound to none is checked by its agents' first upload).

    Raises:
        StoreMismatchError: the job is bound to another store.
        BusUnavailableError, BusError: the KV could not be read.
    """
    here = location_of(store.settings)
    bound = await stored_location(store, job)
    if bound is not None and not same_location(bound, here):
        raise StoreMismatchError(job, str(bound), str(here))
