"""Signal race for ``wait()``: forward SIGTERM/SIGINT/SIGHUP/SIGQUIT to workers.

Handlers are installed on the running loop (``loop.add_signal_handler``) once,
when the first ``wait()`` of that loop starts, shared by every context waiting
in it, and the previous handlers are restored when the last one returns -
including an inherited ``SIG_IGN`` (a signal ignored on entry, as under
``nohup``, is left ignored and never forwarded).

A signal that arrives after its waiter decided to return is re-delivered to the
process once the previous handlers are back, so it is never swallowed.

Outside the main thread (or on a loop without signal support) nothing is
installed: ``wait()`` then works without the race, and says so once in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["FORWARDED_SIGNALS", "SignalWatch", "watch_signals"]

logger = logging.getLogger("aiolaunch")

FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalWatch:
    """What one waiter sees: the first forwarded signal received, if any."""

    def __init__(self, on_signal: Callable[[signal.Signals], None]) -> None:
        self.received: signal.Signals | None = None
        self.consumed = False
        self._on_signal = on_signal

    def _deliver(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig
            self._on_signal(sig)


class _Hub:
    """The handlers of one event loop, shared by its waiters."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: list[SignalWatch] = []
        self.previous: dict[signal.Signals, _Handler] = {}
        # Handlers the application itself registered with loop.add_signal_handler.
        self.previous_loop: dict[signal.Signals, asyncio.Handle] = {}

    def install(self) -> bool:
        installed: dict[signal.Signals, _Handler] = {}
        loop_handlers = getattr(self.loop, "_signal_handlers", {})
        try:
            for sig in FORWARDED_SIGNALS:
                prev = signal.getsignal(sig)
                if prev == signal.SIG_IGN:
                    continue
                if sig in loop_handlers:
                    self.previous_loop[sig] = loop_handlers[sig]
                self.loop.add_signal_handler(sig, self._dispatch, sig)
                installed[sig] = prev
        except (NotImplementedError, RuntimeError, ValueError):
            # Restore what was installed before the failure, then degrade.
            self.previous = installed
            self.restore()
            return False
        self.previous = installed
        return True

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            handle = self.previous_loop.get(sig)
            if handle is not None:
                with contextlib.suppress(Exception):
                    self.loop.add_signal_handler(
                        sig,
                        handle._callback,  # type: ignore[attr-defined]
                        *handle._args,  # type: ignore[attr-defined]
                    )
                    continue
            with contextlib.suppress(Exception):
                self.loop.remove_signal_handler(sig)
            with contextlib.suppress(Exception):
                signal.signal(sig, prev)  # type: ignore[arg-type]
        self.previous = {}
        self.previous_loop = {}

    def _dispatch(self, sig: signal.Signals) -> None:
        for watch in list(self.watches):
            watch._deliver(sig)


_hubs: dict[asyncio.AbstractEventLoop, _Hub] = {}
_said_degraded = False


@contextlib.contextmanager
def watch_signals(on_signal: Callable[[signal.Signals], None]) -> Iterator[SignalWatch]:
    """Watch the forwarded signals for the duration of the block.

    ``on_signal`` is called on the loop thread with the first signal received.
    """
    global _said_degraded
    watch = SignalWatch(on_signal)
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        if threading.current_thread() is not threading.main_thread():
            if not _said_degraded:
                _said_degraded = True
                logger.info(
                    "aiolaunch: wait() runs outside the main thread; signals sent to the "
                    "supervisor are not forwarded to workers (only the main thread can "
                    "handle signals)"
                )
            yield watch
            return
        hub = _Hub(loop)
        if not hub.install():
            if not _said_degraded:
                _said_degraded = True
                logger.info(
                    "aiolaunch: this event loop cannot take signal handlers; "
                    "signals are not forwarded to workers"
                )
            yield watch
            return
        _hubs[loop] = hub
    hub.watches.append(watch)
    try:
        yield watch
    finally:
        hub.watches.remove(watch)
        if not hub.watches:
            del _hubs[loop]
            hub.restore()
        if watch.received is not None and not watch.consumed and not hub.watches:
            # Arrived after the waiter had decided: hand it to the restored handler.
            signal.raise_signal(watch.received)
