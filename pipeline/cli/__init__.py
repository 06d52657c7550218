"""The `tierpipe` command: run node-agent stages, inspect a job, operate on it, run the demo.

- `main`: the parser and the dispatch of each verb.
- `render`: what `status`, `plan`, `ls` and `events` print, as text or JSON.
"""

from tierpipe.cli.main import main

__all__ = ("main",)
