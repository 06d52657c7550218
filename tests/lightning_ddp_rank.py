"""One rank of a Lightning DDP run on CPU over gloo, saving through `TierpipeCheckpoint`.

    python -m tests.lightning_ddp_rank JOB EPOCHS OUT_PREFIX [--no-replicated] [--seed S]
        [--resume STEP]

Run by tests/test_integrations_ddp.py with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT). Saves at every epoch end (4 steps an epoch); with `--resume`, resumes from
that step. Rank r draws dropout from torch's RNG seeded `100 + r`, so each rank's RNG differs.
Each rank appends a JSON line to `OUT_PREFIX<rank>.jsonl` when training starts (after a resume:
what was restored), at each epoch end (what is saved) and when it ends: the step, a sha256 of
every weight and optimizer state tensor, and one of torch's RNG state; and at the start of
each batch, the step and the RNG's sha256 (what dropout draws from).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

import lightning.pytorch as pl
import torch

from tierpipe.integrations.lightning import TierpipeCheckpoint


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(8, 1024)
        self.drop = torch.nn.Dropout(0.3)
        self.w2 = torch.nn.Linear(1024, 2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.w2(self.drop(torch.relu(self.w1(x)))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1234)
        data = torch.utils.data.TensorDataset(
            torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=4)  # (4 batches a rank an epoch)


def sha(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class Report(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def _write(self, trainer: pl.Trainer, module: Net, when: str) -> None:
        tensors = {k: sha(v) for k, v in module.state_dict().items()}
        for i, st in trainer.optimizers[0].state_dict()["state"].items():
            tensors.update({f"optim/{i}/{k}": sha(v) for k, v in st.items()})
        record = {"when": when, "rank": trainer.global_rank, "step": trainer.global_step,
                  "tensors": tensors, "rng": sha(torch.get_rng_state())}  # fmt: skip
        with open(f"{self.out}{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        record = {"when": "batch", "step": trainer.global_step, "rng": sha(torch.get_rng_state())}
        with open(f"{self.out}{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, pl_module, "start")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # (Lightning runs `Checkpoint` callbacks' epoch-end hooks last: this is what it saves)
        self._write(trainer, pl_module, "epoch_end")

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._write(trainer, pl_module, "end")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("job")
    p.add_argument("epochs", type=int)
    p.add_argument("out")
    p.add_argument("--no-replicated", action="store_true", help="replicated=(): all per rank")
    p.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    p.add_argument("--resume", type=int, help="the step to resume from")
    a = p.parse_args()
    cb = TierpipeCheckpoint(a.job, finish_timeout_s=60, replicated=() if a.no_replicated else None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=a.epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Report(a.out)],
    )  # fmt: skip
    torch.manual_seed(a.seed)
    model = Net()
    torch.manual_seed(100 + trainer.global_rank)
    trainer.fit(model, ckpt_path=None if a.resume is None else f"tierpipe:{a.resume}")


if __name__ == "__main__":
    main()
