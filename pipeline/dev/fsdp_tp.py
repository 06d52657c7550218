"""The sharded-state example: a small transformer trained with FSDP2 and tensor parallel on a
2-D device mesh over gloo (CPU), saving through tierpipe and resuming on any mesh.

One process per rank, as torchrun starts them (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT` in the environment)::

    torchrun --nproc-per-node 4 -m tierpipe.dev.fsdp_tp --job sharded --dp 2 --tp 2
    torchrun --nproc-per-node 2 -m tierpipe.dev.fsdp_tp --job sharded --dp 2 --tp 1 --resume

The model's attention and MLP projections are split over the mesh's `tp` dimension
(`ColwiseParallel` in, `RowwiseParallel` out; the embedding row-wise, the output head
column-wise), then every block and the whole model are sharded over `dp` with `fully_shard`:
the state dict holds DTensors on the 2-D mesh (`(_StridedShard(0), Shard(0))`,
`(Shard(0), Shard(1))`, `(Shard(0), Replicate())`) and on `dp` alone (the norms). The
batch of every step is a function of the step alone (split over `dp`), so a resumed run on the
same mesh computes every step exactly as an uninterrupted one.

Every `--every` steps the rank saves `{"model", "optim"}` (`get_state_dict`: DTensors keyed by
parameter name), the step and the RNG state with `tierpipe.Checkpointer`. With `--resume` it
restores first, into the state dict of a model built on this run's mesh (any world size), and
continues to `--steps`.

With `--out FILE` each rank appends JSON lines: `step` (the loss, `float.hex`: exact), `saved`
and `restored` (step, `rng`: a sha256 of this rank's RNG state; rank 0 adds `digests`, a sha256
of every gathered full tensor (`DTensor.full_tensor()`) by its key path, the same on every
mesh), `holding` (with `--hold`: the run trained its steps and waits to be killed), and `done`
(rank 0: the final state's digests, unless nothing was trained after the restore).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from tierpipe.trainer.checkpointer import Checkpointer

__all__ = ("Config", "Transformer", "build", "full_digests", "main")

JOB = "fsdp-tp"


class Config:
    """The model's sizes: small enough for 8 gloo processes on 2 cores."""

    vocab = 128
    dim = 64
    heads = 4
    hidden = 128
    layers = 2
    seq = 16
    #: The global batch of a step, split over the `dp` ranks (a multiple of 1, 2, 4, 8).
    batch = 8
    lr = 1e-2


