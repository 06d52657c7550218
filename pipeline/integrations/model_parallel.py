"""Lightning's sharded strategies for `TierpipeCheckpoint`: the hook on `ModelParallelStrategy`'s
own checkpoint loading, and the reasons other strategies are refused.

`ModelParallelStrategy` (FSDP2's `fully_shard` and tensor parallel, DTensor state) saves and
loads checkpoints itself, not through `CheckpointIO`. Saving needs nothing here: its
`dump_checkpoint` hands every rank its DTensor shards of the model and the optimizers, which
`Checkpointer.save` stores as they are. Loading is a `ShardedLoad`: it answers the strategy's
`load_checkpoint` for `tierpipe:` paths with the model's and optimizers' DTensor state dicts of
this run's mesh as restore targets (in place on the saved mesh, resharded on another), then
loads them as the strategy's own method does (`set_model_state_dict`, `set_optimizer_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

from tierpipe.errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH

__all__ = ("ShardedLoad", "is_sharded", "refusal")

#: (is it a tierpipe path, the step it names: None for the newest)
Parse = Callable[["_PATH"], tuple[bool, int | None]]
#: Restore `step` (None: the newest) into the targets; the saved Lightning checkpoint dict.
Restore = Callable[[int | None, Any], dict[str, Any]]


def is_sharded(strategy: Strategy) -> bool:
    """Whether `strategy` is `ModelParallelStrategy` (True) or resumes through `CheckpointIO`
    (False).

    Raises:
        ConfigError: any other strategy (the message says why), or a `ModelParallelStrategy`
            that saves full state dicts on rank 0 only.
    """
    if isinstance(strategy, ModelParallelStrategy):
        if not strategy._save_distributed_checkpoint:
            raise ConfigError(
                "TierpipeCheckpoint saves each rank's DTensor shards: use "
                "ModelParallelStrategy(save_distributed_checkpoint=True) (the default)"
            )
        return True
    if type(strategy).load_checkpoint is not Strategy.load_checkpoint:
        raise ConfigError(refusal(strategy))
    return False


def refusal(strategy: Strategy) -> str:
    """Why `strategy` cannot resume through TierpipeCheckpoint."""
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        why = (
            "DeepSpeed keeps the ZeRO-partitioned weights and optimizer state inside its engine, "
            "which saves and loads them only as its own files (engine.save_checkpoint / "
            "load_checkpoint), never as a state dict of tensors tierpipe could store"
        )
    elif "FSDP" in name:
        why = (
            "FSDPStrategy is FSDP1: its sharded state dicts hold ShardedTensors of "
            "FlatParameters and its optimizer state comes from FSDP.optim_state_dict, both "
            "loaded only by the strategy from a DCP folder; tierpipe stores DTensor shards: use "
            "ModelParallelStrategy (FSDP2's fully_shard and tensor parallel in configure_model)"
        )
    else:
        why = "it loads checkpoints itself, bypassing CheckpointIO"
    return (
        f"TierpipeCheckpoint supports single device, DDP and ModelParallelStrategy, not {name}: "
        f"{why}"
    )


class ShardedLoad:
    """`trainer.strategy.load_checkpoint`, with `tierpipe:` paths restored from tierpipe into
    this run's DTensor state; any other path goes on to the strategy's own method.

    Args:
        trainer: the trainer whose `ModelParallelStrategy` it hooks (`install()`).
        parse: tells a `tierpipe:` path and its step.
        restore: restores a step into targets and returns the saved checkpoint dict.
    """

    def __init__(self, trainer: pl.Trainer, parse: Parse, restore: Restore) -> None:
        self.trainer, self.parse, self.restore = trainer, parse, restore

    def install(self) -> None:
        self.trainer.strategy.load_checkpoint = self  # type: ignore[method-assign,assignment]

    def remove(self) -> None:
        strategy = self.trainer.strategy
        if strategy.__dict__.get("load_checkpoint") is self:
            del strategy.load_checkpoint

    def __call__(self, path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        ours, step = self.parse(path)
        strategy = self.trainer.strategy
        if not ours:
            return type(strategy).load_checkpoint(strategy, path, weights_only=weights_only)
        return self._load(step)

    def _load(self, step: int | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.trainer.strategy.model
        assert module is not None
        optimizers = list(self.trainer.strategy.optimizers)  # (none outside fit: weights only)
        into = {
            "state_dict": get_model_state_dict(module),
            "optimizer_states": [get_optimizer_state_dict(module, o) for o in optimizers],
        }
        state = self.restore(step, into)
        saved = state.get("optimizer_states", [])
        if optimizers and len(saved) != len(optimizers):
            raise ConfigError(
                f"the checkpoint holds {len(saved)} optimizer states, this run has "
                f"{len(optimizers)} optimizers"
            )
        strict = self.trainer.lightning_module.strict_loading
        options = StateDictOptions(strict=strict)
        set_model_state_dict(module, state["state_dict"], options=options)
        for optimizer, osd in zip(optimizers, saved if optimizers else [], strict=True):
            set_optimizer_state_dict(module, optimizer, optim_state_dict=osd)
        return state
