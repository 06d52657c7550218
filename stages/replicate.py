"""Replicate stage: this node's `verified` -> a replica on each partner node's NVMe.

For every shard this node verified, the stage asks each of its partners in the job
(`tierpipe.peer.ring`, over the live node records that list the job and serve a peer endpoint)
to copy it from this node's endpoint (`POST /v1/replicate`). The partner pulls the file agent to
agent, writes it durably, checks every digest and publishes its own `replicated` event; this
stage publishes nothing (each copy is logged, `replica_made`). A partner that does not answer,
or whose agent is silent, fails the attempt (retryable: tried again within half a heartbeat,
`retry_after`); one silent for longer than `PARTNER_GONE_S`, or stopped, has left the ring, and
the next node takes its place. A shard older than one of the same rank the stage has seen since
is skipped (the newer one gets the copy), so a partner missing for a while holds no newer shard
back; the newest one whose deliveries (`max_deliver`) run out is kept and tried again in the
background until its partner takes it. A job whose ring has no partner yet (a node's record lists
a job from the scan after its folder appears there) has its shards tried again for
`JOIN_GRACE_S`; `peer_replicas` 0, or a job on one node: nothing to do.

Retention of the replicas this node holds: the stage follows the jobs' floors in KV (as the evict
stage does for its own copies) and removes replicas of steps below the NVMe floor that the floors
do not keep, and replicas a newer timeline superseded (a replica of the same rank from a newer
epoch at the same or an earlier step), each published as `evicted` (tier `peer`).

The agent's peer endpoint (`tierpipe.peer.server`) is started by the runner beside this stage
(`endpoint_url`); run on its own, the stage starts one.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import structlog

from tierpipe.bus.batcher import Batcher
from tierpipe.bus.client import Bus
from tierpipe.control.advert import job_nodes, live_nodes
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    PeerUnavailableError,
    RetryableError,
    ShardMissingError,
    TierpipeError,
)
from tierpipe.names import node_name, shard_relpath
from tierpipe.peer.client import PeerClient
from tierpipe.peer.replicas import Replica, Replicas
from tierpipe.peer.ring import partners, replica_count
from tierpipe.peer.server import PeerServer, endpoint_url
from tierpipe.schemas import ShardEvicted, ShardVerified, shard_event
from tierpipe.schemas.jobstate import Floors
from tierpipe.schemas.node import MISSED_BEATS
from tierpipe.settings import Settings

__all__ = (
    "KINDS",
    "STAGE",
    "Partner",
    "Replicate",
    "handle",
    "open",
    "retry_after",
    "superseded",
)

STAGE = "replicate"
KINDS = ("verified",)
log = structlog.get_logger(__name__)
E = TypeVar("E", bound=TierpipeError)

#: How long a job's partners, once read from the node records, are used before reading again
#: (a ring with a partner missing, or none at all, is read again at every shard).
PARTNERS_TTL_S = 2.0
#: For this long after the stage first sees a job, a shard whose job has no partner in the ring
#: yet is tried again rather than left without a copy: a node's record lists a job from the scan
#: after the job's folder appears there, and a node's first shards may be verified before.
JOIN_GRACE_S = 15.0
#: A partner silent for longer than this (or three heartbeats, if longer) has left the job:
#: the next node in the ring takes its place. Until then, copies wait for it.
PARTNER_GONE_S = 60.0
#: How often the replicas held here are looked at again (superseded ones), floors or not.
RECHECK_S = 5.0


@dataclass(frozen=True, slots=True)
class Partner:
    node: str
    url: str


@dataclass
class Replicate:
    settings: Settings
    bus: Bus
    node: str
    #: This node's peer endpoint (where partners pull from).
    url: str
    client: PeerClient
    replicas: Replicas
    store: JobStore
    floors: dict[str, Floors] = field(default_factory=dict)
    _partners: dict[str, tuple[float, list[Partner], int, list[str]]] = field(default_factory=dict)
    _batcher: Batcher | None = None
    #: (job, rank, world size) -> (epoch, step) of the newest shard of it seen here.
    _newest: dict[tuple[str, int, int], tuple[int, int]] = field(default_factory=dict)
    #: When the stage first saw each job (monotonic), for `JOIN_GRACE_S`.
    _first_seen: dict[str, float] = field(default_factory=dict)
    #: The jobs whose shards were last left without a copy for want of a partner (said once).
    _alone: set[str] = field(default_factory=set)
    #: (job, rank, world size) -> the newest shard of it whose deliveries ran out waiting for
    #: its partner: tried again in the background (`retry_waiting`; lost if the agent stops).
    waiting: dict[tuple[str, int, int], ShardVerified] = field(default_factory=dict)

    async def partners(self, job: str) -> tuple[list[Partner], int, list[str]]:
        """This node's partners in `job` whose agents are alive, in ring order (the first `n`
        are its partners; the others stand in for one that refuses), `n`, and the silent ones
        among the first `n` (read again after `PARTNERS_TTL_S`).

        The ring is made of the nodes whose records list the job, serve an endpoint, and were
        heard from within `PARTNER_GONE_S` (a node whose agent stopped, or that stayed silent
        longer, has left the job and hands its place on to the next one).
        """
        cached = self._partners.get(job)
        if cached is not None and time.monotonic() - cached[0] < PARTNERS_TTL_S:
            return cached[1], cached[2], cached[3]
        gone_s = max(PARTNER_GONE_S, MISSED_BEATS * self.settings.node_heartbeat_s)
        records = {
            r.node: r
            for r in await job_nodes(self.bus, self.settings, job, silent_s=gone_s)
            if r.peer_url and r.node != self.node
        }
        ring = {name: r.failure_domain for name, r in records.items()}
        ring[self.node] = self.settings.failure_domain
        n = replica_count(self.settings.peer_replicas, len(ring))
        now = time.time()
        order = partners(ring.items(), self.node, len(ring))
        alive = [Partner(p, records[p].peer_url) for p in order if records[p].alive(now)]
        missing = [p for p in order[:n] if not records[p].alive(now)]
        if n and not missing:  # (a ring short of a partner is read again next time)
            self._partners[job] = (time.monotonic(), alive, n, missing)
        return alive, n, missing

    async def handle(self, event: ShardVerified, attempt: int) -> None:
        """Have `n` partners copy the shard: the first ones in ring order, the next one alive
        standing in for any that refuses or cannot be reached (a node killed a moment ago
        still looks alive in its record); with fewer copies made, the first failure raises
        (a retryable error naming the silent partners, if none answered at all), to be tried
        again soon (`retry_after`).

        A shard older than one of the same rank seen here since (a newer step, or a newer
        timeline) is skipped: that one gets the copy, and a partner missing for a while holds
        nothing back once it is back. A shard of a job with no partner in its ring is tried
        again for `JOIN_GRACE_S` after the stage first saw the job (its partners may not list
        it yet), unless every rank of the step is on this node or no other node's agent serves
        a peer endpoint; then it is left without a copy.
        One whose last delivery (`max_deliver`) fails for want of its partner is acked and kept
        here (`waiting`), tried again until it has its copy or a newer one of its rank comes.
        """
        if event.node != self.node:
            return None
        if self.settings.peer_replicas == 0:
            return None
        key, mark = (event.job, event.rank, event.world_size), (event.epoch, event.step)
        newest = self._newest.setdefault(key, mark)
        if newest > mark:
            reason = "a newer save of this rank was verified here: it gets the copy"
            log.info("replica_skipped", job=event.job, step=event.step, rank=event.rank,
                     newer_step=newest[1], reason=reason)  # fmt: skip
            return None
        self._newest[key] = mark
        try:
            await self._replicate(event)
        except RetryableError as e:
            if attempt < self.settings.max_deliver:
                raise
            self.waiting[key] = event
            log.info("replica_waiting", job=event.job, step=event.step, rank=event.rank,
                     error=str(e), reason=f"{attempt} tries: tried again until the partner "
                     "takes it or a newer save of the rank comes")  # fmt: skip
        except TierpipeError:
            # (this one will never have a copy: older ones of the rank are not skipped)
            self._newest.pop(key, None)
            raise
        return None

    async def _may_join(self, event: ShardVerified) -> bool:
        """Whether a partner may yet join `event`'s job: another node's agent serves a peer
        endpoint, and not every rank of the step is on this node (a job on one node)."""
        if await anyio.to_thread.run_sync(_every_rank_here, event):
            return False
        nodes = await live_nodes(self.bus, self.settings)
        return any(r.node != self.node and r.peer_url for r in nodes)

    async def retry_waiting(self) -> None:
        """Try the shards in `waiting` again every half heartbeat (until cancelled): each
        leaves once it has its copy, fails for good, or a newer one of its rank came."""
        while True:
            await anyio.sleep(_retry_s(self.settings))
            for key, event in list(self.waiting.items()):
                if self._newest.get(key, (-1, -1)) > (event.epoch, event.step):
                    del self.waiting[key]  # (the newer one gets the copy)
                    continue
                try:
                    await self._replicate(event)
                except RetryableError:
                    continue
                except TierpipeError as e:
                    log.warning("replica_not_made", job=event.job, step=event.step,
                                rank=event.rank, error=str(e))  # fmt: skip
                if self.waiting.get(key) is event:
                    del self.waiting[key]

    async def _replicate(self, event: ShardVerified) -> None:
        first_seen = self._first_seen.setdefault(event.job, time.monotonic())
        failed: TierpipeError | None = None
        candidates, n, missing = await self.partners(event.job)
        if n == 0:
            young = time.monotonic() - first_seen < JOIN_GRACE_S
            if young and await self._may_join(event):
                raise retry_after(self.settings, PeerUnavailableError(
                    event.job, "no partner in the job's ring yet (its nodes' records list a job "
                    "from the scan after its folder appears there)"))  # fmt: skip
            if event.job not in self._alone:
                self._alone.add(event.job)
                log.info("replicas_not_made", job=event.job, step=event.step,
                         reason="no other node of the job serves a peer endpoint")  # fmt: skip
            return
        self._alone.discard(event.job)
        made = 0
        for partner in candidates:
            if made == n:
                break
            try:
                done = await self.client.replicate(partner.url, event, source_url=self.url)
            except ShardMissingError as e:
                if await anyio.Path(event.path).exists():
                    raise  # (this node holds it: the partner's answer is wrong, not a race)
                # Retention (or a newer save) removed the copy since its `verified`: nothing to
                # copy any more, and nothing went wrong.
                log.info("replica_skipped", partner=partner.node, job=event.job,
                         step=event.step, rank=event.rank, error=str(e),
                         reason="the copy is no longer on this node")  # fmt: skip
                return
            except TierpipeError as e:
                log.warning("replica_not_made", partner=partner.node, error=str(e))
                self._partners.pop(event.job, None)  # (read the ring again next time)
                failed = failed or e
                continue
            made += 1
            log.info("replica_made", job=event.job, step=event.step, rank=event.rank,
                     partner=partner.node, seconds=done.seconds)  # fmt: skip
        if made < n:
            self._partners.pop(event.job, None)
            if failed is not None:
                raise retry_after(self.settings, failed)
            raise retry_after(
                self.settings, PeerUnavailableError(", ".join(missing) or event.job,
                                                    "no partner alive")
            )  # fmt: skip

    # --- retention of the replicas held here

    async def follow_floors(self) -> None:
        """Apply every job's floors as stored now and at each change, and look at every job's
        replicas again every `RECHECK_S` (until cancelled)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._recheck)
            while True:
                try:
                    async for job, floors in self.store.watch_floors():
                        self.floors[job] = floors
                        await self.prune(job)
                except TierpipeError as e:
                    log.warning("floor_watch_interrupted", error=str(e))
                await anyio.sleep(self.settings.retry_max_s / 10)

    async def _recheck(self) -> None:
        while True:
            await anyio.sleep(RECHECK_S)
            for job in await anyio.to_thread.run_sync(self.replicas.jobs):
                try:
                    await self.prune(job)
                except TierpipeError as e:
                    log.warning("replica_recheck_failed", job=job, error=str(e))

    async def prune(self, job: str) -> list[Replica]:
        """Remove the replicas of `job` held here that the floors no longer keep, or that a
        newer timeline superseded; each published as `evicted` (tier peer). What went."""
        held = await anyio.to_thread.run_sync(self.replicas.held, job)
        floors = self.floors.get(job)
        removed = []
        for replica in held:
            if (
                floors is not None
                and replica.step < floors.nvme
                and replica.step not in floors.keep
            ):
                reason = "below the nvme floor"
            elif superseded(replica, held):
                reason = "superseded by a newer timeline"
            else:
                continue
            if not await self.replicas.remove(replica):
                continue
            evicted = shard_event(
                ShardEvicted, replica, node=self.node, tier="peer",
                location=str(replica.path), reason=reason,
            )  # fmt: skip
            await self.bus.publish(evicted)
            self._batcher = self._batcher or Batcher(self.bus)
            self._batcher.add(evicted)
            removed.append(replica)
            log.info("copy_evicted", job=job, step=replica.step, rank=replica.rank, tier="peer",
                     location=str(replica.path), reason=reason)  # fmt: skip
        if self._batcher is not None:
            await self._batcher.flush()
        return removed


