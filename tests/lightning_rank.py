"""One rank of a Lightning `ModelParallelStrategy` run (FSDP2 over `data_parallel`, tensor
parallel over `tensor_parallel`) on CPU over gloo, saving through `TierpipeCheckpoint`.

Run by tests/test_lightning_sharded.py with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT), so Lightning joins processes it did not create. With `--out`,
rank 0 writes one JSON line when training starts (after a resume: what was restored) and one
when it ends (with `--validate`, one as validation of the newest step starts): the epoch,
the step, and a sha256 of every gathered full tensor of the model and
the optimizer state, the same on every mesh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from tierpipe.integrations.lightning import TierpipeCheckpoint

BATCHES_PER_EPOCH = 2


class Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 4)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(
                self,
                mesh["tensor_parallel"],
                {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
            )
        dp = mesh["data_parallel"]
        fully_shard(self.w1, mesh=dp)
        fully_shard(self.w2, mesh=dp)
        fully_shard(self, mesh=dp)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.w2(torch.relu(self.w1(x))), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1234)
        n = 8 * BATCHES_PER_EPOCH
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
        )
        # The same batches on every rank and mesh: the data does not depend on the world.
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def _full(t: Any) -> torch.Tensor:
    """A copy (`numpy()` of a live FSDP2 parameter would make its storage unresizable)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def fingerprint(trainer: pl.Trainer, module: Mlp) -> dict[str, Any]:
    """sha256 of every gathered full tensor (collective: every rank calls it)."""
    out: dict[str, str] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for name, p in module.named_parameters():
        out[name] = hashlib.sha256(_full(p.data).contiguous().numpy().tobytes()).hexdigest()
    for opt in trainer.optimizers:  # (none when validating)
        for p, st in opt.state.items():
            for key, v in sorted(st.items()):
                full = _full(v).contiguous()
                out[f"{names[id(p)]}/{key}"] = hashlib.sha256(full.numpy().tobytes()).hexdigest()
    lr = [c.scheduler.state_dict()["_last_lr"] for c in trainer.lr_scheduler_configs]
    return {
        "epoch": trainer.current_epoch,
        "step": trainer.global_step,
        "lr": lr[0] if lr else None,
        "tensors": out,
    }


class Report(pl.Callback):
    def __init__(self, out: str | None) -> None:
        self.out = out

    def _write(self, trainer: pl.Trainer, module: Mlp, when: str) -> None:
        record = {"when": when, "world": trainer.world_size, **fingerprint(trainer, module)}
        if self.out and trainer.global_rank == 0:
            with open(self.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, pl_module, "start")

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, pl_module, "end")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if not trainer.training and not trainer.sanity_checking:
            self._write(trainer, pl_module, "validate")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--out")
    p.add_argument("--validate", action="store_true", help="validate the newest step, no fit")
    a = p.parse_args()
    torch.manual_seed(0)
    cb = TierpipeCheckpoint(a.job, finish_timeout_s=60)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=a.world,
        strategy=ModelParallelStrategy(
            data_parallel_size=a.world // a.tp, tensor_parallel_size=a.tp
        ),
        max_epochs=a.epochs,
        use_distributed_sampler=False,  # every rank reads every batch, on any mesh
        limit_val_batches=None if a.validate else 0,  # (validation only with --validate)
        # (after a sanity check the root module holds FSDP2's unsharded parameters, which the
        # fingerprint would not find in the optimizer's state)
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb, Report(a.out)],
    )
    if a.validate:
        trainer.validate(Mlp(), ckpt_path="tierpipe:latest")
    else:
        trainer.fit(Mlp(), ckpt_path=cb.resume_path(trainer))


if __name__ == "__main__":
    main()
