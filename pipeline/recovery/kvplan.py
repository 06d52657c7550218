"""The plan an operator is shown: what a restore would pick now, from the job state in KV alone.

`kv_plan` is the restore planner (`tierpipe.recovery.plan.choose`, what rank 0 of a restart
calls) over the head's candidate steps and their records, with an assumption about NVMe in place
of the look at each rank's disk a restart takes; `KvPlan` says the result for `tierpipe plan`
(text and `--json`), `tierpipe status` and the demo. The steps the rest of the job state does not
confirm are passed over and shown as such (`confirmed_plan` reads the digests and calls
`kv_plan`); `plan_now` reads the job state and plans, as `tierpipe plan` and the demo do.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tierpipe.bus.client import Bus
from tierpipe.control.bitmap import ranks_of
from tierpipe.control.confirm import check_step, claims
from tierpipe.control.folded import folded_head
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import NoCheckpointError
from tierpipe.names import shard_subject
from tierpipe.recovery.plan import choose, named_ranks, recorded
from tierpipe.schemas import ShardEvent, ShardEvicted, ShardReplicated
from tierpipe.schemas.jobstate import JobHead, StepRecord

__all__ = (
    "ASSUME_NVME_KEPT",
    "ASSUME_NVME_LOST",
    "KvPlan",
    "PlanJson",
    "confirmed_plan",
    "kv_plan",
    "node_ranks",
    "plan_now",
    "replica_ranks",
)

ASSUME_NVME_KEPT = (
    "assumes every rank's node still holds its NVMe copy; a restart also checks each rank's "
    "file on its own disk (size, header, digest) and sends a rank without a good one to "
    "object storage"
)
ASSUME_NVME_LOST = (
    "assumes every NVMe copy is lost (--nvme-lost), peer replicas with them (they live on NVMe): "
    "every rank reads object storage"
)
ASSUME_NODES_LOST = (
    "assumes the NVMe copies of the ranks {nodes} saved are lost (--lost-node), and the replicas "
    "they held: those ranks read a verified replica on a surviving node (peer) where there is "
    "one, else object storage, the others their own node's NVMe copy (a restart also checks each "
    "file on its disk)"
)

#: `tierpipe plan --json`: one JSON object (see `KvPlan.to_json`).
PlanJson = dict[str, int | str | list[int] | list[str] | dict[str, str]]


@dataclass(frozen=True, slots=True)
class KvPlan:
    """The step a restore would pick from the job state alone, and where its ranks read."""

    job: str
    step: int
    world_size: int
    #: Ranks that read object storage (the others their own node's NVMe copy), ascending.
    s3_ranks: list[int]
    #: The candidate steps considered, newest first.
    candidates: list[int]
    #: newer candidate step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)
    nvme_lost: bool = False
    #: newer candidate step -> why the job state does not back what its head says of it.
    unconfirmed: dict[int, str] = field(default_factory=dict)
    #: The nodes assumed lost with their NVMe (`--lost-node`).
    lost_nodes: tuple[str, ...] = ()
    #: Ranks that read a verified replica on a surviving node (the `peer` tier), ascending.
    peer_ranks: list[int] = field(default_factory=list)

    @property
    def from_nvme(self) -> int:
        return self.world_size - len(self.s3_ranks) - len(self.peer_ranks)

    def describe(self) -> str:
        """For operators: the step, the count per tier, the rejected steps, the assumption."""
        lines = [
            f"restore step {self.step} of job {self.job!r} ({self.world_size} ranks): "
            f"{self.from_nvme} from NVMe, {len(self.s3_ranks)} from object storage, "
            f"{len(self.peer_ranks)} from peers"
        ]
        if 0 < len(self.peer_ranks) < self.world_size:
            lines.append(f"  from peers: {named_ranks(self.peer_ranks)}")
        if 0 < len(self.s3_ranks) < self.world_size:
            lines.append(f"  from object storage: {named_ranks(self.s3_ranks)}")
        for step, why in sorted(self.unconfirmed.items(), reverse=True):
            lines.append(f"  step {step} unconfirmed (not planned): {why}")
        for step, why in sorted(self.rejected.items(), reverse=True):
            lines.append(f"  step {step} rejected: {why}")
        lines.append(f"  candidates: {', '.join(map(str, self.candidates))}")
        lines.append(f"  note: {self.assumption}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the step and the count per tier, and what the plan assumes of NVMe."""
        return (
            f"step {self.step}: {self.from_nvme} ranks from NVMe, {len(self.s3_ranks)} from "
            f"object storage, {len(self.peer_ranks)} from peers (`tierpipe plan` says why; "
            f"{self.assumption})"
        )

    @property
    def assumption(self) -> str:
        """What the plan assumes of NVMe, for operators."""
        if self.nvme_lost:
            return ASSUME_NVME_LOST
        if self.lost_nodes:
            return ASSUME_NODES_LOST.format(nodes=" and ".join(self.lost_nodes))
        return ASSUME_NVME_KEPT

    def to_json(self) -> PlanJson:
        """`tierpipe plan --json`."""
        return {
            "job": self.job,
            "step": self.step,
            "world_size": self.world_size,
            "from_nvme": self.from_nvme,
            "from_s3": len(self.s3_ranks),
            "s3_ranks": self.s3_ranks,
            "from_peer": len(self.peer_ranks),
            "peer_ranks": self.peer_ranks,
            "candidates": self.candidates,
            "rejected": {str(s): why for s, why in self.rejected.items()},
            "unconfirmed": {str(s): why for s, why in self.unconfirmed.items()},
            "assumes": "nvme_lost"
            if self.nvme_lost
            else "nodes_lost"
            if self.lost_nodes
            else "nvme_kept",
            "lost_nodes": list(self.lost_nodes),
        }


