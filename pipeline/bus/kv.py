"""A JetStream KV bucket (`Bucket`): opened (made if missing) or bound without a request, its
keys read, written (compare-and-set included) and watched.

nats-py's KV errors stop here: a key never written, deleted or purged reads as None; a
compare-and-set that lost returns None; a read nobody answers (the bucket does not exist)
raises `BucketMissingError`; the rest as `translate` says (`BusUnavailableError`,
`BusError`). What the keys mean is the callers' (`tierpipe.control.kvstate`: the job states;
`tierpipe.control.advert`: the node records)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TypeAlias

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from tierpipe.bus.errors import translate
from tierpipe.bus.history import STREAM_NOT_FOUND
from tierpipe.errors import BucketMissingError, BusError

__all__ = (
    "Bucket", "BucketConfig", "Entry", "JetStream", "KeyChanges", "KeyWatch", "bind_bucket",
    "open_bucket",
)  # fmt: skip

#: A connection's JetStream context (`Connection.js`), which a bucket is opened or bound over.
JetStream: TypeAlias = JetStreamContext

#: What `KeyValue.get` raises for a key never written, or deleted (nats-py 2.16 raises the
#: first for both, with the delete's entry; older ones the second).
_ABSENT = (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)
#: JetStream's error code for a stream created with another configuration than the one asked for.
_STREAM_NAME_IN_USE = 10058
#: The operations of a delete and a purge (nats-py's `KV-Operation` header values).
_DELETES = ("DEL", "PURGE")
#: The header of a write's operation, and of a marker the server wrote (a key aged out).
_OPERATION, _MARKER = "KV-Operation", "Nats-Marker-Reason"
#: Messages `stored` asks for at once (a value is at most 256 KiB: 16 MiB a batch at most).
_BATCH = 64
#: How long one fetch of `stored` waits: the server sends what it holds at once, so only a
#: fetch when nothing is left (what was counted aged out) waits this long.
_FETCH_WAIT_S = 1.0
#: How long `stored` waits for the messages its consumer holds before it gives up.
_STALLED_S = 5.0
#: How long the server keeps a consumer of `stored` nobody deleted (its reader died).
_ORPHAN_S = 30.0


@dataclass(frozen=True, slots=True)
class BucketConfig:
    """How a bucket is made when it is missing: one value per key, on file, read by direct get
    (any replica answers, and a user's permissions can name single keys:
    `$JS.API.DIRECT.GET.KV_<bucket>.$KV...`)."""

    name: str
    replicas: int = 1
    #: The largest value it takes (None: the server's limit).
    max_value_bytes: int | None = None
    #: Keys not written for this long leave it (None: never).
    ttl_s: float | None = None
    #: Consumers its stream admits, watchers included (None: the server's default, 1,000).
    max_consumers: int | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """A key as stored: its value (b"": none) and the revision (stream sequence) of its write."""

    key: str
    value: bytes
    revision: int
    #: Whether this write deleted or purged the key (only a watch that keeps deletes sees one).
    deleted: bool = False


def _entry(entry: KeyValue.Entry) -> Entry:
    return Entry(
        key=entry.key,
        value=entry.value or b"",
        revision=entry.revision or 0,
        deleted=entry.operation in _DELETES,
    )


async def open_bucket(js: JetStream, config: BucketConfig) -> Bucket:
    """The bucket `config.name`, made as `config` says if missing (idempotent: of agents
    racing, each gets the one bucket).

    Raises:
        BusUnavailableError: JetStream did not answer.
        BusError: JetStream refused the bucket.
    """
    name = config.name
    with _translated(f"kv bucket {name}", name):
        try:
            return Bucket(name, await js.key_value(name), js)
        except nats.js.errors.BucketNotFoundError:
            try:
                kv = await js.create_key_value(
                    api.KeyValueConfig(
                        bucket=name,
                        history=1,
                        ttl=config.ttl_s,
                        replicas=config.replicas,
                        max_value_size=config.max_value_bytes,
                        storage=api.StorageType.FILE,
                        direct=True,
                    )
                )
            except nats.js.errors.BadRequestError as e:
                if e.err_code != _STREAM_NAME_IN_USE:
                    raise
                # Another agent made it meanwhile (and admitted its watchers, so its config
                # differs from the one asked for here): that one is the bucket.
                return Bucket(name, await js.key_value(name), js)
            if config.max_consumers is not None:
                await _admit_watchers(js, _stream(name), config.max_consumers)
            return Bucket(name, kv, js)


def bind_bucket(js: JetStream, name: str) -> Bucket:
    """The bucket `name` as it is, with no JetStream API request (its reads are direct gets;
    one of a bucket that does not exist raises `BucketMissingError`)."""
    kv = KeyValue(name=name, stream=_stream(name), pre=_prefix(name), js=js, direct=True)
    return Bucket(name, kv, js)


def _stream(bucket: str) -> str:
    """The stream holding `bucket`'s keys."""
    return f"KV_{bucket}"


