"""Signal race for ``wait()``: stop (or only forward) on the signals sent to the supervisor.

Handlers are installed on the running loop (``loop.add_signal_handler``) while
at least one ``wait()`` of that loop watches the signal, shared by every
context waiting in it; the previous handler is restored when the last watcher
of that signal returns - including an inherited ``SIG_IGN`` (a signal ignored
on entry, as under ``nohup``, is left ignored and never forwarded).

Each waiter watches two sets: *stop* signals (by default SIGTERM, SIGINT,
SIGHUP, SIGQUIT) end its group - the first one received is reported once, a
later one is reported as a repeat (the caller escalates to SIGKILL) - and
*forward* signals are only passed on to the workers.

The application keeps its own handlers: a handler it installed before
``wait()`` (``loop.add_signal_handler`` or a Python-level ``signal.signal``
callable) is called for every signal aiolaunch takes, after the workers were
signalled (:meth:`SignalWatch.signalled`). ``SIG_DFL``,
``default_int_handler`` and any Python-level SIGINT handler (``asyncio.run``'s,
ipykernel's: they stand for ``KeyboardInterrupt``) are not called: their
meaning is carried by ``wait()`` raising ``SignalException``.

A signal that arrives after its waiter decided to return is re-delivered to the
process once the previous handler is back, so it is never swallowed.

Outside the main thread (or on a loop without signal support) nothing is
installed: ``wait()`` then works without the race, and warns once in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from ._compat import (
    add_loop_signal_handler,
    call_handle_soon,
    ended_asyncio_run_sigint_handler,
    is_default_handler,
    loop_signal_handler,
    raw_getsignal,
    raw_setsignal,
    reinstall_loop_signal_handler,
    remove_loop_signal_handler,
)

if TYPE_CHECKING:
    from .._workers._handle import WorkerHandle

__all__ = ["STOP_SIGNALS", "SignalWatch", "forward_signal", "watch_signals"]

logger = logging.getLogger("aiolaunch")

STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
_SignalCallback = Callable[[signal.Signals], None]


class SignalWatch:
    """What one waiter sees: the first stop signal received, if any.

    ``received`` is the first stop signal; ``consumed`` is set by the waiter
    once it acted on it (an unconsumed one is re-delivered on leaving).
    """

    def __init__(
        self,
        on_signal: _SignalCallback,
        stop: Iterable[signal.Signals],
        forward: Iterable[signal.Signals] = (),
        on_repeat: _SignalCallback | None = None,
        on_forward: _SignalCallback | None = None,
    ) -> None:
        self.received: signal.Signals | None = None
        self.consumed = False
        self.forward = frozenset(forward)
        # A signal in both sets is only forwarded (the explicit opt-in wins).
        self.stop = frozenset(stop) - self.forward
        self._on_signal = on_signal
        self._on_repeat = on_repeat
        self._on_forward = on_forward
        #: the hub of its loop while it watches (set and cleared by watch_signals)
        self.hub: _Hub | None = None

    def signalled(self) -> None:
        """Say that the workers were sent :attr:`received`.

        The application's own handler for that signal, if any, runs once every
        waiter that received it said so (or left). Idempotent.
        """
        if self.hub is not None:
            self.hub.acknowledge(self)

    def take(self) -> signal.Signals:
        """The stop signal received, now acted on by the waiter (one left
        untaken is re-delivered to the process when the watch ends)."""
        sig = self.received
        assert sig is not None
        self.consumed = True
        return sig

    def deliver(self, sig: signal.Signals) -> None:
        """The hub received ``sig``: record it or pass it on (see the callbacks)."""
        if sig in self.forward:
            if self._on_forward is not None:
                self._on_forward(sig)
        elif self.received is None:
            self.received = sig
            self._on_signal(sig)
        elif self._on_repeat is not None:
            self._on_repeat(sig)


def forward_signal(workers: Iterable[WorkerHandle], sig: signal.Signals, name: str) -> None:
    """Pass a forward-only signal to each running worker; the group keeps running.

    Only the worker process itself gets it (not its process group: a
    DataLoader child with the default action would die of SIGUSR1).
    """
    count = 0
    for w in workers:
        if w.alive:  # not reaped yet: the pid is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, sig)
                count += 1
    logger.info("aiolaunch: forwarded %s to %d workers of %r", sig.name, count, name)


class _Slot:
    """One signal a hub handles: what was there before, and how many watch it."""

    __slots__ = ("previous", "previous_loop", "users")

    def __init__(self, previous: _Handler, previous_loop: asyncio.Handle | None) -> None:
        self.previous = previous
        self.previous_loop = previous_loop
        self.users = 1


class _Pending:
    """A stop signal whose chained handler waits for the waiters to signal workers."""

    __slots__ = ("acknowledged", "sig", "waiting")

    def __init__(self, sig: signal.Signals, waiting: list[SignalWatch]) -> None:
        self.sig = sig
        self.waiting = waiting
        self.acknowledged = False


class _Hub:
    """The handlers of one event loop, shared by its waiters."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: list[SignalWatch] = []
        self.slots: dict[signal.Signals, _Slot] = {}
        self.pending: list[_Pending] = []

    def acquire(self, sigs: Iterable[signal.Signals]) -> list[signal.Signals] | None:
        """Take ``sigs`` over; return those taken (ignored ones are not), ``None`` if impossible."""
        taken: list[signal.Signals] = []
        try:
            for sig in sigs:
                slot = self.slots.get(sig)
                if slot is not None:
                    slot.users += 1
                    taken.append(sig)
                    continue
                prev = raw_getsignal(sig)  # no repr of a Python handler (_signals/_compat.py)
                if prev == signal.SIG_IGN:
                    continue
                prev_loop = loop_signal_handler(self.loop, sig)
                add_loop_signal_handler(self.loop, sig, self._dispatch, sig)
                self.slots[sig] = _Slot(prev, prev_loop)
                taken.append(sig)
        except (NotImplementedError, RuntimeError, ValueError, OSError):
            # Restore what was installed before the failure, then degrade.
            self.release(taken)
            return None
        return taken

    def release(self, sigs: Iterable[signal.Signals]) -> None:
        for sig in sigs:
            slot = self.slots[sig]
            slot.users -= 1
            if slot.users:
                continue
            del self.slots[sig]
            if slot.previous_loop is not None and reinstall_loop_signal_handler(
                self.loop, sig, slot.previous_loop
            ):
                continue
            with contextlib.suppress(Exception):
                remove_loop_signal_handler(self.loop, sig)
            previous = slot.previous
            if sig == signal.SIGINT and ended_asyncio_run_sigint_handler(previous):
                previous = signal.default_int_handler  # what the runner would have put back
            with contextlib.suppress(Exception):
                raw_setsignal(sig, previous)  # no enum conversion of what it replaces

    def acknowledge(self, watch: SignalWatch) -> None:
        for pending in list(self.pending):
            if watch in pending.waiting:
                pending.waiting.remove(watch)
                pending.acknowledged = True
                if not pending.waiting:
                    self.pending.remove(pending)
                    self._chain(pending.sig)

    def leave(self, watch: SignalWatch) -> None:
        for pending in list(self.pending):
            if watch in pending.waiting:
                pending.waiting.remove(watch)
                if not pending.waiting:
                    self.pending.remove(pending)
                    # Nobody acted on it: it is re-delivered instead (watch_signals).
                    if pending.acknowledged:
                        self._chain(pending.sig)

    def _dispatch(self, sig: signal.Signals) -> None:
        if sig not in self.slots:
            # Caught while watched, dispatched after the last watcher left (the
            # loop had queued it): the handler installed now takes it - the next
            # waiter's (start() hands over to wait()), or the one restored.
            signal.raise_signal(sig)
            return
        fresh: list[SignalWatch] = []
        for watch in list(self.watches):
            if sig in watch.stop and watch.received is None:
                fresh.append(watch)
            watch.deliver(sig)
        if fresh:
            # The application's handler runs once these waiters signalled their
            # workers, so a graceful shutdown of its own finds them stopping.
            self.pending.append(_Pending(sig, fresh))
        else:
            # Forwarded (synchronously, above) or a repeat: chain right away.
            self._chain(sig)

    def _chain(self, sig: signal.Signals) -> None:
        """Call the handler that was there before aiolaunch took ``sig``."""
        slot = self.slots.get(sig)
        if slot is None:
            return
        if slot.previous_loop is not None:
            call_handle_soon(self.loop, slot.previous_loop)
            return
        prev = slot.previous
        # A Python-level SIGINT handler stands for KeyboardInterrupt in the
        # frameworks that install one (asyncio.run, ipykernel cancelling the
        # cell): SignalException already carries that meaning, and calling it
        # too would cancel the very task that waits for the workers.
        if callable(prev) and not is_default_handler(prev) and sig != signal.SIGINT:
            # Its own loop callback, as the loop runs signal handlers: an
            # exception it raises is reported by the loop, not by wait();
            # KeyboardInterrupt/SystemExit propagate out of the loop as usual.
            self.loop.call_soon(prev, int(sig), None)


