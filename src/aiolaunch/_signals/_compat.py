"""asyncio's signal internals, each behind one function (``_compat.py``'s
rule, for the signal handlers ``wait()`` takes over and gives back).

aiolaunch relies on a few private details of asyncio's unix loop and of
CPython's ``signal`` module: the handler table a loop keeps for
``loop.add_signal_handler`` (``_signal_handlers``) and a handle's callback
(to chain to an application's handler and to put it back), the loop's own
steps for adding and removing a handler (taken through the C module
``_signal``, at a fraction of the cost: :func:`add_loop_signal_handler`),
and the SIGINT handler ``asyncio.run`` installs. Keeping each access here
means a CPython change breaks one small function with a test
(``tests/test_compat.py``), not the supervisor; where it can, a function
degrades to "not found", or to the loop's public methods, rather than
raising when the detail is missing.

Every function was checked on CPython 3.10, 3.11, 3.12 and 3.13.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "add_loop_signal_handler",
    "call_handle_soon",
    "ended_asyncio_run_sigint_handler",
    "is_asyncio_run_sigint_handler",
    "is_default_handler",
    "loop_signal_handler",
    "raw_getsignal",
    "raw_setsignal",
    "reinstall_loop_signal_handler",
    "remove_loop_signal_handler",
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
        add_loop_signal_handler(loop, sig, callback, *args)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=1)
def _valid_signals() -> frozenset[int]:
    return frozenset(signal.valid_signals())


def _check_signal(sig: int) -> None:
    # asyncio's BaseSelectorEventLoop._check_signal, with the valid signals
    # computed once (they are fixed for the life of the process).
    if not isinstance(sig, int):
        raise TypeError(f"sig must be an int, not {sig!r}")
    if sig not in _valid_signals():
        raise ValueError(f"invalid signal number {sig}")


@contextlib.contextmanager
def _cheap_signal_check(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    # CPython's unix loop checks every signal number of add_signal_handler
    # and remove_signal_handler against signal.valid_signals(), which builds
    # a set of ~65 Signals members on each call: 60-400 us, twice per signal
    # that wait() takes over and gives back (8 calls per wait()). For the
    # duration of our own call, the loop instance's _check_signal is the same
    # check against a set computed once. Other loops (uvloop: no __dict__)
    # are called as they are.
    if not hasattr(type(loop), "_check_signal") or not hasattr(loop, "__dict__"):
        yield
        return
    loop._check_signal = _check_signal  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del loop._check_signal  # type: ignore[attr-defined]


if sys.platform != "win32":
    from asyncio import unix_events as _unix_events
else:  # pragma: no cover - aiolaunch runs on POSIX
    _unix_events = None

try:  # CPython's C module under ``signal``: its functions without the enum wrappers
    import _signal  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - not CPython
    _signal = signal


def raw_getsignal(sig: int) -> Any:
    """``signal.getsignal(sig)`` as the C module gives it: ``SIG_DFL``/``SIG_IGN``
    as plain ints (equal to the ``signal.Handlers`` members), a Python handler
    as itself. ``signal.getsignal`` tries ``signal.Handlers(handler)`` first,
    which fails for a Python handler with a message holding ``repr(handler)``
    (see :class:`_Relay`)."""
    return _signal.getsignal(sig)


class _Relay:
    """Stands in for a Python-level signal handler while the loop replaces it.

    ``loop.add_signal_handler`` replaces the handler with ``signal.signal()``,
    which turns the handler it returns into a ``signal.Handlers`` member where
    it can: for a Python callable that fails with a ``ValueError`` whose
    message is built from ``repr(handler)``. ``asyncio.run()``'s SIGINT handler
    is a ``functools.partial`` holding the main task, whose repr formats the
    coroutine and its frame: ~50 us of every ``wait()`` (which takes SIGINT
    over and gives it back). The relay's repr is a constant; a signal that
    arrives while it is installed goes to the handler it stands for.
    """

    __slots__ = ("handler",)

    def __init__(self, handler: Callable[[int, Any], Any]) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame: Any) -> Any:
        return self.handler(signum, frame)

    def __repr__(self) -> str:
        return "<aiolaunch signal relay>"


@contextlib.contextmanager
def _cheap_replaced_repr(sig: int) -> Iterator[None]:
    # See _Relay. Where the handler is no Python callable (SIG_DFL, SIG_IGN,
    # None), or we cannot set one (not the main thread, a bad number: the
    # loop's own call then fails with its own error), nothing is swapped.
    try:
        previous = _signal.getsignal(sig)
    except (ValueError, OSError, TypeError):
        previous = None
    relay: _Relay | None = None
    if callable(previous) and not isinstance(previous, int):
        relay = _Relay(previous)
        try:
            _signal.signal(sig, relay)
        except (ValueError, OSError, TypeError):
            relay = None
    try:
        yield
    finally:
        if relay is not None and _signal.getsignal(sig) is relay:
            _signal.signal(sig, previous)  # the loop's call failed: as it was


@functools.lru_cache(maxsize=8)
def _plain_unix_loop(cls: Any) -> bool:
    # asyncio's own unix selector loop (any policy's, subclasses included),
    # its signal methods as CPython 3.10-3.13 wrote them (the same source in
    # all four): only then is _add_direct/_remove_direct what they would do.
    base = getattr(_unix_events, "_UnixSelectorEventLoop", None)
    return (
        base is not None
        and issubclass(cls, base)
        and cls.add_signal_handler is base.add_signal_handler
        and cls.remove_signal_handler is base.remove_signal_handler
        and cls._handle_signal is base._handle_signal
        and callable(getattr(_unix_events, "_sighandler_noop", None))
    )


def _direct(loop: asyncio.AbstractEventLoop) -> bool:
    cls: Any = type(loop)
    return _plain_unix_loop(cls) and isinstance(getattr(loop, "_signal_handlers", None), dict)


def _add_direct(
    loop: asyncio.AbstractEventLoop, sig: int, callback: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    # _UnixSelectorEventLoop.add_signal_handler step for step, through the C
    # module: signal.signal() converts the handler it returns into a
    # signal.Handlers member where it can, which for a Python handler fails
    # with a ValueError built from repr(handler) (see _Relay); and
    # iscoroutinefunction(callback) (inspect) is moot for our callbacks.
    # Cold (the first wait() after the loop slept), 4 signals taken over
    # and given back cost ~530 us through the loop's methods.
    _check_signal(sig)
    if loop.is_closed():
        raise RuntimeError("Event loop is closed")
    try:
        # Raises ValueError outside the main thread, as the loop's does.
        _signal.set_wakeup_fd(loop._csock.fileno())  # type: ignore[attr-defined]
    except (ValueError, OSError) as exc:
        raise RuntimeError(str(exc)) from None
    handlers: dict[int, asyncio.Handle] = loop._signal_handlers  # type: ignore[attr-defined]
    handlers[sig] = asyncio.Handle(callback, args, loop, None)
    try:
        _signal.signal(sig, _unix_events._sighandler_noop)  # type: ignore[attr-defined]
        _signal.siginterrupt(sig, False)  # SA_RESTART: fewer EINTRs
    except OSError as exc:
        del handlers[sig]
        if not handlers:
            with contextlib.suppress(ValueError, OSError):
                _signal.set_wakeup_fd(-1)
        if exc.errno == errno.EINVAL:
            raise RuntimeError(f"sig {sig} cannot be caught") from None
        raise


def _remove_direct(loop: asyncio.AbstractEventLoop, sig: int) -> bool:
    # _UnixSelectorEventLoop.remove_signal_handler step for step (see _add_direct).
    _check_signal(sig)
    handlers: dict[int, asyncio.Handle] = loop._signal_handlers  # type: ignore[attr-defined]
    if handlers.pop(sig, None) is None:
        return False
    try:
        _signal.signal(sig, _signal.default_int_handler if sig == signal.SIGINT else 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise RuntimeError(f"sig {sig} cannot be caught") from None
        raise
    if not handlers:
        with contextlib.suppress(ValueError, OSError):
            _signal.set_wakeup_fd(-1)
    return True


def add_loop_signal_handler(
    loop: asyncio.AbstractEventLoop, sig: int, callback: Callable[..., Any], *args: Any
) -> None:
    """``loop.add_signal_handler(sig, callback, *args)`` (``callback`` a plain
    function, not a coroutine function), at a fraction of its cost.

    On asyncio's own unix loop: its steps, through the C signal module (see
    :func:`_add_direct`); on any other loop (uvloop, a subclass overriding
    the method): the loop's own method, without its per-call
    ``signal.valid_signals()`` (see :func:`_cheap_signal_check`) and without
    the repr of the Python handler it replaces (see :class:`_Relay`). The
    same errors either way: ``ValueError``/``TypeError`` for a bad number,
    ``RuntimeError`` outside the main thread, on a closed loop or for a
    signal that cannot be caught.
    """
    if _direct(loop):
        _add_direct(loop, sig, callback, args)
        return
    with _cheap_signal_check(loop), _cheap_replaced_repr(sig):
        loop.add_signal_handler(sig, callback, *args)


def remove_loop_signal_handler(loop: asyncio.AbstractEventLoop, sig: int) -> bool:
    """``loop.remove_signal_handler(sig)``: ``SIG_DFL`` (SIGINT:
    ``default_int_handler``) installed, ``False`` if the loop had no handler.
    At a fraction of its cost, as :func:`add_loop_signal_handler`."""
    if _direct(loop):
        return _remove_direct(loop, sig)
    with _cheap_signal_check(loop):
        return loop.remove_signal_handler(sig)


def raw_setsignal(sig: int, handler: Any) -> None:
    """``signal.signal(sig, handler)``, without turning the handler it replaces
    into a ``signal.Handlers`` member (see :func:`raw_getsignal`)."""
    _signal.signal(sig, handler)


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


def ended_asyncio_run_sigint_handler(handler: object) -> bool:
    """Whether ``handler`` is ``asyncio.run()``'s SIGINT handler of a run that
    has ended (its main task is done).

    The runner puts :func:`signal.default_int_handler` back when its run ends
    only if its own handler is still installed then; a ``wait()`` still
    holding SIGINT at that moment (main() returned, the loop's teardown is
    cancelling the waiting task) would otherwise restore the dead run's.
    """
    if not is_asyncio_run_sigint_handler(handler):
        return False
    assert isinstance(handler, functools.partial)
    main_task = handler.keywords.get("main_task")
    return isinstance(main_task, asyncio.Future) and main_task.done()


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
