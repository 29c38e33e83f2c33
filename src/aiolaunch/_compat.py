"""Every use of CPython internals and version differences, each behind one function.

aiolaunch relies on a few private details of :mod:`asyncio` (the handlers a
loop keeps for ``loop.add_signal_handler``, the SIGINT handler installed by
``asyncio.run``). Keeping each access here means a CPython change breaks one
small function with a test, not the supervisor; every function degrades to
"not found" rather than raising when the detail is missing.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "call_handle_soon",
    "is_asyncio_run_sigint_handler",
    "is_default_handler",
    "loop_signal_handler",
    "reinstall_loop_signal_handler",
    "task_cancelling",
]


def loop_signal_handler(loop: asyncio.AbstractEventLoop, sig: int) -> asyncio.Handle | None:
    """The handle the application registered with ``loop.add_signal_handler(sig, ...)``.

    ``None`` when there is none, or when the loop does not keep them the way
    CPython's selector loops do (``loop._signal_handlers``).
    """
    handlers = getattr(loop, "_signal_handlers", None)
    if not isinstance(handlers, dict):
        return None
    handle = handlers.get(sig)
    return handle if isinstance(handle, asyncio.Handle) else None


def _callback_of(handle: asyncio.Handle) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    callback = getattr(handle, "_callback", None)
    args = getattr(handle, "_args", None)
    if not callable(callback) or not isinstance(args, tuple):
        return None
    return callback, args


def reinstall_loop_signal_handler(
    loop: asyncio.AbstractEventLoop, sig: int, handle: asyncio.Handle
) -> bool:
    """Put a handle taken by :func:`loop_signal_handler` back; ``False`` if that failed."""
    found = _callback_of(handle)
    if found is None or handle.cancelled():
        return False
    callback, args = found
    try:
        loop.add_signal_handler(sig, callback, *args)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def call_handle_soon(loop: asyncio.AbstractEventLoop, handle: asyncio.Handle) -> bool:
    """Schedule a signal handle's callback as the loop would on a signal.

    Runs in the handle's own :mod:`contextvars` context; ``False`` when the
    handle was cancelled or cannot be read.
    """
    found = _callback_of(handle)
    if found is None or handle.cancelled():
        return False
    callback, args = found
    context = getattr(handle, "_context", None)
    loop.call_soon(callback, *args, context=context)
    return True


def is_asyncio_run_sigint_handler(handler: object) -> bool:
    """Whether ``handler`` is the SIGINT handler ``asyncio.run()`` installs (3.11+).

    That handler cancels the main task on the first Ctrl-C; it stands for
    Python's default ``KeyboardInterrupt`` behaviour, so aiolaunch treats it
    like :func:`signal.default_int_handler`.
    """
    if not isinstance(handler, functools.partial):
        return False
    runner = getattr(asyncio, "Runner", None)
    on_sigint = getattr(runner, "_on_sigint", None)
    return on_sigint is not None and getattr(handler.func, "__func__", None) is on_sigint


def task_cancelling(task: asyncio.Task[Any] | None) -> int:
    """Pending cancellation requests of ``task`` (``Task.cancelling()``; 0 before 3.11)."""
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if callable(cancelling) else 0


def is_default_handler(handler: object) -> bool:
    """Whether ``handler`` means "the signal's default meaning" for aiolaunch.

    ``SIG_DFL``, ``None`` (installed from C), :func:`signal.default_int_handler`
    and ``asyncio.run``'s SIGINT handler: there is no application handler to
    chain to, and ``wait()`` raising ``SignalException`` carries the meaning.
    """
    return (
        handler is None
        or handler == signal.SIG_DFL
        or handler is signal.default_int_handler
        or is_asyncio_run_sigint_handler(handler)
    )
