"""The trainer's side: what training code calls and what runs in its process.

- `checkpointer`: `Checkpointer`, the API training code uses (save, restore, wait).
- `snapshot`: the pipeline's first stage, run in the trainer: a slot, the copy, the `staged`
  event (also a restore's write-back).
- `saving`: a Checkpointer's saves: staging slots, the copy, the hand-off to the outbox.
- `handle`: `SaveHandle`, the fate of one save as its events arrive.
- `outbox`: each save's `staged` event, published off the training loop.
- `jobs`: a trainer's job: made by its first save, never by a look.
"""

from tierpipe.trainer.checkpointer import Checkpointer
from tierpipe.trainer.handle import SaveHandle, SaveStats

__all__ = ("Checkpointer", "SaveHandle", "SaveStats")
