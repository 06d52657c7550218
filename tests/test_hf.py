"""The Hugging Face integration: a `Trainer` saves through tierpipe and resumes from it bitwise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the tierpipe[hf] extra (transformers) is not installed")
pytest.importorskip("accelerate", reason="the tierpipe[hf] extra (accelerate) is not installed")

from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tierpipe.integrations.hf import TierpipeCallback
from tierpipe.settings import Settings

MAX_STEPS = 12  # 8 batches an epoch: the resumed run crosses an epoch boundary
SAVE_STEPS = 3
CRASH_AT = 7  # the newest save before it is step 6, mid-epoch


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same for every instance with the same seed."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Crash(TrainerCallback):
    """Stands in for a failure: the training dies at the end of a step."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == CRASH_AT:
            raise RuntimeError("crash")


def trainer(out: Path, seed: int, callbacks: list[TrainerCallback]) -> Trainer:
    """A 2-layer GPT-2 (dropout on, tied embeddings) built from a config: nothing downloaded.
    Logs every 3 steps and evaluates every 6, so saves happen after a log and an evaluation."""
    torch.manual_seed(seed)  # (a resumed run starts from other weights)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        save_steps=SAVE_STEPS,
        logging_steps=3,
        eval_strategy="steps",
        eval_steps=6,
        seed=0,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(32, seed=1),
        eval_dataset=Tokens(8, seed=2),
        callbacks=callbacks,
    )


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    assert t.model is not None
    return t.model.state_dict()


def history(t: Trainer) -> list[dict[str, Any]]:
    """The log history without wall-clock figures."""
    timing = ("runtime", "per_second")
    return [
        {k: v for k, v in entry.items() if not any(w in k for w in timing)}
        for entry in t.state.log_history
    ]


def test_trainer_resumes_bitwise_from_tierpipe(
    settings: Settings, agent: Callable[..., Any], job: str, tmp_path: Path
) -> None:
    """A run that crashed and resumed from the newest tierpipe save ends with the weights and
    the log history of an uninterrupted run, bit for bit; with nothing saved it starts fresh."""
    agent().wait_ready()
    uninterrupted = trainer(tmp_path / "a", seed=0, callbacks=[])
    uninterrupted.train()

    cb = TierpipeCallback(job, settings=settings)
    first = trainer(tmp_path / "b", seed=0, callbacks=[cb, Crash()])
    assert cb.resume_dir() is None  # (nothing saved yet: a fresh start)
    with pytest.raises(RuntimeError, match="crash"):
        first.train(resume_from_checkpoint=None)
    cb.checkpointer.wait_until_finished(30)
    cb.close()

    cb = TierpipeCallback(job, settings=settings)
    resumed = trainer(tmp_path / "b", seed=1, callbacks=[cb])
    folder = cb.resume_dir()
    assert folder is not None and Path(folder).name == "step-6-rank-0"
    assert sorted(p.name for p in Path(folder).iterdir()) == [
        "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"
    ]  # fmt: skip
    resumed.train(resume_from_checkpoint=folder)

    assert resumed.state.global_step == MAX_STEPS
    assert not Path(folder).exists()  # (removed once the Trainer read it)
    final = weights(resumed)
    for name, weight in weights(uninterrupted).items():
        assert torch.equal(final[name], weight), name
    # Every log entry (losses, grad norms, learning rates, eval losses) matches, including
    # those logged before the crash, which came back with the trainer state.
    assert history(resumed)[:-1] == history(uninterrupted)[:-1]


def test_fsdp_is_refused_with_the_reason(tmp_path: Path) -> None:
    """FSDP (here FSDP2) is refused when the Trainer starts the callback, saying why: on CPU
    accelerate does not even run it (it drops the FSDP plugin and trains DDP; a Trainer of one
    process refuses FSDP itself, so the callback's hook is called directly)."""
    from transformers import TrainerControl, TrainerState

    from tierpipe.errors import ConfigError

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2},
        report_to=[],
        max_steps=1,
    )
    cb = TierpipeCallback("j")
    with pytest.raises(ConfigError, match=r"FSDP training yet.*on CPU it drops the FSDP plugin"):
        cb.on_init_end(args, TrainerState(), TrainerControl())
