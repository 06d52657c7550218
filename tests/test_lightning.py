"""The Lightning integration: every rank saves the Lightning checkpoint to tierpipe, and a new
Trainer resumes from it exactly as an uninterrupted run."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
import torch

from tierpipe.bus.client import Bus
from tierpipe.control.kvstate import JobStore
from tierpipe.errors import UnsupportedStateError
from tierpipe.recovery.survey import current_head
from tierpipe.settings import Settings

lightning = pytest.importorskip(
    "lightning", reason="the tierpipe[lightning] extra is not installed (pip install lightning)"
)
pl = lightning.pytorch

from tierpipe.integrations.lightning import (  # noqa: E402  (after the importorskip)
    RESUME_LATEST,
    TierpipeCheckpoint,
)

BATCHES_PER_EPOCH = 4
EPOCHS = 4


class Boring(pl.LightningModule):
    """A Linear layer on a fixed random dataset, AdamW and a StepLR schedule."""

    def __init__(self, seed: int, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(8, 2)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses[self.trainer.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1234)
        n = 16 * BATCHES_PER_EPOCH
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)


class Seen(pl.Callback):
    """Records where training (re)started."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = (trainer.current_epoch, trainer.global_step)


def trainer(epochs: int, *callbacks: pl.Callback) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # TierpipeCheckpoint is a Checkpoint callback: with it, Lightning adds no ModelCheckpoint.
        enable_checkpointing=any(isinstance(c, TierpipeCheckpoint) for c in callbacks),
        callbacks=list(callbacks),
    )


def nvme_steps(settings: Settings, job: str) -> list[int]:
    """The job's steps complete on NVMe, from the job state in KV once it folded every event."""

    async def read() -> list[int]:
        async with Bus(settings) as bus:
            store = await JobStore(bus.js, settings).open()
            head = await current_head(
                bus, store, settings, job=job, holder="test", deadline=time.monotonic() + 30
            )
        return list(head.nvme_steps) if head else []

    return anyio.run(read)


def weights_and_optimizer(model: Boring) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    opt = model.trainer.optimizers[0]
    return dict(model.state_dict()), opt.state_dict()


def assert_same_optimizer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    for idx, st in a["state"].items():
        for name, t in st.items():
            assert torch.equal(b["state"][idx][name], t), (idx, name)


