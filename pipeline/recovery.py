"""Recovery planning: which step to restore, and where each rank reads its shard from.

`plan_recovery` is a pure function of the catalog, the new run's world size, the nodes that
survived and the new run's rank -> node map. It picks the newest step for which every rank has a
verified copy it can reach: its own node's NVMe copy if that node survived and still holds it,
else the object-storage copy. Each rank gets its sources in order of preference, so a copy that
turns out bad at load time falls back to the next one; every newer step that could not be used is
listed with the reason, for operators (`tierpipe plan`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog

from tierpipe.bus import Bus
from tierpipe.catalog import EVIDENCE_ERRORS, Catalog, Copy, Shard
from tierpipe.collective import Collective
from tierpipe.errors import (
    ConfigError,
    NoCheckpointError,
    RestoreTimeoutError,
    SourceUnreachableError,
    StorageAuthError,
    TierpipeError,
    UnavailableError,
    WorldSizeMismatchError,
)
from tierpipe.names import SUBJECT_ROOT, plan_subject
from tierpipe.schemas import (
    RecoveryPlanned,
    RestoreReport,
    SourceRef,
    StageFailed,
    decode_event,
    encode_event,
)
from tierpipe.settings import Settings

log = structlog.get_logger(__name__)

#: The restart id when neither torchelastic nor the caller names one: ranks then match up by
#: stream order (a report counts only if published after this rank's `ready`).
_ANONYMOUS = "anonymous"
#: Tries of one source during an outage (the store down or hung) before this restore skips it.
_OUTAGE_TRIES = 3

__all__ = ["Plan", "Restored", "Restorer", "Source", "plan_recovery"]


Source = SourceRef


@dataclass(frozen=True, slots=True)
class Plan:
    job: str
    step: int
    world_size: int
    #: rank -> copies to try, best first.
    sources: dict[int, list[Source]]
    #: newer step -> why it could not be used.
    rejected: dict[int, str] = field(default_factory=dict)
    #: What operators should know about the chosen step (copies skipped as corrupt, ...).
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"restore step {self.step} of job {self.job!r} ({self.world_size} ranks)"]
        for rank, srcs in sorted(self.sources.items()):
            first = srcs[0]
            where = f"NVMe on {first.node}" if first.tier == "nvme" else "object storage"
            more = f" (then {len(srcs) - 1} fallback)" if len(srcs) > 1 else ""
            lines.append(f"  rank {rank}: {where}: {first.location}{more}")
        for step, why in sorted(self.rejected.items(), reverse=True):
            lines.append(f"  step {step} rejected: {why}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan_recovery(
    catalog: Catalog,
    job: str,
    *,
    world_size: int,
    alive: Collection[str],
    rank_nodes: Mapping[int, str],
    step: int | None = None,
    exclude: Collection[int] | Mapping[int, str] = (),
    local_steps: Mapping[int, Collection[int]] | None = None,
) -> Plan:
    """The newest restorable step (or exactly `step`) and every rank's sources.

    Args:
        alive: nodes that survived with their NVMe (a replaced node is not alive).
        rank_nodes: the new run's node for each rank.
        step: restore this step rather than the newest possible one.
        exclude: steps already found unusable in this restart (a rank had no loadable copy);
            a mapping gives the reason for each.
        local_steps: per rank, the steps whose NVMe copy that rank found on its node (checked on
            disk); when given, an NVMe copy counts only if it is listed.

    Raises:
        WorldSizeMismatchError: the newest checkpoint has another world size.
        NoCheckpointError: nothing restorable (the message says why for each step).
    """
    missing = set(range(world_size)) - set(rank_nodes)
    if missing:
        raise ConfigError(f"rank -> node map lacks ranks {sorted(missing)}")
    steps = catalog.steps(job)
    if not steps:
        raise NoCheckpointError(f"job {job!r} has no checkpoints in the event stream")
    if step is not None and step not in steps:
        raise NoCheckpointError(
            f"step {step} of job {job!r} was never saved; {_newest_saved(catalog, job)}"
        )
    rejected: dict[int, str] = {}
    candidates = sorted((s for s in steps if step is None or s == step), reverse=True)
    for s in candidates:
        shards = steps[s]
        if s in exclude:
            why = exclude[s] if isinstance(exclude, Mapping) else ""
            rejected[s] = f"a rank found no loadable copy in this restore ({why or 'see its log'})"
            continue
        # Only shards with a verified copy say which world size saved the step: a bogus event
        # must not turn into a world-size error.
        backed = [sh for sh in shards if any(c.usable for c in sh.copies.values())]
        if not backed:
            rejected[s] = "; ".join(_why_not(sh, sh.rank, "", alive) for sh in shards)
            continue
        saved_world = backed[0].world_size
        if saved_world != world_size:
            if not rejected and s == candidates[0]:
                raise WorldSizeMismatchError(
                    f"step {s} of job {job!r} was saved by {saved_world} ranks, this run has "
                    f"{world_size}; restore needs the same world size (no resharding yet)"
                )
            rejected[s] = f"saved with world size {saved_world}"
            continue
        by_rank = {sh.rank: sh for sh in shards if sh.world_size == world_size}
        sources: dict[int, list[Source]] = {}
        problems = []
        for rank in range(world_size):
            here = None if local_steps is None else s in local_steps.get(rank, ())
            found = _sources(by_rank.get(rank), rank_nodes[rank], alive, here)
            if found:
                sources[rank] = found
            else:
                problems.append(_why_not(by_rank.get(rank), rank, rank_nodes[rank], alive))
        if not problems:
            return Plan(job, s, world_size, sources, rejected, _notes(by_rank.values(), job))
        rejected[s] = "; ".join(problems)
    detail = "; ".join(f"step {s}: {why}" for s, why in rejected.items())
    raise NoCheckpointError(f"no restorable step of job {job!r} ({detail})")


def _newest_saved(catalog: Catalog, job: str, count: int = 5) -> str:
    done = catalog.complete_steps(job, ("nvme", "s3"))
    if not done:
        return "no step of it is complete on any tier"
    newest = ", ".join(map(str, reversed(done[-count:])))
    return f"the newest complete steps are {newest}"


def _sources(
    shard: Shard | None, node: str, alive: Collection[str], on_disk: bool | None
) -> list[Source]:
    if shard is None:
        return []
    out = []
    nvme = shard.copy("nvme", node)
    if nvme is not None and nvme.usable and node in alive and on_disk is not False:
        out.append(_ref(nvme, node))
    obj = shard.copy("s3")
    if obj is not None and obj.usable:
        out.append(_ref(obj, ""))
    return out


def _ref(copy: Copy, node: str) -> Source:
    return Source(
        tier=copy.tier,
        node=node,
        location=copy.location,
        nbytes=copy.nbytes,
        header_digest=copy.header_digest or "0" * 32,
    )


def _why_not(shard: Shard | None, rank: int, node: str, alive: Collection[str]) -> str:
    if shard is None:
        return f"rank {rank} never saved it"
    held = [
        f"{c.tier} on {c.node}" + (" (node gone)" if c.node not in alive else "")
        for (tier, _), c in shard.copies.items()
        if tier == "nvme" and c.usable
    ]
    states = [
        f"{c.tier}{'@' + c.node if c.node else ''}: "
        + (
            "superseded (a later run went back past it)"
            if c.superseded
            else "evicted"
            if c.evicted
            else _corrupt(c, shard.job)
            if c.corrupt
            else "unverified"
        )
        for c in shard.copies.values()
        if c.tier != "ram" and not c.usable
    ]
    reason = ", ".join(held + states + shard.doubts) or "no copy beyond RAM"
    where = f" (on {node})" if node else ""
    return f"rank {rank}{where} has no reachable verified copy [{reason}]"


def _corrupt(copy: Copy, job: str) -> str:
    why = copy.corrupt_reason or "a failed check"
    if len(why) > 160:
        why = why[:157] + "..."
    return f"marked corrupt ({why}; `tierpipe reindex --job {job}` re-checks it)"


def _notes(shards: Iterable[Shard], job: str) -> list[str]:
    """Copies of the chosen step the plan skipped as corrupt (a fallback took their place)."""
    return [
        f"rank {sh.rank}: {c.tier}{'@' + c.node if c.node else ''} skipped: {_corrupt(c, job)}"
        for sh in shards
        for c in sh.copies.values()
        if c.corrupt and not c.evicted
    ]


# --- one restart, as every rank runs it


@dataclass(frozen=True, slots=True)
class Restored:
    """What `Checkpointer.restore()` returns."""

    step: int
    state: Any
    #: Where this rank's shard came from.
    source: Source
    #: Every rank's planned sources (best first), as rank 0 decided.
    sources: dict[int, list[Source]]
    seconds: float
    #: Plans it took (more than 1: a copy was bad and every rank moved to an older step).
    rounds: int
    #: The sealed image when it was read from object storage (for the NVMe write-back).
    image: Any = None
    #: How the ranks agreed: "nats" (reports and plans on the stream) or "torch.distributed".
    agreement: str = "nats"


class Restorer:
    """Runs one rank's part of a restart on the bus thread's event loop.

    Every rank publishes `ready` (with the steps whose shard its node holds on NVMe). Rank 0
    waits for all of them, plans, and publishes the plan on `tp.<job>.plan`; every rank loads its
    shard from its first good source and reports `loaded` or `failed`. When all loaded, rank 0
    publishes the plan again as `final`; when one had no good copy left, rank 0 plans an older
    step (a new round) and all ranks load again. With a `collective` (torch.distributed), the
    reports are gathered and the plans broadcast through it instead of awaited on the stream,
    where they are still published.
    """

    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        *,
        job: str,
        rank: int,
        world_size: int,
        node: str,
        restart: str,
        load: Callable[[Source, int], Awaitable[tuple[Any, Any]]],
        collective: Collective | None = None,
    ) -> None:
        self.bus, self.settings = bus, settings
        self.job, self.rank, self.world_size, self.node = job, rank, world_size, node
        self.restart = restart
        self._load = load
        self._collective = collective
        self._deadline = 0.0

    async def run(self, *, step: int | None = None) -> Restored:
        t0 = time.perf_counter()
        self._deadline = time.monotonic() + self.settings.restore_timeout_s
        local = await anyio.to_thread.run_sync(self._local_steps, await self._catalog())
        if self._collective is not None:
            return await self._run_collective(local, step, t0)
        if self.rank == 0:
            window = await self._last_final_plan()
            await self._report("ready", local_steps=local)
            return await self._lead(step, window, t0)
        since, _ = await self._report("ready", local_steps=local)
        return await self._follow(since, t0)

    async def _catalog(self) -> Catalog:
        """The job's catalog as the stream stands now."""
        return await Catalog.replay(self.bus, self.job)

    def _plan(
        self,
        catalog: Catalog,
        reports: list[RestoreReport],
        step: int | None,
        excluded: dict[int, str],
        round_: int,
    ) -> Plan:
        """Rank 0's plan from every rank's `ready` report (its node, its local steps)."""
        rank_nodes = {r.rank: r.node for r in reports}
        plan = plan_recovery(
            catalog,
            self.job,
            world_size=self.world_size,
            alive=set(rank_nodes.values()),
            rank_nodes=rank_nodes,
            step=step,
            exclude=excluded,
            local_steps={r.rank: r.local_steps for r in reports},
        )
        log.info(
            "recovery_planned",
            job=self.job,
            step=plan.step,
            round=round_,
            rejected={str(k): v for k, v in plan.rejected.items()},
        )
        return plan

    async def _run_collective(self, local: list[int], step: int | None, t0: float) -> Restored:
        """The same protocol through torch.distributed collectives: every rank takes part in
        each gather and broadcast, so all ranks see the same reports and decide alike. Reports
        and plans are still published on the stream, for operators."""
        _, ready = await self._report("ready", local_steps=local)
        reports = await self._gather(ready)
        # Rank 0 plans from the stream as it stands once every rank reported (each reported
        # after its own saves were verified), never from a snapshot taken before.
        catalog = await self._catalog() if self.rank == 0 else Catalog()
        excluded: dict[int, str] = {}
        for round_ in itertools.count(1):
            planned, error = None, None
            if self.rank == 0:
                try:
                    plan = self._plan(catalog, reports, step, excluded, round_)
                    planned = self._planned(round_, plan, final=False)
                except (NoCheckpointError, ConfigError) as e:
                    planned, error = (
                        self._planned(round_, None, final=True, error=f"{type(e).__name__}: {e}"),
                        e,
                    )
                await self.bus.publish(planned)
            planned = await self._broadcast(planned)
            if error is not None:
                raise error
            if planned.error:
                _raise_plan_error(planned)
            mine, report = await self._load_planned(
                planned.step, planned.sources[self.rank], round_
            )
            failed = [r for r in await self._gather(report) if r.phase == "failed"]
            if not failed and mine is not None:
                if self.rank == 0:
                    await self.bus.publish(msgspec.structs.replace(planned, final=True))
                return self._restored(planned.step, mine, planned.sources, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[planned.step] = self._abandon(planned.step, failed)
        raise AssertionError("unreachable")

    async def _gather(self, report: RestoreReport) -> list[RestoreReport]:
        assert self._collective is not None
        raw = await anyio.to_thread.run_sync(self._collective.all_gather, encode_event(report))
        return [_decode(b, RestoreReport) for b in raw]

    async def _broadcast(self, plan: RecoveryPlanned | None) -> RecoveryPlanned:
        assert self._collective is not None
        data = encode_event(plan) if plan is not None else None
        raw = await anyio.to_thread.run_sync(self._collective.broadcast, data)
        return _decode(raw, RecoveryPlanned)

    async def _last_final_plan(self) -> int:
        """Stream seq of the last confirmed plan: reports before it belong to an older restart."""
        found = await self.bus.last_raw(plan_subject(self.job))
        if found is None:
            return 0
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            plan = decode_event(found[1])
            if isinstance(plan, RecoveryPlanned) and plan.final:
                return found[0]
        return 0

    def _local_steps(self, catalog: Catalog) -> list[int]:
        """Steps whose shard for this rank this node still has on NVMe (checked on disk)."""
        steps = []
        for s, shards in catalog.steps(self.job).items():
            for shard in shards:
                copy = shard.copy("nvme", self.node)
                if shard.rank == self.rank and copy is not None and copy.usable:
                    with contextlib.suppress(OSError):
                        if os.stat(copy.location).st_size == copy.nbytes:
                            steps.append(s)
        return steps

    async def _lead(self, step: int | None, window: int, t0: float) -> Restored:
        reports = list((await self._await_reports(window, round_=0)).values())
        # Plan from the stream as it stands now that every rank reported (each reported after
        # its own saves were verified), never from a snapshot taken when rank 0 arrived.
        catalog = await self._catalog()
        excluded: dict[int, str] = {}
        for round_ in itertools.count(1):
            try:
                plan = self._plan(catalog, reports, step, excluded, round_)
            except (NoCheckpointError, ConfigError) as e:  # tell the other ranks, then give up
                await self.bus.publish(
                    self._planned(round_, None, final=True, error=f"{type(e).__name__}: {e}")
                )
                raise
            published = await self.bus.publish(self._planned(round_, plan, final=False))
            mine, _ = await self._load_planned(plan.step, plan.sources[self.rank], round_)
            answers = await self._await_reports(published.seq, round_=round_)
            failed = [r for r in answers.values() if r.phase == "failed"]
            if not failed and mine is not None:
                await self.bus.publish(self._planned(round_, plan, final=True))
                return self._restored(plan.step, mine, plan.sources, round_, t0)
            # An explicit `step` stays the only candidate: the next plan then says why it failed.
            excluded[plan.step] = self._abandon(plan.step, failed)
        raise AssertionError("unreachable")

    def _abandon(self, step: int, failed: list[RestoreReport]) -> str:
        """Why every rank moves on from `step` (the failed ranks' own words), logged."""
        log.warning(
            "recovery_step_abandoned", step=step, failed_ranks=sorted(r.rank for r in failed)
        )
        return "; ".join(f"rank {r.rank}: {r.error}" for r in sorted(failed, key=lambda r: r.rank))

    async def _follow(self, since: int, t0: float) -> Restored:
        round_, mine, planned = 0, None, None
        while True:
            seq, plan = await self._await_plan(since, round_)
            if plan.error:
                _raise_plan_error(plan)
            if plan.final and plan.round == round_:
                assert mine is not None
                return self._restored(plan.step, mine, planned or plan.sources, round_, t0)
            round_, planned = plan.round, plan.sources
            mine, _ = await self._load_planned(plan.step, plan.sources[self.rank], round_)
            since = max(since, seq)

    async def _load_planned(
        self, step: int, sources: list[Source], round_: int
    ) -> tuple[tuple[Source, Any, Any] | None, RestoreReport]:
        """This rank's shard from its first good source (None if none), and its report.

        Only evidence (a digest or identity mismatch, a garbled file) is reported as a bad copy
        (`failed`, not retryable); a copy that is unreachable (an outage, retried a few times
        first), refused (credentials) or missing is skipped for this restore only (`failed`,
        retryable), so the next restore tries it again.
        """
        problems = []
        for source in sources:
            try:
                loaded, image = await self._load_retrying(step, source)
            except TierpipeError as e:
                evidence = type(e).__name__ in EVIDENCE_ERRORS
                message = str(e)
                if isinstance(e, StorageAuthError):
                    message += (
                        " (the trainer's own S3 credentials are used for restores: set "
                        "s3_access_key_id / s3_secret_access_key, or TIERPIPE_S3_*, for trainers)"
                    )
                log.warning(
                    "restore_source_failed",
                    step=step,
                    tier=source.tier,
                    location=source.location,
                    error=message,
                    corrupt=evidence,
                )
                problems.append(f"{source.tier}: {type(e).__name__}")
                await self.bus.publish(
                    StageFailed(
                        job=self.job,
                        node=self.node,
                        ts=time.time(),
                        stage="restore",
                        error=type(e).__name__,
                        message=message,
                        retryable=not evidence,
                        attempt=round_,
                        step=step,
                        rank=self.rank,
                        world_size=self.world_size,
                        tier=source.tier,
                    )
                )
                continue
            _, report = await self._report("loaded", round_=round_, step=step, tier=source.tier)
            return (source, loaded, image), report
        _, report = await self._report(
            "failed",
            round_=round_,
            step=step,
            error="no good copy left (" + (", ".join(problems) or "no sources") + ")",
        )
        return None, report

    async def _load_retrying(self, step: int, source: Source) -> tuple[Any, Any]:
        """Load `source`, retrying an outage a few times while the restore deadline allows
        (leaving the other ranks time to hear from this one)."""
        delay = self.settings.retry_base_s
        margin = min(30.0, self.settings.restore_timeout_s / 4)
        for attempt in itertools.count(1):
            left = self._deadline - margin - time.monotonic()
            try:
                with anyio.fail_after(max(left, 1.0)):
                    return await self._load(source, step)
            except TimeoutError as e:
                if isinstance(e, TierpipeError):
                    raise
                raise SourceUnreachableError(source.location) from e
            except UnavailableError as e:
                if attempt >= _OUTAGE_TRIES or delay > self._deadline - margin - time.monotonic():
                    raise
                log.warning(
                    "restore_source_unavailable",
                    step=step,
                    tier=source.tier,
                    location=source.location,
                    attempt=attempt,
                    retry_in_s=delay,
                    error=str(e),
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)
        raise AssertionError("unreachable")

    async def _report(
        self, phase: str, *, round_: int = 0, **fields: Any
    ) -> tuple[int, RestoreReport]:
        report = RestoreReport(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            rank=self.rank,
            world_size=self.world_size,
            phase=phase,
            round=round_,
            **fields,  # type: ignore[arg-type]
        )
        return (await self.bus.publish(report)).seq, report

    async def _await_reports(self, since: int, *, round_: int) -> dict[int, RestoreReport]:
        """Every rank's newest report of this restart for `round_` (any phase for round 0),
        published after stream seq `since`."""
        subject = f"{SUBJECT_ROOT}.{self.job}.restore.*.*"
        while True:
            found: dict[int, RestoreReport] = {}
            for seq, event in await self.bus.latest(subject):
                if (
                    isinstance(event, RestoreReport)
                    and event.restart == self.restart
                    and event.world_size == self.world_size
                    and (round_ == 0 or event.round == round_)
                    and seq > since
                ):
                    found[event.rank] = event
            if len(found) == self.world_size:
                return found
            self._check_deadline(f"{len(found)} of {self.world_size} ranks reported")
            await anyio.sleep(0.05)

    async def _await_plan(self, since: int, round_: int) -> tuple[int, RecoveryPlanned]:
        """The newest plan of this restart published after `since` that moves past `round_`."""
        while True:
            found = await self.bus.last_raw(plan_subject(self.job))
            if found is not None and found[0] > since:
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    plan = decode_event(found[1])
                    if (
                        isinstance(plan, RecoveryPlanned)
                        and plan.restart == self.restart
                        and (
                            plan.round > round_
                            or (plan.final and plan.round == round_)
                            or plan.error
                        )
                    ):
                        return found[0], plan
            self._check_deadline("no plan from rank 0")
            await anyio.sleep(0.05)

    def _check_deadline(self, what: str) -> None:
        if time.monotonic() > self._deadline:
            raise RestoreTimeoutError(self.job, self.restart, self.settings.restore_timeout_s, what)

    def _planned(
        self, round_: int, plan: Plan | None, *, final: bool, error: str = ""
    ) -> RecoveryPlanned:
        """The event for `plan`; without one, the final word that rank 0 gave up (`error`)."""
        return RecoveryPlanned(
            job=self.job,
            node=self.node,
            ts=time.time(),
            restart=self.restart,
            round=round_,
            step=plan.step if plan else 0,
            world_size=self.world_size,
            sources=plan.sources if plan else {},
            rejected=plan.rejected if plan else {},
            final=final,
            error=error,
        )

    def _restored(
        self,
        step: int,
        mine: tuple[Source, Any, Any],
        sources: dict[int, list[Source]],
        rounds: int,
        t0: float,
    ) -> Restored:
        source, loaded, image = mine
        return Restored(
            step,
            loaded.state,
            source,
            sources,
            time.perf_counter() - t0,
            rounds,
            image,
            agreement="nats" if self._collective is None else "torch.distributed",
        )


def _raise_plan_error(plan: RecoveryPlanned) -> None:
    """Raise on another rank the error rank 0 met while planning."""
    kind, _, message = (plan.error or "").partition(": ")
    error = WorldSizeMismatchError if kind == "WorldSizeMismatchError" else NoCheckpointError
    raise error(f"rank 0: {message}")


def _decode(data: bytes, kind: type[Any]) -> Any:
    event = decode_event(data)
    if not isinstance(event, kind):
        raise TypeError(f"expected a {kind.__name__} from the other ranks, got {type(event)}")
    return event
