"""One rank of a 2x2 FSDP2 + tensor-parallel job (gloo, CPU) that saves or restores through
tierpipe; `tests/test_dtensor_save.py` runs four of them.

    python -m tests.dtensor_rank save|restore JOB RANK WORLD STORE_FILE

Settings come from the environment. `save` trains two steps and saves step 2 (the model and
AdamW objects); `restore` builds the same model from another seed, trains one step (so the
optimizer has state), restores into it in place and checks each local tensor kept its memory.
Either prints one JSON line: a sha256 per local shard of the model's and optimizer's state (and
for `restore`, the restored step and the DTensors whose local memory moved); or the error.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tierpipe.errors import TierpipeError
from tierpipe.trainer.checkpointer import Checkpointer


def build(mesh: DeviceMesh, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP, tensor parallel over the mesh's `tp` dim and FSDP2 over `dp`, stepped."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10), torch.nn.LayerNorm(10)
    )
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def sums(state: Any, prefix: str = "") -> dict[str, str]:
    """sha256 of every tensor's local bytes in a state dict, by key path."""
    out = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(sums(v, f"{prefix}{k}/"))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out.update(sums(v, f"{prefix}{i}/"))
    elif isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        data = local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        out[prefix.rstrip("/")] = hashlib.sha256(data).hexdigest()
    return out


def locals_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Where each DTensor's local tensor lives."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    out: dict[str, int] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, DTensor):
            out[path] = v.to_local().data_ptr()
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}/{k}")

    walk(state, "")
    return out


def main() -> None:
    mode, job, rank, world, store = sys.argv[1:6]
    rank_, world_ = int(rank), int(world)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, world_), rank=rank_, world_size=world_
    )
    try:
        mesh = init_device_mesh("cpu", (2, world_ // 2), mesh_dim_names=("dp", "tp"))
        result: dict[str, Any] = {}
        if mode == "save":
            model, optimizer = build(mesh, 0)
            train(model, optimizer, 2, seed=1)
            with Checkpointer(job, rank=rank_, world_size=world_) as ckpt:
                ckpt.save(2, {"model": model, "optim": optimizer, "step": 2})
                ckpt.wait_until_finished(timeout=120)
        else:
            model, optimizer = build(mesh, 7)
            train(model, optimizer, 1, seed=8)  # the optimizer has state to fill in place
            before = locals_of(model, optimizer)
            with Checkpointer(job, rank=rank_, world_size=world_) as ckpt:
                try:
                    restored = ckpt.restore({"model": model, "optim": optimizer})
                except TierpipeError as e:
                    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
                    return
            result["step"] = restored.step
            after = locals_of(model, optimizer)
            result["moved"] = sorted(k for k in after if before.get(k) != after[k])
        result["sums"] = sums({"model": model.state_dict(), "optim": optimizer.state_dict()})
        if mode == "restore":
            train(model, optimizer, 1, seed=9)  # and training goes on from it
        print(json.dumps(result))
    finally:  # (no rank tears gloo down while another is still in a collective)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
