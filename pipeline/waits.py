"""Long waits say so: what is waited for, why, and what to check, within seconds and again
while the wait lasts.

`Reminder` paces the warnings of one wait (`wait_warning_s`): a save waiting for a staging
slot (`Checkpointer.save`, with `slot_wait_reason` for the why), a restore waiting for the other
ranks or for rank 0's plan (`tierpipe.recovery.agree`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from tierpipe.schemas import StageFailed

__all__ = ("Reminder", "missing_ranks", "slot_wait_reason")


class Reminder:
    """When a wait that began now should warn next: after `every_s`, then every `every_s`."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.started = time.monotonic()
        self.next_at = self.started + every_s

    @property
    def waited_s(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def due(self) -> bool:
        """Whether to warn now (and if so, the next warning is `every_s` later)."""
        now = time.monotonic()
        if now < self.next_at:
            return False
        self.next_at = now + self.every_s
        return True


def slot_wait_reason(
    busy_steps: Iterable[int],
    *,
    no_agent: str,
    unpublished: str,
    failures: Mapping[int, StageFailed],
) -> str:
    """Why this rank's staging slots stay busy, as far as the trainer can see.

    Args:
        busy_steps: the steps the busy slots hold.
        no_agent: why no agent serves the node ("": one does, or unknown).
        unpublished: why a save's `staged` event is still not published ("": none).
        failures: the agent's newest failure report per busy step (retryable ones: it keeps
            trying, e.g. NVMe full).
    """
    steps = sorted(busy_steps)
    if no_agent:
        return f"{no_agent}: nothing frees the slots (they hold steps {steps})"
    if unpublished:
        return f"{unpublished}; the agent cannot see that save until it is"
    for step in steps:
        f = failures.get(step)
        if f is not None:
            again = "retrying" if f.retryable else "gave up"
            return f"the agent cannot write step {step} ({f.stage} {again}: {f.error}: {f.message})"
    return (
        f"the node's agent has not verified steps {steps} yet (slow NVMe, or see "
        "`tierpipe events --job <job> --kind failed`)"
    )


def missing_ranks(reported: Iterable[int], world_size: int, *, limit: int = 32) -> list[int]:
    """The ranks of `world_size` not in `reported` (the first `limit` of them)."""
    seen = set(reported)
    out: list[int] = []
    for rank in range(world_size):
        if rank not in seen:
            out.append(rank)
            if len(out) == limit:
                break
    return out
