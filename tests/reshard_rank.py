"""One rank of a gloo job that saves or restores DTensors through tierpipe (tests/test_reshard.py).

    python -m tests.reshard_rank JOB RANK WORLD STORE_FILE save|restore LAYOUT [STEP]

LAYOUT is the device mesh: `4` (1-D), `2x2`, ... The state is `global_state()` laid out on it:
`w` (8 MiB, several blocks) and `v` (uneven) as DTensors, `n` a plain tensor, `r` the rank.
Settings come from the environment. Prints one JSON line: for a restore, the step, tier, how
the ranks agreed, and the sha256 of each gathered full tensor; or the error.
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


def global_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(23)
    return {
        "w": torch.randn(2048, 1024, generator=gen),
        "v": torch.randn(9, 7, generator=gen).to(torch.bfloat16),
        "n": torch.arange(5),
    }


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def placements(layout: str) -> dict[str, list[Any]]:
    if "x" in layout:
        return {"w": [Shard(0), Shard(1)], "v": [Replicate(), Shard(0)]}
    return {"w": [Shard(0)], "v": [Shard(1)]}


def state(layout: str, *, empty: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", tuple(int(n) for n in layout.split("x")))
    out: dict[str, Any] = {}
    for name, t in global_state().items():
        if name == "n":
            out[name] = torch.zeros_like(t) if empty else t
            continue
        out[name] = distribute_tensor(
            torch.zeros_like(t) if empty else t, mesh, placements(layout)[name]
        )
    return out


def main() -> None:
    job, rank, world, store, action, layout = sys.argv[1:7]
    step = int(sys.argv[7]) if len(sys.argv) > 7 else None
    rank_, world_ = int(rank), int(world)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_), rank=rank_, world_size=world_
    )
    try:
        with Checkpointer(job, rank=rank_, world_size=world_) as ckpt:
            if action == "save":
                ckpt.save(step or 1, {"model": state(layout, empty=False), "r": rank_})
                ckpt.wait_until_finished(timeout=120)
                print(json.dumps({"saved": rank_}))
                return
            target = {"model": state(layout, empty=True)}
            try:
                restored = ckpt.restore(target, step=step)
            except TierpipeError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}))
                return
        sums = {
            k: sha(v.full_tensor() if isinstance(v, DTensor) else v)
            for k, v in target["model"].items()
        }
        print(json.dumps({
            "step": restored.step, "tier": restored.source.tier, "agreement": restored.agreement,
            "rounds": restored.rounds, "r": restored.state["r"], "sums": sums,
        }))  # fmt: skip
    finally:  # (no rank tears gloo down while another is still in a collective)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
