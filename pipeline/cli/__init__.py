"""The `tierpipe` command: run node-agent stages, inspect a job, operate on it, run the demo.

- `dispatch`: `main`, the entry point: parse, load the settings, hand each verb on.
- `exits`: the exit statuses, and the one mapping from the error tree to them.
- `parser`: the verbs and their options (`--json` on every verb but the services); how a rate
  and a time on the command line are read.
- `views`: the read-only views (`status`, `plan`, `ls`, `events`).
- `ops`: the operations (`worker`, `flush`, `budget`, `reindex`, `export`, `import`,
  `prefetch`, `gc`, `rm`, `up`, `demo`).
- `render`: what `status` and `ls` print, as text or JSON.
- `events`: what `events` prints: its filters, a line or a JSON object per event.
"""

from tierpipe.cli.dispatch import main

__all__ = ("main",)
