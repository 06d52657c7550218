"""`python -m bench control --nodes N [--ranks-per-node 8] [--steps S]`: the control plane at
scale, with simulated agents and ranks (events only, no tensor bytes; tasks, not processes).

What runs for real: an embedded nats-server, the `TIERPIPE` stream, the job-state KV bucket and
ONE retention `Coordinator` for the job, in a process of its own with its own event loop (uvloop
where installed, as the agent) and its own NATS connection, as in an agent, so its loop thread's
CPU time is the coordinator's whole cost: decoding, nats-py, the fold (`JobState`), the KV
writes, its object-removal events. Its object store is a no-op recorder. (It ran as a thread of
this process before, sharing the GIL, the allocator and the caches with the simulated nodes'
publishing; at 1,000 nodes the two figures were within the run-to-run spread.)

What is simulated (in the main thread, its publishing cost not counted): every node publishes for
each of its ranks what a real agent and trainer publish per checkpoint, in phases across all
ranks: `staged` (trainer), `written` (nvme-write), `verified` (verify), `evicted` ram (evict:
slot released), `flushed` (flush); then, once the checkpoint is folded and quiet, the nodes
apply the floors as stored in KV and publish `evicted` nvme for their copies below the NVMe floor
(as `tierpipe.stages.evict` does). Publishes are pipelined (`publish_async`, at most `IN_FLIGHT`
unacknowledged) on one connection, so stream order is publication order.

The job keeps `KEEP` (2 complete steps on NVMe, 1 in object storage): from the third checkpoint
on every checkpoint is steady state (one step completes, one leaves object storage, one leaves
NVMe). Per-checkpoint figures are means over those steady checkpoints (all checkpoints when
fewer than 3 steps). A checkpoint's interval runs from its first `staged` to the quiet after its
NVMe evictions (the fold caught up with the stream and no KV write for `QUIET_FLUSHES` flushes).

Figures (JSON keys):
- `deliveries_per_ckpt_per_node`: JetStream deliveries per checkpoint per node, the sum of
  `stage_deliveries_per_ckpt_per_node` (FORMULA, the stages are not run: each node's durable
  consumers take each rank's `staged` (nvme-write), then the node's batch of `written`
  (verify) and of `verified` (flush, evict): ranks-per-node + 3; the simulated agents publish
  the batches), `coordinator_deliveries_per_ckpt_per_node`
  (MEASURED: every consumer's delivered count from the server's `/jsz`, over the checkpoint's
  interval: the coordinator's ordered consumer of the job's events and its KV watchers) and
  `floor_watch_deliveries_per_ckpt_per_node` (MEASURED writes of the floor key per checkpoint x
  1: every agent watches `*.floor`). `trainer_core_deliveries_per_ckpt_per_node` (core NATS,
  not JetStream, not in the sum): each rank's Checkpointer subscribes to its own shard's subject,
  so it gets every event its node publishes about it (counted from the simulated events).
- `coordinator_cpu_s_per_ckpt`: the coordinator's CPU per checkpoint (its process's loop thread);
  `coordinator_events_per_cpu_s`: stream messages folded per second of it.
  `receive_cpu_s_per_ckpt` (`receive_us_per_msg`): the same process's CPU to read the same
  checkpoint's messages again through the same kind of consumer and do nothing with them:
  what nats-py costs before any decode or fold, the floor under `coordinator_cpu_s_per_ckpt`
  for this many messages (`coordinator_cpu_over_receive`: the median of the per-checkpoint
  ratios, with its 90 % interval, `_lo`, `_hi`).
  `fold_us_per_rank_event`: the part of it that is `JobState`'s fold alone, per rank event:
  `written`, `verified` and `flushed` of every rank for 2 steps (at most `FOLD_RANKS` ranks),
  decoded beforehand, folded in this process (the least CPU time of 3 folds).
- `fold_lag_s`: from the last `flushed` of the last step to the KV head listing that step as
  complete in object storage (`fold_lag_s_max`: the largest over all steps).
- `max_msg_bytes`: the largest payload published: the simulated events, the coordinator's events,
  the restart's `ready` report and plan, and every KV value the coordinator wrote. (The old
  restore protocol's plan message is not published here: `old_restore.plan_msg_bytes` is its
  size at this world size.)
- `kv_bytes_per_ckpt`, `kv_writes_per_ckpt`: values the coordinator wrote per checkpoint (lease
  renewals excluded).
- `restart_state_bytes`: what one rank reads from KV at restart (`tierpipe.recovery.survey`):
  the head (which carries the candidate steps' records where they fit), and for each candidate
  step (the newest 3 with a record and the newest 2 complete on each tier) the chunk of header
  digests holding the rank, and its record if the head does not carry it (`restart_records`:
  the records read from their own keys; `record_bytes`: one record at this world size, as
  stored), measured by reading them.
- `restart_s_history_ratio`: MEASURED on small separate jobs (`HISTORY_NODES` nodes, default
  retention, paced publishing): the median time to read that restart state after 1,000
  checkpoints over the same after 10, the two jobs' reads interleaved (`restart_s_history` has
  both).
- `plan_s`: MEASURED, from the restart until every simulated rank has its plan, through the
  real restore code (`tierpipe.recovery.agree.Restorer`, one per simulated rank, as tasks),
  each rank started as torchrun starts it (`local_rank`, `local_world_size` = ranks per
  node): each node's local leader waits for the fold of its node's newest events
  (`current_head`), surveys the real KV for its node's ranks (`survey`: each record and digest
  chunk once) and publishes one `ready` for them; rank 0 collects them on its watch, picks
  with `choose` and publishes the compact plan (step + deflated bitmap); every other rank takes
  it from its own core subscription to the plan subject (opened at its start; a catch-up read
  of the stored plan only after `restore_plan_poll_s` without one), then reads what it loads
  (the plan step's record and digest chunk), "loads", reports `loaded`, and rank 0 publishes
  the final plan (`restart.sources_s`: until every rank knew its sources; `restart.restore_s`:
  until every rank returned). Simulated: no NVMe copy is on this machine (each node's disk
  check finds none, so every rank reads object storage: the largest plan bitmap); loading
  returns at once. The simulated ranks share connections, one per process: from
  `RESTART_PROCS_FROM` nodes the nodes are split over `RESTART_PROCS` processes
  (`restart.processes`; this one has rank 0), and their requests are throttled to
  `IN_FLIGHT_REQUESTS` in flight per process (one client's queue would time out tens of
  thousands at once; real ranks each send a few from their own process); the cyclic GC is off
  while they run. `restart` has the details (`same_plan`: every rank got the same step and
  bitmap, `plan_msg_bytes`, `ready_msg_bytes`: a node's `ready`). `old_restore` measures the
  old protocol's rank-0 side on this job, for comparison: the replay of the whole job stream
  into a catalog (`replay_s`, `replay_events`, `replay_bytes`), `plan_recovery_s`, and
  `plan_msg_bytes`.
- `kv_equals_fold`: the KV (head, floors, every step record and no other step key) equals a
  fresh `JobState` fold of the job's stream as stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import importlib.util
import inspect
import json
import pstats
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import ShardIdent, log, scratch_dir
from bench.paired import ratio_keys

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus
    from tierpipe.bus.kv import Bucket
    from tierpipe.control.jobstate import JobState
    from tierpipe.control.kvstate import JobStore
    from tierpipe.recovery.agree import Restorer
    from tierpipe.schemas import Event
    from tierpipe.schemas.jobstate import JobHead
    from tierpipe.settings import Settings

__all__ = ["run"]

#: The retention of the measured job: the smallest, so steady state comes at the third step.
KEEP_NVME, KEEP_S3 = 2, 1
#: Unacknowledged publishes of the simulated agents.
IN_FLIGHT = 256
#: The message limit every message must stay under.
MSG_LIMIT = 256 * 1024
#: Quiet: the fold caught up and no KV write for this many flush intervals.
QUIET_FLUSHES = 2.5
POLL_S = 0.05
#: The restart-state read at 10 vs 1,000 checkpoints of history: nodes, and reads timed.
HISTORY_NODES = 1
HISTORY_STEPS = (10, 1000)
HISTORY_READS = 21
#: Paced publishing in the history runs: at most this many steps ahead of the fold.
HISTORY_LAG_STEPS = 20
#: What a shard would be (in the events only).
SHARD_BYTES = 1 << 30
TENSORS = 205
EPOCH = 1_767_225_600_000_000_000
BUCKET = "tierpipe-bench"
COORDINATOR = "bench-coordinator"


def _node(n: int) -> str:
    return f"node-{n:05d}"


# --- the simulated agents


@dataclass
class Layout:
    """The job's ranks on its nodes."""

    job: str
    nodes: int
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> str:
        return _node(rank // self.ranks_per_node)

    def phases(self, step: int) -> list[list[Event]]:
        """One checkpoint's events as the agents and trainers publish them: every rank's
        `staged`, then `written`, then `verified` with the slot's release, then `flushed`."""
        from tierpipe.names import shard_relpath
        from tierpipe.schemas import (
            ShardEvicted,
            ShardFlushed,
            ShardStaged,
            ShardVerified,
            ShardWritten,
        )

        w = self.world_size
        ts = time.time()
        staged: list[Event] = []
        written: list[Event] = []
        verified: list[Event] = []
        flushed: list[Event] = []
        for rank in range(w):
            ident: dict[str, Any] = dict(
                job=self.job, node=self.node_of(rank), ts=ts, step=step, rank=rank, world_size=w,
                epoch=EPOCH,
            )  # fmt: skip
            rel = str(shard_relpath(self.job, step, rank, w))
            path = f"/nvme/tierpipe/{rel}"
            slot = f"/dev/shm/tierpipe/{self.job}/rank-{rank:05d}/slot-{step % 2}"
            digest = f"{step:016x}{rank:016x}"
            staged.append(
                ShardStaged(**ident, staging_path=slot, slot=step % 2, nbytes=SHARD_BYTES,
                            tensors=TENSORS, stall_s=0.05, generation=step)
            )  # fmt: skip
            written.append(
                ShardWritten(**ident, path=path, nbytes=SHARD_BYTES, header_digest=digest,
                             tensors=TENSORS, seconds=1.5)
            )  # fmt: skip
            verified += [
                ShardVerified(**ident, path=path, nbytes=SHARD_BYTES, header_digest=digest,
                              seconds=0.8),
                ShardEvicted(**ident, tier="ram", location=slot, reason="nvme copy verified"),
            ]  # fmt: skip
            flushed.append(
                ShardFlushed(**ident, bucket=BUCKET, key=rel, etag=f'"{digest}-64"',
                             checksum="AAAAAA==-64", header_digest=digest, nbytes=SHARD_BYTES,
                             seconds=12.0)
            )  # fmt: skip
        return [staged, written, verified, flushed]

    def nvme_evictions(self, step: int) -> list[Event]:
        """Every node removing its NVMe copies of `step` (retention, once flushed)."""
        from tierpipe.names import shard_relpath
        from tierpipe.schemas import ShardEvicted

        w = self.world_size
        ts = time.time()
        return [
            ShardEvicted(
                job=self.job, node=self.node_of(rank), ts=ts, step=step, rank=rank, world_size=w,
                epoch=EPOCH, tier="nvme",
                location=f"/nvme/tierpipe/{shard_relpath(self.job, step, rank, w)}",
                reason="retention (if-flushed)",
            )
            for rank in range(w)
        ]  # fmt: skip


class Publisher:
    """The simulated agents' publishing: the `Bus.publish` headers, pipelined."""

    def __init__(self, bus: Bus, settings: Settings) -> None:
        assert bus.nc is not None
        self._js = bus.nc.jetstream(
            timeout=settings.request_timeout_s, publish_async_max_pending=IN_FLIGHT
        )
        self._base = settings.stream
        self.count = 0
        self.max_bytes = 0
        self.last_seq = 0

    async def publish(self, events: Iterable[Event]) -> None:
        from tierpipe.bus.client import KIND_HEADER, SCHEMA_HEADER
        from tierpipe.names import event_subject, msg_id, stream_name
        from tierpipe.schemas import SCHEMA_VERSION, encode_event

        futures = []
        for event in _with_batches(events):
            data = encode_event(event)
            self.max_bytes = max(self.max_bytes, len(data))
            headers = {
                "Nats-Msg-Id": msg_id(event),
                KIND_HEADER: str(type(event).__struct_config__.tag),
                SCHEMA_HEADER: str(SCHEMA_VERSION),
            }
            futures.append(
                await self._js.publish_async(
                    event_subject(event),
                    data,
                    stream=stream_name(self._base, event.job),
                    headers=headers,
                )
            )
        await self._js.publish_async_completed()
        for f in futures:
            ack = f.result()  # (raises what the server refused)
            if ack.duplicate:
                raise RuntimeError(f"duplicate publish at seq {ack.seq}")
            self.last_seq = max(self.last_seq, ack.seq)
        self.count += len(futures)


def _with_batches(events: Iterable[Event]) -> list[Event]:
    """`events`, then each simulated node's `NodeBatch`es of them, as agents publish them."""
    from tierpipe.schemas import BATCH_MAX, NodeBatch, ShardEvent

    out = list(events)
    grouped: dict[tuple[str, str, str], list[Event]] = {}
    for e in out:
        kind = str(type(e).__struct_config__.tag)
        if getattr(e, "tier", None) == "ram":
            continue  # (slot releases are reported per rank only, as evict does)
        if isinstance(e, ShardEvent) and kind in ("written", "verified", "flushed", "evicted"):
            grouped.setdefault((e.job, e.node, kind), []).append(e)
    for (job, node, kind), found in grouped.items():
        for i in range(0, len(found), BATCH_MAX):
            batch = NodeBatch(
                job=job, node=node, ts=time.time(), batch=kind,  # type: ignore[arg-type]
                events=found[i : i + BATCH_MAX],  # type: ignore[arg-type]
            )  # fmt: skip
            out.append(batch)
    return out


# --- the coordinator, in its own process


@dataclass
class CoordinatorStats:
    """What the coordinator wrote and published (kept in its process, copied out on request)."""

    kv_writes: int = 0
    kv_bytes: int = 0
    kv_max_bytes: int = 0
    floor_writes: int = 0
    lease_writes: int = 0
    published: int = 0
    published_max_bytes: int = 0
    removed: list[tuple[str, int]] = field(default_factory=list)

    def snapshot(self) -> tuple[int, int, int]:
        return self.kv_writes, self.kv_bytes, self.floor_writes


class CoordinatorProcess:
    """One real `Coordinator` (following every job in the bucket) in a process of its own, as
    in an agent: its CPU is its event loop thread's alone, not shared with the simulated nodes'
    publishing (a thread here would wait on their GIL and share their allocator and caches).
    Asked over a pipe (`hosts`, `leads`, `cpu_s`, `stats`); `profile`: cProfile its loop, printed
    on its stderr at `stop_profile()`."""

    def __init__(self, settings: Settings, *, profile: bool = False) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_coordinator_main, args=(settings.as_env(), child, profile),
            name="bench-coordinator", daemon=True,
        )  # fmt: skip
        self._lock = threading.Lock()

    def __enter__(self) -> CoordinatorProcess:
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the coordinator process did not start")
        ready = self._conn.recv()
        if ready != "ready":
            raise RuntimeError(f"the coordinator did not start: {ready}")
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self._ask("stop")
        self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()

    def _ask(self, *request: Any) -> Any:
        with self._lock:
            self._conn.send(request)
            if not self._conn.poll(60):
                raise RuntimeError(f"the coordinator did not answer {request[0]!r}")
            kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"the coordinator failed: {value}")
        return value

    def cpu_s(self) -> float:
        """The coordinator's event-loop thread's CPU time so far."""
        return float(self._ask("cpu"))

    @property
    def stats(self) -> CoordinatorStats:
        return CoordinatorStats(**self._ask("stats"))

    def hosts(self, job: str) -> None:
        """Make this coordinator a lease candidate for `job` (it hosts rank 0)."""
        self._ask("hosts", job)

    def leads(self, job: str) -> bool:
        return bool(self._ask("leads", job))

    def receive(self, job: str, first: int, last: int) -> tuple[int, float]:
        """Read the messages the job's coordinator folds, stream sequences `first` to `last`,
        through the same kind of consumer on this process's connection, doing nothing with
        them: (messages, loop-thread CPU seconds). What nats-py costs before any fold."""
        n, cpu = self._ask("receive", job, first, last)
        return int(n), float(cpu)

    def stop_profile(self) -> None:
        """Stop profiling and print the profile (the coordinator's stderr is this one's)."""
        self._ask("stop_profile")


