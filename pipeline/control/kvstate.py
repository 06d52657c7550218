"""The jobs' compacted state in JetStream KV: reading it, and writing it as its one writer.

The bucket (`Settings.kv_bucket`) holds the keys of `tierpipe.schemas.jobstate`. Readers
(restarts, the CLI, nodes watching their floors) read a few keys; the coordinator of a job
writes them with compare-and-set on every key it owns, so a paused coordinator that lost its
lease can never overwrite what its successor wrote: its first write fails, and it stops.

nats-py's errors stop here, as `BusUnavailableError` or `BusError` (`LeaseLostError` for a
writer that lost its lease).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tierpipe.bus import kv as bucket
from tierpipe.bus.connect import translate
from tierpipe.control.jobstate import Changes, JobState
from tierpipe.errors import BusError, BusUnavailableError, LeaseLostError
from tierpipe.schemas.jobstate import (
    RANKS_PER_CHUNK,
    Budget,
    Floors,
    JobHead,
    Keep,
    Lease,
    RankDigests,
    Shares,
    StepRecord,
    decode_record,
    encode_record,
)
from tierpipe.settings import Settings

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus

__all__ = (
    "JobStore",
    "budget_key",
    "default_keep",
    "head_key",
    "location_key",
    "shares_key",
    "step_key",
)

log = structlog.get_logger(__name__)

T = TypeVar("T")
_json = msgspec.json.Encoder()

_ABSENT = bucket.ABSENT


def default_keep(settings: Settings) -> Keep:
    """The retention policy of a job that did not set its own: the agent's settings."""
    return Keep(
        nvme_keep_latest_k=settings.nvme_keep_latest_k,
        s3_keep_latest_k=settings.s3_keep_latest_k,
        s3_keep_period=settings.s3_keep_period,
        evict_unflushed=settings.evict_unflushed,
    )


def head_key(job: str) -> str:
    return f"{job}.head"


def floor_key(job: str) -> str:
    return f"{job}.floor"


def keep_key(job: str) -> str:
    return f"{job}.keep"


def lease_key(job: str) -> str:
    return f"{job}.lease"


def budget_key(job: str) -> str:
    return f"{job}.budget"


def shares_key(job: str) -> str:
    return f"{job}.shares"


def location_key(job: str) -> str:
    return f"{job}.location"


def step_key(job: str, step: int) -> str:
    return f"{job}.step.{step}"


def digests_key(job: str, step: int, chunk: int) -> str:
    return f"{job}.step.{step}.ranks.{chunk}"


def _translated(what: str) -> contextlib.AbstractContextManager[None]:
    return translate(what, keep=(*_ABSENT, nats.js.errors.KeyWrongLastSequenceError))


