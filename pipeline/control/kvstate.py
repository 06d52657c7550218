"""The jobs' compacted state in JetStream KV: reading it, and writing it as its one writer.

The bucket (`Settings.kv_bucket`) holds the keys of `tierpipe.schemas.jobstate`. Readers
(restarts, the CLI, nodes watching their floors) read a few keys; the coordinator of a job
writes them with compare-and-set on every key it owns, so a paused coordinator that lost its
lease can never overwrite what its successor wrote: its first write fails, and it stops.

The bucket's reads and writes go through `tierpipe.bus.kv.Bucket`, where nats-py's errors stop
(`BusUnavailableError`, `BusError`); a writer that lost its lease gets `LeaseLostError`.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, TypeVar

import msgspec
import structlog

from tierpipe.bus.kv import (
    Bucket,
    BucketConfig,
    JetStream,
    KeyChanges,
    bind_bucket,
    open_bucket,
)
from tierpipe.control.jobstate import Changes, JobState
from tierpipe.errors import BucketMissingError, BusError, BusUnavailableError, LeaseLostError
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
from tierpipe.schemas.layout import LAYOUT_DIGEST_PATTERN
from tierpipe.settings import Settings

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus

__all__ = (
    "JobStore",
    "budget_key",
    "default_keep",
    "head_key",
    "layout_key",
    "location_key",
    "shares_key",
    "step_key",
)

log = structlog.get_logger(__name__)

T = TypeVar("T")
_json = msgspec.json.Encoder()

#: The largest value the bucket takes (a message must stay below 256 KiB at any job size).
MAX_VALUE_BYTES = 256 * 1024


def default_keep(settings: Settings) -> Keep:
    """The retention policy of a job that did not set its own: the agent's settings."""
    return Keep(
        nvme_keep_latest_k=settings.nvme_keep_latest_k,
        s3_keep_latest_k=settings.s3_keep_latest_k,
        s3_keep_period=settings.s3_keep_period,
        evict_unflushed=settings.evict_unflushed,
        s3_every_steps=settings.s3_every_steps,
        s3_every_s=settings.s3_every_s,
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


def layout_key(job: str, digest: str) -> str:
    """The key of a stored layout (`tierpipe.schemas.layout`; created once, removed by `rm`).

    Raises:
        ValueError: `digest` is not a layout digest.
    """
    if not digest or not re.fullmatch(LAYOUT_DIGEST_PATTERN, digest):
        raise ValueError(f"not a layout digest: {digest[:40]!r}")
    return f"{job}.layout.{digest}"


def step_key(job: str, step: int) -> str:
    return f"{job}.step.{step}"


def digests_key(job: str, step: int, chunk: int) -> str:
    return f"{job}.step.{step}.ranks.{chunk}"


def bucket_config(settings: Settings) -> BucketConfig:
    """The job-state bucket (`Settings.kv_bucket`) as it is made: its stream admits every
    agent's watchers (`stream_max_consumers`; 2 an agent, where nats-server admits 1,000
    consumers a stream by default: 500 agents)."""
    return BucketConfig(
        name=settings.kv_bucket,
        replicas=settings.stream_replicas,
        max_value_bytes=MAX_VALUE_BYTES,
        max_consumers=settings.stream_max_consumers,
    )


class JobStore:
    """The KV bucket of job states, over a connected `Bus`'s JetStream context."""

    @classmethod
    async def opened(cls, bus: Bus) -> JobStore:
        """The job store over `bus`'s connection, opened (`open`): the operators' tools'."""
        return await cls(bus.js, bus.settings).open()

    def __init__(self, js: JetStream, settings: Settings) -> None:
        self._js = js
        self.settings = settings
        self._kv: Bucket | None = None
        #: Bound without asking JetStream whether the bucket exists (`bind`).
        self._bound = False
        #: key -> revision of this writer's last write (compare-and-set on the next).
        self._revs: dict[str, int] = {}

    async def open(self) -> JobStore:
        """Bind the bucket, creating it if missing (idempotent)."""
        self._kv = await open_bucket(self._js, bucket_config(self.settings))
        return self

    def bind(self) -> JobStore:
        """Bind the bucket as it is, with no JetStream API request (its reads are direct gets):
        for a job's ranks but rank 0, which `open`s it. (At 80,000 ranks, a stream-info request
        each would overflow the server's API queue, 10,000 by default.) A bucket that does not
        answer a read is opened then (`_value`)."""
        self._kv = bind_bucket(self._js, self.settings.kv_bucket)
        self._bound = True
        return self

    @property
    def kv(self) -> Bucket:
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
        try:
            entry = await self.kv.get(key)
        except BucketMissingError:
            if not self._bound:
                raise
            self._bound = False
            await self.open()
            return await self._value(key)
        return None if entry is None or not entry.value else (entry.value, entry.revision)

    async def create(self, key: str, value: bytes) -> bool:
        """Store `value` under `key` unless the key holds a value already (atomic: of agents
        racing, one stores); whether this one did."""
        return await self.kv.create(key, value) is not None

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
        """Every job's head as stored now (`tierpipe ls`): one read of `*.head`
        (`Bucket.stored`); a value that does not decode is skipped."""
        out: dict[str, JobHead] = {}
        for _, value in await self.kv.stored("*.head"):
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
        """Every key of `job` in the bucket (`<job>.<...>`), sorted: one read of `<job>.>`
        (`Bucket.stored`)."""
        return sorted(key for key, _ in await self.kv.stored(f"{job}.>"))

    def changes(self, job: str) -> contextlib.AbstractAsyncContextManager[KeyChanges]:
        """Wake-ups at each write of `job`'s own keys (`<job>.head`, `.lease`, ...; not its
        records), for a reader waiting for its head to catch up (`folded_head`)."""
        return self.kv.changes(f"{job}.*")

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
        watch = await self.kv.watch(pattern, ignore_deletes=True)
        try:
            async for entry in watch:
                if entry is not None and entry.value:
                    yield entry.key.split(".", 1)[0], entry.value
        finally:
            await watch.stop()

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
        if keep is not None:
            await self.kv.put(key, _json.encode(keep))
        else:  # (a policy stored already stays)
            await self.kv.create(key, _json.encode(default_keep(self.settings)))

    async def purge(self, keys: Iterable[str]) -> None:
        """Remove `keys` with their history (`tierpipe rm`), in the order given."""
        for key in keys:
            await self.kv.purge(key)

    async def set_budget(self, job: str, budget: Budget) -> None:
        """Set the job's admission budgets (an operator's or the trainer's: the newest wins);
        the job's coordinator divides them among its active nodes within a few seconds."""
        await self.kv.put(budget_key(job), _json.encode(budget))

    # --- the coordinator's side

    async def acquire(
        self, job: str, holder: str, ttl_s: float, *, expired_for_s: float = 0.0,
        pid: int = 0, host: str = "", gone: Lease | None = None,
    ) -> Lease | None:  # fmt: skip
        """Take the job's lease if it is free, or expired `expired_for_s` ago, or held by
        exactly `gone` (a holder shown gone: `tierpipe.control.holder`); None if another
        holds it. `pid`, `host`: the taking agent's process (0: not an agent). Compare-and-set
        with a new term: a holder paused past its loss finds its next write refused."""
        key = lease_key(job)
        now = time.time()
        entry = await self.kv.get(key)
        current = (
            msgspec.json.decode(entry.value, type=Lease)
            if entry is not None and entry.value
            else None
        )
        if (
            current is not None
            and current.holder != holder
            and current.expires > now - expired_for_s
            and current != gone
        ):
            return None
        lease = Lease(
            holder=holder, term=(current.term + 1) if current else 1, expires=now + ttl_s,
            pid=pid, host=host, since=now,
        )  # fmt: skip
        if entry is None:
            rev = await self.kv.create(key, _json.encode(lease))
        else:
            rev = await self.kv.update(key, _json.encode(lease), last=entry.revision)
        if rev is None:
            return None  # another agent took it first
        self._revs = {key: rev}
        log.info("lease_acquired", job=job, holder=holder, term=lease.term,
                 taken_from=None if current is None else current.holder)  # fmt: skip
        return lease

    async def renew(self, job: str, lease: Lease, ttl_s: float) -> Lease:
        """Extend the lease.

        Raises:
            LeaseLostError: another agent took it over (this one was paused past its expiry).
        """
        renewed = msgspec.structs.replace(lease, expires=time.time() + ttl_s)
        await self._cas(job, lease_key(job), _json.encode(renewed))
        return renewed

    async def release(self, job: str, lease: Lease) -> None:
        """Give the lease up (a clean stop): another agent may take it at once."""
        with contextlib.suppress(BusError, BusUnavailableError):
            await self._cas(job, lease_key(job), _json.encode(
                msgspec.structs.replace(lease, expires=0.0)
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
        last = self._revs.get(key)
        if last is None:
            last = await self.kv.revision(key)
        rev = await self.kv.update(key, value, last=last)
        if rev is None:
            raise LeaseLostError(job, key)
        self._revs[key] = rev
