"""The demo's trainer rank (`tierpipe demo --rank R`): a small language model that saves through
tierpipe, resumes after a restart, and reports what it did as JSON lines on stdout.

One process per rank, as torchrun starts them. With more than one rank the ranks train one model
with DDP over gloo (`MASTER_ADDR` / `MASTER_PORT` from the launcher). The data of every step is
a function of (rank, step) and dropout draws from the saved and restored RNG state, so a resumed
run computes every step exactly as the first run did: the demo compares the losses of the steps
both runs trained.

Lines (one JSON object each): `{"event": "restored", ...}` first (`"tier": "none"` and step 0
when there was nothing to resume from: a fresh job, or a restart that found no step restorable,
which then starts the job over), `{"event": "step", "step", "loss"}` per step (the loss as
`float.hex`, exact), `{"event": "saved", "step", "stall_s"}` per save, and last
`{"event": "done", ...}`: after the final save is verified, the rank restores it into a fresh
model and compares it with its live state bitwise, and times `torch.save` (plus fsync) of the
same state as the baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from tierpipe.errors import NoCheckpointError
from tierpipe.trainer.checkpointer import Checkpointer

__all__ = ("JOB", "run_rank")

JOB = "demo"
_VOCAB, _DIM, _LAYERS, _SEQ, _BATCH = 2048, 128, 2, 64, 8


class _LM(torch.nn.Module):
    """A small causal language model with tied input and output embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(_VOCAB, _DIM)
        torch.nn.init.normal_(self.embed.weight, std=0.02)  # (tied to the output: small logits)
        layer = torch.nn.TransformerEncoderLayer(
            _DIM, nhead=4, dim_feedforward=4 * _DIM, dropout=0.1, batch_first=True
        )
        self.body = torch.nn.TransformerEncoder(layer, _LAYERS)
        self.head = torch.nn.Linear(_DIM, _VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied weights must come back tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens), mask=_MASK, is_causal=True))


def _model() -> _LM:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    return _LM()


#: The "language": each token is followed by its image under a fixed permutation, so the loss
#: falls as the model learns it.
_NEXT = torch.randperm(_VOCAB, generator=torch.Generator().manual_seed(7))
_MASK = torch.nn.Transformer.generate_square_subsequent_mask(_SEQ)


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    tokens = torch.empty(_BATCH, _SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, _VOCAB, (_BATCH,), generator=g)
    for i in range(_SEQ):
        tokens[:, i + 1] = _NEXT[tokens[:, i]]
    return tokens


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # Through the module's forward (DDP's, with more than one rank): that is what makes DDP
    # average the gradients in backward.
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _torch_save_s(state: dict[str, Any], reps: int = 3) -> float:
    """Median seconds of `torch.save` of `state` to a file, flushed and fsynced (what a
    blocking checkpoint to local disk costs the trainer)."""
    times = []
    with tempfile.TemporaryDirectory(prefix="tierpipe-demo-") as d:
        for i in range(reps):
            t = time.perf_counter()
            with open(os.path.join(d, f"{i}.pt"), "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_rank(rank: int, world_size: int, steps: int, every: int) -> int:
    """Train this rank to `steps`, saving every `every` steps, resuming from the job's newest
    checkpoint if it has one; returns 0 when the final restore matched the live state."""
    _emit(event="started", rank=rank, t=time.time())  # (Python and torch imported)
    torch.set_num_threads(1)  # (the demo's ranks, agents and servers share a small machine)
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    net = _model()
    model: torch.nn.Module = net
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(net)
    optim = torch.optim.AdamW(net.parameters(), lr=3e-3)
    torch.manual_seed(100 + rank)  # this rank's dropout RNG: saved and restored
    stalls: list[float] = []
    step_s: list[float] = []
    ckpt = Checkpointer(JOB, rank=rank, world_size=world_size)
    start = 1
    t = time.perf_counter()
    restored, why = None, "latest_step() found no step complete on any tier"
    try:  # a restart: every rank restores, in place
        if ckpt.latest_step() is not None:
            restored = ckpt.restore({"model": net, "optim": optim})
    except NoCheckpointError as e:  # (steps were saved, but none can be restored now)
        why = f"restore(): {e}"
    if restored is None:  # the job starts over: its first saves supersede what it had
        ckpt.close()
        ckpt = Checkpointer(JOB, rank=rank, world_size=world_size, overwrite=True)
        _emit(event="restored", rank=rank, step=0, tier="none", why=why,
              restore_s=time.perf_counter() - t, t=time.time())  # fmt: skip
    else:
        torch.set_rng_state(restored.state["rng"])
        start = restored.state["step"] + 1
        _emit(event="restored", rank=rank, step=restored.step, tier=restored.source.tier,
              restore_s=restored.seconds, t=time.time())  # fmt: skip
    with ckpt:
        for step in range(start, steps + 1):
            t = time.perf_counter()
            loss = _loss(model, _batch(rank, step))
            optim.zero_grad()
            loss.backward()
            optim.step()
            step_s.append(time.perf_counter() - t)
            _emit(event="step", rank=rank, step=step, loss=float(loss.item()).hex(), t=time.time())
            if step % every == 0:
                state = {"model": net, "optim": optim, "step": step, "rng": torch.get_rng_state()}
                t = time.perf_counter()
                ckpt.save(step, state)  # blocks only for the copy into shared memory
                stalls.append(time.perf_counter() - t)
                _emit(event="saved", rank=rank, step=step, stall_s=stalls[-1], t=time.time())
        ckpt.wait_until_finished(timeout=120)
        live = {k: v.clone() for k, v in net.state_dict().items()}
        baseline = _torch_save_s({"model": net.state_dict(), "optim": optim.state_dict()})
        fresh = _model()  # what a restarted rank would build, then restore into
        again = ckpt.restore({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())})
    equal = all(torch.equal(fresh.state_dict()[k], v) for k, v in live.items())
    equal &= fresh.embed.weight.data_ptr() == fresh.head.weight.data_ptr()
    if world_size > 1:
        dist.barrier()  # (no rank tears gloo down while a peer is in a collective)
        dist.destroy_process_group()
    _emit(
        event="done",
        rank=rank,
        step=again.step,
        tier=again.source.tier,
        restore_ms=again.seconds * 1e3,
        bitwise_equal=bool(equal),
        stall_s=stalls,
        step_s=statistics.median(step_s) if step_s else None,
        torch_save_s=baseline,
    )
    return 0 if equal else 1
