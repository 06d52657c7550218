"""Hugging Face `Trainer` integration: save through tierpipe at `save_steps`, resume from it.

`TierpipeCallback` saves on every rank, at each multiple of `save_steps` and at the last step,
what the Trainer's own checkpoint folder holds: the model, the optimizer, the LR scheduler, the
`TrainerState` (its JSON) and the random generators' states. The save comes after the step's
logging and evaluation, where the Trainer writes its own, so a resumed run's log history and
RNG streams match an uninterrupted run's.

The Trainer reads the state it resumes from (the global step, hence the batches to skip; the
weights; the RNG states) out of a folder before any callback runs, so `resume_dir()` restores
the job's newest complete step and writes, per rank, exactly the files `Trainer.train(
resume_from_checkpoint=...)` reads, in formats it loads without executing code:
`model.safetensors` (safetensors), `optimizer.pt`, `scheduler.pt` and `rng_state.pth` (or
`rng_state_<rank>.pth`) (plain data that `torch.load(weights_only=True)` takes), and
`trainer_state.json`.

Under DDP (a distributed Trainer of more than one process, no `parallelism_config`) the model
and the optimizer state are the same on every rank: they are declared `replicated`, stored once
per job (by rank 0) and restored on every rank from its shard (`tierpipe.integrations.ddp`);
the RNG states, which differ, stay each rank's own.

Needs `pip install 'tierpipe[hf]'`; `import tierpipe` never imports transformers.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import structlog
import torch

try:
    import numpy as np
    from safetensors.torch import save_file
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.training_args import ParallelMode
except ImportError as e:  # pragma: no cover (the extra is installed where this is tested)
    raise ImportError(
        f"tierpipe.integrations.hf needs the Hugging Face extra ({e.name} is missing): "
        "pip install 'tierpipe[hf]'"
    ) from e

from tierpipe.errors import ConfigError, NoCheckpointError
from tierpipe.integrations.ddp import (
    Replicated,
    check_declared,
    declared_keys,
    validate_replicated,
)
from tierpipe.settings import Settings
from tierpipe.trainer.checkpointer import Checkpointer

__all__ = ("TierpipeCallback",)

log = structlog.get_logger(__name__)

#: The file names `Trainer` reads from a checkpoint folder (transformers' own constants).
_MODEL = "model.safetensors"
_OPTIMIZER = "optimizer.pt"
_SCHEDULER = "scheduler.pt"
_TRAINER_STATE = "trainer_state.json"
#: The keys of a save (`TierpipeCallback._save`); the first two are the same on every DDP rank.
_KEYS = ("model", "optimizer", "lr_scheduler", "trainer_state", "rng")
_DDP_KEYS = _KEYS[:2]


class TierpipeCallback(TrainerCallback):
    """Saves a `Trainer`'s checkpoints through tierpipe on every rank; `resume_dir()` resumes.

    Pass it to the Trainer (`callbacks=[cb]`); the Trainer's `on_init_end` gives it the rank
    and world size (`args.process_index`, `args.world_size`). Set `save_strategy="no"` so the
    Trainer does not also write its own folders, synchronously, at the same steps (keeping
    them does no harm: the two are independent). The Checkpointer is opened on first use and
    closed at the end of training.

    Args:
        job: the tierpipe job's name.
        every_steps: save every this many optimizer steps; default the Trainer's `save_steps`
            (`args.save_steps`, also when `save_strategy="no"`). The last step is saved too.
        settings: tierpipe settings; default `load_settings()`.
        replicated: keys of the save that are the same on every rank, their tensors stored once
            per job (by rank 0) and restored by every rank from its shard. None: `("model",
            "optimizer")` under DDP (`args.parallel_mode` distributed, `args.world_size` > 1, no
            `parallelism_config`), none otherwise; `()`: every rank stores its own. Other keys:
            "lr_scheduler", "trainer_state", "rng". Resume with the same choice.

    Raises:
        ConfigError: `every_steps` is below 1, `replicated` is not keys of the save, or (at
            `Trainer(...)`) DeepSpeed or FSDP is enabled (the message says why; see the
            README's integrations section).
    """

    def __init__(
        self,
        job: str,
        *,
        every_steps: int | None = None,
        settings: Settings | None = None,
        replicated: Replicated = None,
    ) -> None:
        if every_steps is not None and every_steps < 1:
            raise ConfigError(f"every_steps must be at least 1 (got {every_steps!r})")
        self._replicated = validate_replicated(replicated)
        check_declared(self._replicated or (), _KEYS)
        self.job = job
        self.every_steps = every_steps
        self.settings = settings
        self._args: TrainingArguments | None = None
        self._checkpointer: Checkpointer | None = None
        #: A step whose save waits for the step's logging and evaluation.
        self._pending: int | None = None
        #: The folder `resume_dir()` wrote: removed once the Trainer has read it.
        self._resume_folder: Path | None = None

    # --- the Checkpointer

    @property
    def checkpointer(self) -> Checkpointer:
        """This rank's Checkpointer (opened on first use), e.g. for `wait_until_finished()`.

        Raises:
            ConfigError: the callback was not passed to a Trainer yet.
        """
        if self._checkpointer is None:
            if self._args is None:
                raise ConfigError("pass the TierpipeCallback to a Trainer (callbacks=[...]) first")
            args = self._args
            self._checkpointer = Checkpointer(
                self.job,
                rank=args.process_index,
                world_size=args.world_size,
                settings=self.settings,
                replicated=declared_keys(self._replicated, _DDP_KEYS, data_parallel=_ddp(args)),
            )
        return self._checkpointer

    def close(self) -> None:
        """Close the Checkpointer (idempotent; the node agent still writes staged saves out)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    # --- resuming

    def resume_dir(self, folder: str | Path | None = None) -> str | None:
        """Restore the job's newest complete step into a checkpoint folder the Trainer reads.

        All ranks call it, after `Trainer(...)` and before `trainer.train(
        resume_from_checkpoint=cb.resume_dir())`. The folder is removed once the resumed
        training has read it (at its first step, or its end).

        Args:
            folder: where this rank's folder (`step-<s>-rank-<r>`) goes; default
                `<output_dir>/tierpipe-resume`.

        Returns:
            The folder's path, or None when the job has no checkpoint (training starts fresh).

        Raises:
            ConfigError: the callback was not passed to a Trainer yet.
            NoCheckpointError: the job has complete steps, but none can be restored.
            WorldSizeMismatchError: the checkpoint was saved by another number of ranks.
        """
        cp = self.checkpointer
        args = self._args
        assert args is not None  # (set with the checkpointer)
        try:
            restored = cp.restore()
        except NoCheckpointError:
            # Rank 0's plan found nothing on any rank; the job having no step at all is a fresh
            # start, steps that exist but cannot be restored are an error.
            if cp.all_steps():
                raise
            log.info("hf_resume_skipped", job=self.job, rank=cp.rank, reason="no checkpoint")
            return None
        default = Path(args.output_dir or "trainer_output", "tierpipe-resume")
        root = default if folder is None else Path(folder)
        out = root / f"step-{restored.step}-rank-{cp.rank}"
        shutil.rmtree(out, ignore_errors=True)  # (a folder an earlier attempt left behind)
        _write_folder(restored.state, out, args)
        self._resume_folder = out
        log.info("hf_resume_written", job=self.job, rank=cp.rank, step=restored.step, path=str(out))
        return str(out)

    # --- Trainer events

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if args.deepspeed:
            raise ConfigError(
                "TierpipeCallback does not support DeepSpeed: the ZeRO-partitioned weights and "
                "optimizer state live inside the DeepSpeed engine, saved and loaded only as its "
                "own checkpoint files, never as a state dict of tensors tierpipe could store"
            )
        if args.fsdp:
            raise ConfigError(
                "TierpipeCallback does not support FSDP training yet: the Trainer saves and "
                "loads FSDP state through accelerate (save_fsdp_model/load_fsdp_model), and "
                "accelerate runs FSDP only on accelerators (on CPU it drops the FSDP plugin and "
                "trains DDP), so this support is untested and refused; for FSDP2 state use "
                "tierpipe's Checkpointer with get_state_dict/set_state_dict (DTensor state) or "
                "Lightning's ModelParallelStrategy with TierpipeCheckpoint"
            )
        self._args = args

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        self._forget_resume_folder()  # (the Trainer read it before its first step)
        if self._pending is not None:  # (another callback cancelled the log or the evaluation)
            self._save(args, state, **kw)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        every = self.every_steps or state.save_steps
        step = state.global_step
        if not ((every > 0 and step % every == 0) or step >= state.max_steps):
            return
        self._pending = step
        # The Trainer logs, then evaluates, then saves its own checkpoint; so do we.
        if not (control.should_log or control.should_evaluate):
            self._save(args, state, **kw)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        # (during an evaluation, `should_evaluate` is still set: its `on_evaluate` saves)
        if self._pending == state.global_step and not control.should_evaluate:
            self._save(args, state, **kw)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if self._pending == state.global_step:
            self._save(args, state, **kw)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if self._pending is not None:
            self._save(args, state, **kw)
        self._forget_resume_folder()
        self.close()

    # --- helpers

    def _save(self, args: TrainingArguments, state: TrainerState, **kw: object) -> None:
        step, self._pending = state.global_step, None
        self.checkpointer.save(
            step,
            {
                "model": kw["model"],
                "optimizer": kw["optimizer"],
                "lr_scheduler": kw["lr_scheduler"],
                # (as `TrainerState.save_to_json` writes it)
                "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True)
                + "\n",
                "rng": _rng_states(args),
            },
        )
        log.info("hf_checkpoint_saved", job=self.job, rank=self.checkpointer.rank, step=step)

    def _forget_resume_folder(self) -> None:
        if self._resume_folder is not None:
            shutil.rmtree(self._resume_folder, ignore_errors=True)
            self._resume_folder = None


def _ddp(args: TrainingArguments) -> bool:
    """Whether the Trainer runs DDP: every rank holds the whole model and optimizer state.
    (DeepSpeed and FSDP are refused; a `parallelism_config` shards or splits the model.)"""
    return (
        args.parallel_mode == ParallelMode.DISTRIBUTED
        and args.world_size > 1
        and getattr(args, "parallelism_config", None) is None
    )


def _rng_states(args: TrainingArguments) -> dict[str, Any]:
    """The random generators' states, as `Trainer._save_rng_state` takes them (CPU and CUDA)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            states["cuda"] = torch.cuda.random.get_rng_state_all()
        else:
            states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def _write_folder(state: Any, out: Path, args: TrainingArguments) -> None:
    """The checkpoint folder `Trainer` resumes from, written from a restored state.

    Raises:
        ConfigError: the state is not one `TierpipeCallback` saved.
    """
    if not isinstance(state, dict) or not isinstance(state.get("trainer_state"), str):
        raise ConfigError("the restored step was not saved by TierpipeCallback")
    out.mkdir(parents=True)
    # safetensors refuses tensors that share memory (tied weights): a second sharer is copied.
    seen: set[int] = set()
    tensors = {}
    for key, t in state["model"].items():
        if not isinstance(t, torch.Tensor):
            continue  # (a module's extra state: not weights, and safetensors holds tensors only)
        storage = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if storage in seen else t.contiguous()
        seen.add(storage)
    save_file(tensors, str(out / _MODEL), metadata={"format": "pt"})
    torch.save(state["optimizer"], out / _OPTIMIZER)
    torch.save(state["lr_scheduler"], out / _SCHEDULER)
    (out / _TRAINER_STATE).write_text(state["trainer_state"], encoding="utf-8")
    rng = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    torch.save(state["rng"], out / rng)
