"""Interop: a job's step in the formats other tools load, and a checkpoint of theirs brought in.

- `merge`: a step's ranks merged into one global layout (pure): which rank's shard or value
  each part of the output takes, and the check that the shards tile every sharded tensor.
- `dcp`: the step as one torch.distributed.checkpoint checkpoint (`tierpipe export --to dcp`),
  and a DCP checkpoint read back without running code it holds.
- `merged`: the full model as one torch file (`tierpipe export --to torch --merged`);
  `hfsplit`: as safetensors files written in place, split with an index as Hugging Face's
  (`--to safetensors --merged`).
- `importer`: a DCP checkpoint saved as a step of a job (`tierpipe import --from dcp`).

Import from the modules: this package imports nothing.
"""

__all__: tuple[str, ...] = ()
