"""Integrations with training frameworks, each an optional extra imported only when used.

- `tierpipe.integrations.lightning` (`pip install tierpipe[lightning]`): a Lightning callback
  that saves on every rank and a `CheckpointIO` that resumes from tierpipe;
  `tierpipe.integrations.model_parallel` hooks its resume into `ModelParallelStrategy`
  (FSDP2 + tensor parallel) and says why other sharded strategies are refused.
- `tierpipe.integrations.hf` (`pip install tierpipe[hf]`): a Hugging Face `TrainerCallback`
  that saves at `save_steps`, and the checkpoint folder the `Trainer` resumes from.
- `tierpipe.integrations.ddp`: both callbacks' rule for DDP's replicated state (the model and
  optimizer state stored once per job) and the torch RNG each rank keeps as its own.

`import tierpipe` never imports these frameworks.
"""
