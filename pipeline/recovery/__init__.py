"""Recovery: getting a job's state back after a restart.

`plan` decides which step to restore and where each rank reads it from (pure); `agree` runs the
ranks' agreement on the stream (or through `collective`, torch.distributed); `load` reads a
shard back from NVMe or object storage, verified; `reindex` rebuilds a job's events from the
shards themselves. Import from the modules: this package imports nothing, so `tierpipe plan` and
`tierpipe reindex` never pay for importing torch.
"""

__all__: tuple[str, ...] = ()
