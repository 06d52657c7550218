"""The resharded restore: a step saved by another world size (or mesh) loaded into this one.

`Checkpointer.restore` calls `restore_or_reshard`: with DTensor targets (or a `value_rank`), it
asks `Resharder.needed` whether the step to restore was saved by another number of ranks, or
with another layout than a DTensor target's (judged from the step's global layout, which its
record names, `tierpipe.reshard.steplayout`; for an older step, this rank's saved head read and
compared); if so,
`Resharder.run` restores it, else the normal restore does (in place, `tierpipe.recovery`). Every
rank then assembles its state from the saved shards (`tierpipe.reshard.assemble`: only the
blocks overlapping its new local shards, each checked).

The step: the newest one of the job state's candidates (`JobHead.candidates`) that is complete,
every saved rank with a verified copy counted on some tier (NVMe, a peer's replica, object
storage; `tierpipe.recovery.plan.counts`), or exactly the `step` asked for. With
torch.distributed initialised for this job (always so with DTensors), rank 0 chooses and
broadcasts its choice, every rank reports how its reads went (an all-gather), and if one found
no good copy of a part it needs, rank 0 chooses an older step and all read again. Without it,
every rank chooses from the job state by itself (the same records give the same step) and a
rank that finds no good copy raises: there is no way to move the others to an older step.
Copies proven bad are reported (`failed`), as the normal restore does.

Each saved rank's copies, best first: its file on this node's NVMe (where the job state counts
an NVMe copy and the file is there), the nodes that announced that very save (their `verified`
and `replicated` events, same header digest) through their peer endpoints, then its object
(where the job state counts one). Unlike the normal restore, nothing is written back to NVMe
(no whole shard is read) and the step is not pinned against retention while it is read (the
newest complete step of every tier is always kept).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import (
    EVIDENCE_ERRORS,
    LayoutMismatchError,
    NoCheckpointError,
    ShardMissingError,
    TierpipeError,
    WorldSizeMismatchError,
)
from tierpipe.names import shard_subject
from tierpipe.recovery.agree import Restored
from tierpipe.recovery.collective import Collective
from tierpipe.recovery.load import Expected
from tierpipe.recovery.plan import counts
from tierpipe.recovery.survey import Reads, current_head
from tierpipe.reshard.assemble import ValueRank, assemble, holds_dtensor
from tierpipe.reshard.reads import Origin, Tally, Tiers, read_parts
from tierpipe.reshard.steplayout import skeleton, stored_layout
from tierpipe.schemas import ShardReplicated, ShardVerified, SourceRef, StageFailed, Tier
from tierpipe.schemas.layout import StepLayout
from tierpipe.settings import Settings
from tierpipe.state import flatten_targets, layout_mismatch
from tierpipe.storage.nvme import NvmeStore
from tierpipe.storage.s3.keys import object_key
from tierpipe.tree import is_dtensor

__all__ = ("Resharder", "ValueRank", "restore_or_reshard")

log = structlog.get_logger(__name__)


async def restore_or_reshard(
    restore: Callable[[], Awaitable[Restored]],
    resharder: Callable[[], Resharder],
    into: Any,
    *,
    step: int | None,
    value_rank: ValueRank,
    replicated: frozenset[str] = frozenset(),
) -> Restored:
    """`Checkpointer.restore`'s choice: `resharder()`'s run where `into` holds a DTensor (or
    `value_rank` is given, or the job declares `replicated` keys) and the step was saved by
    another world size, a DTensor target's layout is not the saved one, or this rank's shard
    holds no bytes of a replica its writer stored (`Resharder.needed`), or the normal
    `restore()` raised that; else `restore()`'s (which, without DTensors and `value_rank`,
    raises WorldSizeMismatchError as before: a plain state saved by other ranks is refused
    unless the caller names a rule; and LayoutMismatchError for a replica stored elsewhere)."""
    if value_rank is None and not replicated and not holds_dtensor(into):
        return await restore()
    reshard = resharder()
    try:
        if not await reshard.needed(into, step):
            try:
                return await restore()
            except (WorldSizeMismatchError, LayoutMismatchError) as e:
                log.info("restore_resharded_instead", job=reshard.job, rank=reshard.rank,
                         why=f"{type(e).__name__}: {e}")  # fmt: skip
        return await reshard.run(into, step=step, value_rank=value_rank)
    finally:
        reshard.close()


class _Choice(msgspec.Struct, frozen=True):
    """Rank 0's choice, as broadcast: the step and the world size that saved it, or why none."""

    step: int = -1
    world_size: int = 0
    error: str = ""