def _coordinator_main(env: dict[str, str], conn: Any, profile: bool) -> None:
    """The coordinator process: its loop (uvloop where installed, as the agent) runs the
    coordinator; a thread answers the parent's requests on it."""
    import dataclasses

    from tierpipe.log import configure_logging
    from tierpipe.settings import load_settings

    configure_logging("warning", "json", only_if_unconfigured=True)
    settings = load_settings(path=None, env=env)
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        factory = uvloop.new_event_loop
    stats = CoordinatorStats()
    prof = cProfile.Profile() if profile else None

    async def serve() -> None:
        from tierpipe.bus.client import Bus
        from tierpipe.control.coordinator import Coordinator
        from tierpipe.control.kvstate import JobStore

        async def remove(job: str, step: int, world_size: int, ranks: object) -> None:
            if ranks is None:  # (a step's objects; not a late upload's, removed on its own)
                stats.removed.append((job, step))

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        async with Bus(settings, name=COORDINATOR) as bus:
            store = await JobStore(bus.js, settings).open()
            _instrument(store, bus, stats)
            coordinator = Coordinator(settings, bus, store, COORDINATOR, remove)

            def answer(kind: str, *args: Any) -> Any:  # (in the loop's thread)
                if kind == "cpu":
                    return time.thread_time()
                if kind == "stats":
                    return dataclasses.asdict(stats)
                if kind == "hosts":
                    return coordinator.hosts(args[0], 0)
                if kind == "leads":
                    return args[0] in coordinator.leading
                if kind == "receive":
                    return _receive(bus, *args)
                if kind == "stop_profile":
                    if prof is not None:
                        prof.disable()
                        _print_profile(pstats.Stats(prof, stream=sys.stderr))
                    return None
                if kind == "stop":
                    stop.set()
                    return None
                raise ValueError(kind)

            def requests() -> None:  # (a thread: blocks on the pipe, never on the loop)
                while True:
                    try:
                        request = conn.recv()
                    except EOFError:
                        loop.call_soon_threadsafe(stop.set)
                        return
                    future = asyncio.run_coroutine_threadsafe(_call(answer, *request), loop)
                    try:
                        conn.send(("ok", future.result(60)))
                    except Exception as e:
                        conn.send(("error", repr(e)))
                    if request[0] == "stop":
                        return

            task = asyncio.create_task(coordinator.run())
            threading.Thread(target=requests, daemon=True).start()
            if prof is not None:
                prof.enable()
            conn.send("ready")
            await stop.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve())
    except BaseException as e:
        with contextlib.suppress(Exception):
            conn.send(repr(e))
        raise


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


