"""Cancellation helpers: run cleanup to completion whatever the caller's fate,
bound a wait in time, and defer a task that may be stopped before it starts.

A leaf module (asyncio only; anyio only where the caller's anyio cancel
scopes must be held off, or on Python 3.10), so that every layer that must
not be interrupted half-way - the shutdown of a group, a restart that wires
up a freshly spawned worker, the signal race of ``wait()`` - uses the same
rule, and every bounded wait the same timeout.

Why not anyio's ``move_on_after`` and cancel scopes throughout: importing
anyio's asyncio backend costs ~20 ms of CPU at the first use - inside the
first ``wait()``, beside the workers it just started - and each scope a few
tens of microseconds; ``asyncio.timeout`` (3.11+) does the same job for
asyncio's own cancellations.
"""

from __future__ import annotations

import asyncio
import math
import sys
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType

__all__ = ["DelayedTask", "move_on_after", "shielded"]

T = TypeVar("T")

#: anyio's asyncio backend: an anyio cancel scope can exist only once it is imported.
_ANYIO_BACKEND = "anyio._backends._asyncio"


def _anyio_shield() -> Any:
    """A shielded anyio cancel scope if anyio's asyncio backend is loaded,
    else ``None`` (no anyio scope can surround the caller)."""
    if _ANYIO_BACKEND not in sys.modules:
        return None
    import anyio

    return anyio.CancelScope(shield=True)


async def shielded(aw: Awaitable[T], on_cancel: Callable[[int], None] | None = None) -> T:
    """Run ``aw`` to completion even if the caller is cancelled.

    Cancellation of the caller is re-raised once ``aw`` finished: cleanup can
    be delayed by a cancel, never skipped. ``on_cancel(n)`` is called with
    the count so far for each cancellation that arrives meanwhile (so a
    caller can hurry the cleanup up, e.g. escalate to SIGKILL).

    *Cancellation*: both asyncio's (``Task.cancel``) and anyio's cancel
    scopes are held off (an anyio shielded scope around an
    ``asyncio.shield``, entered only where anyio is in use), so this works
    under ``asyncio.timeout``, ``anyio.move_on_after`` and task groups alike.
    """
    task = asyncio.ensure_future(aw)
    cancels = 0
    scope = _anyio_shield()
    if scope is not None:
        scope.__enter__()
    try:
        while True:
            try:
                result = await asyncio.shield(task)
                break
            except asyncio.CancelledError:
                if task.done():
                    raise
                cancels += 1
                if on_cancel is not None:
                    on_cancel(cancels)
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
    if cancels:
        raise asyncio.CancelledError
    return result


class move_on_after:
    """``async with move_on_after(seconds):`` - the block is cancelled after
    ``seconds`` (``None`` or infinite: never) and then left quietly; a
    cancellation from outside goes through. :attr:`cancelled_caught` says
    whether the time ran out.

    ``asyncio.timeout`` on 3.11+ (asyncio alone); anyio's ``move_on_after``
    on 3.10, which has no ``Task.uncancel`` to tell the two apart.
    """

    __slots__ = ("_cm", "_delay", "cancelled_caught")

    def __init__(self, seconds: float | None) -> None:
        self._delay = None if seconds is None or seconds == math.inf else max(0.0, seconds)
        self._cm: Any = None
        self.cancelled_caught = False

    async def __aenter__(self) -> move_on_after:
        if sys.version_info >= (3, 11):
            self._cm = asyncio.timeout(self._delay)
            await self._cm.__aenter__()
        else:  # pragma: no cover - 3.10
            import anyio

            self._cm = anyio.move_on_after(math.inf if self._delay is None else self._delay)
            self._cm.__enter__()
        return self

    def expire(self) -> None:
        """End the block now, as if its time ran out (on the loop; inside
        the block only)."""
        if sys.version_info >= (3, 11):
            self._cm.reschedule(asyncio.get_running_loop().time())
        else:  # pragma: no cover - 3.10
            self._cm.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if sys.version_info >= (3, 11):
            try:
                await self._cm.__aexit__(exc_type, exc, tb)
            except TimeoutError:
                self.cancelled_caught = True
                return True
            return False
        suppress = bool(self._cm.__exit__(exc_type, exc, tb))  # pragma: no cover - 3.10
        self.cancelled_caught = bool(self._cm.cancelled_caught)  # pragma: no cover - 3.10
        return suppress  # pragma: no cover - 3.10


class DelayedTask:
    """``run()`` as a task of its own, ``delay`` seconds from now (on the
    running loop); :meth:`stop` ends it either way. Until then only a timer
    handle: stopping it sooner cancels the handle - no task was made, none
    to unwind (``close()`` right after a start)."""

    __slots__ = ("_handle", "_run", "_task")

    def __init__(self, delay: float, run: Callable[[], Awaitable[None]]) -> None:
        self._run = run
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            delay, self._begin
        )

    def _begin(self) -> None:
        self._handle = None
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Cancel the timer, or the task and await its end. Idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
