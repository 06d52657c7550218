"""tierpipe benchmarks: `python -m bench <name> [--size-gib N] [--reps N]`.

- `stall`: how long `Checkpointer.save()` blocks the training loop (blocking and overlapped
  modes), against a bare memcpy, `torch.save`+fsync and DCP `async_save` (default and reused
  `DefaultStager`), on the same synthetic transformer state in the same run.
- `nvme`: the node agent's `staged -> written -> verified` path (nvme-write, verify, evict
  workers as a subprocess) against `dd` O_DIRECT write/read of the same byte count, plus
  `torch.save`+fsync and safetensors `save_file`+fsync for context.

Every benchmark prints progress to stderr and exactly one JSON line (medians) to stdout.
"""
