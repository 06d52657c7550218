"""One rank of a Hugging Face `Trainer` DDP run on CPU over gloo, saving through
`TierpipeCallback`.

    python -m tests.hf_ddp_rank JOB OUT_PREFIX save|resume [--no-replicated]

Run by tests/test_integrations_ddp.py with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT). A 2-layer GPT-2 (dropout on) trains for `STEPS` steps, saving every 2; rank
r reseeds torch with `100 + r` after the Trainer is built, so each rank's RNG differs. `save`
writes `OUT_PREFIX<rank>.json` as the last step is saved: a sha256 of every weight, every
optimizer state tensor and torch's RNG state. `resume` restores with `resume_dir()`, writes the
same hashes of the folder's files (what the Trainer loads), then trains 2 more steps from it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tierpipe.integrations.hf import TierpipeCallback

STEPS = 4


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def sha(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def hashes(model: dict[str, torch.Tensor], optim: dict[str, Any], rng: torch.Tensor) -> Any:
    out = {f"model/{k}": sha(v) for k, v in model.items()}
    for i, st in optim["state"].items():
        out.update({f"optim/{i}/{k}": sha(v) for k, v in st.items()})
    return {"tensors": out, "rng": sha(rng)}


class Report(TrainerCallback):
    """Records the state at the last step, right after `TierpipeCallback` saved it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == STEPS:
            record = hashes(kw["model"].state_dict(), kw["optimizer"].state_dict(),
                            torch.get_rng_state())  # fmt: skip
            self.path.write_text(json.dumps({**record, "step": state.global_step}))


def main() -> None:
    job, out, action = sys.argv[1:4]
    replicated = () if "--no-replicated" in sys.argv else None
    torch.manual_seed(0 if action == "save" else 1)  # (a resumed run starts from other weights)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=f"{out}trainer", max_steps=STEPS if action == "save" else STEPS + 2,
        per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no", save_steps=2,
        logging_steps=100, seed=0, use_cpu=True, report_to=[], disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    cb = TierpipeCallback(job, replicated=replicated)
    rank = args.process_index
    path = Path(f"{out}{rank}.json")
    callbacks: list[TrainerCallback] = [cb, Report(path)] if action == "save" else [cb]
    trainer = Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks
    )
    torch.manual_seed(100 + rank)
    if action == "save":
        trainer.train()
        return
    folder = cb.resume_dir()
    assert folder is not None
    f = Path(folder)
    record = hashes(
        load_file(str(f / "model.safetensors")),
        torch.load(f / "optimizer.pt", weights_only=True),
        # (numpy's state in it takes the Trainer's allowlist: this test's own file)
        torch.load(f / f"rng_state_{rank}.pth", weights_only=False)["cpu"],
    )
    trainer.train(resume_from_checkpoint=folder)
    path.write_text(json.dumps({**record, "step": trainer.state.global_step, "folder": f.name}))


if __name__ == "__main__":
    main()
