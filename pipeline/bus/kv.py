"""A JetStream KV bucket's handle: opened (made if missing) or bound without a request, and the
watches an operator's read or a waiting reader takes of it. What its keys mean is
`tierpipe.control.kvstate`'s."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from tierpipe.bus.connect import translate
from tierpipe.settings import Settings

__all__ = (
    "ABSENT", "MAX_VALUE_BYTES", "KeyChanges", "bind_bucket", "changes", "open_bucket", "stored",
)  # fmt: skip

#: What `KeyValue.get` raises for a key never written, or deleted.
ABSENT = (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)

#: The largest value the bucket takes (a message must stay below 256 KiB at any job size).
MAX_VALUE_BYTES = 256 * 1024


async def open_bucket(js: JetStreamContext, settings: Settings) -> KeyValue:
    """The job-state bucket (`Settings.kv_bucket`), made if missing (idempotent).

    Raises:
        BusUnavailableError: JetStream did not answer.
        BusError: JetStream refused the bucket.
    """
    s = settings
    with translate(f"kv bucket {s.kv_bucket}"):
        try:
            return await js.key_value(s.kv_bucket)
        except nats.js.errors.BucketNotFoundError:
            config = api.KeyValueConfig(
                bucket=s.kv_bucket,
                history=1,
                replicas=s.stream_replicas,
                max_value_size=MAX_VALUE_BYTES,
                storage=api.StorageType.FILE,
                # Reads by direct get: any replica answers, and a trainer's permissions
                # can name its own job's keys (`$JS.API.DIRECT.GET.KV_<bucket>.$KV...`).
                direct=True,
            )
            kv = await js.create_key_value(config)
            await _admit_watchers(js, settings)
            return kv


def bind_bucket(js: JetStreamContext, settings: Settings) -> KeyValue:
    """The job-state bucket as it is, with no JetStream API request (its reads are direct gets)."""
    b = settings.kv_bucket
    return KeyValue(name=b, stream=f"KV_{b}", pre=f"$KV.{b}.", js=js, direct=True)


async def _admit_watchers(js: JetStreamContext, settings: Settings) -> None:
    """Let the bucket's stream take every agent's watchers (2 each): nats-server admits
    1,000 consumers a stream unless the stream says otherwise (500 agents)."""
    stream = f"KV_{settings.kv_bucket}"
    config = (await js.stream_info(stream)).config
    if config.max_consumers != settings.stream_max_consumers:
        config.max_consumers = settings.stream_max_consumers
        await js.update_stream(config)


async def stored(kv: KeyValue, pattern: str) -> list[tuple[str, bytes]]:
    """(key, value) of every key matching `pattern` as stored now (deleted ones left out): one
    watch, stopped once it delivered what is stored.

    Raises:
        BusUnavailableError: JetStream did not answer.
    """
    found = []
    with translate(f"kv watch {pattern}"):
        watcher = await kv.watch(pattern, ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is None:  # (what was stored is all delivered)
                    break
                found.append((entry.key, entry.value or b""))
        finally:
            with contextlib.suppress(Exception):  # (a closed connection has nothing to stop)
                await watcher.stop()
    return found


class KeyChanges:
    """Wakes a reader each time a key matching its pattern is written (`changes`)."""

    def __init__(self, watcher: KeyValue.KeyWatcher) -> None:
        self._watcher = watcher

    async def wait(self, timeout_s: float) -> None:
        """Until a watched key is written (or a value as stored is first delivered), or for
        `timeout_s` seconds at most."""
        with anyio.move_on_after(max(timeout_s, 0.0)):
            await self._watcher.updates(timeout=None)  # (no limit but the scope's)


@contextlib.asynccontextmanager
async def changes(kv: KeyValue, pattern: str) -> AsyncIterator[KeyChanges]:
    """Wake-ups at each write of a key matching `pattern` (see `KeyChanges`).

    Raises:
        BusUnavailableError: JetStream did not answer.
    """
    with translate(f"kv watch {pattern}"):
        watcher = await kv.watch(pattern)
    try:
        yield KeyChanges(watcher)
    finally:
        with contextlib.suppress(Exception):  # (a closed connection has nothing to stop)
            await watcher.stop()
