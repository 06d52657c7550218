"""The node advertisement: what a node's agent tells the trainers of its node.

An agent stores its node's record (`NodeRecord`: its staging and NVMe roots, the object store it
flushes to, never credentials; its pid and stages) in the KV bucket `<kv_bucket>-nodes` under
the node's name once its stages are bound, again every `node_heartbeat_s`, and marks it stopped
when it exits. A trainer reads its node's record (one direct get) on its first save or
restore:

- no record, a stopped one, or one three heartbeats old: no agent serves the node, and the
  trainer says so at once (its saves would wait for staging slots that never free);
- the roots and the store the record names are where the node keeps its copies: the trainer
  takes them for every such setting its own settings did not set (`adopt`), so a trainer whose
  environment lacks `source .tierpipe/env` still restores from the agent's NVMe, and warns
  about the ones it did set differently.

Reading never creates anything; a record that cannot be read (an outage, a server that does not
let this user read it) leaves both questions open, and nothing is claimed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.bus.kv import Bucket, BucketConfig, bind_bucket, open_bucket
from tierpipe.errors import BucketMissingError, TierpipeError
from tierpipe.names import local_jobs
from tierpipe.schemas.node import MISSED_BEATS, NodeRecord
from tierpipe.settings import Settings, explicit_fields

__all__ = (
    "ADOPTED",
    "NodeState",
    "adopt",
    "advertise",
    "bucket_name",
    "job_nodes",
    "live_nodes",
    "read_node",
)

log = structlog.get_logger(__name__)

#: The settings a trainer takes from its node's record unless it set them itself.
ADOPTED = ("staging_root", "nvme_root", "s3_endpoint", "s3_region", "s3_bucket", "s3_prefix")
#: Records of nodes whose agent is gone leave the bucket after this long.
_RECORD_TTL_S = 7 * 86400.0
_json = msgspec.json.Encoder()
#: How often the agent looks for jobs new to its node between heartbeats.
JOBS_SCAN_S = 1.0


def bucket_name(settings: Settings) -> str:
    """The KV bucket of the node records: `<kv_bucket>-nodes`."""
    return f"{settings.kv_bucket}-nodes"


# --- the agent's side


async def advertise(
    settings: Settings, bus: Bus, *, node: str, stages: Sequence[str], peer_url: str = "",
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Store `node`'s record now and every `node_heartbeat_s` until cancelled, then mark it
    stopped (unless another agent of the node wrote it since). Never raises: a record that
    cannot be stored is logged (once per cause) and tried again at the next beat. Started
    (`task_status`) once the first store was tried: an agent says it is ready after that, so
    a trainer started then finds the record.

    The record names the agent's peer endpoint (`peer_url`, "" without one), the node's
    failure domain, and the jobs it has copies of as of each beat (`local_jobs`): the nodes of a
    job, and so the partners of each (`tierpipe.peer.ring`), are the records that list it."""
    record = NodeRecord(
        node=node,
        pid=os.getpid(),
        host=socket.gethostname(),
        started_ts=time.time(),
        heartbeat_ts=time.time(),
        heartbeat_s=settings.node_heartbeat_s,
        stages=list(stages),
        staging_root=settings.staging_root,
        nvme_root=settings.nvme_root,
        s3_endpoint=_without_userinfo(settings.s3_endpoint),
        s3_region=settings.s3_region,
        s3_bucket=settings.s3_bucket,
        s3_prefix=settings.s3_prefix,
        peer_url=peer_url,
        failure_domain=settings.failure_domain,
    )
    kv: Bucket | None = None
    revision: int | None = None
    trouble = ""
    try:
        jobs = await _jobs(settings)
        while True:
            record = msgspec.structs.replace(record, heartbeat_ts=time.time(), jobs=jobs)
            try:
                kv = kv or await _open_bucket(bus, settings)
                revision = await kv.put(node, _json.encode(record))
                if trouble:
                    log.info("node_record_stored", node=node)
                trouble = ""
            except TierpipeError as e:
                if str(e) != trouble:
                    log.warning("node_record_not_stored", node=node, error=str(e))
                trouble = str(e)
            task_status.started()  # (after the first try; a no-op after)
            task_status = anyio.TASK_STATUS_IGNORED
            # The next beat, or sooner once the node takes part in another job (its partners
            # find it in the job's ring before its first shard is verified).
            next_beat = time.monotonic() + settings.node_heartbeat_s
            while (left := next_beat - time.monotonic()) > 0:
                await anyio.sleep(min(left, JOBS_SCAN_S))
                if (now_jobs := await _jobs(settings)) != jobs:
                    jobs = now_jobs
                    break
    finally:
        if kv is not None and revision is not None:
            stopped = msgspec.structs.replace(record, stopped_ts=time.time())
            # (another agent's record since: leave it)
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(2),
                contextlib.suppress(Exception),
            ):
                await kv.update(node, _json.encode(stopped), last=revision)


async def _jobs(settings: Settings) -> list[str]:
    return sorted(
        await anyio.to_thread.run_sync(local_jobs, settings.staging_root, settings.nvme_root)
    )


