"""One rank of a torch.distributed (gloo) job that restores through tierpipe.

    python -m tests.dist_rank JOB RANK WORLD STORE_FILE

Settings come from the environment. Prints one JSON line: the restored step, tier, how the
ranks agreed, rounds, and a sha256 per model tensor after the restore; or the error.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from tests.test_recovery import model
from tierpipe.errors import TierpipeError
from tierpipe.trainer.checkpointer import Checkpointer


def main() -> None:
    job, rank, world, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        target = model(999)
        with Checkpointer(job, rank=rank, world_size=world) as ckpt:
            try:
                restored = ckpt.restore({"model": target})
            except TierpipeError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e)}))
                return
        sums = {
            k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in target.state_dict().items()
        }
        print(json.dumps({
            "step": restored.step,
            "tier": restored.source.tier,
            "agreement": restored.agreement,
            "rounds": restored.rounds,
            "sums": sums,
        }))  # fmt: skip
    finally:  # (no rank tears gloo down while another is still in a collective)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
