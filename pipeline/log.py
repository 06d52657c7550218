"""structlog configuration: JSON lines when stderr is not a terminal, else a console renderer.

Secrets never reach a log line: tracebacks are rendered without frame locals (a local holding a
password or a key would otherwise be printed), and a last-resort scrubber replaces every known
secret value in every rendered line with `***`. Known secrets are those passed to
`configure_logging` and those registered by `register_secrets` (every `Bus` registers its
settings' secrets, so every process that talks to NATS scrubs them).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import unquote

import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars, get_contextvars
from structlog.typing import (
    EventDict,
    ExceptionRenderer,
    Processor,
    ProcessorReturnValue,
    WrappedLogger,
)

if TYPE_CHECKING:
    from tierpipe.settings import Settings

__all__ = (
    "bind_io",
    "configure_logging",
    "register_secrets",
    "scrub",
    "settings_secrets",
    "unit_of_work",
)

_MASK = "***"
_lock = threading.Lock()
#: Every form of every known secret, longest first (so a secret containing another is masked
#: whole).
_secrets: tuple[str, ...] = ()


def settings_secrets(settings: Settings) -> list[str]:
    """The secret values of `settings` (passwords, tokens, keys, URL credentials), plus the S3
    access key id (the other half of the key pair)."""
    found = list(settings.secrets())
    if settings.s3_access_key_id and len(settings.s3_access_key_id) >= 4:
        found.append(settings.s3_access_key_id)
    return found


def register_secrets(values: Iterable[str | None]) -> None:
    """Add secret values to be masked in every log line of this process (idempotent)."""
    global _secrets
    with _lock:
        _secrets = tuple(sorted(set(_secrets) | _forms(values), key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str | None] | None = None) -> str:
    """`text` with every registered secret (or every one of `secrets`) replaced by `***`."""
    known = _secrets if secrets is None else sorted(_forms(secrets), key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, _MASK)
    return text


def _forms(values: Iterable[str | None]) -> set[str]:
    """Each value as written, as JSON escapes it, and percent-decoded (as in a URL)."""
    forms: set[str] = set()
    for value in values:
        if value and len(value) >= 4:  # shorter: too easily ordinary text
            forms.update({value, json.dumps(value)[1:-1], unquote(value)})
    return {f for f in forms if len(f) >= 4}


class _Scrubbed:
    """The renderer, then the scrubber: the last processor, so it sees the finished line."""

    def __init__(self, renderer: Processor) -> None:
        self.renderer = renderer

    def __call__(
        self, logger: WrappedLogger, name: str, event_dict: EventDict
    ) -> ProcessorReturnValue:
        rendered = self.renderer(logger, name, event_dict)
        if isinstance(rendered, bytes):
            return scrub(rendered.decode("utf-8", "replace")).encode()
        return scrub(rendered) if isinstance(rendered, str) else rendered


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    *,
    only_if_unconfigured: bool = False,
    secrets: Iterable[str | None] = (),
) -> None:
    """Configure structlog once for this process.

    Args:
        level: minimum level name (`debug`, `info`, `warning`, `error`).
        fmt: `json`, `console`, or `auto` (console on a terminal, else JSON).
        only_if_unconfigured: leave an application's own structlog configuration alone
            (what a library such as `Checkpointer` passes).
        secrets: values never to print (e.g. `settings_secrets(settings)`); masked as `***`.
    """
    register_secrets(secrets)
    if only_if_unconfigured and structlog.is_configured():
        return
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    if console:
        tracebacks: Processor = structlog.dev.set_exc_info
        renderer: Processor = structlog.dev.ConsoleRenderer(
            exception_formatter=_console_tracebacks()
        )
    else:
        # Frame locals off: a traceback must not print the password a frame was holding.
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            tracebacks,
            _Scrubbed(renderer),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


@contextmanager
def unit_of_work(**fields: object) -> Iterator[None]:
    """Bind `fields` (stage, job, step, rank) to the log lines of one unit of work. What the
    work binds besides with `bind_contextvars` (bytes, paths) goes into its canonical line
    and no further: the context is as before once the block ends."""
    outer = get_contextvars()
    bind_contextvars(**fields)
    try:
        yield
    finally:
        clear_contextvars()
        bind_contextvars(**outer)


def bind_io(nbytes: int, seconds: float, **fields: object) -> None:
    """Bind what a unit of work moved (bytes, MiB/s and `fields`) to its canonical line."""
    bind_contextvars(nbytes=nbytes, mib_s=round(nbytes / 2**20 / max(seconds, 1e-9), 1), **fields)


def _console_tracebacks() -> ExceptionRenderer:
    """rich's traceback (when installed) without locals, and only each frame's own line as
    the plain one shows it: the lines around it may hold literals, and the traceback is
    rendered after the secrets were masked."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False, extra_lines=0)