def kv_plan(
    job: str,
    candidates: Sequence[int],
    records: Mapping[int, StepRecord],
    *,
    nvme_lost: bool = False,
    lost_nodes: Sequence[str] = (),
    lost_ranks: Collection[int] = (),
    unconfirmed: Mapping[int, str] | None = None,
    replicas_lost: Collection[int] = (),
) -> KvPlan:
    """What a restart would pick among `candidates` (newest first, as a restart considers
    them), from their `records` alone: `choose` over every rank's steps as the records say
    them (`recorded`), NVMe assumed kept, lost (`nvme_lost`, every peer replica with it), or
    lost for `lost_ranks` (the ranks whose NVMe copies were on `lost_nodes`; `replicas_lost`:
    the ranks whose replica those nodes held). The world size is the newest candidate's (a
    restart of another size would be refused); steps of another size are rejected.
    `unconfirmed` (step -> why): candidates passed over, whatever their records say (the job
    state does not back them: `tierpipe.control.confirm`).

    Raises:
        NoCheckpointError: no candidate has a copy of every rank (says why, per step).
    """
    doubted = dict(unconfirmed or {})
    newest = next((records[s] for s in candidates if s in records and s not in doubted), None)
    if newest is None:
        why = [f"step {s}: unconfirmed: {w}" for s, w in doubted.items() if s in candidates]
        raise NoCheckpointError(
            f"job {job!r} has no {'confirmed ' if doubted else ''}step record in its job state"
            + (f" (candidates: {', '.join(map(str, candidates))})" if candidates else "")
            + (f" ({'; '.join(why)})" if why else "")
        )
    world = newest.world_size
    passed = {s: w for s, w in doubted.items() if s in candidates}
    considered = [s for s in candidates if s not in passed]
    lost: bool | Collection[int] = True if nvme_lost else lost_ranks
    reports, bad, notes, peer = recorded(
        considered, records, world, nvme_lost=lost, replicas_lost=replicas_lost
    )
    choice = choose(
        job, reports, world, candidates=considered, unusable=bad, notes=notes,
        passed={s: f"unconfirmed: {w}" for s, w in passed.items()}, peer=peer,
    )  # fmt: skip
    return KvPlan(
        job, choice.step, world, ranks_of(choice.from_s3), list(candidates), choice.rejected,
        nvme_lost, passed, tuple(lost_nodes), ranks_of(choice.from_peer),
    )  # fmt: skip