class JobStore:
    """The KV bucket of job states, over a connected `Bus`'s JetStream context."""

    @classmethod
    async def opened(cls, bus: Bus) -> JobStore:
        """The job store over `bus`'s connection, opened (`open`): the operators' tools'."""
        return await cls(bus.js, bus.settings).open()

    def __init__(self, js: JetStreamContext, settings: Settings) -> None:
        self._js = js
        self.settings = settings
        self._kv: KeyValue | None = None
        #: Bound without asking JetStream whether the bucket exists (`bind`).
        self._bound = False
        #: key -> revision of this writer's last write (compare-and-set on the next).
        self._revs: dict[str, int] = {}

    async def open(self) -> JobStore:
        """Bind the bucket, creating it if missing (idempotent)."""
        self._kv = await bucket.open_bucket(self._js, self.settings)
        return self

    def bind(self) -> JobStore:
        """Bind the bucket as it is, with no JetStream API request (its reads are direct gets):
        for a job's ranks but rank 0, which `open`s it. (At 80,000 ranks, a stream-info request
        each would overflow the server's API queue, 10,000 by default.) A bucket that does not
        answer a read is opened then (`_value`)."""
        self._kv = bucket.bind_bucket(self._js, self.settings)
        self._bound = True
        return self

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise RuntimeError("JobStore.open() first")
        return self._kv

    # --- reading

    async def value(self, key: str) -> bytes | None:
        """The value of `key`, or None."""
        found = await self._value(key)
        return None if found is None else found[0]

    async def _value(self, key: str) -> tuple[bytes, int] | None:
        """(value, revision) of `key`, or None. A bound store (`bind`) whose bucket does not
        answer makes sure it exists (`open`, once) and reads again."""
        with _translated(f"kv {key}"):
            try:
                entry = await self.kv.get(key)
            except _ABSENT:
                return None
            except nats.errors.NoRespondersError:
                if not self._bound:
                    raise
                self._bound = False
                await self.open()
                return await self._value(key)
        return None if not entry.value else (entry.value, entry.revision or 0)

    async def create(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` unless the key holds a value already (atomic: of agents
        racing, one stores); whether this one did."""
        with _translated(f"kv {key}"):
            try:
                await self.kv.create(key, value)
            except nats.js.errors.KeyWrongLastSequenceError:
                return False
        return True

    async def _get(self, key: str, kind: type[T]) -> tuple[T, int] | None:
        found = await self._value(key)
        return None if found is None else (msgspec.json.decode(found[0], type=kind), found[1])

    async def head(self, job: str) -> JobHead | None:
        found = await self._get(head_key(job), JobHead)
        return found[0] if found else None

    async def floors(self, job: str) -> Floors:
        """The job's floors (none yet: nothing is below them)."""
        found = await self._get(floor_key(job), Floors)
        return found[0] if found else Floors()

    async def keep(self, job: str) -> Keep | None:
        found = await self._get(keep_key(job), Keep)
        return found[0] if found else None

    async def budget(self, job: str) -> Budget:
        """The job's admission budgets (none set: no job-wide cap)."""
        found = await self._get(budget_key(job), Budget)
        return found[0] if found else Budget()

    async def shares(self, job: str) -> Shares:
        """This node's part of the job's budgets (none yet: no job-wide cap)."""
        found = await self._get(shares_key(job), Shares)
        return found[0] if found else Shares()

    async def record(self, job: str, step: int) -> StepRecord | None:
        found = await self._value(step_key(job, step))
        return None if found is None else decode_record(found[0])

    async def heads(self) -> dict[str, JobHead]:
        """Every job's head as stored now (`tierpipe ls`): one watch of `*.head`, stopped once
        it delivered what is stored; a value that does not decode is skipped."""
        out: dict[str, JobHead] = {}
        for _, value in await bucket.stored(self.kv, "*.head"):
            with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
                head = msgspec.json.decode(value, type=JobHead)
                out[head.job] = head
        return out

    async def lease(self, job: str) -> Lease | None:
        found = await self._get(lease_key(job), Lease)
        return None if found is None else found[0]

    async def digests(self, job: str, step: int, chunk: int) -> RankDigests | None:
        """One chunk of a step's header digests (None: not stored)."""
        found = await self._get(digests_key(job, step, chunk), RankDigests)
        return None if found is None else found[0]

    async def keys(self, job: str) -> list[str]:
        """Every key of `job` in the bucket (`<job>.<...>`), sorted: one watch, stopped once it
        delivered what is stored."""
        return sorted(key for key, _ in await bucket.stored(self.kv, f"{job}.>"))

    def changes(self, job: str) -> contextlib.AbstractAsyncContextManager[bucket.KeyChanges]:
        """Wake-ups at each write of `job`'s own keys (`<job>.head`, `.lease`, ...; not its
        records), for a reader waiting for its head to catch up (`folded_head`)."""
        return bucket.changes(self.kv, f"{job}.*")

    async def rank_digest(self, job: str, step: int, rank: int) -> tuple[str, int] | None:
        """(header digest, size) of `rank`'s verified copy of `step`, or None: one read of
        the chunk holding it, whatever the job's size."""
        found = await self._get(digests_key(job, step, rank // RANKS_PER_CHUNK), RankDigests)
        return None if found is None else found[0].of(rank)

    async def records(self, job: str, steps: Iterable[int]) -> dict[int, StepRecord]:
        out = {}
        for step in steps:
            rec = await self.record(job, step)
            if rec is not None:
                out[step] = rec
        return out

    async def load(self, job: str, keep: Keep) -> JobState:
        """The job's state as stored, for a coordinator taking over (the records it needs)."""
        head = await self.head(job)
        floors = await self.floors(job)
        window = head.window if head else 0
        steps = [t for t in head.steps if t < window] if head else []
        return JobState(job, keep, head=head, floors=floors, records=await self.records(job, steps))

    async def _watch(self, pattern: str) -> AsyncIterator[tuple[str, bytes]]:
        """(job, value) of every key matching `pattern` as stored now, then of each change."""
        with _translated(f"kv watch {pattern}"):
            watcher = await self.kv.watch(pattern, ignore_deletes=True)
        try:
            async for entry in watcher:
                if entry is not None and entry.value:
                    yield entry.key.split(".", 1)[0], entry.value
        finally:
            with contextlib.suppress(Exception):  # (a closed connection has nothing to stop)
                await watcher.stop()

    async def jobs(self) -> AsyncIterator[str]:
        """Every job with a stored policy, then each new one (a trainer starting)."""
        async for job, _ in self._watch("*.keep"):
            yield job

    def watch_floors(self) -> AsyncIterator[tuple[str, Floors]]:
        """(job, floors) of every job as stored now, then at each change."""
        return self._watch_values("floor", Floors)

    def watch_shares(self) -> AsyncIterator[tuple[str, Shares]]:
        """(job, shares) of every job as stored now, then at each change."""
        return self._watch_values("shares", Shares)

    async def _watch_values(self, name: str, kind: type[T]) -> AsyncIterator[tuple[str, T]]:
        """(job, value) of every job's `<job>.<name>` key, decoded (a value that does not
        decode is logged and skipped)."""
        async for job, value in self._watch(f"*.{name}"):
            try:
                yield job, msgspec.json.decode(value, type=kind)
            except msgspec.ValidationError as e:
                log.warning("kv_value_ignored", key=f"{job}.{name}", error=str(e))

    # --- the trainer's and operators' side

    async def register(self, job: str, keep: Keep | None = None) -> None:
        """Make the job known to the coordinators: with its retention policy `keep` (the
        trainer's), or with the settings' defaults unless it has one already."""
        key = keep_key(job)
        with (
            _translated(f"kv {key}"),
            contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError),
        ):
            if keep is not None:
                await self.kv.put(key, _json.encode(keep))
            else:
                await self.kv.create(key, _json.encode(default_keep(self.settings)))

    async def purge(self, keys: Iterable[str]) -> None:
        """Remove `keys` with their history (`tierpipe rm`), in the order given."""
        for key in keys:
            with _translated(f"kv purge {key}"):
                await self.kv.purge(key)

    async def set_budget(self, job: str, budget: Budget) -> None:
        """Set the job's admission budgets (an operator's or the trainer's: the newest wins);
        the job's coordinator divides them among its active nodes within a few seconds."""
        key = budget_key(job)
        with _translated(f"kv {key}"):
            await self.kv.put(key, _json.encode(budget))

    # --- the coordinator's side

    async def acquire(
        self, job: str, holder: str, ttl_s: float, *, expired_for_s: float = 0.0
    ) -> Lease | None:
        """Take the job's lease if it is free, or expired `expired_for_s` ago; None if another
        holds it."""
        key = lease_key(job)
        now = time.time()
        with _translated(f"kv {key}"):
            try:
                entry = await self.kv.get(key)
            except _ABSENT:
                entry = None
            current = (
                msgspec.json.decode(entry.value, type=Lease)
                if entry is not None and entry.value
                else None
            )
            if (
                current is not None
                and current.holder != holder
                and current.expires > now - expired_for_s
            ):
                return None
            lease = Lease(
                holder=holder, term=(current.term + 1) if current else 1, expires=now + ttl_s
            )
            try:
                if entry is None:
                    rev = await self.kv.create(key, _json.encode(lease))
                else:
                    rev = await self.kv.update(key, _json.encode(lease), last=entry.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return None  # another agent took it first
        self._revs = {key: rev}
        log.info("lease_acquired", job=job, holder=holder, term=lease.term)
        return lease

    async def renew(self, job: str, lease: Lease, ttl_s: float) -> Lease:
        """Extend the lease.

        Raises:
            LeaseLostError: another agent took it over (this one was paused past its expiry).
        """
        renewed = Lease(holder=lease.holder, term=lease.term, expires=time.time() + ttl_s)
        await self._cas(job, lease_key(job), _json.encode(renewed))
        return renewed

    async def release(self, job: str, lease: Lease) -> None:
        """Give the lease up (a clean stop): another agent may take it at once."""
        with contextlib.suppress(BusError, BusUnavailableError):
            await self._cas(job, lease_key(job), _json.encode(
                Lease(holder=lease.holder, term=lease.term, expires=0.0)
            ))  # fmt: skip

    async def write(self, state: JobState, changes: Changes) -> None:
        """Store what `changes` says changed: records, then floors, then the head (a reader
        that sees a head finds every record it names).

        Raises:
            LeaseLostError: a key changed under this writer (another coordinator wrote it).
        """
        job = state.job
        for step, chunk in sorted(changes.digests):
            digests = state.rank_digests(step, chunk)
            if digests is not None:
                await self._cas(job, digests_key(job, step, chunk), _json.encode(digests))
        for step in sorted(changes.put):
            rec = state.record(step)
            if rec is not None:
                await self._cas(job, step_key(job, step), encode_record(rec))
        if changes.floors:
            await self._cas(job, floor_key(job), _json.encode(state.floors()))
        await self._cas(job, head_key(job), _json.encode(state.head()))
        gone = [step_key(job, step) for step in sorted(changes.deleted)] + [
            digests_key(job, step, chunk)
            for step, chunks in sorted(changes.digests_deleted.items())
            for chunk in range(chunks)
        ]
        for key in gone:
            with _translated(f"kv {key}"):
                await self.kv.delete(key)
            self._revs.pop(key, None)

    async def write_shares(self, job: str, shares: Shares) -> None:
        """Store each node's part of the job's budgets (compare-and-set, fenced by the lease
        like every key the coordinator writes).

        Raises:
            LeaseLostError: another coordinator wrote the key since this one did.
        """
        await self._cas(job, shares_key(job), _json.encode(shares))

    async def _cas(self, job: str, key: str, value: bytes) -> None:
        """Put `value` if the key is as this writer left it (or, the first time, as it is)."""
        with _translated(f"kv {key}"):
            last = self._revs.get(key)
            if last is None:
                try:
                    last = (await self.kv.get(key)).revision or 0
                except nats.js.errors.KeyDeletedError as e:
                    last = e.entry.revision
                except nats.js.errors.KeyNotFoundError:
                    last = 0
            try:
                self._revs[key] = await self.kv.update(key, value, last=last)
            except nats.js.errors.KeyWrongLastSequenceError as e:
                raise LeaseLostError(job, key) from e
