"""PyTorch Lightning integration: every rank saves through tierpipe, and `fit()` resumes from it.

Lightning writes checkpoints through its `CheckpointIO` plugin on rank 0 only, but a tierpipe
job is one shard per rank, so saving cannot live in a `CheckpointIO`. `TierpipeCheckpoint` is a
`Checkpoint` callback instead: on every rank it builds the same checkpoint dict that
`ModelCheckpoint` writes (`dump_checkpoint`: weights, optimizers, LR schedulers, loops,
callbacks, precision plugin, datamodule) and hands it to that rank's `Checkpointer`, keyed by
`trainer.global_step`. Loading does go through `CheckpointIO`, on every rank: in `setup()` the
callback wraps the strategy's plugin in a `TierpipeCheckpointIO` that answers the paths
`tierpipe:latest` and `tierpipe:<step>` with `Checkpointer.restore()` and hands every other path
to the plugin it wraps. So `trainer.fit(model, ckpt_path="tierpipe:latest")` restores exactly what
a `.ckpt` file would, through Lightning's own restore path.

`ModelParallelStrategy` (FSDP2 and tensor parallel, DTensor state) loads its checkpoints itself,
not through `CheckpointIO`: there the callback answers `tierpipe:` paths of the strategy's
`load_checkpoint` instead, restoring the model's and optimizers' DTensor state dicts of this
run's mesh in place (the saved mesh) or resharded (another world size or mesh).

    cb = TierpipeCheckpoint("my-run", every_n_train_steps=500)
    trainer = Trainer(callbacks=[cb], max_epochs=10)
    trainer.fit(model, datamodule=dm, ckpt_path=cb.resume_path(trainer))

Needs `pip install 'tierpipe[lightning]'`; `import tierpipe` never imports Lightning.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import structlog
from torch.utils.hooks import RemovableHandle

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import Checkpoint
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - only without the extra
    raise ImportError(
        "tierpipe.integrations.lightning needs Lightning: pip install 'tierpipe[lightning]'"
    ) from e

from tierpipe.errors import ConfigError, UnsupportedStateError
from tierpipe.integrations.ddp import (
    Replicated,
    check_declared,
    declared_keys,
    put_back_rng,
    rng_state,
    validate_replicated,
)
from tierpipe.integrations.model_parallel import ShardedLoad, is_sharded
from tierpipe.names import validate_token
from tierpipe.trainer.checkpointer import Checkpointer
from tierpipe.tree import encode_tree

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH

    from tierpipe.schemas.jobstate import Keep
    from tierpipe.settings import Settings

__all__ = ("RESUME_LATEST", "TierpipeCheckpoint", "TierpipeCheckpointIO")

log = structlog.get_logger(__name__)

#: `ckpt_path` that resumes from the newest step every rank can restore.
RESUME_LATEST = "tierpipe:latest"
_RESUME_PATH = re.compile(r"tierpipe:(latest|[0-9]+)")
#: The checkpoint's keys DDP keeps equal on every rank (not `_RNG_KEY`: each rank's own RNG).
_DDP_KEYS = ("state_dict", "optimizer_states")
_RNG_KEY = "tierpipe_rng"  # (a checkpoint's key of its rank's torch RNG: CPU, CUDA if used)
#: Checkpoint keys Lightning does not need to resume training (`load_from_checkpoint` rebuilds
#: a module from them): values there that cannot be stored without pickle are dropped.
_HOLDERS = (pl.LightningModule, pl.LightningDataModule)  # (whose hparams a checkpoint holds)
_HPARAMS_KEYS = frozenset(c.CHECKPOINT_HYPER_PARAMS_KEY for c in _HOLDERS)
_HPARAMS_TYPE_KEYS = frozenset(c.CHECKPOINT_HYPER_PARAMS_TYPE for c in _HOLDERS)


def _parse_resume_path(path: _PATH) -> tuple[bool, int | None]:
    """(is it a tierpipe path, the step it names: None for the newest)."""
    m = _RESUME_PATH.fullmatch(str(path))
    if m is None:
        return False, None
    return True, None if m.group(1) == "latest" else int(m.group(1))


class TierpipeCheckpointIO(CheckpointIO):
    """Lightning's checkpoint plugin, with `tierpipe:` paths loaded from tierpipe on every rank.

    `TierpipeCheckpoint` installs it in `setup()` around the strategy's plugin (`base`), which
    keeps handling every other path (`ModelCheckpoint` files, `trainer.save_checkpoint()`).

    Args:
        callback: the callback whose `Checkpointer` restores.
        base: the plugin it wraps.
    """

    def __init__(self, callback: TierpipeCheckpoint, base: CheckpointIO) -> None:
        super().__init__()
        self.callback = callback
        self.base = base

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint file through `base`.

        Raises:
            ConfigError: `path` is a `tierpipe:` path (Lightning calls this on rank 0 only;
                tierpipe saves come from `TierpipeCheckpoint` on every rank).
        """
        if _parse_resume_path(path)[0]:
            raise ConfigError(
                f"cannot save to {str(path)!r}: tierpipe saves on every rank through "
                "TierpipeCheckpoint(every_n_train_steps=..., save_on_train_epoch_end=...)"
            )
        self.base.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint at `path`: `tierpipe:latest` or `tierpipe:<step>` from tierpipe (a
        collective: Lightning calls it on every rank), any other path through `base`.

        Raises:
            NoCheckpointError: tierpipe has nothing restorable (or not that step).
        """
        ours, step = _parse_resume_path(path)
        if not ours:
            return self.base.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        return self.callback._restore(step)

    def remove_checkpoint(self, path: _PATH) -> None:
        self.base.remove_checkpoint(path)

    def teardown(self) -> None:
        self.base.teardown()


class TierpipeCheckpoint(Checkpoint):
    """Save the whole Lightning checkpoint on every rank to tierpipe, and resume from it.

    Saves happen every `every_n_train_steps` optimizer steps and/or at the end of every training
    epoch, keyed by `trainer.global_step`; one step is saved once. A save due on an epoch's last
    batch is left to the epoch end when that saves too, so a resume starts the next epoch
    cleanly. The saved dict is what `ModelCheckpoint` writes, except hyperparameters that cannot
    be stored without pickle (an `argparse.Namespace` value, a dataclass, the hparams' type),
    which are dropped with one warning: Lightning does not need them to resume. Any other value
    that cannot be stored (from a callback's `state_dict()` or `on_save_checkpoint`) stops the
    save with `UnsupportedStateError`.

    It is a `Checkpoint` callback, like `ModelCheckpoint`: Lightning runs it after the
    module's and the other callbacks' epoch-end hooks (so their state is in the save), and adds
    no `ModelCheckpoint` of its own (keep `enable_checkpointing=True`; add a `ModelCheckpoint`
    yourself for `.ckpt` files, listed before this callback if you use `ckpt_path="best"`,
    which asks the first `Checkpoint` callback).

    Resume with `trainer.fit(model, ckpt_path=cb.resume_path(trainer))`, or pass
    `ckpt_path="tierpipe:latest"` / `"tierpipe:<step>"` directly. Supported strategies: single
    device, DDP (the model and optimizers stored once per job: `replicated`), and
    `ModelParallelStrategy` (each rank saves its DTensor shards; a resume on
    another world size or mesh reshards them). Not `FSDPStrategy` (FSDP1: ShardedTensor state)
    nor DeepSpeed (state only in the engine's own files). Each rank's torch RNG is saved too and
    put back where the uninterrupted run has it (at an epoch-end save's restore; else as the
    next batch starts). A resume from a mid-epoch save is exact if the dataloaders are stateful
    (`StatefulDataLoader`; otherwise Lightning warns and the rest of that epoch reads batches from
    the epoch's start); from an epoch-end save, except that Lightning shuffles the next epoch of a
    shuffled loader in another order (as with its own `.ckpt` files).

    Args:
        job: the tierpipe job (`[A-Za-z0-9_-]{1,64}`).
        every_n_train_steps: save every this many optimizer steps (None or 0: never mid-epoch).
        save_on_train_epoch_end: save at the end of every training epoch.
        blocking: False overlaps the copy into shared memory with the next training step;
            optimizers (and modules with buffers) then wait for it before they mutate the state.
        finish_timeout_s: at the end of a stage, wait up to this long for the saves to be
            verified on NVMe (0: do not wait; the node agent writes staged saves regardless).
        settings: tierpipe settings; default `load_settings()`.
        overwrite: start the job over (see `Checkpointer`); without it, a run that did not
            resume may not save steps the job already has.
        keep: the job's retention policy (see `Checkpointer`).
        replicated: top-level keys of the checkpoint dict the same on every rank, their tensors
            stored once per job (by rank 0) and restored by every rank from its shard. None:
            `("state_dict", "optimizer_states")` under `DDPStrategy` of more than one rank
            (buffers DDP lets differ, e.g. BatchNorm's, come back as rank 0's, as from a
            `.ckpt`), none otherwise; `()`: every rank stores its own. Resume with the same.

    Raises:
        InvalidNameError: `job` is not a safe name.
        ConfigError: `every_n_train_steps` is negative, nothing would ever be saved, or
            `replicated` is not key names (at the first save: not keys of the checkpoint).
    """

    def __init__(
        self,
        job: str,
        *,
        every_n_train_steps: int | None = None,
        save_on_train_epoch_end: bool = True,
        blocking: bool = True,
        finish_timeout_s: float = 60.0,
        settings: Settings | None = None,
        overwrite: bool = False,
        keep: Keep | None = None,
        replicated: Replicated = None,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ConfigError(f"every_n_train_steps must be >= 0 (got {every_n_train_steps!r})")
        if not every_n_train_steps and not save_on_train_epoch_end:
            raise ConfigError("TierpipeCheckpoint would never save: set every_n_train_steps")
        self.job = validate_token("job", job)
        self.every_n_train_steps = every_n_train_steps or 0
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.blocking = blocking
        self.finish_timeout_s = finish_timeout_s
        self._settings = settings
        self._overwrite = overwrite
        self._keep, self._replicated = keep, validate_replicated(replicated)
        self._checkpointer: Checkpointer | None = None
        self._io: TierpipeCheckpointIO | None = None
        self._guards: list[RemovableHandle] = []
        self._sharded_load: ShardedLoad | None = None
        self._last_saved: int | None = None
        self._dropped_warned = False
        self._rng: dict[str, Any] | None = None  # (a resumed step's RNG, until put back)

    @property
    def checkpointer(self) -> Checkpointer:
        """This rank's `Checkpointer` (between `setup()` and `teardown()`).

        Raises:
            ConfigError: the callback is not set up.
        """
        if self._checkpointer is None:
            raise ConfigError("TierpipeCheckpoint has no Checkpointer outside a trainer stage")
        return self._checkpointer

    def resume_path(self, trainer: pl.Trainer) -> str | None:
        """`ckpt_path` for `trainer.fit()`: `"tierpipe:latest"` if the job has a complete step,
        else None (start fresh). Every rank calls it, with its own trainer, before `fit()`.

        The check opens (and closes) a short-lived `Checkpointer` as this trainer's rank: the
        ranks of a run with a `spawn` launcher do not exist yet, and each opens its own later.
        Each rank reads the job state by itself: they could disagree only if the job's very
        first step completed while they checked (a run that crashed moments after it).
        """
        with self._open(trainer) as probe:
            step = probe.latest_step()
        log.info("lightning_resume_checked", job=self.job, rank=trainer.global_rank, step=step)
        return None if step is None else RESUME_LATEST

    def _open(self, trainer: pl.Trainer) -> Checkpointer:
        return Checkpointer(
            self.job,
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
            local_world_size=trainer.num_devices,
            settings=self._settings,
            overwrite=self._overwrite,
            keep=self._keep,
            replicated=self._declared(trainer),
        )

    def _declared(self, trainer: pl.Trainer) -> frozenset[str]:
        ddp = isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1
        return declared_keys(self._replicated, _DDP_KEYS, data_parallel=ddp)

    # --- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Open this rank's `Checkpointer` and wrap the strategy's `CheckpointIO`.

        Raises:
            ConfigError: the strategy loads checkpoints without `CheckpointIO` and is not
                `ModelParallelStrategy` (FSDP1, DeepSpeed: the message says why), or
                `ModelParallelStrategy(save_distributed_checkpoint=False)`.
        """
        strategy = trainer.strategy
        sharded = is_sharded(strategy)
        if self._checkpointer is None:
            self._checkpointer = self._open(trainer)
        if sharded:
            self._sharded_load = ShardedLoad(trainer, _parse_resume_path, self._restore)
            self._sharded_load.install()
        io = strategy.checkpoint_io
        if isinstance(io, TierpipeCheckpointIO):  # another trainer's or an earlier stage's
            io = io.base
        self._io = TierpipeCheckpointIO(self, io)
        strategy.checkpoint_io = self._io
        self._last_saved = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.blocking:
            return
        # An overlapped copy reads the live tensors: whatever mutates them waits for it first.
        ckpt = self.checkpointer
        self._guards = [ckpt.guard(opt) for opt in trainer.optimizers]
        self._guards += [
            ckpt.guard(m)
            for m in pl_module.modules()
            if next(m.buffers(recurse=False), None) is not None
        ]

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        n = self.every_n_train_steps
        if not n or trainer.global_step % n:
            return
        if (
            self.save_on_train_epoch_end
            and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        ):
            return  # the epoch end saves this step, so that a resume starts the next epoch
        self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_on_train_epoch_end:
            self._save(trainer, epoch_end=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wait for the saves (up to `finish_timeout_s`), unwrap `CheckpointIO`, close."""
        self._close(trainer, wait=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Close without waiting: Lightning skips `teardown()` after an exception. The node
        agent still writes the saves staged so far."""
        self._close(trainer, wait=False)

    def _close(self, trainer: pl.Trainer, *, wait: bool) -> None:
        for guard in self._guards:
            guard.remove()
        self._guards = []
        if self._sharded_load is not None:
            self._sharded_load.remove()
        self._sharded_load = None
        if self._io is not None and trainer.strategy.checkpoint_io is self._io:
            trainer.strategy.checkpoint_io = self._io.base
        self._io = None
        ckpt, self._checkpointer = self._checkpointer, None
        if ckpt is None:
            return
        try:
            if wait and self.finish_timeout_s > 0 and self._last_saved is not None:
                ckpt.wait_until_finished(self.finish_timeout_s)
        finally:
            ckpt.close()

    # --- saving and restoring

    def _save(self, trainer: pl.Trainer, *, epoch_end: bool = False) -> None:
        step = trainer.global_step
        if (
            getattr(trainer, "fast_dev_run", False)  # (set outside Trainer's annotations)
            or trainer.sanity_checking
            or trainer.state.fn != TrainerFn.FITTING
            or step == self._last_saved
        ):
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint = self._storable(checkpoint)
        check_declared(self._declared(trainer), checkpoint)
        checkpoint[_RNG_KEY] = {**rng_state(), "epoch_end": epoch_end}
        try:
            handle = self.checkpointer.save(step, checkpoint, blocking=self.blocking)
        except UnsupportedStateError as e:
            raise UnsupportedStateError(
                e.path,
                f"{e.reason}; a Lightning checkpoint saved by tierpipe holds tensors, containers "
                "and plain values only (check the callbacks' state_dict() and on_save_checkpoint)",
            ) from e
        self._last_saved = step
        log.debug(
            "lightning_checkpoint_saved",
            job=self.job,
            rank=trainer.global_rank,
            step=step,
            epoch=trainer.current_epoch,
            skipped=handle.skipped,
        )

    def _storable(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """`checkpoint` without the hyperparameters that cannot be stored without pickle."""
        dropped: list[str] = []
        out: dict[str, Any] = {}
        for key, value in checkpoint.items():
            if key in _HPARAMS_TYPE_KEYS:
                dropped.append(key)
                continue
            if key in _HPARAMS_KEYS and isinstance(value, dict):
                kept = {}
                for name, v in value.items():
                    if _encodable(v) and isinstance(name, str | int):
                        kept[name] = v
                    else:
                        dropped.append(f"{key}/{name}")
                value = kept
            out[key] = value
        if dropped and not self._dropped_warned:
            self._dropped_warned = True
            log.warning("lightning_hparams_dropped", job=self.job, keys=dropped)
        return out

    def _restore(self, step: int | None, into: Any = None) -> dict[str, Any]:
        restored = self.checkpointer.restore(into, step=step)
        # Lightning may call the epoch-end hooks of the restored step again: not a new save.
        self._last_saved = restored.step
        state = restored.state
        if not isinstance(state, dict) or "pytorch-lightning_version" not in state:
            raise ConfigError(
                f"step {restored.step} of job {self.job!r} is not a Lightning checkpoint "
                "(saved by TierpipeCheckpoint)"
            )
        self._rng = state.pop(_RNG_KEY, None)
        if self._rng is not None and self._rng.pop("epoch_end", False):
            put_back_rng(self._rng)  # (the next epoch's loaders draw from it, as they did)
            self._rng = None
        log.info("lightning_checkpoint_restored", job=self.job, step=restored.step)
        return state

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Put back the RNG of a mid-epoch step resumed from, once the loaders drew from it."""
        put_back_rng(self._rng)
        self._rng = None


def _encodable(value: Any) -> bool:
    """Whether tierpipe can store `value` (the state tree's own check, not a second copy)."""
    try:
        encode_tree(value)
    except UnsupportedStateError:
        return False
    return True
