"""Recovery: getting a job's state back after a restart.

- `plan`: the restore planner (pure): which step to restore, which ranks read it from object
  storage; `kvplan`: the plan an operator is shown (`tierpipe plan`), the same planner over the
  job state in KV with an assumption about NVMe in place of a look at the disks.
- `agree`: `Restorer`, one rank's part of a restart; `leader`: rank 0's part (reports, plans);
  `follower`: the other ranks' (taking plans); `collective`: the agreement through
  torch.distributed instead of the stream.
- `survey`: what a restart's ranks can read, from the job state and their own disks.
- `load`: a shard read back from NVMe or object storage, verified (`_read`: to tensors,
  `_writeback`: a copy from object storage staged for NVMe again, `_short`: resource failures).
- `prefetch`: a node's shards copied to its NVMe ahead of a restart; `export`: a step read rank
  by rank and written out in other tools' formats (per rank, merged, DCP: `tierpipe.interop`);
  `reindex`: a job's events rebuilt from the shards themselves.

Import from the modules: this package imports nothing, so `tierpipe plan` and `tierpipe
reindex` never pay for importing torch.
"""

__all__: tuple[str, ...] = ()
