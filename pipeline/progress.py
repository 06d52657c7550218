"""Progress of long operator work (reindex, prefetch): units done out of units known so far.

Library code reports through a plain callback; the CLI draws a progress bar from it
(`tierpipe.cli`), and nothing else needs to know.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ("Progress", "Ticker")

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