async def _receive(bus: Any, job: str, first: int, last: int) -> tuple[int, float]:
    """`CoordinatorProcess.receive`, in its process."""
    from tierpipe.names import state_subjects

    def ignore(body: bytes) -> Any:
        return None

    n, t0 = 0, time.thread_time()
    async with bus.follow(state_subjects(job), start_seq=first, decode=ignore) as follow:
        while True:
            got = await follow.batch(5.0)
            n += sum(1 for m in got if m.seq <= last)
            if not got or got[-1].seq >= last:
                return n, time.thread_time() - t0


def _instrument(store: JobStore, bus: Bus, stats: CoordinatorStats) -> None:
    """Count what the coordinator writes to KV and publishes (wrapping this instance only)."""
    cas = store._cas
    publish = bus._publish

    async def counted_cas(job: str, key: str, value: bytes) -> None:
        if key.endswith(".lease"):
            stats.lease_writes += 1
        else:
            stats.kv_writes += 1
            stats.kv_bytes += len(value)
            stats.floor_writes += key.endswith(".floor")
        stats.kv_max_bytes = max(stats.kv_max_bytes, len(value))
        await cas(job, key, value)

    async def counted_publish(subject: str, data: bytes, **kwargs: Any) -> Any:
        stats.published += 1
        stats.published_max_bytes = max(stats.published_max_bytes, len(data))
        return await publish(subject, data, **kwargs)

    store._cas = counted_cas  # type: ignore[method-assign]
    bus._publish = counted_publish  # type: ignore[method-assign]


# --- reading the server and the KV


def _deliveries(monitor_url: str) -> dict[str, int]:
    """Consumer name -> messages it delivered, for every consumer on the server."""
    url = f"{monitor_url}/jsz?accounts=true&streams=true&consumers=true"
    with urllib.request.urlopen(url, timeout=10) as r:
        info = json.loads(r.read())
    out = {}
    for account in info.get("account_details") or []:
        for stream in account.get("stream_detail") or []:
            for c in stream.get("consumer_detail") or []:
                out[f"{stream['name']}/{c['name']}"] = int(c["delivered"]["consumer_seq"])
    return out