class _Outcome(msgspec.Struct, frozen=True):
    """How one rank's reads went, as gathered: "" or the error's class and message."""

    kind: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class Saved:
    """What the job state says of the step to restore."""

    step: int
    world_size: int


class Resharder:
    """One rank's part of a resharded restore (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        store: JobStore,
        job: str,
        rank: int,
        world_size: int,
        node: str,
        collective: Collective | None = None,
    ) -> None:
        self.bus, self.settings, self.store = bus, settings, store
        self.job, self.rank, self.world_size, self.node = job, rank, world_size, node
        self._collective = collective
        self._reads = Reads(store, job)
        self._nvme = NvmeStore.from_settings(settings)

    async def needed(self, into: Any, step: int | None) -> bool:
        """Whether the step to restore (the newest complete one, or `step`) needs resharding
        into `into`: saved by another world size, or a DTensor target whose layout (global
        shape, mesh, placements, coordinate) is not the one this rank saved, or a replica this
        rank's shard holds no bytes of (judged from the step's layout; without one, this rank's
        head read; any rank's answer counts for all). False where nothing can be chosen (the
        normal restore says why)."""
        choice = await self._share(await self._choose(step, {}) if self._leads() else None)
        differs = ""
        if not choice.error:
            saved = Saved(choice.step, choice.world_size)
            if saved.world_size != self.world_size:
                return True
            layout = await self._layout(saved.step)
            judged = None if layout is None else self._judged(layout, into, saved)
            log.debug("reshard_checked", job=self.job, rank=self.rank, step=saved.step,
                      checked_from="header" if judged is None else "layout")  # fmt: skip
            try:
                if judged is None:
                    async with Tiers(self.settings, self.bus, node=self.node) as tiers:
                        origin = await self.origin(saved, self.rank, peers=False)
                        head = await read_parts(tiers, origin, lambda h: [], _skip, Tally())
                    mismatch = layout_mismatch(head.header, into)
                    judged = "" if mismatch is None else str(mismatch)
                differs = judged
            except TierpipeError as e:  # (the normal restore finds its copies, or says why)
                log.info("reshard_check_skipped", job=self.job, rank=self.rank, error=str(e))
        return any(o.kind for o in await self._gather(_Outcome(differs)))

    async def _layout(self, step: int) -> StepLayout | None:
        """The step's global layout, where its record names one the job state holds (None:
        an older step, ranks that disagreed, or a job state that did not answer)."""
        try:
            rec = await self._reads.record(step)
            if rec is None or not rec.layout:
                return None
            return await stored_layout(self.store, self.job, rec.layout)
        except TierpipeError as e:
            log.info("reshard_layout_unread", job=self.job, step=step, error=str(e))
            return None

    def _judged(self, layout: StepLayout, into: Any, saved: Saved) -> str | None:
        """What `layout_mismatch` says of this rank's saved shard, judged from the layout
        (the shard's sharded entries, `steplayout.skeleton`): "" where it fits `into` in
        place; None where the layout cannot tell (a DTensor target it does not name: the
        header says whether that was saved as a plain tensor; a rank not in a saved mesh)."""
        targets, _ = flatten_targets(into) if into is not None else ({}, [])
        paths = {t.path for t in layout.tensors}
        if any(is_dtensor(t) and path not in paths for path, t in targets.items()):
            return None
        try:
            header = skeleton(
                layout, job=self.job, step=saved.step, rank=self.rank,
                world_size=saved.world_size,
            )  # fmt: skip
        except LayoutMismatchError:
            return None
        mismatch = layout_mismatch(header, into)
        return "" if mismatch is None else str(mismatch)

    async def run(
        self, into: Any, *, step: int | None = None, value_rank: ValueRank = None
    ) -> Restored:
        """Choose the step, read this rank's parts of it into `into`, agree it went well.

        Raises:
            NoCheckpointError: no complete step (or `step` is not complete, or no good copy
                of a part was left on some rank).
            LayoutMismatchError: a saved tensor does not fit its target (on some rank).
        """
        t0 = time.perf_counter()
        excluded: dict[int, str] = {}
        for round_ in range(1, 100):
            choice = await self._share(
                await self._choose(step, excluded) if self._leads() else None
            )
            if choice.error:
                raise NoCheckpointError(
                    choice.error if self._leads() else f"rank 0: {choice.error}"
                )
            saved = Saved(choice.step, choice.world_size)
            done: _Result | TierpipeError
            tally = Tally()
            try:
                done = await self._assemble(saved, into, value_rank, tally)
                outcome = _Outcome()
            except (ShardMissingError, LayoutMismatchError) as e:
                done, outcome = e, _Outcome(type(e).__name__, str(e))
            finally:
                with anyio.CancelScope(shield=True):
                    await self._report_bad(saved, tally, round_)
            bad = [(r, o) for r, o in enumerate(await self._gather(outcome)) if o.kind]
            if isinstance(done, _Result) and not bad:
                restored = done
                seconds = time.perf_counter() - t0
                log.info("checkpoint_resharded", job=self.job, rank=self.rank, step=saved.step,
                         saved_world_size=saved.world_size, world_size=self.world_size,
                         values_from=restored.source.location, bytes_by_tier=tally.nbytes,
                         seconds=round(seconds, 3), rounds=round_)  # fmt: skip
                return Restored(
                    saved.step, restored.state, restored.source, b"", seconds, round_,
                    "nats" if self._collective is None else "torch.distributed",
                )  # fmt: skip
            if isinstance(done, TierpipeError) and (
                isinstance(done, LayoutMismatchError) or step is not None
            ):
                raise done
            layout = [(r, o) for r, o in bad if o.kind == "LayoutMismatchError"]
            if layout:
                raise LayoutMismatchError(f"rank {layout[0][0]}: {layout[0][1].message}")
            if step is not None:
                r, o = bad[0]
                raise NoCheckpointError(f"step {step}: rank {r}: {o.message}")
            excluded[saved.step] = f"rank {bad[0][0]}: {bad[0][1].message}"
            log.warning("reshard_step_abandoned", job=self.job, step=saved.step,
                        why=excluded[saved.step])  # fmt: skip
        raise NoCheckpointError(f"no step of job {self.job!r} could be read ({excluded})")

    async def _report_bad(self, saved: Saved, tally: Tally, round_: int) -> None:
        """Report every copy the reads proved bad (a digest, an identity), as the normal
        restore does (`Loader.report`): the job state stops counting it. Outages, missing
        copies and refusals are no verdict on a copy: only logged (`reshard_source_failed`)."""
        for rank, copy, e in tally.failed:
            if type(e).__name__ not in EVIDENCE_ERRORS:
                continue
            try:
                await self.bus.publish(
                    StageFailed(
                        job=self.job, node=copy.node or self.node, ts=time.time(),
                        stage="restore", error=type(e).__name__, message=str(e),
                        retryable=False, attempt=round_, step=saved.step, rank=rank,
                        world_size=saved.world_size, tier=copy.tier,
                    )
                )  # fmt: skip
            except TierpipeError as failed:
                log.warning("reshard_report_failed", job=self.job, error=str(failed))

    async def _assemble(
        self, saved: Saved, into: Any, value_rank: ValueRank, tally: Tally
    ) -> _Result:
        origins: dict[int, Origin] = {}

        async def origin(r: int) -> Origin:
            if r not in origins:
                origins[r] = await self.origin(saved, r)
            return origins[r]

        paths = [self._nvme.locate(self.job, saved.step, r, saved.world_size)
                 for r in range(saved.world_size)]  # fmt: skip
        found = await anyio.to_thread.run_sync(lambda: [os.path.exists(p) for p in paths])
        local = frozenset(r for r, there in enumerate(found) if there)
        async with Tiers(self.settings, self.bus, node=self.node) as tiers:
            got = await assemble(
                tiers, origin, into, rank=self.rank, old_world=saved.world_size,
                value_rank=value_rank, local=local, tally=tally,
                layout=await self._layout(saved.step),
            )  # fmt: skip
        by_tier = got.tally.nbytes
        tier = Counter(by_tier).most_common(1)[0][0] if by_tier else "nvme"
        value = origins[got.value_rank]
        source = SourceRef(
            tier=tier,  # type: ignore[arg-type]  # (a tally's tiers are a source's)
            node=self.node if tier == "nvme" else "",
            location=f"rank {got.value_rank} of {saved.world_size}",
            nbytes=sum(by_tier.values()),
            header_digest=value.expected.header_digest,
        )
        return _Result(got.state, source)

    async def origin(self, saved: Saved, rank: int, *, peers: bool = True) -> Origin:
        """Where saved `rank`'s shard of the step is, best first (see the module docstring;
        `peers=False`: not on peers, whose lookup reads the rank's event history)."""
        step, world = saved.step, saved.world_size
        digest = await self._reads.digest(step, rank)
        rec = await self._reads.record(step)
        if digest is None or rec is None:
            expected = Expected(self.job, step, rank, world, "0" * 32)
            return Origin(expected, 0, [])
        header_digest, nbytes = digest
        expected = Expected(self.job, step, rank, world, header_digest)
        nvme, s3, peer = counts(rec, rank)
        copies: list[SourceRef] = []

        def add(tier: Tier, node: str, location: str) -> None:
            copies.append(SourceRef(tier=tier, node=node, location=location, nbytes=nbytes,
                                    header_digest=header_digest))  # fmt: skip

        path = self._nvme.locate(self.job, step, rank, world)
        if nvme and await anyio.to_thread.run_sync(os.path.exists, path):
            add("nvme", self.node, path)
        # The node that saved it serves its own copy, partners their replicas.
        if peers and (nvme or peer):
            for node in await self._holders(saved, rank, header_digest):
                if node != self.node or not copies:
                    add("peer", node, node)
        if s3:
            key = object_key(self.settings.s3_prefix.strip("/"), self.job, step, rank, world)
            add("s3", "", f"s3://{self.settings.s3_bucket}/{key}")
        return Origin(expected, nbytes, copies)

    async def _holders(self, saved: Saved, rank: int, header_digest: str) -> list[str]:
        """The nodes that announced this save of `rank` (its writer first, then replicas)."""
        found: list[str] = []
        for kind in ("verified", "replicated"):
            for e in reversed(await self.bus.history(shard_subject(self.job, kind, "*", rank))):
                if (
                    isinstance(e, ShardVerified | ShardReplicated)
                    and (e.step, e.world_size, e.header_digest)
                    == (saved.step, saved.world_size, header_digest)
                    and e.node not in found
                ):
                    found.append(e.node)
        return found

    async def _choose(self, step: int | None, excluded: dict[int, str]) -> _Choice:
        """Rank 0's choice: the newest complete candidate step not excluded (or `step`)."""
        deadline = time.monotonic() + self.settings.restore_timeout_s / 4
        try:
            head = await current_head(
                self.bus, self.store, self.settings, job=self.job,
                holder=f"{self.node}-rank-{self.rank}", deadline=deadline,
            )  # fmt: skip
            if head is not None:
                self._reads.add(head)
            candidates = [step] if step is not None else head.candidates() if head else []
            why: list[str] = []
            for s in candidates:
                rec = await self._reads.record(s)
                if s in excluded:
                    why.append(f"step {s}: {excluded[s]}")
                elif rec is None:
                    why.append(f"step {s}: no record in the job state")
                elif lacking := [r for r in range(rec.world_size) if not any(counts(rec, r))]:
                    why.append(f"step {s}: {len(lacking)} of {rec.world_size} saved ranks have "
                               f"no copy (rank {lacking[0]}, ...)")  # fmt: skip
                else:
                    return _Choice(s, rec.world_size)
        except TierpipeError as e:
            return _Choice(error=f"{type(e).__name__}: {e}")
        return _Choice(error=f"no complete step of job {self.job!r} to reshard ("
                             + ("; ".join(why) or "no steps") + ")")  # fmt: skip

    def _leads(self) -> bool:
        return self._collective is None or self.rank == 0

    async def _share(self, choice: _Choice | None) -> _Choice:
        """Rank 0's `choice` on every rank (without a collective, this rank's own)."""
        if self._collective is None:
            assert choice is not None
            return choice
        data = msgspec.json.encode(choice) if choice is not None else None
        raw = await anyio.to_thread.run_sync(self._collective.broadcast, data)
        return msgspec.json.decode(raw, type=_Choice)

    async def _gather(self, outcome: _Outcome) -> list[_Outcome]:
        if self._collective is None:
            return [outcome]
        raw = await anyio.to_thread.run_sync(
            self._collective.all_gather, msgspec.json.encode(outcome)
        )
        return [msgspec.json.decode(b, type=_Outcome) for b in raw]

    def close(self) -> None:
        self._nvme.close()


def _skip(*_: object) -> None:
    """(nothing to take: only the head is read)"""


@dataclass(frozen=True, slots=True)
class _Result:
    state: Any
    source: SourceRef
