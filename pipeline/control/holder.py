"""The lease holder's fate: whether the agent that holds a job's coordinator lease is gone.

A restart folds the job's newest events itself when the job has no live coordinator
(`tierpipe.recovery.survey.current_head`); a lease that has not run out yet says nothing of
whether its holder still lives, and waiting for it to run out costs up to `lease_ttl_s`. So the
holding agent's node record (`tierpipe.control.advert`: one direct get) is read, and the holder
counts as gone, its lease taken over at once (compare-and-set with a new term: a holder that was
only paused finds its next write refused, `LeaseLostError`), when:
- the record is its own process's (same pid and host, as the lease names them) and says that
  process stopped, or has been silent for `MISSED_BEATS` heartbeats; or its peer endpoint
  (`NodeRecord.peer_url`) refuses connections (the process that listened is gone);
- the record is another process's that runs the evict stage (the coordinator's), alive, and
  started after the holder's term began: a new agent of the node (an agent holds its node's
  evict lock, so two never run side by side).
Anything else (no record, one that cannot be read, a holder that is not an agent, an endpoint
that does not answer in time) shows nothing, and the lease is left to run out: a live holder
never loses its lease to this.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import structlog

from tierpipe.control.advert import read_node
from tierpipe.schemas.jobstate import Lease
from tierpipe.schemas.node import MISSED_BEATS, NodeRecord

if TYPE_CHECKING:
    from tierpipe.bus.client import Bus
    from tierpipe.control.kvstate import JobStore
    from tierpipe.settings import Settings

__all__ = ("agent_identity", "gone_reason", "holder_gone", "take_over")

log = structlog.get_logger(__name__)

#: How long a connection to the holder's peer endpoint may take before it shows nothing.
PROBE_S = 0.5
#: The stage whose agent coordinates the node's jobs (it runs the `Coordinator`).
COORDINATING_STAGE = "evict"


def agent_identity() -> tuple[int, str]:
    """(pid, host) of this process, as its node record names them (an agent's lease carries
    them)."""
    return os.getpid(), socket.gethostname()


def gone_reason(lease: Lease, record: NodeRecord | None, now: float) -> str:
    """Why the node record shows the lease's holder gone ("": it does not). Pure."""
    if not lease.pid or record is None or record.node != lease.holder:
        return ""
    if (record.pid, record.host) == (lease.pid, lease.host):
        if record.stopped_ts is not None:
            return f"its agent (pid {record.pid} on {record.host}) stopped"
        if not record.alive(now):
            return (
                f"its agent (pid {record.pid} on {record.host}) has been silent for "
                f"{record.silent_s(now):.0f} s ({MISSED_BEATS} heartbeats missed)"
            )
        return ""
    # (one that started before the term began is an older agent, whose record the holder has
    # not overwritten yet: it may not have stored its own)
    newer = record.started_ts > lease.since
    if newer and record.alive(now) and COORDINATING_STAGE in record.stages:
        return (
            f"another agent of node {record.node} runs (pid {record.pid} on {record.host}, "
            f"not the holder's pid {lease.pid} on {lease.host})"
        )
    return ""


async def holder_gone(bus: Bus, settings: Settings, lease: Lease) -> str:
    """Why the agent holding `lease` is gone ("": it is not shown gone). Never raises."""
    if not lease.pid:
        return ""
    state = await read_node(bus, settings, lease.holder)
    reason = gone_reason(lease, state.record, time.time())
    if reason or state.record is None:
        return reason
    r = state.record
    if (r.pid, r.host) == (lease.pid, lease.host) and r.peer_url:
        return await _refused(r.peer_url)
    return ""


async def _refused(url: str) -> str:
    """Why the holder's peer endpoint shows it gone: it refuses connections ("": it accepts
    one, or does not answer within `PROBE_S`, or the URL names no port)."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return ""
    with anyio.move_on_after(PROBE_S):
        try:
            stream = await anyio.connect_tcp(parts.hostname, parts.port)
        except OSError as e:
            # (anyio tries each address, and names what each refused as the cause)
            causes = getattr(e.__cause__, "exceptions", None) or [e.__cause__ or e]
            if all(isinstance(c, ConnectionRefusedError) for c in causes):
                return f"its peer endpoint {url} refuses connections"
            return ""
        await stream.aclose()
    return ""


async def take_over(
    bus: Bus, settings: Settings, store: JobStore, job: str, holder: str, *, agent: bool
) -> Lease | None:
    """Take the job's lease from a holder shown gone (`holder_gone`), as `holder` (`agent`:
    this process is the node's agent, and the lease names it); None when the lease is free
    of it, held by a live holder or one not shown gone, or taken by another first."""
    lease = await store.lease(job)
    if lease is None or lease.holder == holder or lease.expires <= time.time():
        return None  # (free, or ours: a plain acquire takes it)
    reason = await holder_gone(bus, settings, lease)
    if not reason:
        return None
    pid, host = agent_identity() if agent else (0, "")
    taken = await store.acquire(job, holder, settings.lease_ttl_s, pid=pid, host=host, gone=lease)
    if taken is not None:
        log.warning("lease_taken_over", job=job, holder=holder, gone=lease.holder,
                    term=taken.term, left_s=round(lease.expires - time.time(), 1),
                    reason=reason)  # fmt: skip
    return taken
