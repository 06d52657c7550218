"""A node's record, as its agent advertises it in KV (`tierpipe.control.advert`).

Key: the node name, in the bucket `<kv_bucket>-nodes`. What the trainers of the node need to
find the agent's copies and to tell whether an agent serves the node at all; never credentials.
Unknown fields are ignored, so a newer agent may say more.
"""

from __future__ import annotations

import msgspec

__all__ = ("NodeRecord",)

#: Heartbeats a record may miss before its agent counts as gone.
MISSED_BEATS = 3


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    pid: int
    host: str
    started_ts: float
    #: When the agent last stored the record (the node's clock: trainers share it).
    heartbeat_ts: float
    #: How often it stores it.
    heartbeat_s: float
    #: The stages it runs (`nvme-write`, `verify`, `flush`, `evict`).
    stages: list[str]
    staging_root: str
    nvme_root: str
    s3_endpoint: str | None
    s3_region: str
    s3_bucket: str
    s3_prefix: str
    #: The agent's peer endpoint (`http://host:port`, what other agents and restoring trainers
    #: fetch this node's copies and replicas from), "" when it serves none.
    peer_url: str = ""
    #: The node's failure-domain label (e.g. its rack): partners are chosen in another one.
    failure_domain: str = ""
    #: The jobs this node has copies of (a folder under its staging or NVMe root), as of the
    #: last heartbeat: the ring of a job's nodes is made of the records that list it.
    jobs: list[str] = []
    #: Set when the agent stopped (drained and exited): no agent serves the node since.
    stopped_ts: float | None = None

    def silent_s(self, now: float) -> float:
        """Seconds since the agent last stored its record."""
        return max(0.0, now - self.heartbeat_ts)

    def alive(self, now: float) -> bool:
        """Whether the agent runs: not stopped, and heard from within `MISSED_BEATS` beats."""
        return self.stopped_ts is None and self.silent_s(now) <= MISSED_BEATS * self.heartbeat_s