async def _open_bucket(bus: Bus, settings: Settings) -> Bucket:
    """The records' bucket, created if missing (by an agent: a trainer only reads, by direct
    get: no JetStream API request)."""
    config = BucketConfig(
        name=bucket_name(settings), replicas=settings.stream_replicas, ttl_s=_RECORD_TTL_S
    )
    return await open_bucket(bus.js, config)


def _without_userinfo(url: str | None) -> str | None:
    """An endpoint URL without credentials in it (a record never carries one)."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


# --- the trainer's side


@dataclass(frozen=True, slots=True)
class NodeState:
    """What a trainer learned of its node's agent."""

    node: str
    #: The record (None: there is none).
    record: NodeRecord | None
    #: Why it could not be read ("": it was, or there is none); then nothing is known.
    unknown: str = ""

    def absent(self, now: float | None = None) -> str:
        """Why no agent serves the node ("": one does, or nothing is known)."""
        if self.unknown:
            return ""
        if self.record is None:
            return f"no node agent alive for node {self.node} (none has advertised it)"
        r, now = self.record, time.time() if now is None else now
        if r.stopped_ts is not None:
            return (
                f"no node agent alive for node {self.node}: its agent (pid {r.pid} on "
                f"{r.host}) stopped {round(now - r.stopped_ts)} s ago"
            )
        if not r.alive(now):
            return (
                f"no node agent alive for node {self.node}: its agent (pid {r.pid} on "
                f"{r.host}) has not been heard from for {round(r.silent_s(now))} s (it "
                f"reports every {r.heartbeat_s:g} s; {MISSED_BEATS} missed count as gone)"
            )
        return ""


#: What to do about a node without an agent (for warnings).
HINT = (
    "start `tierpipe worker all` (or `tierpipe up`) on this node, with the same node name, "
    "staging root and NATS as this trainer"
)


async def read_node(bus: Bus, settings: Settings, node: str) -> NodeState:
    """`node`'s record, by one direct get (nothing is created). Never raises."""
    try:
        entry = await bind_bucket(bus.js, bucket_name(settings)).get(node)
    except BucketMissingError:
        return NodeState(node, None)  # (no bucket: no agent ever advertised a node)
    except TierpipeError as e:
        return NodeState(node, None, unknown=f"{type(e).__name__}: {e}")
    if entry is None:
        return NodeState(node, None)
    try:
        record = msgspec.json.decode(entry.value, type=NodeRecord)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        return NodeState(node, None, unknown=f"unreadable record: {e}")
    return NodeState(node, record)


async def job_nodes(
    bus: Bus, settings: Settings, job: str, *, silent_s: float | None = None
) -> list[NodeRecord]:
    """The records of the nodes whose agents list `job`, by name: those alive, or with
    `silent_s`, also those not stopped and heard from within `silent_s` (one read of the
    bucket; [] if there is none yet).

    Raises:
        BusUnavailableError: the bucket could not be read.
    """
    now, found = time.time(), []
    for record in await _records(bus, settings):
        recent = (
            silent_s is not None and record.stopped_ts is None and record.silent_s(now) <= silent_s
        )
        if job in record.jobs and (record.alive(now) or recent):
            found.append(record)
    return found


async def live_nodes(bus: Bus, settings: Settings) -> list[NodeRecord]:
    """The records of every node whose agent is alive, whatever jobs they list, by name (one
    read of the bucket; [] if there is none yet).

    Raises:
        BusUnavailableError: the bucket could not be read.
    """
    now = time.time()
    return [r for r in await _records(bus, settings) if r.alive(now)]


async def _records(bus: Bus, settings: Settings) -> list[NodeRecord]:
    """Every readable record in the bucket, by node name."""
    try:
        stored = await bind_bucket(bus.js, bucket_name(settings)).stored(">")
    except BucketMissingError:
        return []
    found = []
    for _, value in stored:
        try:
            found.append(msgspec.json.decode(value, type=NodeRecord))
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
    return sorted(found, key=lambda r: r.node)


def adopt(settings: Settings, record: NodeRecord) -> tuple[Settings, dict[str, object]]:
    """`settings` with every `ADOPTED` field they did not set taken from the node's record
    (logged as `node_settings_adopted`); the ones they set and the record says otherwise are
    kept and warned about (`node_settings_differ`). Returns the settings and what was taken."""
    explicit = explicit_fields(settings)
    taken: dict[str, object] = {}
    differ: dict[str, list[object]] = {}
    for name in ADOPTED:
        mine, theirs = getattr(settings, name), getattr(record, name)
        if mine == theirs:
            continue
        if name in explicit:
            differ[name] = [mine, theirs]
        else:
            taken[name] = theirs
    if taken:
        log.info("node_settings_adopted", node=record.node, fields=taken)
    if differ:
        log.warning(
            "node_settings_differ",
            node=record.node,
            fields=differ,
            hint="this process's own settings win (its saves and restores use them); the "
            "node's agent uses the others: unset them to use the agent's",
        )
    return (settings.replace(**taken) if taken else settings), taken