def _prefix(bucket: str) -> str:
    """What a key's subject starts with in `bucket`'s stream (`$KV.<bucket>.<key>`)."""
    return f"$KV.{bucket}."


async def _admit_watchers(js: JetStream, stream: str, max_consumers: int) -> None:
    """Let the bucket's stream take `max_consumers` consumers (every agent's watchers, 2 each):
    nats-server admits 1,000 consumers a stream unless the stream says otherwise."""
    config = (await js.stream_info(stream)).config
    if config.max_consumers != max_consumers:
        config.max_consumers = max_consumers
        await js.update_stream(config)


@contextlib.contextmanager
def _translated(what: str, bucket: str) -> Iterator[None]:
    """`translate`, and a read nobody answered as `BucketMissingError`; nats-py errors that are
    neither an outage nor an API error (an invalid key) as `BusError`."""
    try:
        with translate(what, keep=(nats.errors.NoRespondersError, nats.js.errors.NotFoundError)):
            yield
    except nats.errors.NoRespondersError as e:
        raise BucketMissingError(bucket, what) from e
    except nats.js.errors.NotFoundError as e:
        if e.err_code == STREAM_NOT_FOUND:  # (a watch: it asks the API, not a direct get)
            raise BucketMissingError(bucket, what) from e
        raise BusError(f"{what}: {e.description or e}") from e
    except nats.errors.Error as e:
        raise BusError(f"{what}: {e}") from e


class Bucket:
    """A KV bucket's keys (`open_bucket`, `bind_bucket`).

    Every method raises `BusUnavailableError` when JetStream does not answer and `BusError`
    when it refuses; reads of a bucket that does not exist, `BucketMissingError`.
    """

    def __init__(self, name: str, kv: KeyValue, js: JetStream) -> None:
        self.name = name
        self._kv = kv
        self._js = js

    def _translated(self, key: str) -> contextlib.AbstractContextManager[None]:
        return _translated(f"kv {key}", self.name)

    async def get(self, key: str) -> Entry | None:
        """`key` as stored, or None: never written, deleted or purged."""
        with self._translated(key):
            try:
                return _entry(await self._kv.get(key))
            except _ABSENT:
                return None

    async def revision(self, key: str) -> int:
        """The revision of `key`'s newest write for a compare-and-set (`update`) to follow: its
        value's, or its delete's (a writer removed it, and may write it again); 0 if never
        written or purged. The update with `last=0` of a purged key is refused: a writer does
        not bring back a key removed with its history (`tierpipe rm` purges)."""
        with self._translated(key):
            try:
                return (await self._kv.get(key)).revision or 0
            except _ABSENT as e:  # (nats-py: the marker that removed it, if any, as `entry`)
                entry = getattr(e, "entry", None)
                if entry is None or getattr(e, "op", None) != "DEL":
                    return 0
                return int(entry.revision or 0)

    async def put(self, key: str, value: bytes) -> int:
        """Store `value` under `key` whatever it holds; the write's revision."""
        with self._translated(key):
            revision: int = await self._kv.put(key, value)
        return revision

    async def create(self, key: str, value: bytes) -> int | None:
        """Store `value` under `key` unless the key holds a value (atomic: of writers racing,
        one stores); the write's revision, or None: the key holds one."""
        with self._translated(key):
            try:
                revision: int = await self._kv.create(key, value)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None
        return revision

    async def update(self, key: str, value: bytes, *, last: int) -> int | None:
        """Store `value` under `key` if the key's newest write is revision `last` (0: none)
        (compare-and-set); the write's revision, or None: the key changed since."""
        with self._translated(key):
            try:
                revision: int = await self._kv.update(key, value, last=last)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None
        return revision

    async def delete(self, key: str) -> None:
        """Delete `key` (a delete marker stays as its newest write)."""
        with self._translated(key):
            await self._kv.delete(key)

    async def purge(self, key: str) -> None:
        """Remove `key` with its history."""
        with self._translated(f"purge {key}"):
            await self._kv.purge(key)

    async def keys(self) -> list[str]:
        """Every key holding a value ([]: none)."""
        with self._translated("keys"):
            try:
                return list(await self._kv.keys())
            except nats.js.errors.NoKeysError:
                return []

    async def watch(self, pattern: str, *, ignore_deletes: bool = False) -> KeyWatch:
        """A watch of the keys matching `pattern` (see `KeyWatch`); `stop` it."""
        with self._translated(f"watch {pattern}"):
            return KeyWatch(await self._kv.watch(pattern, ignore_deletes=ignore_deletes), self._js)

    async def stored(self, pattern: str) -> list[tuple[str, bytes]]:
        """(key, value) of every key matching `pattern` as stored now (deleted and purged ones
        left out; keys written meanwhile may be in), read through an ephemeral pull consumer
        of the newest write of each key, deleted once read.

        Not a watch stopped at nats-py's "all delivered" marker: that marker could come before
        values the server had already sent (nats-py issue 842), and `tierpipe ls` showed a job
        without its state. Nothing reaches a pull consumer unasked, so the count it has pending
        when made is every key stored, and each message says how many are left after it.
        """
        with self._translated(f"stored {pattern}"):
            return await _stored(self._js, self.name, pattern)

    @contextlib.asynccontextmanager
    async def changes(self, pattern: str) -> AsyncIterator[KeyChanges]:
        """Wake-ups at each write of a key matching `pattern` (see `KeyChanges`)."""
        watch = await self.watch(pattern)
        try:
            yield KeyChanges(watch)
        finally:
            await watch.stop()


