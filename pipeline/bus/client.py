"""The event bus (`Bus`): the jobs' streams, publishing events, reading and watching them.

nats-py exceptions stop here: callers see `BusUnavailableError` (retryable: down, timeout),
`BusAuthError` (the server refused this client's credentials or TLS) or `BusError` (refused: bad
config, API error; `tierpipe.bus.errors` says which). The connection itself is
`tierpipe.bus.connection`'s (credentials and TLS from the settings). The stream's configuration is
`tierpipe.bus.stream`'s; reading its history and watching it, `tierpipe.bus.history`'s; the stages'
durable pull consumers, `tierpipe.bus.consumer`'s. Each job has a stream of its own
(`<stream>_<job>`, subjects `tp.<job>.>`); a subject names its job, so every call here finds the
stream from the subject it is given. A stream that vanished (deleted by an operator, lost by the
server) is recreated by the next publish that finds it missing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from tierpipe.bus import history, stream
from tierpipe.bus.connection import Connection
from tierpipe.bus.errors import UNAVAILABLE, text, translate
from tierpipe.bus.history import Follow, Raw, Watch
from tierpipe.errors import BusAuthError, BusError, BusUnavailableError, InvalidNameError
from tierpipe.log import scrub
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


@dataclass(frozen=True, slots=True)
class Published:
    seq: int
    #: The server already had this `Nats-Msg-Id` (a republish after redelivery).
    duplicate: bool


class Bus(Connection):
    """Async context manager around one NATS connection (`Connection`): a job's stream, its
    events published, read back and watched."""

    def __init__(
        self, settings: Settings, *, name: str = "tierpipe", connect_wait_s: float = 0.0
    ) -> None:
        super().__init__(settings, name=name, connect_wait_s=connect_wait_s)
        #: A read that finds no stream makes sure of it first (`ensure_stream_on_first_miss`).
        self._ensure_on_miss = False
        #: Jobs whose stream this connection made sure of (`ensure_job_stream`).
        self._ensured: set[str] = set()
        #: Called with every event published (an agent's metrics count them).
        self.on_publish: Callable[[Event], None] | None = None

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

    async def stream_size(self, job: str) -> tuple[int, int] | None:
        """(messages, bytes) of `job`'s stream, or None: there is no such stream.

        Raises:
            BusUnavailableError: JetStream did not answer.
        """
        name = stream_name(self.settings.stream, job)
        with translate(f"stream {name}", keep=(nats.js.errors.NotFoundError,)):
            try:
                state = (await self.js.stream_info(name)).state
            except nats.js.errors.NotFoundError:
                return None
        return int(state.messages or 0), int(state.bytes or 0)

    async def delete_stream(self, job: str) -> None:
        """Delete `job`'s stream and every message in it (`tierpipe rm`).

        Raises:
            BusUnavailableError: JetStream did not answer.
            BusError: JetStream refused (no such stream, or it denies deletes).
        """
        name = stream_name(self.settings.stream, job)
        with translate(f"deleting stream {name}"):
            await self.js.delete_stream(name)

    async def has_consumer(self, job: str, durable: str) -> bool:
        """Whether `job`'s stream has the durable consumer `durable`. A JetStream API request.

        Raises:
            BusUnavailableError: JetStream did not answer.
        """
        name = stream_name(self.settings.stream, job)
        with translate(f"consumer {durable} of {name}", keep=(nats.js.errors.NotFoundError,)):
            try:
                await self.js.consumer_info(name, durable)
            except nats.js.errors.NotFoundError:
                return False
        return True

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
                raise BusUnavailableError(f"list streams: {text(e)}") from e
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
    ) -> api.PubAck:
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
                    await anyio.sleep(max(0.0, min(0.25, deadline - time.monotonic())))
            except nats.js.errors.APIError as e:
                raise BusError(f"publish to {subject} refused: {e.description or e}") from e
            except UNAVAILABLE as e:
                raise BusUnavailableError(f"publish to {subject}: {text(e)}") from e
            else:
                if tried and ack.duplicate:  # our own earlier try landed after all
                    ack.duplicate = False
                return ack
            tried = True

    async def subscribe(
        self, subject: str, callback: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
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
                raise BusUnavailableError(f"get {subject}: {text(e)}") from e
            await self.ensure_stream(subject_job(subject), update=False)  # (clears the flag)
            return await self.last_raw(subject)
        except UNAVAILABLE as e:
            raise BusUnavailableError(f"get {subject}: {text(e)}") from e
        return raw.seq or 0, raw.data or b""

    async def newest_seq(self, subject: str) -> int:
        """Stream seq of the newest message on `subject` (wildcards allowed, but for the job);
        0: none, or no stream at all. A JetStream API request (by the stream's index), so it
        answers for a stream that allows no direct gets too.

        Raises:
            BusUnavailableError: JetStream did not answer.
        """
        with translate(f"newest message on {subject}", keep=(nats.js.errors.NotFoundError,)):
            try:
                msg = await self.js.get_msg(self.stream(subject), subject=subject)
            except nats.js.errors.NotFoundError:  # no such message, or no stream at all
                return 0
        return int(msg.seq or 0)

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
    ) -> contextlib.AbstractAsyncContextManager[MemoryObjectReceiveStream[Raw]]:
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