def test_resume_from_tierpipe_matches_an_uninterrupted_run(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """Fit 2 epochs with saves, then a new model and Trainer resume from tierpipe to 4 epochs:
    epoch, step, weights, optimizer and losses equal a 4-epoch run without interruption."""
    monkeypatch.chdir(tmp_path)  # Lightning's default_root_dir
    agent()

    reference = Boring(seed=0, lr=0.05)
    trainer(EPOCHS).fit(reference)
    ref_weights, ref_opt = weights_and_optimizer(reference)
    assert reference.trainer.global_step == EPOCHS * BATCHES_PER_EPOCH

    # Run B, part 1: the job is empty, so it starts fresh; saves at steps 2, 4 (epoch end), 6, 8,
    # overlapped with training. A hyperparameter that cannot be stored without pickle is dropped,
    # with a warning.
    cb = TierpipeCheckpoint(job, every_n_train_steps=2, blocking=False, settings=settings)
    first = trainer(EPOCHS // 2, cb)
    assert cb.resume_path(first) is None
    with structlog.testing.capture_logs() as logs:
        first.fit(Boring(seed=0, lr=0.05, args=argparse.Namespace(x=1)), ckpt_path=None)
    dropped = [e for e in logs if e["event"] == "lightning_hparams_dropped"]
    assert [e["keys"] for e in dropped] == [["hyper_parameters/args"]]
    # (fit() returned after its teardown waited for the saves to be verified on NVMe)
    assert nvme_steps(settings, job) == [2, 4, 6, 8]

    # Part 2: another model (other initial weights), another Trainer and callback resume.
    cb2 = TierpipeCheckpoint(job, every_n_train_steps=2, settings=settings)
    seen = Seen()
    second = trainer(EPOCHS, cb2, seen)
    assert cb2.resume_path(second) == RESUME_LATEST
    resumed = Boring(seed=1, lr=0.05)
    second.fit(resumed, ckpt_path=cb2.resume_path(second))

    assert seen.start == (EPOCHS // 2, EPOCHS // 2 * BATCHES_PER_EPOCH)
    assert second.global_step == reference.trainer.global_step
    assert second.current_epoch == reference.trainer.current_epoch
    weights, opt = weights_and_optimizer(resumed)
    for k, v in ref_weights.items():
        assert torch.equal(weights[k], v), k
    assert_same_optimizer(ref_opt, opt)
    assert second.lr_scheduler_configs[0].scheduler.state_dict() == (
        reference.trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s >= 8}


class Opaque(pl.Callback):
    """A callback whose state holds an object tierpipe cannot store without pickle."""

    def state_dict(self) -> dict[str, Any]:
        return {"where": object()}


def test_unstorable_callback_state_stops_the_save(
    settings: Settings, job: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """A callback state that cannot be stored fails the save with UnsupportedStateError naming
    its key path (no agent needed: the save fails before anything is staged)."""
    monkeypatch.chdir(tmp_path)
    cb = TierpipeCheckpoint(job, settings=settings, finish_timeout_s=0)
    with pytest.raises(UnsupportedStateError) as e:
        trainer(1, cb, Opaque()).fit(Boring(seed=0))
    assert e.value.path == ("callbacks", "Opaque", "where")
    assert "state_dict()" in e.value.reason


class Shuffled(Boring):
    """`Boring` with dropout (draws from torch's RNG every step) and a shuffled
    `StatefulDataLoader` (its sampler's position and generator are in the checkpoint)."""

    def __init__(self, seed: int, shuffle: bool = True) -> None:
        super().__init__(seed)
        self.shuffle = shuffle
        self.drop = torch.nn.Dropout(0.5)
        self.firsts: dict[int, float] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        self.firsts[self.trainer.global_step] = x[0, 0].item()
        loss = torch.nn.functional.mse_loss(self.layer(self.drop(x)), y)
        self.losses[self.trainer.global_step] = loss.item()
        return loss

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        g = torch.Generator().manual_seed(1234)
        n = 16 * BATCHES_PER_EPOCH
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
        )
        return StatefulDataLoader(data, batch_size=16, shuffle=self.shuffle)


@pytest.mark.parametrize(
    ("stop", "shuffle"), [(6, True), (12, False)], ids=["mid_epoch_shuffled", "epoch_end"]
)
def test_a_stateful_loader_with_dropout_resumes_bit_for_bit(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path, monkeypatch: Any,
    stop: int, shuffle: bool,
) -> None:  # fmt: skip
    """Stopped at step `stop` (mid-epoch: 6, a shuffled loader; an epoch's end: 12) and resumed
    by a new Trainer and model: every later batch and loss, the weights and the optimizer equal
    an uninterrupted run's, bit for bit (each rank's RNG is saved with its checkpoint and put
    back where the uninterrupted run has it). Not tested: a shuffled loader resumed from an
    epoch's end, whose next epoch Lightning shuffles otherwise (README)."""
    monkeypatch.chdir(tmp_path)
    agent()
    pl.seed_everything(7)
    reference = Shuffled(seed=0, shuffle=shuffle)
    trainer(EPOCHS).fit(reference)
    ref_weights, ref_opt = weights_and_optimizer(reference)

    pl.seed_everything(7)
    cb = TierpipeCheckpoint(job, every_n_train_steps=3, settings=settings)
    first = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=EPOCHS, max_steps=stop, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
    )  # fmt: skip
    first.fit(Shuffled(seed=0, shuffle=shuffle))
    assert stop in nvme_steps(settings, job)

    pl.seed_everything(99)  # (another seed: the resumed run must not depend on it)
    cb2 = TierpipeCheckpoint(job, every_n_train_steps=3, settings=settings)
    second = trainer(EPOCHS, cb2)
    resumed = Shuffled(seed=1, shuffle=shuffle)
    second.fit(resumed, ckpt_path=cb2.resume_path(second))
    assert second.global_step == reference.trainer.global_step
    assert resumed.firsts == {s: v for s, v in reference.firsts.items() if s >= stop}
    assert resumed.losses == {s: v for s, v in reference.losses.items() if s >= stop}
    weights, opt = weights_and_optimizer(resumed)
    for k, v in ref_weights.items():
        assert torch.equal(weights[k], v), k
    assert_same_optimizer(ref_opt, opt)
