"""Cancellation helpers: run cleanup to completion whatever the caller's fate.

A leaf module (asyncio and anyio only), so that every layer that must not be
interrupted half-way - the shutdown of a group, a restart that wires up a
freshly spawned worker, the signal race of ``wait()`` - uses the same rule.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["shielded"]

T = TypeVar("T")


async def shielded(aw: Awaitable[T], on_cancel: Callable[[int], None] | None = None) -> T:
    """Run ``aw`` to completion even if the caller is cancelled.

    Cancellation of the caller is re-raised once ``aw`` finished: cleanup can
    be delayed by a cancel, never skipped. ``on_cancel(n)`` is called with
    the count so far for each cancellation that arrives meanwhile (so a
    caller can hurry the cleanup up, e.g. escalate to SIGKILL).

    *Cancellation*: both asyncio's (``Task.cancel``) and anyio's cancel
    scopes are held off (an anyio shielded scope around an
    ``asyncio.shield``), so this works under ``asyncio.timeout``,
    ``anyio.move_on_after`` and task groups alike.
    """
    task = asyncio.ensure_future(aw)
    cancels = 0
    with anyio.CancelScope(shield=True):
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
    if cancels:
        raise asyncio.CancelledError
    return result
