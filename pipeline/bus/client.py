"""The event bus: one NATS connection, the jobs' streams, publishing and watching events.

nats-py exceptions stop here: callers see `BusUnavailableError` (retryable: down, timeout),
`BusAuthError` (the server refused this client's credentials or TLS) or `BusError` (refused: bad
config, API error). Credentials and TLS come from the settings (user/password, token, creds
file, nkey seed, CA and client certificate; `tierpipe.bus.connect`). The stream's configuration is
`tierpipe.bus.stream`'s; reading its history and watching it, `tierpipe.bus.history`'s; the stages'
durable pull consumers, `tierpipe.bus.consumer`'s. Each job has a stream of its own
(`<stream>_<job>`, subjects `tp.<job>.>`); a subject names its job, so every call here finds the
stream from the subject it is given. A stream that vanished (deleted by an operator, lost by the
server) is recreated by the next publish that finds it missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import api

from tierpipe.bus import history, stream
from tierpipe.bus.connect import UNAVAILABLE, connect_options, refusal, translate
from tierpipe.bus.history import Follow, Raw, Watch
from tierpipe.errors import BusAuthError, BusError, BusUnavailableError, InvalidNameError
from tierpipe.log import register_secrets, scrub, settings_secrets
from tierpipe.names import (
    event_subject,
    msg_id,
    redact_url,
    stream_name,
    subject_job,
    validate_token,
)
from tierpipe.schemas import SCHEMA_VERSION, Event, StageFailed, decode_event, encode_event
from tierpipe.schemas.facts import Fact
from tierpipe.settings import Settings

__all__ = ("Bus", "Published", "redact_url")

log = structlog.get_logger(__name__)

KIND_HEADER = "Tp-Kind"
SCHEMA_HEADER = "Tp-Schema"

#: A permissions violation as nats-py reports it: `... for Publish to "<subject>"`.
_DENIED = re.compile(r"Permissions Violation for (Publish|Subscription) to \"?([^\"']+)\"?", re.I)


@dataclass(frozen=True, slots=True)
class Published:
    seq: int
    #: The server already had this `Nats-Msg-Id` (a republish after redelivery).
    duplicate: bool


class Bus:
    """Async context manager around one NATS connection and its JetStream context."""

    def __init__(
        self, settings: Settings, *, name: str = "tierpipe", connect_wait_s: float = 0.0
    ) -> None:
        self.settings = settings
        self.name = name
        self.connect_wait_s = connect_wait_s
        self._closing = False
        #: A read that finds no stream makes sure of it first (`ensure_stream_on_first_miss`).
        self._ensure_on_miss = False
        #: Jobs whose stream this connection made sure of (`ensure_job_stream`).
        self._ensured: set[str] = set()
        self._connected = False
        self._last_error: BaseException | None = None
        self._refused = asyncio.Event()
        #: Subjects the server refused a publish to (permissions), with its words.
        self._denied: dict[str, str] = {}
        #: Set while connected: publishes wait for it rather than queue up in nats-py's buffer.
        self._up = asyncio.Event()
        self.nc: nats.NATS | None = None
        self.js: Any = None
        #: Called with every event published (an agent's metrics count them).
        self.on_publish: Callable[[Event], None] | None = None
        # Every process that talks to NATS masks these in its logs (see tierpipe.log).
        register_secrets(settings_secrets(settings))

    async def __aenter__(self) -> Bus:
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
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.nc.options["max_reconnect_attempts"] = -1
        self._connected = True
        self._up.set()
        self.js = self.nc.jetstream(timeout=s.request_timeout_s)
        log.debug("bus_connected", url=redact_url(s.nats_url), name=self.name)

    async def _connect_once(self, servers: list[str], options: dict[str, Any]) -> nats.NATS:
        """One round over `servers`. nats-py keeps retrying a server whose certificate it
        rejects instead of failing, so a refusal reported to the error callback ends it here."""
        s = self.settings
        self._last_error = None
        self._refused = asyncio.Event()
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
        refused = asyncio.ensure_future(self._refused.wait())
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
                if refusal(e) is not None:
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

    # --- the stream

    def stream(self, subject: str) -> str:
        """The name of the stream that holds `subject` (its job's).

        Raises:
            InvalidNameError: `subject` names no single job.
        """
        return stream_name(self.settings.stream, subject_job(subject))

    async def ensure_stream(self, job: str, *, update: bool = True) -> None:
        """Create `job`'s stream, or update it if its settings changed (idempotent).

        Trainers pass `update=False`: they create a missing stream but leave the agent's alone.

        Raises:
            BusError: the server refused the config (e.g. a change it cannot apply in place).
        """
        await stream.ensure_stream(self.js, self.settings, job, update=update)
        self._ensure_on_miss = False

    async def ensure_job_stream(self, job: str) -> None:
        """`ensure_stream(job)` once per connection (an agent's stages, finding a job new to
        the node: the agent's settings win)."""
        if job not in self._ensured:
            await self.ensure_stream(job)
            self._ensured.add(job)

    async def stream_made(self, job: str) -> tuple[str, int] | None:
        """When `job`'s stream was made, and the newest sequence it ever stored (that stays when
        limits drop messages; a stream made again numbers from 1 again); None: there is no such
        stream. A JetStream API request.

        Raises:
            BusUnavailableError: JetStream did not answer.
        """
        name = stream_name(self.settings.stream, job)
        with translate(f"stream {name}", keep=(nats.js.errors.NotFoundError,)):
            try:
                info = await self.js.stream_info(name)
            except nats.js.errors.NotFoundError:
                return None
        return str(info.created or ""), int(info.state.last_seq or 0)

    async def jobs(self) -> list[str]:
        """The jobs that have a stream, by name (operators' tools: a JetStream API request per
        page of 256 streams, never on a hot path).

        Raises:
            BusUnavailableError: JetStream did not answer.
        """
        prefix, offset = f"{self.settings.stream}_", 0
        found: list[str] = []
        while True:
            try:
                page = await self.js.streams_info(offset=offset)
            except UNAVAILABLE as e:
                raise BusUnavailableError(f"list streams: {e or type(e).__name__}") from e
            if not page:
                return sorted(found)
            offset += len(page)
            for info in page:
                name = info.config.name or ""
                if name.startswith(prefix):
                    with contextlib.suppress(InvalidNameError):  # (`ctl`, another tool's)
                        found.append(validate_token("job", name[len(prefix) :]))

    def ensure_stream_on_first_miss(self) -> None:
        """For a trainer rank that skips `ensure_stream` (tens of thousands of stream-info
        requests would overflow the server's API queue): the first `last_raw` that finds no
        stream (it may start before rank 0 or any agent made it) makes sure of it, once
        (`update=False`), and asks again. Other readers get `BusUnavailableError`: a read-only
        tool never creates a stream."""
        self._ensure_on_miss = True

    # --- events

    async def publish(
        self, event: Event, *, timeout: float | None = None, id_suffix: str = ""
    ) -> Published:
        """Publish an event with `Nats-Msg-Id` and wait for the stream's ack.

        `id_suffix` sets a republished event apart from its original (reindex after a purge:
        the server still remembers the original ids for the duplicate window).

        Raises:
            BusUnavailableError: no ack in time.
            BusError: the server refused the message.
        """
        if isinstance(event, StageFailed):
            # Errors are reported with str(e): last-resort masking of a secret one may embed.
            message = scrub(event.message, self.settings.secrets())
            event = msgspec.structs.replace(event, message=message)
        headers = {
            "Nats-Msg-Id": msg_id(event) + id_suffix,
            KIND_HEADER: str(type(event).__struct_config__.tag),
            SCHEMA_HEADER: str(SCHEMA_VERSION),
        }
        subject = event_subject(event)
        ack = await self._publish(subject, encode_event(event), headers=headers, timeout=timeout)
        if self.on_publish is not None and not ack.duplicate:
            self.on_publish(event)
        return Published(ack.seq, bool(ack.duplicate))

    async def _publish(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None, timeout: float | None
    ) -> Any:
        """Publish into the stream and wait for its ack, trying again until `timeout`.

        A stream found missing (deleted under us, lost by the server) is created again, once:
        nobody answers a publish to a missing stream, and only when no core subscriber listens
        on the subject does the server say so at once; otherwise the publish just times out, so
        a timed-out try checks that the stream still exists. Tries share one `Nats-Msg-Id`, so
        the stream keeps one copy whichever of them landed.
        """
        timeout = timeout or self.settings.request_timeout_s
        deadline = time.monotonic() + timeout
        per_try = max(1.0, timeout / 4)
        checked = tried = False
        last: BaseException | None = None
        while True:
            # While disconnected, nats-py would buffer the message and send it after the
            # reconnect, long after the caller was told it failed: wait for the connection
            # instead, so a publish that failed was never sent.
            await self._until_connected(subject, deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"{type(last).__name__}" if last else "no ack"
                raise BusUnavailableError(
                    f"publish to {subject}: no ack within {timeout:g} s ({why})"
                ) from last
            try:
                ack = await self.js.publish(
                    subject,
                    data,
                    timeout=min(left, per_try),
                    stream=self.stream(subject),
                    # nats-py adds the expected-stream header to the dict it is given
                    headers=dict(headers) if headers is not None else None,
                )
            except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError) as e:
                if subject in self._denied:
                    where = redact_url(self.settings.nats_url)
                    raise BusAuthError(where, self._denied.pop(subject)) from e
                # No stream answered: deleted, or (in a cluster) electing a new leader.
                last = e
                if not checked:
                    checked = True
                    await stream.recreate_if_missing(
                        self.js, self.settings, subject_job(subject), min(left, per_try)
                    )
                elif isinstance(e, nats.js.errors.NoStreamResponseError):
                    await asyncio.sleep(max(0.0, min(0.25, deadline - time.monotonic())))
            except nats.js.errors.APIError as e:
                raise BusError(f"publish to {subject} refused: {e.description or e}") from e
            except UNAVAILABLE as e:
                raise BusUnavailableError(f"publish to {subject}: {e or type(e).__name__}") from e
            else:
                if tried and ack.duplicate:  # our own earlier try landed after all
                    ack.duplicate = False
                return ack
            tried = True

    async def _until_connected(self, subject: str, deadline: float) -> None:
        if self.nc is None or self.nc.is_closed:
            raise BusUnavailableError(f"publish to {subject}: the connection is closed")
        if self._up.is_set():
            return
        try:
            await asyncio.wait_for(self._up.wait(), max(0.0, deadline - time.monotonic()))
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

    async def subscribe(self, subject: str, callback: Callable[[Msg], Awaitable[None]]) -> Any:
        """A core (non-JetStream) subscription: live events only, no replay."""
        return await self._client().subscribe(subject, cb=callback)

    async def publish_raw(self, subject: str, data: bytes) -> int:
        """Publish a non-event message (a control command) into the stream; returns its seq."""
        ack = await self._publish(subject, data, headers=None, timeout=None)
        return ack.seq

    async def last_raw(self, subject: str) -> tuple[int, bytes] | None:
        """(stream seq, body) of the newest message on `subject` (with wildcards: the newest of
        all the subjects it matches), or None. A direct get: no JetStream API request."""
        try:
            raw = await self.js.get_last_msg(self.stream(subject), subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        except nats.errors.NoRespondersError as e:
            if not self._ensure_on_miss:
                raise BusUnavailableError(f"get {subject}: {e or type(e).__name__}") from e
            await self.ensure_stream(subject_job(subject), update=False)  # (clears the flag)
            return await self.last_raw(subject)
        except UNAVAILABLE as e:
            raise BusUnavailableError(f"get {subject}: {e or type(e).__name__}") from e
        return raw.seq or 0, raw.data or b""

    async def last_event(self, subject: str) -> Event | None:
        """The newest event on `subject` (see `last_raw`), or None."""
        raw = await self.last_raw(subject)
        if raw is None:
            return None
        try:
            return decode_event(raw[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def history(self, subject: str) -> list[Event]:
        """Every stored event on `subject` (wildcards allowed), oldest first, as of now.

        Read through an ephemeral push consumer whose messages land straight in a callback
        (no per-message task, unlike a pull fetch): ~35k events/s here, decoding included.
        Undecodable messages are skipped (the stages report those when they meet them).
        """
        return [e for _, e in await self._collect(subject, api.DeliverPolicy.ALL, seqs=False)]

    async def stored(self, subject: str, *, since: float | None = None) -> list[Raw]:
        """Every stored message on `subject` as it is (or those stored at `since` or later,
        seconds since the epoch), oldest first, as of now: what an operator looks at."""
        return await history.collect_raw(
            self._client(), self.js, self.stream(subject), subject, api.DeliverPolicy.ALL,
            timeout=self.settings.request_timeout_s, since=since,
        )  # fmt: skip

    def tail(
        self, subject: str, *, after: int
    ) -> contextlib.AbstractAsyncContextManager[asyncio.Queue[Raw]]:
        """Every message on `subject` stored after stream sequence `after`, as it comes."""
        return history.tail(self.js, self.stream(subject), subject, after=after)

    async def latest(self, subject: str) -> list[tuple[int, Event]]:
        """(stream seq, event) of the newest message on each subject matching `subject`."""
        return await self._collect(subject, api.DeliverPolicy.LAST_PER_SUBJECT, seqs=True)

    def watch(
        self, subject: str, *, each_subject: bool = True
    ) -> contextlib.AbstractAsyncContextManager[Watch]:
        """The newest stored message on each subject matching `subject` (the newest of them
        all with `each_subject=False`), then every later one as the stream stores it, in stream
        order (see `tierpipe.bus.history.watch`). Open it before publishing what its messages
        answer."""
        return history.watch(self.js, self.stream(subject), subject, each_subject=each_subject)

    def follow(
        self,
        subject: str | list[str],
        *,
        start_seq: int,
        decode: Callable[[bytes], Event | Fact] = decode_event,
    ) -> contextlib.AbstractAsyncContextManager[Follow]:
        """Every message on `subject` (or any of several) from `start_seq` on, then every
        later one, in batches (see `tierpipe.bus.history.follow`): for a reader that folds a lot.
        `decode`: what a body becomes (default: an event; the coordinator takes facts)."""
        first = subject if isinstance(subject, str) else subject[0]
        return history.follow(
            self.js, self.stream(first), subject, start_seq=start_seq, decode=decode
        )

    async def _collect(
        self, subject: str, policy: api.DeliverPolicy, *, seqs: bool
    ) -> list[tuple[int, Event]]:
        return await history.collect(
            self._client(),
            self.js,
            self.stream(subject),
            subject,
            policy,
            seqs=seqs,
            timeout=self.settings.request_timeout_s,
        )