def retry_after(settings: Settings, error: E) -> E:
    """`error`, to be tried again within half a heartbeat where it is a partner's absence (a
    `PeerUnavailableError`): a silent partner's record changes no sooner, and one that refused
    may be back by then; capped by the runner's growing delay."""
    if isinstance(error, PeerUnavailableError):
        error.retry_after_s = _retry_s(settings)
    return error


def _retry_s(settings: Settings) -> float:
    return max(0.5, settings.node_heartbeat_s / 2)


def _every_rank_here(event: ShardVerified) -> bool:
    """Whether every rank of `event`'s step has its copy on this node (a job on one node)."""
    folder = Path(event.path).parent
    try:
        here = set(os.listdir(folder))
    except OSError:
        return False
    names = (shard_relpath(event.job, event.step, r, event.world_size).name
             for r in range(event.world_size))  # fmt: skip
    return all(name in here for name in names)


def superseded(replica: Replica, held: list[Replica]) -> bool:
    """Whether a replica of the same rank from a newer epoch (a run that rewound) is held at the
    same or an earlier step: `replica`'s timeline was abandoned there."""
    return any(
        r.rank == replica.rank and r.epoch > replica.epoch and r.step <= replica.step for r in held
    )


@asynccontextmanager
async def open(settings: Settings, bus: Bus) -> AsyncIterator[Replicate]:
    """The peer client, this node's replicas, its endpoint's URL (the agent's, or one started
    here); the retention of the replicas and the shards left waiting for their partner, in the
    background."""
    node = node_name(settings.node)
    async with AsyncExitStack() as stack:
        url = endpoint_url.get()
        if not url:
            url = (await stack.enter_async_context(PeerServer(settings, bus, node=node))).url
        client = await stack.enter_async_context(PeerClient(token=settings.peer_token))
        replicas = Replicas.from_settings(settings)
        stack.callback(replicas.close)
        store = await JobStore(bus.js, settings).open()
        ctx = Replicate(settings, bus, node, url, client, replicas, store)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.follow_floors)
            tg.start_soon(ctx.retry_waiting)
            yield ctx
            tg.cancel_scope.cancel()


handle = Replicate.handle
