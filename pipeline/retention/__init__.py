"""Retention's shared rules and operators' clean-up.

`kept` says what a job keeps on each tier, from its state in KV (the one rule the evict stage,
the flush stage and `tierpipe gc` apply); `gc` finds and removes what no kept step owns (objects,
COMMITs, this node's NVMe files); `rm` deletes a job. Import from the modules.
"""

__all__: tuple[str, ...] = ()
