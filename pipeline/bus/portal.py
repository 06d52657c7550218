"""The trainer's NATS client: a `Bus` on an anyio blocking portal (its own event-loop thread).

The trainer's threads never run the bus: `Checkpointer` calls `BusPortal.run` from them, and
every call has a deadline, past which the call is cancelled and the trainer gets
`BusUnavailableError` while the client keeps reconnecting in the background.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

import structlog
from anyio.from_thread import start_blocking_portal

from tierpipe.bus.client import Bus
from tierpipe.errors import BusUnavailableError, TierpipeError
from tierpipe.settings import Settings

__all__ = ("BusPortal",)

log = structlog.get_logger(__name__)

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")
#: The bus loop runs on uvloop where it is installed (as the node agent does).
_LOOP_OPTIONS = {"use_uvloop": True} if importlib.util.find_spec("uvloop") else {}


class BusPortal:
    """A NATS client on its own event-loop thread (an anyio blocking portal), so the trainer's
    threads never run it; every call has a deadline."""

    def __init__(self, settings: Settings, name: str) -> None:
        self._stack: contextlib.ExitStack | None = contextlib.ExitStack()
        self.portal = self._stack.enter_context(
            start_blocking_portal("asyncio", _LOOP_OPTIONS, name="tierpipe-bus")
        )
        self.bus = Bus(settings, name=name)
        try:
            self.run(self.bus.connect, timeout=settings.connect_timeout_s + 5)
        except BaseException:
            self.close()
            raise

    def run(
        self,
        func: Callable[[*PosArgsT], Awaitable[T]],
        *args: *PosArgsT,
        timeout: float | None,
    ) -> T:
        """Run `func(*args)` on the bus thread and return its result.

        Raises:
            BusUnavailableError: no answer within `timeout` (NATS down or unreachable: the
                client keeps reconnecting meanwhile), with the cause kept; the call is cancelled.
            TierpipeError: what the coroutine raised.
        """
        future = self.portal.start_task_soon(func, *args)
        done, _ = concurrent.futures.wait([future], timeout)
        if not done:  # (not `except TimeoutError`: the coroutine may raise a TimeoutError itself)
            future.cancel()  # cancels the call's task on the bus thread
            nc = self.bus.nc
            state = "connected" if nc is not None and nc.is_connected else "not connected"
            raise BusUnavailableError(
                f"NATS did not answer within {timeout:g} s ({state})"
            ) from TimeoutError(f"bus call timed out after {timeout} s")
        return future.result()

    def close(self) -> None:
        """Close the client, then stop the loop, cancelling what is left, and join its thread
        (idempotent). A loop that does not stop within 10 s is left to its daemon thread."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            self.run(self.bus.aclose, timeout=10)
        except (TimeoutError, TierpipeError) as e:
            log.debug("bus_close_failed", error=str(e))
        # The portal's exit joins the loop's thread without a deadline: it runs on a daemon
        # thread of its own, so a stuck loop cannot hang the trainer (nor its exit).
        closer = threading.Thread(target=self._stop, args=(stack,), name="tierpipe-bus-close")
        closer.daemon = True
        closer.start()
        closer.join(10)

    def _stop(self, stack: contextlib.ExitStack) -> None:
        with contextlib.suppress(RuntimeError):  # (the loop is gone already)
            self.portal.call(self.portal.stop, True)  # cancels the calls still running
        stack.close()  # joins the loop's thread
