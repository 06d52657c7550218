"""structlog configuration: JSON lines when stderr is not a terminal, else a console renderer."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging"]


def configure_logging(
    level: str = "info", fmt: str = "auto", *, only_if_unconfigured: bool = False
) -> None:
    """Configure structlog once for this process.

    Args:
        level: minimum level name (`debug`, `info`, `warning`, `error`).
        fmt: `json`, `console`, or `auto` (console on a terminal, else JSON).
        only_if_unconfigured: leave an application's own structlog configuration alone
            (what a library such as `Checkpointer` passes).
    """
    if only_if_unconfigured and structlog.is_configured():
        return
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if not console else structlog.dev.set_exc_info,
            structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
