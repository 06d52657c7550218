"""One rank of a gloo job whose state holds replicated values (tests/test_replicated_once.py).

    python -m tests.replicated_rank JOB RANK WORLD STORE_FILE save|restore|restore-none

The state of step s (`global_state(s)`) on a 1-D mesh of all ranks: `model/norm` a DTensor
replicated over it, `model/w` one sharded on dim 0, and `ddp` plain tensors the same on every
rank, declared replicated (`Checkpointer(replicated=("ddp",))`), with a plain float; `r` the
rank. `save` saves steps 1 and 2. `restore` restores into zeroed targets of this world and
prints the sha256 of each full tensor; `restore-none` restores without targets and prints those
of the tensors it returns (a DTensor's: the value rank's local shard). Settings come from the
environment. Prints one JSON line, or the error.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tierpipe.errors import TierpipeError
from tierpipe.trainer.checkpointer import Checkpointer

REPLICATED = ("ddp",)


def global_state(step: int) -> dict[str, dict[str, Any]]:
    gen = torch.Generator().manual_seed(23)
    return {
        "model": {"norm": torch.randn(300, generator=gen) + step,
                  "w": torch.randn(6, 5, generator=gen) + step},
        "ddp": {"emb": torch.randn(200, 4, generator=gen) + step, "n": torch.arange(5) + step,
                "lr": 0.1 * step},
    }  # fmt: skip


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def state(world: int, step: int, *, empty: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    g = global_state(step)
    out: dict[str, Any] = {"model": {}, "ddp": {}}
    for name, t in g["model"].items():
        placement = Replicate() if name == "norm" else Shard(0)
        out["model"][name] = distribute_tensor(
            torch.zeros_like(t) if empty else t, mesh, [placement]
        )
    for name, v in g["ddp"].items():
        out["ddp"][name] = torch.zeros_like(v) if empty and isinstance(v, torch.Tensor) else v
    return out


def sums(tree: dict[str, Any]) -> dict[str, str]:
    return {
        f"{group}/{k}": sha(v.full_tensor() if isinstance(v, DTensor) else v)
        for group in ("model", "ddp")
        for k, v in tree[group].items()
        if isinstance(v, torch.Tensor)
    }


def main() -> None:
    job, rank, world, store, action = sys.argv[1:6]
    rank_, world_ = int(rank), int(world)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_), rank=rank_, world_size=world_
    )
    try:
        with Checkpointer(job, rank=rank_, world_size=world_, replicated=REPLICATED) as ckpt:
            if action == "save":
                for step in (1, 2):
                    ckpt.save(step, {**state(world_, step, empty=False), "r": rank_})
                ckpt.wait_until_finished(timeout=120)
                print(json.dumps({"saved": rank_}))
                return
            target = state(world_, 1, empty=True) if action == "restore" else None
            try:
                restored = ckpt.restore(target)
            except TierpipeError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}))
                return
        got = target if target is not None else restored.state
        print(json.dumps({
            "step": restored.step, "tier": restored.source.tier, "rounds": restored.rounds,
            "r": restored.state["r"], "lr": restored.state["ddp"]["lr"], "sums": sums(got),
        }))  # fmt: skip
    finally:  # (no rank tears gloo down while another is still in a collective)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