def _delivered_since(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(n - before.get(name, 0) for name, n in after.items())


async def _restart_read(kv: Bucket, job: str, rank: int = 0) -> tuple[int, int]:
    """What one rank reads from KV at restart (`tierpipe.recovery.survey`): the head, then for
    each candidate step the digest chunk holding the rank, and its record unless the head
    carries it. (bytes, records read from their own keys)."""
    import msgspec

    from tierpipe.control.kvstate import digests_key, head_key, step_key
    from tierpipe.schemas.jobstate import RANKS_PER_CHUNK, JobHead

    entry = await kv.get(head_key(job))
    value = entry.value if entry is not None else b""
    head = msgspec.json.decode(value, type=JobHead)
    total, records = len(value), 0
    carried = {r.step for r in head.records}
    for step in head.candidates():
        keys = [digests_key(job, step, rank // RANKS_PER_CHUNK)]
        if step not in carried:
            keys.append(step_key(job, step))
        for key in keys:
            found = await kv.get(key)
            if found is None:
                continue
            total += len(found.value)
            records += key == step_key(job, step)
    return total, records


class Driver:
    """The simulated agents of one job, and the waits on its coordinator."""

    def __init__(
        self,
        settings: Settings,
        server_monitor_url: str,
        bus: Bus,
        store: JobStore,
        coordinator: CoordinatorProcess,
        layout: Layout,
    ) -> None:
        self.settings, self.bus, self.store = settings, bus, store
        self.monitor_url = server_monitor_url
        self.coordinator = coordinator
        self.layout = layout
        self.publisher = Publisher(bus, settings)
        #: Steps whose NVMe copies the nodes still hold.
        self.on_nvme: set[int] = set()
        #: Events per (node, rank) subject: what each rank's Checkpointer receives.
        self.node_events = 0

    @property
    def job(self) -> str:
        return self.layout.job

    async def start(self, keep: Any) -> None:
        """Make its stream, register the job, and wait until the coordinator leads it."""
        await self.bus.ensure_stream(self.job)
        self.coordinator.hosts(self.job)
        await self.store.register(self.job, keep)
        deadline = time.monotonic() + 30
        while not self.coordinator.leads(self.job):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not take the lease of {self.job}")
            await asyncio.sleep(POLL_S)

    async def publish(self, events: list[Event]) -> None:
        await self.publisher.publish(events)
        self.node_events += len(events)

    async def checkpoint(self, step: int) -> None:
        """Every rank's events of one checkpoint, phase after phase (pipelined)."""
        await self.publish([e for phase in self.layout.phases(step) for e in phase])
        self.on_nvme.add(step)

    async def apply_floors(self) -> int:
        """The nodes remove their NVMe copies the stored floors no longer keep; steps removed."""
        floors = await self.store.floors(self.job)
        gone = sorted(t for t in self.on_nvme if t < floors.nvme and t not in floors.keep)
        for step in gone:
            await self.publish(self.layout.nvme_evictions(step))
            self.on_nvme.discard(step)
        return len(gone)

    async def head(self) -> JobHead | None:
        return await self.store.head(self.job)

    async def last_seq(self) -> int:
        """The newest stream sequence of what the job's coordinator folds."""
        from tierpipe.names import state_subjects

        seqs = [await self.bus.last_raw(s) for s in state_subjects(self.job)]
        return max((found[0] for found in seqs if found), default=0)

    async def wait_complete(self, step: int, timeout_s: float) -> None:
        """Until the KV head lists `step` as complete in object storage."""
        deadline = time.monotonic() + timeout_s
        while True:
            head = await self.head()
            if head is not None and step in head.s3_steps:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"step {step} not complete in the KV head after {timeout_s} s")
            await asyncio.sleep(POLL_S / 5)

    async def wait_folded(self, seq: int, timeout_s: float) -> None:
        """Until the KV head says the fold reached stream sequence `seq`."""
        deadline = time.monotonic() + timeout_s
        while True:
            head = await self.head()
            if seq == 0 or (head is not None and head.seq >= seq):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fold did not reach seq {seq} within {timeout_s} s")
            await asyncio.sleep(POLL_S)

    async def wait_quiet(self, timeout_s: float) -> None:
        """Until the fold caught up with the stream and nothing was written to KV for
        `QUIET_FLUSHES` flush intervals."""
        deadline = time.monotonic() + timeout_s
        quiet_s = QUIET_FLUSHES * self.settings.coordinator_flush_s
        since: float | None = None
        writes = -1
        while True:
            head = await self.head()
            last = await self.last_seq()
            now_writes = self.coordinator.stats.kv_writes
            if head is not None and head.seq >= last and now_writes == writes:
                since = since or time.monotonic()
                if time.monotonic() - since >= quiet_s:
                    return
            else:
                since = None
            writes = now_writes
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not catch up within {timeout_s} s")
            await asyncio.sleep(POLL_S)

    def timeout_s(self) -> float:
        return 60 + self.layout.world_size * 7 / 500  # (at worst 500 events/s folded)


# --- one measured job


@dataclass
class Checkpoint:
    step: int
    wall_s: float
    publish_s: float
    fold_lag_s: float
    cpu_s: float
    stream_msgs: int
    sim_events: int
    deliveries: int
    kv_writes: int
    kv_bytes: int
    floor_writes: int
    #: The first and last stream sequence of the checkpoint's messages.
    seqs: tuple[int, int] = (0, 0)


async def _measured_job(d: Driver, steps: int) -> list[Checkpoint]:
    from tierpipe.schemas.jobstate import Keep

    await d.start(Keep(nvme_keep_latest_k=KEEP_NVME, s3_keep_latest_k=KEEP_S3))
    out = []
    for step in range(1, steps + 1):
        cpu0 = d.coordinator.cpu_s()
        del0 = _deliveries(d.monitor_url)
        seq0, sim0 = await d.last_seq(), d.publisher.count
        kv0 = d.coordinator.stats.snapshot()
        t0 = time.perf_counter()
        await d.checkpoint(step)
        t1 = time.perf_counter()
        await d.wait_complete(step, d.timeout_s())
        t2 = time.perf_counter()
        await d.wait_quiet(d.timeout_s())
        await d.apply_floors()
        await d.wait_quiet(d.timeout_s())
        t3 = time.perf_counter()
        cpu1 = d.coordinator.cpu_s()
        del1 = _deliveries(d.monitor_url)
        kv1 = d.coordinator.stats.snapshot()
        seq1 = await d.last_seq()
        ckpt = Checkpoint(
            step=step, wall_s=t3 - t0, publish_s=t1 - t0, fold_lag_s=t2 - t1, cpu_s=cpu1 - cpu0,
            stream_msgs=seq1 - seq0, sim_events=d.publisher.count - sim0,
            deliveries=_delivered_since(del0, del1), kv_writes=kv1[0] - kv0[0],
            kv_bytes=kv1[1] - kv0[1], floor_writes=kv1[2] - kv0[2], seqs=(seq0 + 1, seq1),
        )  # fmt: skip
        log(f"  step {step}: {ckpt.stream_msgs} msgs, publish {ckpt.publish_s:.2f} s, fold lag "
            f"{ckpt.fold_lag_s:.2f} s, coordinator cpu {ckpt.cpu_s:.3f} s, "
            f"{ckpt.deliveries} deliveries, {ckpt.kv_writes} kv writes ({ckpt.kv_bytes} B), "
            f"wall {ckpt.wall_s:.1f} s")  # fmt: skip
        out.append(ckpt)
    return out


def _over_receive(
    timed: list[Checkpoint], received: list[tuple[int, float]]
) -> dict[str, float | None]:
    """`coordinator_cpu_over_receive` (`_lo`, `_hi`): per steady checkpoint, the coordinator's
    CPU over its messages' receive CPU; the median of those ratios and its 90 % interval
    (`bench.paired`: one pair per checkpoint, the same messages on both sides)."""
    pairs = [(s, c.cpu_s) for c, (_, s) in zip(timed, received, strict=True) if s > 0]
    return ratio_keys("coordinator_cpu_over_receive", pairs)


def _steady(ckpts: list[Checkpoint]) -> list[Checkpoint]:
    """The steady-state checkpoints (step 3 on), or all of them when there are fewer."""
    return [c for c in ckpts if c.step >= 3] or ckpts


async def _history_job(d: Driver, steps: int) -> None:
    """A job of `steps` checkpoints published at pace (at most `HISTORY_LAG_STEPS` ahead of the
    fold), with the nodes applying the floors as stored before each."""
    await d.start(None)  # (the settings' default retention)
    ends: dict[int, int] = {}
    for step in range(1, steps + 1):
        await d.apply_floors()
        await d.checkpoint(step)
        ends[step] = d.publisher.last_seq
        await d.wait_folded(ends.get(step - HISTORY_LAG_STEPS, 0), d.timeout_s())
    await d.wait_complete(steps, d.timeout_s())
    await d.wait_quiet(d.timeout_s())
    await d.apply_floors()
    await d.wait_quiet(d.timeout_s())


async def _history_reads(jobs: dict[int, Driver]) -> dict[str, float]:
    """The median time to read each job's restart state, the jobs' reads interleaved (so a
    drift of the machine or the server over the run weighs on each alike)."""
    times: dict[int, list[float]] = {n: [] for n in jobs}
    found: dict[int, tuple[int, int]] = {}
    for _ in range(HISTORY_READS):
        for n, d in jobs.items():
            t0 = time.perf_counter()
            found[n] = await _restart_read(d.store.kv, d.job)
            times[n].append(time.perf_counter() - t0)
    out = {}
    for n, d in jobs.items():
        out[str(n)] = s = statistics.median(times[n])
        log(f"  history {n} steps ({d.publisher.count} events): restart read {found[n][0]} B, "
            f"{found[n][1]} records, {s * 1e3:.2f} ms")  # fmt: skip
    return out


async def _replay(d: Driver) -> tuple[list[tuple[int, Event]], float]:
    from nats.js import api

    from tierpipe.bus import history
    from tierpipe.names import job_subjects

    assert d.bus.nc is not None
    t0 = time.perf_counter()
    stored = await history.collect(
        d.bus.nc, d.bus.js, d.bus.stream(job_subjects(d.job)), job_subjects(d.job),
        api.DeliverPolicy.ALL,
        seqs=True, timeout=d.settings.request_timeout_s,
    )  # fmt: skip
    return stored, time.perf_counter() - t0


# --- a restart through the real agreement protocol


class _NoNvme:
    """A simulated rank's NVMe store: its copies are not on this machine (`locate` names paths
    under an empty folder), so every rank's disk check finds none."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def locate(self, job: str, step: int, rank: int, world_size: int) -> str:
        from tierpipe.names import shard_relpath

        # (as `NvmeStore.locate`; a string join, not pathlib: 80k ranks call it in one process)
        return f"{self.root}/{shard_relpath(job, step, rank, world_size)}"


@dataclass
class _Loaded:
    state: Any = None


class _SimLoader:
    """The part of `tierpipe.recovery.load.Loader` a `Restorer` uses, without tensors: loading
    a shard is instant and notes when this rank had its plan."""

    def __init__(self, layout: Layout, rank: int, nvme: _NoNvme, planned: dict[int, float]):
        self.job, self.rank, self.world_size = layout.job, rank, layout.world_size
        self.node = layout.node_of(rank)
        self.nvme = nvme
        self._planned = planned

    async def first_good(
        self, sources: list[Any], into: Any, *, step: int, attempt: int, deadline: float
    ) -> tuple[Any, _Loaded] | str:
        self._planned.setdefault(self.rank, time.monotonic())
        return (sources[0], _Loaded()) if sources else "no sources"

    async def report(self, tier: str, step: int, e: Exception, **kw: Any) -> None:
        raise AssertionError(f"rank {self.rank}: copy of step {step} on {tier} failed: {e}")

    def settle(self, step: int | None) -> None:
        pass


#: Requests (KV gets, direct gets, publishes) the simulated ranks have in flight at once: one
#: client taking tens of thousands at once would time them out in its own queue, where real
#: ranks each send a few from their own process.
IN_FLIGHT_REQUESTS = 256


class _Throttled:
    """`target` (a `Bus` or a KV `Bucket`), with at most `IN_FLIGHT_REQUESTS` of the simulated
    ranks' requests in flight (the rest pass through)."""

    THROTTLED = frozenset({"get", "last_raw", "publish"})

    def __init__(self, target: Any, slots: asyncio.Semaphore, counts: Counter[str]) -> None:
        self._target, self._slots, self._counts = target, slots, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self.THROTTLED:
            return attr

        async def throttled(*args: Any, **kwargs: Any) -> Any:
            self._counts[name] += 1
            async with self._slots:
                return await attr(*args, **kwargs)

        return throttled


async def _throttled(bus: Bus, settings: Settings, counts: Counter[str]) -> tuple[Any, JobStore]:
    """The bus and a job store for the simulated ranks (see `_Throttled`), their requests
    counted in `counts` by method (`get`: KV, `last_raw`: direct get, `publish`)."""
    from tierpipe.control.kvstate import JobStore

    slots = asyncio.Semaphore(IN_FLIGHT_REQUESTS)
    store = await JobStore(bus.js, settings).open()
    store._kv = _Throttled(store.kv, slots, counts)  # type: ignore[assignment]
    return _Throttled(bus, slots, counts), store


def _timed_restorer(
    planned: dict[int, float], counts: Counter[str], before_plan: Counter[str]
) -> type[Restorer]:
    """`Restorer`, noting in `planned` when each rank got the plan it loads (before it reads
    what it needs to load it: the plan step's record and digest chunk), and in `before_plan`
    the requests `counts` held when the first rank got it."""
    from tierpipe.recovery.agree import Restorer

    class Timed(Restorer):
        async def load_planned(self, plan: Any, round_: int) -> Any:
            if not planned:
                before_plan.update(counts)
            planned.setdefault(self.rank, time.monotonic())
            return await super().load_planned(plan, round_)

    return Timed


#: Processes the simulated ranks of a restart run in, from `RESTART_PROCS_FROM` nodes on (this
#: one, with rank 0, and the others spawned; the nodes split evenly): one process cannot drive
#: tens of thousands of ranks' requests through nats-py in time, real ranks each have their own.
RESTART_PROCS = 2
RESTART_PROCS_FROM = 1000
#: The request timeout of the simulated ranks' connections (see `_restart`).
RANK_REQUEST_TIMEOUT_S = 120.0


@dataclass
class _Part:
    """What one process's simulated ranks did (times on the machine's monotonic clock)."""

    ranks: int
    #: When the first and the last of them got the plan they loaded; how many did.
    planned: tuple[float, float, int]
    #: When the last of them knew its sources; how many did.
    loading: tuple[float, int]
    #: (step, from_s3 bitmap, rounds) of what they restored.
    plans: set[tuple[int, bytes, int]]
    from_s3_ranks: int
    #: Their requests by method (see `_throttled`): in all, and before the first had the plan.
    requests: dict[str, int] = field(default_factory=dict)
    requests_before_plan: dict[str, int] = field(default_factory=dict)
    error: str = ""


async def _run_ranks(
    bus: Bus, settings: Settings, layout: Layout, ranks: range, restart: str, nvme_root: Path
) -> _Part:
    """The simulated `ranks` of `layout`, each through the real `Restorer` (see `_restart`)."""
    nvme = _NoNvme(nvme_root)
    planned: dict[int, float] = {}
    loading: dict[int, float] = {}
    counts: Counter[str] = Counter()
    before_plan: Counter[str] = Counter()
    timed = _timed_restorer(planned, counts, before_plan)
    rpn = layout.ranks_per_node
    throttled, store = await _throttled(bus, settings, counts)

    async def one(rank: int) -> Any:
        loader: Any = _SimLoader(layout, rank, nvme, loading)
        restorer = timed(
            throttled, settings, store, loader, restart=restart, local_rank=rank % rpn,
            local_world_size=rpn,
        )  # fmt: skip
        return await restorer.run()

    # The cyclic collector off while they run: tens of thousands of simulated ranks in one heap
    # make each full collection scan all of them (a real rank's heap is its own).
    gc.collect()
    gc.disable()
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(rank)) for rank in ranks]
    finally:
        gc.enable()
    results = [t.result() for t in tasks]
    times = list(planned.values())
    return _Part(
        ranks=len(ranks),
        planned=(min(times, default=0.0), max(times, default=0.0), len(times)),
        loading=(max(loading.values(), default=0.0), len(loading)),
        plans={(r.step, r.s3_bitmap, r.rounds) for r in results},
        from_s3_ranks=len(results[0].from_s3) if results else 0,
        requests=dict(counts),
        requests_before_plan=dict(before_plan),
    )


