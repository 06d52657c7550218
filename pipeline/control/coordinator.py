"""The retention coordinator: one per job, elected with a lease in KV.

Every agent runs one (inside its evict worker); for each job its node takes part in (a folder of
the job under its staging or NVMe root, as the stages find their jobs: `names.local_jobs`; an
agent never bids for a job it has nothing of, however long its lease has expired) once the job
is registered (its retention policy, `<job>.keep`, is stored by the trainer when it starts, or
by the evict stage), it takes the job's lease if it is free and then, until it loses it:
- folds the job's events into `JobState`, read from the stream with an ordered consumer from
  the stored `resume_seq` (a bounded suffix, not the history);
- every `coordinator_flush_s`, stores what changed (compare-and-set, fenced by the lease);
- removes the objects of the steps below the object-storage floor (DeleteObjects, 1,000 keys a
  request) once it stored the records that say they are gone, and an object confirmed only after
  its step's removal (an upload that completed as the floor passed: `Changes.s3_late`);
- writes the COMMIT manifest of each step that becomes complete in object storage
  (`tierpipe.storage.s3.commit`), once it stored the records that say so;
- pins the step an in-progress restore reads (the job's recovery plans are in its stream);
- names the job's upload target (`Floors.upload`, `tierpipe.control.upload`), passing its clock
  in at every round for the object-storage cadence;
- divides the job's admission budgets (`<job>.budget`) among its active nodes (`ActiveNodes`:
  those that reported one of the newest checkpoints) and stores each node's part
  (`<job>.shares`) whenever the budget or the number of active nodes changes.

Every object write or delete is of the job's own object store: the job is bound to one in KV
(`tierpipe.control.location`) by the first agent that writes one of its objects, and an agent whose
store is another one neither leads the job nor touches an object of it (`StoreMismatchError`,
logged).
Nodes watch the floors and remove their own NVMe copies (`tierpipe.stages.evict`). No node
keeps a catalog of the whole job; the work per event is O(1) in the number of steps kept.
A coordinator that is paused past its lease's expiry finds its next write refused
(`LeaseLostError`) and goes back to waiting for the lease.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import msgspec
import structlog

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.history import Follow
from tierpipe.control.bitmap import bitmap, ranks_of
from tierpipe.control.holder import agent_identity, take_over
from tierpipe.control.jobstate import Changes, JobState
from tierpipe.control.kvstate import JobStore, default_keep, layout_key
from tierpipe.control.location import bind_location, check_location, location_of
from tierpipe.control.pins import RestorePins
from tierpipe.control.shares import ACTIVE_STEPS, ActiveNodes, divide
from tierpipe.errors import LeaseLostError, StoreMismatchError, TierpipeError, UnavailableError
from tierpipe.names import local_jobs, plan_subject, shard_subject, state_subjects
from tierpipe.schemas import Event, RecoveryPlanned, RestoreReport, ShardEvicted, decode_event
from tierpipe.schemas.commit import CommitManifest
from tierpipe.schemas.facts import BatchFact, Fact, PlanFact, RestoreFact, decode_fact
from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, Budget, Lease, Shares, StepRecord
from tierpipe.settings import Settings

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus

__all__ = ("ACTIVE_STEPS", "ActiveNodes", "Coordinator", "RestorePins", "divide")

log = structlog.get_logger(__name__)

#: The agents of the nodes that host a rank below this bid for a job's lease at once.
CANDIDATE_RANKS = 32

#: How often a coordinator reads its job's retention policy and budgets again.
POLICY_READ_S = 5.0
#: How often an agent looks for jobs new to its node (as its stages do: `runner.JOB_SCAN_S`).
JOB_SCAN_S = 0.5

#: Removes objects of (job, step, world size): the step's COMMIT and every rank's object (ranks
#: None), or the objects of the ranks given alone. The coordinator's one use of object storage.
RemoveObjects = Callable[[str, int, int, Sequence[int] | None], Awaitable[None]]
#: Creates a step's COMMIT manifest in object storage; whether it was written (False: one was
#: there already).
CommitStep = Callable[[CommitManifest], Awaitable[bool]]


class Coordinator:
    """This agent's bid to coordinate every job of its node: `run()` until cancelled."""

    def __init__(
        self,
        settings: Settings,
        bus: Bus,
        store: JobStore,
        node: str,
        remove: RemoveObjects,
        *,
        commit: CommitStep | None = None,
    ) -> None:
        """`commit`: writes COMMIT manifests (None: none are written, as when a restart folds
        the state to read it)."""
        self.settings, self.bus, self.store, self.node = settings, bus, store, node
        self._remove = remove
        self._commit = commit
        #: (job, step) -> its record (`s3`: the ranks whose removal is announced) and whether
        #: every rank's object goes (else those in `s3` alone): objects to remove, not removed yet.
        self._removals: dict[tuple[str, int], tuple[StepRecord, bool]] = {}
        #: (job, step) -> its manifest: COMMITs to write, not written yet.
        self._commits: dict[tuple[str, int], CommitManifest] = {}
        #: Jobs this agent leads now (for tests and the status line).
        self.leading: set[str] = set()
        #: job -> the lowest rank this node hosts a shard of.
        self._ranks: dict[str, int] = {}
        #: The jobs with a folder on this node, as last looked for (`run`).
        self._local: set[str] = set()
        #: The object store this agent's removals and COMMITs go to.
        self.location = location_of(settings)
        #: job -> the refusal last logged for it (each is logged once).
        self._refused: dict[str, str] = {}

    async def run(self) -> None:
        """Follow every job the KV knows (its policy is stored: a trainer or agent registered
        it), and every one that appears later, once this node takes part in it (`local_jobs`,
        looked for again every `JOB_SCAN_S`, as the stages do): never a job the node has nothing
        of."""
        s = self.settings
        registered: set[str] = set()

        async def watch() -> None:
            async for job in self.store.jobs():
                registered.add(job)

        followed: set[str] = set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            while True:
                self._local = local_jobs(s.staging_root, s.nvme_root)
                for job in sorted(registered & (self._local | set(self._ranks)) - followed):
                    followed.add(job)
                    tg.start_soon(self.follow, job)
                await anyio.sleep(JOB_SCAN_S)

    def hosts(self, job: str, rank: int) -> None:
        """This node holds a shard of `rank` of `job` (its evict stage saw it verified)."""
        self._ranks[job] = min(rank, self._ranks.get(job, rank))

    def _local_job(self, job: str) -> bool:
        """This node takes part in `job`: a folder of it here (as last looked for), or a shard
        of it verified here."""
        return job in self._local or job in self._ranks

    async def follow(self, job: str) -> None:
        """Take the job's lease whenever it is free, and lead the job while it is held; only
        while this node takes part in the job, and never with an object store other than the
        job's (`StoreMismatchError`, logged once; looked at again every few lease TTLs).

        Candidates are the agents of the nodes that host one of the job's lowest ranks
        (`CANDIDATE_RANKS`): they bid as soon as the lease is free. Every other agent looks
        rarely, with jitter, and bids only for a lease expired long ago (every candidate is
        gone), so thousands of agents do not poll one key."""
        ttl = self.settings.lease_ttl_s
        pid, host = agent_identity()  # (what the lease names: `tierpipe.control.holder`)
        while True:
            candidate = self._ranks.get(job, CANDIDATE_RANKS) < CANDIDATE_RANKS
            refused = False
            try:
                # No evidence of the job here (its folder went): no bid, however old the lease.
                if self._local_job(job):
                    await self._check_store(job)
                    lease = await self.store.acquire(
                        job, self.node, ttl, expired_for_s=0.0 if candidate else 3 * ttl,
                        pid=pid, host=host,
                    )  # fmt: skip
                    if lease is None and candidate:  # (a holder shown gone: taken at once)
                        lease = await take_over(
                            self.bus, self.settings, self.store, job, self.node, agent=True
                        )
                    if lease is not None:
                        await self._lead(job, lease)
            except StoreMismatchError as e:
                refused = True
                if self._refused.get(job) != str(e):
                    self._refused[job] = str(e)
                    log.error("coordinator_refused", job=job, error=str(e))
            except (LeaseLostError, UnavailableError) as e:
                log.warning("coordinator_stepped_down", job=job, error=str(e))
            finally:
                self.leading.discard(job)
            rarely = refused or not candidate  # (a refused job: looked at again in case it moved)
            await anyio.sleep(ttl * random.uniform(2, 4) if rarely else ttl / 3)  # noqa: S311

    async def _check_store(self, job: str) -> None:
        """Check that the job's objects are not bound to another object store than this
        agent's (before a bid: a coordinator that could not write them never leads).

        Raises:
            StoreMismatchError: they are.
        """
        await check_location(self.store, job)
        self._refused.pop(job, None)

    async def catch_up(self, job: str, seq: int) -> bool:
        """Fold the job's events up to stream sequence `seq` into its KV state, if the job has
        no live coordinator (no agent runs evict, or the holder died: its lease expired, or its
        node's record shows it gone, `tierpipe.control.holder`): take the lease, fold, store,
        and hand the lease back. No retention work meanwhile (the floors hold). False if
        another holds the lease (it folds them itself).

        Raises:
            LeaseLostError: a key changed under this fold (a coordinator began meanwhile).
        """
        lease = await self.store.acquire(
            job, self.node, self.settings.lease_ttl_s
        ) or await take_over(self.bus, self.settings, self.store, job, self.node, agent=False)
        if lease is None:
            return False
        await self._lead(job, lease, until=seq)
        return True

    async def _lead(self, job: str, lease: Lease, *, until: int | None = None) -> None:
        """Lead the job until cancelled or the lease is lost (`until`: only until the state
        has folded that stream sequence, holding the floors)."""
        s = self.settings
        held = until is not None
        keep = await self.store.keep(job) or default_keep(s)
        state = await self.store.load(job, keep)
        await self._made_again(job, state)
        head = state.head()
        start = head.resume_seq or 1
        # COMMITs left from an earlier term are dropped: the step may have been removed since
        # (a COMMIT must not outlive its objects); the fold from `resume_seq` completes it again.
        self._commits = {k: m for k, m in self._commits.items() if k[0] != job}
        self.leading.add(job)
        log.info("coordinator_leading", job=job, term=lease.term, resume_seq=start, seq=head.seq)
        pins = RestorePins(s.restore_timeout_s)
        for subject in (plan_subject(job), shard_subject(job, "restore", "*", 0)):
            newest = await self.bus.last_event(subject)  # (it may predate resume_seq)
            if newest is not None:
                pins.note(newest)
        # A catch-up holds the floors from its first event (not only from its first pin):
        # folding the job state to read it removes nothing.
        state.pin(pins.steps(job), hold=held or pins.held(job))
        renew_at = time.monotonic() + s.lease_ttl_s / 3
        keep_at = time.monotonic() + POLICY_READ_S
        budget, shares = await self.store.budget(job), await self.store.shares(job)
        active = ActiveNodes()
        named = state.floors().upload
        try:
            while True:  # (the stream made again: followed again from its start)
                follow = self.bus.follow(state_subjects(job), start_seq=start, decode=_decode)
                async with follow as events:
                    while True:
                        await _fold_for(s.coordinator_flush_s, events, state, pins, active,
                                        held=held)  # fmt: skip
                        # (a pin that timed out goes)
                        state.pin(pins.steps(job), hold=held or pins.held(job))
                        again = False
                        if time.monotonic() >= renew_at:
                            lease = await self.store.renew(job, lease, s.lease_ttl_s)
                            renew_at = time.monotonic() + s.lease_ttl_s / 3
                            again = await self._made_again(job, state)
                        if time.monotonic() >= keep_at:
                            state.keep = await self.store.keep(job) or state.keep
                            budget = await self.store.budget(job)
                            keep_at = time.monotonic() + POLICY_READ_S
                        changes = state.take_changes()
                        if changes:
                            await self._store(state, changes)
                        if (floors := state.floors()).upload != named:
                            named = floors.upload
                            log.info("upload_target_named", job=job, step=named, safe=floors.safe)
                        shares = await self._share(job, budget, len(active), shares, lease.term)
                        if again:
                            break
                        if until is not None and state.seq >= until:
                            return
                start = 1
        finally:
            with anyio.move_on_after(2, shield=True):  # (a clean stop hands the job on at once)
                await self.store.release(job, lease)

    async def _made_again(self, job: str, state: JobState) -> bool:
        """Whether the job's stream was made again since `state` folded it: deleted, or lost
        by its server, it numbers its events from 1 again, and the fold goes on from there
        (`JobState.renumber`). A JetStream API request (at the lead's start, then at each lease
        renewal)."""
        found = await self.bus.stream_made(job)
        if found is None:  # (gone for now: its next publish makes it again)
            return False
        folded = state.seq
        if not state.on_stream(*found):
            return False
        log.warning("stream_made_again", job=job, folded_seq=folded, stream_seq=found[1])
        return True

    async def _store(self, state: JobState, changes: Changes) -> None:
        """Store what changed, and remove the objects of the steps it drops below the
        object-storage floor (their records say no rank has a copy there any more, so no
        restore plans to read them); each removal is published as `evicted`. A removal the
        store refuses now is retried at the next flush while this coordinator leads; one it
        never gets to leaves orphaned objects, never a missing copy."""
        for step in changes.committed:
            if self._commit is not None and (manifest := self._manifest(state, step)) is not None:
                self._commits[(state.job, step)] = manifest
        for step, rec in changes.s3_removed.items():
            self._removal(state.job, rec, every=True)
            # A step removed before its COMMIT was written gets none (written after the removal
            # it would name removed objects).
            self._commits.pop((state.job, step), None)
        for rec in changes.s3_late.values():
            self._removal(state.job, rec, every=False)
        if any(k[0] == state.job for k in (*self._commits, *self._removals)):
            # Of the job's own store only: bound by the first object write (StoreMismatchError:
            # this coordinator steps down before it stores or touches anything).
            await bind_location(self.store, state.job, self.location)
        await self.store.write(state, changes)
        await self._write_commits(state.job)
        for (job, step), (rec, every) in sorted(self._removals.items()):
            if job != state.job:
                continue
            try:
                await self._remove(job, step, rec.world_size, None if every else ranks_of(rec.s3))
            except TierpipeError as e:
                log.warning("object_removal_deferred", job=job, step=step, error=str(e))
                return
            del self._removals[(job, step)]
            # Reported per node only (a batch of 64 ranks a message): no trainer waits on these.
            batches = Batcher(self.bus)
            for rank in ranks_of(rec.s3):
                batches.add(
                    ShardEvicted(
                        job=job, node=self.node, ts=time.time(), step=step, rank=rank,
                        world_size=rec.world_size, epoch=rec.epoch, tier="s3", location="",
                        reason="retention",
                    )
                )  # fmt: skip
            await batches.flush()
            log.info("objects_removed", job=job, step=step, ranks=rec.world_size)

    def _removal(self, job: str, rec: StepRecord, *, every: bool) -> None:
        """Note objects of `rec`'s step to remove: every rank's, or those of the ranks in
        `rec.s3` alone (merged with a removal of the step not done yet)."""
        key = (job, rec.step)
        if (had := self._removals.get(key)) is not None:
            ranks = [*ranks_of(had[0].s3), *ranks_of(rec.s3)]
            rec = msgspec.structs.replace(rec, s3=bitmap(ranks, rec.world_size))
            every |= had[1]
        self._removals[key] = (rec, every)

    async def _share(
        self, job: str, budget: Budget, active: int, stored: Shares, term: int
    ) -> Shares:
        """Store the job's budgets divided among its `active` nodes if that changes what is
        stored (O(1): no write while neither changes); what is stored now. With no node
        active (a new term before any report, a job at rest) the last division stands."""
        want = divide(budget, active or stored.nodes, term)
        unchanged = (want.flush_bytes_per_s_per_node, want.restore_gets_per_node, want.nodes) == (
            stored.flush_bytes_per_s_per_node,
            stored.restore_gets_per_node,
            stored.nodes,
        )
        uncapped = not (stored.flush_bytes_per_s_per_node or stored.restore_gets_per_node)
        if unchanged or (budget == Budget() and uncapped):  # (no budget: nothing to divide)
            return stored
        await self.store.write_shares(job, want)
        log.info("budget_shares_stored", job=job, nodes=want.nodes,
                 flush_bytes_per_s_per_node=want.flush_bytes_per_s_per_node,
                 restore_gets_per_node=want.restore_gets_per_node)  # fmt: skip
        return want

    def _manifest(self, state: JobState, step: int) -> CommitManifest | None:
        """The COMMIT manifest of a step complete in object storage, from the state's record
        and rank digests (None, logged: the state lacks a rank's digest)."""
        rec = state.record(step)
        if rec is None:
            return None
        chunks = [state.rank_digests(step, c) for c in range(-(-rec.world_size // RANKS_PER_CHUNK))]
        try:
            return CommitManifest.from_chunks(
                state.job, step, rec.world_size, rec.epoch, [c for c in chunks if c is not None],
                by=self.node, ts=time.time(), layout=rec.layout,
            )  # fmt: skip
        except ValueError as e:
            log.warning("step_commit_skipped", job=state.job, step=step, error=str(e))
            return None

    async def _write_commits(self, job: str) -> None:
        """Write the job's pending COMMITs, oldest first; one the store refuses now waits for
        the next flush (with those after it), as removals do."""
        commit = self._commit
        for (j, step), manifest in sorted(self._commits.items()):
            if j != job or commit is None:
                continue
            try:
                if manifest.layout and not manifest.layout_data:  # (its bytes, from the KV)
                    data = await self.store.value(layout_key(job, manifest.layout)) or b""
                    manifest = msgspec.structs.replace(
                        manifest, layout=manifest.layout if data else "", layout_data=data
                    )
                written = await commit(manifest)
            except TierpipeError as e:
                log.warning("step_commit_deferred", job=job, step=step, error=str(e))
                return
            del self._commits[(j, step)]
            log.info("step_committed", job=job, step=step, ranks=manifest.world_size,
                     epoch=manifest.epoch, written=written)  # fmt: skip


async def _fold_for(
    seconds: float,
    events: Follow,
    state: JobState,
    pins: RestorePins,
    active: ActiveNodes,
    *,
    held: bool,
) -> None:
    """Fold what arrives for up to `seconds` (less once the follow is idle, or at once after
    a restore's `hold`: its rank 0 waits to read the job state until this fold is stored)."""
    job = state.job
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        batch = await events.batch(left)
        held_now = False
        for stored in batch:
            if stored.event is None:  # (no event this version reads: skipped, as replays do)
                state.passed(stored.seq)
                continue
            if isinstance(stored.event, RecoveryPlanned | RestoreReport):
                pins.note(stored.event)  # pinned before later events fold
                state.pin(pins.steps(job), hold=held or pins.held(job))
                held_now |= isinstance(stored.event, RestoreReport) and stored.event.phase == "hold"
            if isinstance(stored.event, BatchFact):
                active.note(stored.event)
            state.apply(stored.seq, stored.event)
        if not batch or held_now:
            return


def _decode(data: bytes) -> Event | Fact:
    """What the coordinator folds, as facts (`tierpipe.schemas.facts`: a quarter of a full
    decode's cost); restore reports and plans in full, for its pins."""
    fact = decode_fact(data)
    return decode_event(data) if isinstance(fact, RestoreFact | PlanFact) else fact