class Block(nn.Module):
    """Pre-norm attention and MLP; head counts follow the local width, so the same code runs
    with the projections split over `tp`."""

    def __init__(self, c: type[Config]) -> None:
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.attn_norm = nn.LayerNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.dim, bias=False)
        self.wv = nn.Linear(c.dim, c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.hidden)
        self.w2 = nn.Linear(c.hidden, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in self.qkv())
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))

    def qkv(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return self.wq, self.wk, self.wv


class Transformer(nn.Module):
    """Token embedding, `layers` blocks, final norm, output head."""

    def __init__(self, c: type[Config]) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(mesh: DeviceMesh, c: type[Config] = Config) -> Transformer:
    """The model on `mesh` (dims `dp`, `tp`): the same initial values on every mesh and device
    (one seed, drawn on the CPU), tensor parallel over `tp`, then FSDP2 over `dp`."""
    torch.manual_seed(0)
    model = Transformer(c).to(mesh.device_type)
    tp = mesh["tp"]
    for block in model.blocks:
        plan: dict[str, ParallelStyle] = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "w1")}
        plan |= {"wo": RowwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(block, tp, plan)
    parallelize_module(
        model,
        tp,
        {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def batch(step: int, dp_rank: int, dp: int, c: type[Config] = Config) -> torch.Tensor:
    """This dp rank's part of step `step`'s global batch: tokens drawn from the step's seed."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=gen)
    per = c.batch // dp
    return tokens[dp_rank * per : (dp_rank + 1) * per]


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], f"{path}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, tree


def full_digests(state: Any) -> dict[str, str]:
    """sha256 of every tensor of `state` by key path, DTensors gathered to their full tensor
    first (a collective: every rank calls it, in the same order)."""
    out = {}
    for path, v in _leaves(state):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            raw = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[path] = hashlib.sha256(raw).hexdigest()
    return out


class _Lines:
    """This rank's JSON lines (none without `--out`)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.rank = rank
        self.file: TextIO | None = None if path is None else open(path, "a", buffering=1)  # noqa: SIM115

    def emit(self, **record: object) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"rank": self.rank, **record}) + "\n")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tierpipe.dev.fsdp_tp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--job", default=JOB)
    p.add_argument("--dp", type=int, default=2, help="FSDP ranks (mesh dim 0)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (mesh dim 1)")
    p.add_argument("--steps", type=int, default=12, help="train up to this step")
    p.add_argument("--every", type=int, default=4, help="save every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="restore the newest step first")
    p.add_argument("--hold", action="store_true", help="after the last step, wait to be killed")
    p.add_argument("--out", default=None, help="append this rank's JSON lines to this file")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo (default); cuda: NCCL, the GPU of LOCAL_RANK",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.dp * args.tp != world:
        sys.exit(f"--dp {args.dp} x --tp {args.tp} != WORLD_SIZE {world}")
    if Config.batch % args.dp or Config.heads % args.tp:
        sys.exit(f"--dp must divide {Config.batch}, --tp must divide {Config.heads}")
    # torch's advice for GPU runs, not this example's business: FSDP2 on a module returning a
    # view, and the two all-gathers `full_tensor()` makes of a strided (FSDP over TP) shard.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    backend = "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"  # (gloo too: the Checkpointer's restore agrees on the CPU)
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        _train(args, rank, world)
        dist.barrier()  # (no rank tears its group down while a peer is in a collective)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, world: int) -> None:
    lines = _Lines(args.out, rank)
    mesh = init_device_mesh(args.device, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = build(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=Config.lr)
    torch.manual_seed(100 + rank)
    with Checkpointer(args.job, rank=rank, world_size=world) as ckpt:
        ckpt.guard(optim)
        start = 1
        if args.resume:
            # The targets: this mesh's state dict (the optimizer's state made by a no-op step).
            msd, osd = get_state_dict(model, optim)
            restored = ckpt.restore({"model": msd, "optim": osd})
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
            torch.set_rng_state(restored.state["rng"])
            start = restored.step + 1
            digests = full_digests({"model": msd, "optim": osd})
            lines.emit(
                event="restored",
                step=restored.step,
                tier=restored.source.tier,
                rng=_rng_digest(),
                **({"digests": digests} if rank == 0 else {}),
            )
        for step in range(start, args.steps + 1):
            tokens = batch(step, dp_rank, args.dp).to(args.device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, Config.vocab), tokens[:, 1:].reshape(-1))
            optim.zero_grad()
            loss.backward()
            optim.step()
            lines.emit(event="step", step=step, loss=float(loss.item()).hex())
            if args.every and step % args.every == 0:
                msd, osd = get_state_dict(model, optim)
                state = {"model": msd, "optim": osd}
                ckpt.save(step, {**state, "step": step, "rng": torch.get_rng_state()})
                digests = full_digests(state)
                extra = {"digests": digests} if rank == 0 else {}
                lines.emit(event="saved", step=step, rng=_rng_digest(), **extra)
        if args.hold:
            lines.emit(event="holding", step=args.steps)
            while True:  # (the test kills the run here, its saves in flight or done)
                signal.pause()
        ckpt.wait_until_finished(timeout=300)
        if start > args.steps:  # (nothing trained since the restore: its digests stand)
            lines.emit(event="done", step=start - 1)
            return
        msd, osd = get_state_dict(model, optim)
        digests = full_digests({"model": msd, "optim": osd})
        lines.emit(event="done", step=args.steps, **({"digests": digests} if rank == 0 else {}))


def _rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    main()