def _restart_proc(
    env: dict[str, str], layout: Layout, ranks: range, restart: str, nvme_root: Path,
    go: Any, out: Any,
) -> None:  # fmt: skip
    """A spawned process's part of the restart: connect, say so, wait for `go`, run `ranks`."""
    from tierpipe.log import configure_logging

    configure_logging("warning", "json", only_if_unconfigured=True)

    async def main() -> _Part:
        from tierpipe.bus.client import Bus
        from tierpipe.settings import load_settings

        settings = load_settings(path=None, env=env)
        async with Bus(settings, name=f"bench-ranks-{ranks.start}") as bus:
            out.put("connected")
            await asyncio.to_thread(go.wait)
            return await _run_ranks(bus, settings, layout, ranks, restart, nvme_root)

    try:
        out.put(asyncio.run(main()))
    except BaseException as e:
        out.put(_Part(len(ranks), (0.0, 0.0, 0), (0.0, 0), set(), 0, error=repr(e)))


async def _restart(d: Driver, work: Path, procs: int = 1) -> dict[str, Any]:
    """Every simulated rank restores through the real `Restorer` as its node's torchrun would
    start it (local rank and local world size): node leaders survey the real KV for their
    node's ranks and publish real `ready` reports; rank 0 collects them on its watch, picks
    with `choose` and publishes the compact plan; every rank takes it from its own core
    subscription (a catch-up read only if none came within `restore_plan_poll_s`), reads what it
    loads, "loads" and reports `loaded`; rank 0 publishes the final plan. The nodes are split
    over `procs` processes (this one has rank 0), each with its own connection. See the module
    docstring."""
    import multiprocessing

    from tierpipe.bus.client import Bus
    from tierpipe.names import plan_subject, shard_subject
    from tierpipe.schemas import decode_event, encode_event

    lay = d.layout
    restart = f"bench-{time.time_ns()}"
    cut = [lay.nodes * i // procs * lay.ranks_per_node for i in range(procs + 1)]
    parts = [range(cut[i], cut[i + 1]) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    # A simulated rank's request waits in its process's loop behind tens of thousands of other
    # ranks' work (a real rank's would not): the request timeout of the ranks' connections is
    # `RANK_REQUEST_TIMEOUT_S`, theirs alone.
    settings = d.settings.replace(
        request_timeout_s=max(d.settings.request_timeout_s, RANK_REQUEST_TIMEOUT_S)
    )
    env = settings.as_env()
    children = [
        ctx.Process(target=_restart_proc, args=(env, lay, part, restart, work / "no-nvme", go, out))
        for part in parts[1:]
    ]
    for child in children:
        child.start()
    try:
        for _ in children:  # (started and connected before the clock starts)
            assert await asyncio.to_thread(out.get, True, 120) == "connected"
        t0 = time.monotonic()
        go.set()
        async with Bus(settings, name="bench-ranks-0") as bus:
            mine = await _run_ranks(bus, settings, lay, parts[0], restart, work / "no-nvme")
        found = [mine] + [await asyncio.to_thread(out.get, True, 1800) for _ in children]
        restore_s = time.monotonic() - t0
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    errors = [p.error for p in found if p.error]
    if errors:
        raise RuntimeError(f"a process of simulated ranks failed: {errors}")
    plans = set().union(*(p.plans for p in found))
    (step, _, rounds) = next(iter(plans))
    planned = sum(p.planned[2] for p in found)
    loaded = sum(p.loading[1] for p in found)
    plan_msg = await d.bus.last_raw(plan_subject(lay.job))
    reports = await d.bus.history(shard_subject(lay.job, "restore", lay.node_of(0), 0))
    ready = [len(encode_event(e)) for e in reports if getattr(e, "phase", "") == "ready"]
    final = decode_event(plan_msg[1]) if plan_msg else None
    return {
        "plan_s": max(p.planned[1] for p in found) - t0 if planned == lay.world_size else None,
        "sources_s": max(p.loading[0] for p in found) - t0 if loaded == lay.world_size else None,
        "first_plan_s": min(p.planned[0] for p in found) - t0,
        "restore_s": restore_s,
        "processes": procs,
        "ranks_planned": planned,
        "same_plan": len(plans) == 1,
        "step": step,
        "from_s3_ranks": found[0].from_s3_ranks,  # (one rank's list: listed on demand)
        "rounds": rounds,
        "final_plan": bool(final is not None and getattr(final, "final", False)),
        "requests_per_node": _per_node([p.requests for p in found], lay.nodes),
        "requests_per_node_before_plan": _per_node(
            [p.requests_before_plan for p in found], lay.nodes
        ),
        "plan_msg_bytes": len(plan_msg[1]) if plan_msg else None,
        "ready_msg_bytes": max(ready, default=None),
    }


#: Ranks of the synthetic fold that `fold_us_per_rank_event` times.
FOLD_RANKS = 8000


def _fold_us(world: int, ranks_per_node: int) -> float:
    """CPU µs per rank event of `JobState.apply`, on facts built beforehand (see the module
    docstring)."""
    from tierpipe.control.jobstate import JobState
    from tierpipe.schemas import ShardFlushed, ShardVerified, ShardWritten
    from tierpipe.schemas.facts import fact_of
    from tierpipe.schemas.jobstate import Keep

    facts = []
    for step in (1, 2):
        for rank in range(world):
            node = f"n{rank // ranks_per_node}"
            ident = ShardIdent(
                job="fold", node=node, ts=0.0, step=step, rank=rank, world_size=world
            )
            digest = f"{step:016x}{rank:016x}"
            path = f"/nvme/{node}/fold/step-{step}/rank-{rank}"
            facts += [
                fact_of(ShardWritten(**ident, nbytes=4096, header_digest=digest, path=path,
                                     tensors=1, seconds=0)),
                fact_of(ShardVerified(**ident, nbytes=4096, header_digest=digest, path=path,
                                      seconds=0)),
                fact_of(ShardFlushed(**ident, nbytes=4096, header_digest=digest, bucket="b",
                                     key=path, etag="e", checksum="c", seconds=0)),
            ]  # fmt: skip
    best = float("inf")
    for _ in range(3):
        state = JobState("fold", Keep(nvme_keep_latest_k=2, s3_keep_latest_k=1))
        gc.collect()
        t0 = time.process_time()
        for seq, fact in enumerate(facts, 1):
            state.apply(seq, fact)
        best = min(best, time.process_time() - t0)
    return best / len(facts) * 1e6


def _per_node(counts: list[dict[str, int]], nodes: int) -> dict[str, float]:
    """Requests by method per node, summed over the processes' `counts`."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return {k: round(v / nodes, 2) for k, v in sorted(total.items())}


def _old_restore(d: Driver, stored: list[tuple[int, Event]], read_s: float) -> dict[str, Any]:
    """Rank 0 of the old protocol: the catalog folded from the whole job stream, the plan, and
    the plan message every rank receives."""
    import msgspec

    from tests.oracle_catalog import Catalog
    from tests.oracle_plan import plan_recovery
    from tierpipe.control.bitmap import bitmap
    from tierpipe.schemas import RecoveryPlanned, encode_event

    t0 = time.perf_counter()
    catalog = Catalog()
    for _, event in stored:
        catalog.apply(event)
    fold_s = time.perf_counter() - t0
    lay = d.layout
    rank_nodes = {r: lay.node_of(r) for r in range(lay.world_size)}
    local = sorted(d.on_nvme)
    t0 = time.perf_counter()
    plan = plan_recovery(
        catalog, d.job, world_size=lay.world_size, alive=set(rank_nodes.values()),
        rank_nodes=rank_nodes, local_steps={r: local for r in range(lay.world_size)},
    )  # fmt: skip
    plan_s = time.perf_counter() - t0
    # Today's plan: the step and a bitmap (every rank reading object storage: its largest).
    msg = RecoveryPlanned(
        job=d.job, node=lay.node_of(0), ts=time.time(), restart="bench", round=1,
        step=plan.step, world_size=lay.world_size,
        from_s3=bitmap(range(lay.world_size), lay.world_size), rejected=plan.rejected,
    )  # fmt: skip
    return {
        "replay_s": read_s + fold_s,
        "replay_events": len(stored),
        "replay_bytes": sum(len(encode_event(e)) for _, e in stored),
        "plan_recovery_s": plan_s,
        "plan_step": plan.step,
        # The old plan listed every rank's sources (~400 B a rank).
        "old_plan_msg_bytes": len(msgspec.json.encode(plan.sources)),
        "plan_msg_bytes": len(encode_event(msg)),
    }


def _kv_equals_fold(
    state: JobState, head: bytes, floors: bytes, records: dict[int, bytes]
) -> list[str]:
    """Where the KV differs from `state` (empty: it equals it)."""
    import msgspec

    from tierpipe.schemas.jobstate import Floors, JobHead, decode_record

    problems = []
    if msgspec.json.decode(head, type=JobHead) != state.head():
        problems.append(f"head: kv {head!r} != fold {state.head()}")
    if msgspec.json.decode(floors, type=Floors) != state.floors():
        problems.append(f"floors: kv {floors!r} != fold {state.floors()}")
    want = state.records()
    if sorted(records) != sorted(want):
        problems.append(f"step keys: kv {sorted(records)} != fold {sorted(want)}")
    for step, value in records.items():
        if step in want and decode_record(value) != want[step]:
            problems.append(f"step {step}: kv differs from the fold")
    return problems


async def _check_kv(d: Driver, stored: list[tuple[int, Event]], keep: Any) -> list[str]:
    """The KV against a fresh fold of the job's stream as stored."""
    from tierpipe.control.jobstate import JobState
    from tierpipe.control.kvstate import floor_key, head_key
    from tierpipe.schemas import ShardEvent

    state = JobState(d.job, keep)
    made = await d.bus.stream_made(d.job)
    if made is not None:
        state.on_stream(*made)  # (as the coordinator: the head names the stream it counts in)
    for seq, event in stored:
        if not isinstance(event, ShardEvent):  # (what the coordinator reads: `state_subjects`)
            state.apply(seq, event)
    kv = d.store.kv
    records = {}
    prefix = f"{d.job}.step."
    for key in await _keys(kv):
        if key.startswith(prefix) and key[len(prefix) :].isdigit():  # (not `.ranks.<n>`)
            records[int(key[len(prefix) :])] = await _value(kv, key)
    head = await _value(kv, head_key(d.job))
    floors = await _value(kv, floor_key(d.job))
    return _kv_equals_fold(state, head, floors, records)


async def _value(kv: Bucket, key: str) -> bytes:
    entry = await kv.get(key)
    return entry.value if entry is not None else b""


async def _keys(kv: Bucket, tries: int = 3) -> list[str]:
    """The bucket's keys. (nats-py's `keys()` now and then finds none in a bucket that has
    thousands, as the server is loaded at 10,000 nodes: asked again.)"""
    for _ in range(tries - 1):
        if keys := await kv.keys():
            return keys
    return await kv.keys()


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


async def _main(
    work: Path,
    nodes: int,
    ranks_per_node: int,
    steps: int,
    history_steps: Sequence[int],
    old_restore: bool,
    profile: bool,
    restart_procs: int,
) -> dict[str, Any]:
    from tierpipe.bus.client import Bus
    from tierpipe.control.kvstate import JobStore
    from tierpipe.dev import NatsServer
    from tierpipe.schemas.jobstate import Keep
    from tierpipe.settings import load_settings

    with NatsServer(work / "nats") as server:
        settings = load_settings(
            path=None, env={"TIERPIPE_NATS_URL": server.url, "TIERPIPE_LOG_LEVEL": "warning"}
        )
        async with Bus(settings, name="bench-agents") as bus:
            store = await JobStore(bus.js, settings).open()
            with CoordinatorProcess(settings, profile=profile) as coordinator:
                layout = Layout("control", nodes, ranks_per_node)
                d = Driver(settings, server.monitor_url, bus, store, coordinator, layout)
                log(f"control: {nodes} nodes x {ranks_per_node} ranks, {steps} steps")
                ckpts = await _measured_job(d, steps)
                coordinator.stop_profile()
                received = [
                    coordinator.receive(d.job, *c.seqs) for c in _steady(ckpts) if c.seqs[1]
                ]
                restart_bytes, restart_records = await _restart_read(store.kv, d.job)
                record_bytes = 0
                head = await d.head()
                if head is not None and head.steps:
                    record_bytes = len(await _value(store.kv, f"{d.job}.step.{head.steps[-1]}"))
                stored, read_s = await _replay(d)
                keep = Keep(nvme_keep_latest_k=KEEP_NVME, s3_keep_latest_k=KEEP_S3)
                problems = await _check_kv(d, stored, keep)
                for p in problems:
                    log(f"  KV != fold: {p}")
                old = _old_restore(d, stored, read_s) if old_restore else None
                del stored
                log(f"  restart: {layout.world_size} ranks through the agreement protocol")
                restart = await _restart(d, work, restart_procs)
                log(f"  restart: plan_s {restart['plan_s']}, restore_s {restart['restore_s']:.2f}")
                jobs = {}
                for n in history_steps:
                    hist = Layout(f"history{n}", HISTORY_NODES, ranks_per_node)
                    jobs[n] = Driver(settings, server.monitor_url, bus, store, coordinator, hist)
                    await _history_job(jobs[n], n)
                history = await _history_reads(jobs)
                stats = coordinator.stats
                published_max = stats.published_max_bytes
                kv_max = stats.kv_max_bytes
                removed = sum(job == d.job for job, _ in stats.removed)
    steady = _steady(ckpts)
    cpu = _mean([c.cpu_s for c in steady])
    receive_cpu = _mean([s for _, s in received])
    msgs = _mean([c.stream_msgs for c in steady])
    r = ranks_per_node
    stage = r + 3  # (see the module docstring: `staged` per rank, then the node's batches)
    coord = _mean([c.deliveries for c in steady])
    floor_watch = _mean([c.floor_writes for c in steady])
    restart_max = max(restart["plan_msg_bytes"] or 0, restart["ready_msg_bytes"] or 0)
    ratio = None
    if len(history_steps) == 2 and history[str(history_steps[0])] > 0:
        ratio = history[str(history_steps[1])] / history[str(history_steps[0])]
    result: dict[str, Any] = {
        "nodes": nodes,
        "ranks_per_node": r,
        "world_size": layout.world_size,
        "steps": steps,
        "steady_steps": [c.step for c in steady],
        "deliveries_per_ckpt_per_node": stage + coord / nodes + floor_watch,
        "stage_deliveries_per_ckpt_per_node": stage,
        "coordinator_deliveries_per_ckpt": coord,
        "coordinator_deliveries_per_ckpt_per_node": coord / nodes,
        "floor_watch_deliveries_per_ckpt_per_node": floor_watch,
        "trainer_core_deliveries_per_ckpt_per_node": _mean([c.sim_events for c in steady]) / nodes,
        "coordinator_cpu_s_per_ckpt": cpu,
        "coordinator_cpu_s_by_step": [round(c.cpu_s, 4) for c in ckpts],
        "coordinator_events_per_cpu_s": msgs / cpu if cpu else None,
        "receive_cpu_s_per_ckpt": receive_cpu,
        "receive_us_per_msg": 1e6 * receive_cpu / _mean([n for n, _ in received]),
        **_over_receive([c for c in steady if c.seqs[1]], received),
        "fold_us_per_rank_event": round(
            _fold_us(min(layout.world_size, FOLD_RANKS), ranks_per_node), 2
        ),
        "stream_msgs_per_ckpt": msgs,
        "fold_lag_s": ckpts[-1].fold_lag_s,
        "fold_lag_s_max": max(c.fold_lag_s for c in ckpts),
        "ckpt_wall_s": _mean([c.wall_s for c in steady]),
        "publish_s_per_ckpt": _mean([c.publish_s for c in steady]),
        "max_msg_bytes": max(d.publisher.max_bytes, published_max, kv_max, restart_max),
        "max_event_bytes": max(d.publisher.max_bytes, published_max, restart_max),
        "max_kv_value_bytes": kv_max,
        "kv_bytes_per_ckpt": _mean([c.kv_bytes for c in steady]),
        "kv_writes_per_ckpt": _mean([c.kv_writes for c in steady]),
        "restart_state_bytes": restart_bytes,
        "restart_records": restart_records,
        "record_bytes": record_bytes,
        "restart_s_history_ratio": ratio,
        "restart_s_history": history,
        "plan_s": restart["plan_s"],
        "restart": restart,
        "old_restore": old,
        "objects_removed_steps": removed,
        "kv_equals_fold": not problems,
        "msg_limit_bytes": MSG_LIMIT,
        "notes": (
            "plan_s: from the restart until every simulated rank had its plan, through the real "
            "Restorer (node leaders survey the KV for their node and publish one ready each, "
            "rank 0 chooses and publishes the compact plan, every rank takes it from its own "
            "core subscription; no NVMe copies on this machine, so every rank reads object "
            "storage; loading is instant); the simulated ranks share one connection per "
            f"process ({restart['processes']} processes). "
            "old_restore: rank 0's side of the old replay protocol on this job, for comparison. "
            "stage_deliveries_per_ckpt_per_node is a formula (ranks per node + 3: nvme-write "
            "per rank, then the node's batches to verify, flush and evict), the other "
            "deliveries are measured (/jsz). restart_s_history_ratio: restart-state read time "
            "after "
            f"{'/'.join(map(str, history_steps))} checkpoints of {HISTORY_NODES}-node jobs "
            "(default retention). Retention of the measured job: "
            f"{KEEP_NVME} on NVMe, {KEEP_S3} in object storage."
        ),
    }
    return result


def _print_profile(stats: pstats.Stats) -> None:
    """The coordinator thread's profile over the measured job, on stderr."""
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def run(
    nodes: int = 100,
    ranks_per_node: int = 8,
    steps: int = 5,
    *,
    history_steps: Sequence[int] = HISTORY_STEPS,
    old_restore: bool = True,
    profile: bool = False,
    restart_procs: int | None = None,
) -> dict[str, Any]:
    """Drive the control plane for `steps` checkpoints of `nodes` x `ranks_per_node` ranks;
    the figures of the module's docstring. `restart_procs`: processes the restart's simulated
    ranks run in (default `RESTART_PROCS` from `RESTART_PROCS_FROM` nodes on, else 1)."""
    from tierpipe.log import configure_logging

    if nodes < 1 or ranks_per_node < 1 or steps < 1:
        raise ValueError("nodes, ranks_per_node and steps must be >= 1")
    if restart_procs is None:
        restart_procs = RESTART_PROCS if nodes >= RESTART_PROCS_FROM else 1
    restart_procs = max(1, min(restart_procs, nodes))
    # structlog's defaults print to stdout, which must carry only the JSON line.
    configure_logging("warning", "json", only_if_unconfigured=True)
    with scratch_dir("control") as work:
        coro: Coroutine[Any, Any, dict[str, Any]] = _main(
            work,
            nodes,
            ranks_per_node,
            steps,
            history_steps,
            old_restore,
            profile,
            restart_procs,
        )
        return asyncio.run(coro)