async def confirmed_plan(
    store: JobStore,
    job: str,
    head: JobHead,
    records: Mapping[int, StepRecord],
    *,
    step: int | None = None,
    nvme_lost: bool = False,
    lost_nodes: Sequence[str] = (),
    lost_ranks: Collection[int] = (),
    replicas_lost: Collection[int] = (),
) -> KvPlan:
    """`kv_plan` over `head`'s candidates (`records`: theirs, as read), each step it would pick
    confirmed first (`check_step`: every rank's digest, which a restore reads each copy
    against): one that is not is passed over, shown as unconfirmed, and the next planned. So is
    a step the head claims complete that has no record.

    Raises:
        NoCheckpointError: no candidate is confirmed and restorable (says why, per step).
        BusUnavailableError, BusError: the KV could not be read.
    """
    candidates = head.candidates(step)
    unconfirmed = {
        s: "the head says it is complete, but the step has no record (removed since?)"
        for s in candidates
        if s not in records and claims(head, s)
    }
    while True:
        plan = kv_plan(
            job, candidates, records, nvme_lost=nvme_lost, lost_nodes=lost_nodes,
            lost_ranks=lost_ranks, unconfirmed=unconfirmed, replicas_lost=replicas_lost,
        )  # fmt: skip
        why = await check_step(store, job, records[plan.step], plan.step, tiers=None)
        if not why:
            return plan
        unconfirmed[plan.step] = why


async def plan_now(
    bus: Bus,
    store: JobStore,
    job: str,
    *,
    step: int | None = None,
    nvme_lost: bool = False,
    lost_nodes: Sequence[str] = (),
) -> tuple[JobHead, int, KvPlan]:
    """What a restore of `job` would pick now (`tierpipe plan`, the demo): the job's head once
    folded (`folded_head`), its candidates' records, and `confirmed_plan` over them, with NVMe
    assumed kept, lost (`nvme_lost`), or lost on `lost_nodes` (the ranks those nodes saved,
    `node_ranks`). Returns (head, the stream seq of the job's newest event, the plan).

    Raises:
        ConfigError: the job has no state in KV.
        NoCheckpointError: `step` has no record, or no candidate is confirmed and restorable.
        BusUnavailableError, BusError: NATS or the KV could not be read.
    """
    head, stream_seq = await folded_head(bus, store, job)
    records = await store.records(job, head.candidates(step))
    if step is not None and step not in records:
        kept = ", ".join(map(str, head.steps)) or "none"
        raise NoCheckpointError(
            f"step {step} of job {job!r} has no record in its job state (the steps it keeps: "
            f"{kept})"
        )
    # (the ranks those nodes ran at the world size of the newest step with a record)
    world = next((records[s].world_size for s in head.candidates(step) if s in records), 0)
    lost_ranks = await node_ranks(bus, job, lost_nodes, world) if lost_nodes else []
    held = await replica_ranks(bus, job, lost_nodes, world) if lost_nodes else []
    # (steps the rest of the job state does not back are passed over, shown as such)
    plan = await confirmed_plan(
        store, job, head, records, step=step, nvme_lost=nvme_lost, lost_nodes=lost_nodes,
        lost_ranks=lost_ranks, replicas_lost=held,
    )  # fmt: skip
    return head, stream_seq, plan


async def node_ranks(bus: Bus, job: str, nodes: Iterable[str], world_size: int) -> list[int]:
    """The ranks of `job` at `world_size` that `nodes` ran (those of the nodes' events: the
    newest on each subject, a kind per rank, not the history; the job state does not record
    nodes), ascending. A node's events about the replicas it holds of other nodes' ranks
    (`replicated`, and their eviction) do not make those ranks its own.

    Raises:
        BusUnavailableError, BusError: NATS could not be read.
    """
    ranks: set[int] = set()
    for node in nodes:
        for _, event in await bus.latest(shard_subject(job, "*", node, "*")):
            if (
                isinstance(event, ShardEvent)
                and event.world_size == world_size
                and not _about_replica(event)
            ):
                ranks.add(event.rank)
    return sorted(ranks)


async def replica_ranks(bus: Bus, job: str, nodes: Iterable[str], world_size: int) -> list[int]:
    """The ranks of `job` at `world_size` whose replica `nodes` hold or held (their newest
    `replicated` event per rank, not the history; the job state counts a rank's replicas, not
    where they are), ascending: with those nodes lost, the planner counts no replica of these
    ranks. A replica is never on the node that saved its copy, so a lost node's own ranks are
    not among them unless a second lost node held theirs.

    Raises:
        BusUnavailableError, BusError: NATS could not be read.
    """
    ranks: set[int] = set()
    for node in nodes:
        for _, event in await bus.latest(shard_subject(job, "replicated", node, "*")):
            if isinstance(event, ShardReplicated) and event.world_size == world_size:
                ranks.add(event.rank)
    return sorted(ranks)


def _about_replica(event: ShardEvent) -> bool:
    """An event of a replica's holder about that replica (the rank is its source's)."""
    return isinstance(event, ShardReplicated) or (
        isinstance(event, ShardEvicted) and event.tier == "peer"
    )
