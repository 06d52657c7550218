"""Agreement among a restart's ranks through torch.distributed, when the trainer initialised it.

Recovery's reports and plans are msgspec-encoded events (never pickled); these collectives move
their bytes as uint8 tensors: lengths first, then the padded payloads. With the NCCL backend the
tensors live on the rank's CUDA device (captured from the calling thread, since collectives run
on a helper thread), with gloo on the CPU. Collectives block until every rank of the group
calls them, under the process group's own timeout.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
import torch

from tierpipe.schemas import Event, RecoveryPlanned, RestoreReport, decode_event, encode_event
from tierpipe.state import tensor_buffer

__all__ = ("Collective",)

E = TypeVar("E", bound=Event)


class Collective:
    """The default torch.distributed group, for a job whose rank and world size it matches."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._device = device
        self.world_size = dist.get_world_size()

    @classmethod
    def from_torch(cls, rank: int, world_size: int) -> Collective | None:
        """The initialised default group if it is this job's (same rank and world size)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            return None
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(device)

    async def gather(self, report: RestoreReport) -> list[RestoreReport]:
        """Every rank's report, in rank order (the collectives run on a worker thread)."""
        raw = await anyio.to_thread.run_sync(self.all_gather, encode_event(report))
        return [_decode(b, RestoreReport) for b in raw]

    async def share(self, plan: RecoveryPlanned | None) -> RecoveryPlanned:
        """Rank 0's plan, on every rank (the others pass None)."""
        data = encode_event(plan) if plan is not None else None
        return _decode(await anyio.to_thread.run_sync(self.broadcast, data), RecoveryPlanned)

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order."""
        sizes = [self._length(0) for _ in range(self.world_size)]
        self._dist.all_gather(sizes, self._length(len(data)))
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        out = [
            torch.zeros(longest, dtype=torch.uint8, device=self._device)
            for _ in range(self.world_size)
        ]
        self._dist.all_gather(out, self._payload(data, longest))
        return [_bytes(t, n) for t, n in zip(out, lengths, strict=True)]

    def broadcast(self, data: bytes | None, *, src: int = 0) -> bytes:
        """Rank `src`'s `data` (None on the other ranks)."""
        size = self._length(len(data) if data is not None else 0)
        self._dist.broadcast(size, src)
        length = int(size.item())
        payload = self._payload(data or b"", length)
        self._dist.broadcast(payload, src)
        return _bytes(payload, length)

    def _length(self, n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int64, device=self._device)

    def _payload(self, data: bytes, n: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.uint8)
        if data:
            t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return t.to(self._device)


def _bytes(t: torch.Tensor, n: int) -> bytes:
    cpu = t[:n].cpu()
    return bytes(tensor_buffer(cpu))


def _decode(data: bytes, kind: type[E]) -> E:
    event = decode_event(data)
    if not isinstance(event, kind):
        raise TypeError(f"expected a {kind.__name__} from the other ranks, got {type(event)}")
    return event
