"""How `tierpipe` ends: its exit statuses, the one mapping from the error tree
(`tierpipe.errors`) to them, and what `tierpipe --help` says of them."""

from __future__ import annotations

import signal

from tierpipe.errors import (
    AgentLockedError,
    ConfigError,
    JobBusyError,
    JobStateMissingError,
    StaleStepError,
)

__all__ = ("EPILOG", "FAILURE", "INTERRUPTED", "OK", "READER_GONE", "USAGE", "exit_code")

#: The command did what was asked.
OK = 0
#: It could not: NATS or the object store unreachable, a job or step not found, nothing to do
#: that was asked for, a refusal of what the job's state forbids, a damaged checkpoint.
FAILURE = 1
#: It was asked wrongly: bad arguments or settings, a bad or unknown name of a node (argparse's
#: status too).
USAGE = 2
#: Ctrl-C (a `--follow` ended by it is not interrupted: it ends with `OK`).
INTERRUPTED = 128 + signal.SIGINT
#: The reader of stdout went away (`tierpipe ls --json | head -1`).
READER_GONE = 128 + signal.SIGPIPE

#: `ConfigError` leaves that say what the state of the job or node forbids now, not what was
#: asked wrongly: the same command may succeed later.
_STATE_REFUSALS = (AgentLockedError, JobBusyError, JobStateMissingError, StaleStepError)

#: Under `tierpipe --help`.
EPILOG = f"""\
exit status:
  {OK}    ok
  {FAILURE}    failed: NATS or the object store unreachable, a job or step not found, nothing
       to do that was asked for, refused by the job's state (in use, locked)
  {USAGE}    usage error: bad arguments, settings or names (a node nothing knows too)
  {INTERRUPTED}  interrupted (Ctrl-C; `events --follow` ends with 0)

Read commands take --json: one JSON object per line on stdout. Logs go to stderr, never to
stdout."""


def exit_code(error: Exception) -> int:
    """The exit status `tierpipe` ends with after `error` (an error of the tree, or any other
    exception a command let through)."""
    if isinstance(error, ConfigError) and not isinstance(error, _STATE_REFUSALS):
        return USAGE
    return FAILURE
