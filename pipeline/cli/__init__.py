"""The `tierpipe` command: run node-agent stages, inspect a job, operate on it, run the demo.

- `dispatch`: `main`, the entry point: parse, load the settings, hand each verb on.
- `parser`: the verbs and their options; how a rate and a time on the command line are read.
- `views`: the read-only views (`status`, `plan`, `ls`, `events`).
- `ops`: the operations (`worker`, `flush`, `budget`, `reindex`, `export`, `prefetch`, `gc`,
  `rm`, `up`, `demo`).
- `render`: what `status`, `plan`, `ls` and `events` print, as text or JSON.
"""

from tierpipe.cli.dispatch import main

__all__ = ("main",)