_hubs: dict[asyncio.AbstractEventLoop, _Hub] = {}
_said_degraded = False


def _degraded(why: str) -> None:
    global _said_degraded
    if not _said_degraded:
        _said_degraded = True
        logger.warning("aiolaunch: %s; signals sent to the supervisor are not forwarded", why)


@contextlib.contextmanager
def watch_signals(
    on_signal: _SignalCallback,
    *,
    stop: Iterable[signal.Signals] = STOP_SIGNALS,
    forward: Iterable[signal.Signals] = (),
    on_repeat: _SignalCallback | None = None,
    on_forward: _SignalCallback | None = None,
) -> Iterator[SignalWatch]:
    """Watch signals for the duration of the block.

    Callbacks run on the loop thread: ``on_signal`` with the first ``stop``
    signal received, ``on_repeat`` with each later one, ``on_forward`` with
    each ``forward`` signal. The caller calls :meth:`SignalWatch.signalled`
    once it acted on ``on_signal``.
    """
    watch = SignalWatch(on_signal, stop, forward, on_repeat, on_forward)
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        _degraded("wait() runs outside the main thread (only the main thread can handle signals)")
        yield watch
        return
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = _Hub(loop)
    taken = hub.acquire(watch.stop | watch.forward)
    if taken is None:
        if not hub.watches:
            del _hubs[loop]
        _degraded("this event loop cannot take signal handlers")
        yield watch
        return
    watch.hub = hub
    hub.watches.append(watch)
    try:
        yield watch
    finally:
        hub.watches.remove(watch)
        hub.leave(watch)
        hub.release(taken)
        watch.hub = None
        if not hub.watches:
            del _hubs[loop]
        received = watch.received
        if received is not None and not watch.consumed and received not in hub.slots:
            # Arrived after the waiter had decided: hand it to the restored handler.
            signal.raise_signal(received)
