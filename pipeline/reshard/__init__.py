"""Resharding on load: a restore into another world size or mesh than the one that saved.

- `layout`: the planner (pure): which parts of which saved shards each new local shard needs,
  the whole blocks to read for them, and the copy of each part into its target;
- `reads`: ranged reads of saved shards from this node's NVMe, a peer or object storage, every
  block checked against its digest before its bytes are used, an outage's copy tried again;
- `copies`: one copy of a shard read by byte ranges (a file, a peer's endpoint, an object);
- `buffers`: the reads' buffers (reused, bounded in bytes per restore);
- `steplayout`: a save's global layout (the same for every rank), kept in the job state;
- `planning`: which parts of which saved shards fill each target, from the layout or a header;
- `assemble`: one rank's state from parts of the saved shards (the value rule, the copies);
- `restore`: the resharded restore itself (when it is needed, the step, the agreement).

Import from the modules: this package imports nothing.
"""

__all__: tuple[str, ...] = ()
