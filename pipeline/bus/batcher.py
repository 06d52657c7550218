"""A stage's outputs reported per node: one `NodeBatch` per job and kind, not an event per rank.

The runner hands each message's outputs to a `Batcher` and defers the message's ack to it. At
`flush()` (after every message that was itself a batch, and at the end of each fetch) the
batcher publishes the node's events of each job and kind as `NodeBatch` messages, which the next
stage and the job's coordinator consume: a delivery per node, whatever the ranks per node. Then
it acks the messages whose outputs they carry. Each event was already published on its own
rank's subject when the handler returned it (the trainers' save handles and operators read
those), so a batch is a second report of the same facts, never the only one: and the ack
comes after it, so a batch that could not be published (NATS down past the publish deadline)
gets its messages handed back and done again, never lost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import get_args

import structlog
from nats.aio.msg import Msg

from tierpipe.bus.client import Bus
from tierpipe.bus.consumer import quietly
from tierpipe.errors import TierpipeError
from tierpipe.schemas import BATCH_MAX, BatchKind, Event, NodeBatch, ShardEvent

__all__ = ("Batcher",)

log = structlog.get_logger(__name__)

_KINDS = frozenset(get_args(BatchKind))


class Batcher:
    """Outputs of the messages handled since the last `flush()`, and their pending acks."""

    def __init__(self, bus: Bus, *, id_suffix: str = "") -> None:
        self.bus, self.id_suffix = bus, id_suffix
        self._events: dict[tuple[str, str, str], list[Event]] = defaultdict(list)
        self._acks: list[Msg] = []

    def add(self, event: Event) -> None:
        """Report `event` (already published on its rank's subject) in its node's batch."""
        kind = type(event).__struct_config__.tag
        if kind in _KINDS and isinstance(event, ShardEvent):
            self._events[(event.job, event.node, str(kind))].append(event)

    def ack_later(self, msg: Msg) -> None:
        """Ack `msg` once the batches holding its outputs are out."""
        self._acks.append(msg)

    async def flush(self) -> None:
        """Publish the batches, then ack their messages (nak them if a batch could not go)."""
        events, acks = self._events, self._acks
        self._events, self._acks = defaultdict(list), []
        try:
            for (job, node, kind), found in events.items():
                for i in range(0, len(found), BATCH_MAX):
                    batch = NodeBatch(
                        job=job, node=node, ts=time.time(),
                        batch=kind,  # type: ignore[arg-type]  # (one of `BatchKind`)
                        events=found[i : i + BATCH_MAX],  # type: ignore[arg-type]
                    )  # fmt: skip
                    await self.bus.publish(batch, id_suffix=self.id_suffix)
        except TierpipeError as e:
            log.warning("batch_not_published", error=str(e), messages=len(acks))
            for msg in acks:
                await quietly(msg.nak())
            return
        for msg in acks:
            await quietly(msg.ack())