async def _stored(js: JetStream, bucket: str, pattern: str) -> list[tuple[str, bytes]]:
    """`Bucket.stored` (nats-py's errors raised as they come)."""
    stream, prefix = _stream(bucket), _prefix(bucket)
    # (Named here, so that a read cancelled before the server answered deletes it too.)
    name = f"stored-{secrets.token_hex(8)}"
    config = api.ConsumerConfig(
        name=name,
        filter_subject=prefix + pattern,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=api.AckPolicy.NONE,
        mem_storage=True,
        inactive_threshold=_ORPHAN_S,
    )

    async def outstanding(taken: int) -> int:
        """What the consumer still holds, and what it sent that has not come yet (its answer
        can overtake messages it sent before it, as the watch's marker did): exact."""
        info = await js.consumer_info(stream, name)
        sent = info.delivered.consumer_seq if info.delivered else 0
        return max((info.num_pending or 0) + sent - taken, 0)

    found: list[tuple[str, bytes]] = []
    sub = None
    try:
        # (It counts as one of the stream's consumers, as a watcher does: deleted at once.
        # Made shielded: a read cancelled while the server made it would send its delete
        # before the answer came, and the server, which may handle the two out of order, could
        # make the consumer after the delete found none: left on the stream for `_ORPHAN_S`.)
        with anyio.CancelScope(shield=True):
            made = await js.add_consumer(stream, config)
        counted = left = made.num_pending or 0
        taken = waited = 0
        while left > 0 or taken < counted:
            # Fewer came than were counted (some aged out meanwhile, or the count on the last
            # one lagged), or none came in time (a fetch with none to send waits it out).
            if left == 0 and (left := await outstanding(taken)) == 0:
                break
            sub = sub or await js.pull_subscribe_bind(name, stream=stream)
            try:
                msgs = await sub.fetch(_BATCH, timeout=_FETCH_WAIT_S)
            except TimeoutError:  # (nats-py's, or asyncio's where its deadline passed)
                waited += 1
                if waited * _FETCH_WAIT_S >= _STALLED_S:
                    raise
                left = 0
                continue
            waited = 0
            for msg in msgs:
                headers = msg.headers or {}
                if headers.get(_OPERATION) not in _DELETES and _MARKER not in headers:
                    found.append((msg.subject.removeprefix(prefix), msg.data))
            # (A batch comes in order: its last message's count is the one that matters.)
            taken, left = taken + len(msgs), msgs[-1].metadata.num_pending if msgs else 0
    finally:
        # (Shielded: a cancelled read deletes it too. Should this fail, the server deletes it
        # after `_ORPHAN_S`.)
        with anyio.CancelScope(shield=True), anyio.move_on_after(_STALLED_S):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)
    return found


class KeyWatch:
    """The keys matching a pattern (`Bucket.watch`): each as stored now, then None once they are
    all delivered (at once if there are none), then each write as it comes."""

    def __init__(self, watcher: KeyValue.KeyWatcher, js: JetStream) -> None:
        self._watcher, self._js = watcher, js

    def __aiter__(self) -> KeyWatch:
        return self

    async def __anext__(self) -> Entry | None:
        entry = await anext(self._watcher)  # (ends once stopped)
        return None if entry is None else _entry(entry)

    async def next(self) -> Entry | None:
        """The next entry or None (see above), however long it takes."""
        entry = await self._watcher.updates(timeout=None)  # (no limit but the caller's)
        return None if entry is None else _entry(entry)

    async def stop(self) -> None:
        """Stop watching and delete the watch's consumer (nats-py leaves it on the stream for
        5 minutes, counting towards its consumer limit); idempotent, and a closed connection
        or a user not allowed to delete it has nothing more to do (the server drops it then)."""
        sub = getattr(self._watcher, "_sub", None)  # (nats-py's: no public name for it)
        with contextlib.suppress(Exception):
            await self._watcher.stop()
        stream, consumer = getattr(sub, "_stream", None), getattr(sub, "_consumer", None)
        if stream and consumer:
            with contextlib.suppress(Exception), anyio.move_on_after(2, shield=True):
                await self._js.delete_consumer(stream, consumer)


class KeyChanges:
    """Wakes a reader each time a key matching its pattern is written (`Bucket.changes`)."""

    def __init__(self, watch: KeyWatch) -> None:
        self._watch = watch

    async def wait(self, timeout_s: float) -> None:
        """Until a watched key is written (or a value as stored is first delivered), or for
        `timeout_s` seconds at most."""
        with anyio.move_on_after(max(timeout_s, 0.0)):
            await self._watch.next()
