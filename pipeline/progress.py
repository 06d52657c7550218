"""Progress of long operator work (reindex, prefetch, the demo): units done out of units known
so far.

Library code reports through a plain callback (`Progress`, counted by a `Ticker`); the CLI and
the demo draw a bar from it (`bar`), and nothing else needs to know.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ("Bar", "Progress", "Ticker", "bar")

#: Called with (units done, units known so far) as the work goes.
Progress = Callable[[int, int], None]


class Ticker:
    """Counts units of work for a `Progress` callback (None: counts for nobody). Call it as
    each unit starts (loops that `continue` need no bookkeeping): the units before are done."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress, self.started, self.total = progress, 0, 0

    def more(self, n: int) -> None:
        """`n` more units are known."""
        self.total += n
        self._say(max(0, self.started - 1))

    def __call__(self) -> None:
        """The next unit starts."""
        self.started += 1
        self._say(self.started - 1)

    def done(self) -> None:
        """Every unit is done."""
        self.started = self.total
        self._say(self.total)

    def _say(self, finished: int) -> None:
        if self.progress is not None:
            self.progress(finished, self.total)


class Bar(Protocol):
    """What `bar()` yields: a `Progress` callback that can also change the bar's text."""

    def __call__(
        self, finished: int, total: int | None = None, what: str | None = None
    ) -> None: ...


@contextmanager
def bar(what: str, *, total: int | None = None, stderr: bool = True) -> Iterator[Bar]:
    """A rich progress bar, drawn only when its stream (stderr, else stdout) is a terminal: a
    pipe or a log gets the work's own lines alone. It goes away when the block ends."""
    from rich import progress as rp
    from rich.console import Console

    console = Console(stderr=stderr)
    columns = ("{task.description}", rp.BarColumn(), rp.MofNCompleteColumn(),
               rp.TimeElapsedColumn())  # fmt: skip
    with rp.Progress(*columns, console=console, transient=True,
                     disable=not console.is_terminal) as shown:  # fmt: skip
        task = shown.add_task(what, total=total)

        def update(finished: int, total: int | None = None, what: str | None = None) -> None:
            shown.update(task, completed=finished, total=total, description=what)

        yield update
