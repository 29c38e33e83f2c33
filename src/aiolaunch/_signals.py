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
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from ._compat import (
    call_handle_soon,
    is_default_handler,
    loop_signal_handler,
    reinstall_loop_signal_handler,
)
from ._errors import SignalException
from ._shutdown import shielded

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._workers._handle import WorkerHandle

__all__ = [
    "DEFAULT_SIGNALS_TO_HANDLE",
    "FORWARDED_SIGNALS",
    "FORWARD_SIGNALS_ENV",
    "SHUTDOWN_TIMEOUT_ENV",
    "SIGNALS_TO_HANDLE_ENV",
    "STOP_DEADLINE_FILE_ENV",
    "STOP_SIGNALS",
    "SignalPlan",
    "SignalWatch",
    "forward_signal",
    "parse_signals",
    "resolve_signals",
    "watch_signals",
]

logger = logging.getLogger("aiolaunch")

STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
)
# The historical name: the default stop signals.
FORWARDED_SIGNALS = STOP_SIGNALS

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
        self._hub: _Hub | None = None

    def signalled(self) -> None:
        """Say that the workers were sent :attr:`received`.

        The application's own handler for that signal, if any, runs once every
        waiter that received it said so (or left). Idempotent.
        """
        if self._hub is not None:
            self._hub.acknowledge(self)

    async def stop_group(self, sent: asyncio.Event, end: asyncio.Future[Any]) -> NoReturn:
        """Act on :attr:`received`, whose shutdown ``end`` already began.

        Once the death signal went out (``sent``, or ``end`` finished first)
        the application's own handler runs (:meth:`signalled` - also when the
        caller was cancelled meanwhile); then ``end`` is awaited, shielded, and
        :class:`SignalException` raised.
        """
        sig = self.received
        assert sig is not None
        self.consumed = True
        try:
            await shielded(_first_of(sent, end))
        finally:
            self.signalled()
        await shielded(end)
        raise SignalException(f"Process {os.getpid()} got signal: {sig.value}", sigval=sig)

    def _deliver(self, sig: signal.Signals) -> None:
        if sig in self.forward:
            if self._on_forward is not None:
                self._on_forward(sig)
        elif self.received is None:
            self.received = sig
            self._on_signal(sig)
        elif self._on_repeat is not None:
            self._on_repeat(sig)


async def _first_of(event: asyncio.Event, end: asyncio.Future[Any]) -> None:
    # Whichever comes first: the event is set, or ``end`` finished.
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, end}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


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
                prev = signal.getsignal(sig)
                if prev == signal.SIG_IGN:
                    continue
                prev_loop = loop_signal_handler(self.loop, sig)
                self.loop.add_signal_handler(sig, self._dispatch, sig)
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
                self.loop.remove_signal_handler(sig)
            with contextlib.suppress(Exception):
                signal.signal(sig, slot.previous)

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
        fresh: list[SignalWatch] = []
        for watch in list(self.watches):
            if sig in watch.stop and watch.received is None:
                fresh.append(watch)
            watch._deliver(sig)
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
    watch._hub = hub
    hub.watches.append(watch)
    try:
        yield watch
    finally:
        hub.watches.remove(watch)
        hub.leave(watch)
        hub.release(taken)
        watch._hub = None
        if not hub.watches:
            del _hubs[loop]
        received = watch.received
        if received is not None and not watch.consumed and received not in hub.slots:
            # Arrived after the waiter had decided: hand it to the restored handler.
            signal.raise_signal(received)


# -- which signals a group handles, and what its workers are told -----------

#: torch's default for ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
FORWARD_SIGNALS_ENV = "AIOLAUNCH_FORWARD_SIGNALS"
#: In every worker's environment: the grace (seconds) between the death signal
#: and SIGKILL when ``wait()`` stops the group.
SHUTDOWN_TIMEOUT_ENV = "AIOLAUNCH_SHUTDOWN_TIMEOUT"
#: In every worker's environment: a file that holds, once the group is being
#: stopped, the wall-clock time (Unix seconds) at which survivors get SIGKILL.
STOP_DEADLINE_FILE_ENV = "AIOLAUNCH_STOP_DEADLINE_FILE"
_DEADLINE_NAME = "stop_deadline"

# Cannot be caught (KILL, STOP), or asyncio reaps children with it (CHLD).
_UNHANDLED = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD})


def _one_signal(item: object) -> signal.Signals:
    if isinstance(item, bool):
        raise TypeError(f"{item!r} is not a signal")
    if isinstance(item, int):
        return signal.Signals(item)  # ValueError for a number that is no signal
    if isinstance(item, str):
        name = item.strip().upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"{item!r} is not a signal name") from None
    raise TypeError(f"{item!r} is not a signal (a name like 'SIGUSR1', or a number)")


def parse_signals(spec: object, *, what: str, strict: bool) -> frozenset[signal.Signals]:
    """Read a set of signals: ``"SIGTERM,SIGUSR1"`` (torch's form), names or numbers.

    Names may omit ``SIG`` and any case is accepted; empty items are skipped.
    ``strict`` (a keyword argument): a bad item raises ``ValueError`` or
    ``TypeError`` naming ``what``; otherwise (an environment variable, as
    torch reads it) it is skipped with a warning. SIGKILL and SIGSTOP cannot
    be handled, and SIGCHLD belongs to asyncio: they are refused the same way.
    """
    if isinstance(spec, str):
        items: list[object] = [part for part in spec.split(",") if part.strip()]
    elif isinstance(spec, int):
        items = [spec]
    else:
        try:
            items = list(spec)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"{what}={spec!r} must be a comma-separated str like 'SIGTERM,SIGUSR1' "
                "or a list of signal names or numbers"
            ) from None
    found: set[signal.Signals] = set()
    for item in items:
        try:
            sig = _one_signal(item)
            if sig in _UNHANDLED:
                raise ValueError(f"{sig.name} cannot be handled by the supervisor")
        except (TypeError, ValueError) as exc:
            if strict:
                raise type(exc)(
                    f"{what}: {exc}; pass names like 'SIGTERM,SIGUSR1' "
                    "(SIGKILL, SIGSTOP and SIGCHLD excluded)"
                ) from None
            logger.warning("aiolaunch: %s: %s; skipped", what, exc)
            continue
        found.add(sig)
    return frozenset(found)


def resolve_signals(
    keyword: object, *, what: str, env: str, default: str, strict_env: bool = False
) -> frozenset[signal.Signals]:
    """The keyword's signals, or (keyword ``None``) those of ``$env``, or ``default``.

    ``strict_env``: a bad name in ``$env`` raises too (aiolaunch's own
    variables); otherwise it is skipped with a warning, as torch reads its own.
    """
    if keyword is not None:
        return parse_signals(keyword, what=what, strict=True)
    return parse_signals(os.environ.get(env, default), what=f"${env}", strict=strict_env)


class SignalPlan:
    """One group's signals: which stop it, which are only forwarded, and the stop deadline.

    The deadline file (``$AIOLAUNCH_STOP_DEADLINE_FILE`` in the workers'
    environment) is empty while the group runs (made by :meth:`make_file` as
    ``start_processes`` returns, not before the first spawn); before the death
    signal goes out the supervisor writes the wall-clock time at which
    survivors get SIGKILL (rewritten to "now" when a second signal
    escalates). It is removed once the group is gone.
    """

    def __init__(
        self,
        stop: frozenset[signal.Signals],
        forward: frozenset[signal.Signals],
        shutdown_timeout: float,
    ) -> None:
        self.forward = forward
        # A signal in both sets is only forwarded (the explicit opt-in wins).
        self.stop = stop - forward
        self.shutdown_timeout = shutdown_timeout
        self._deadline_file = ""
        self._released = False

    def watch(
        self,
        changed: asyncio.Event,
        escalate: Callable[[str], None],
        workers: Mapping[int, WorkerHandle],
        name: str,
    ) -> contextlib.AbstractContextManager[SignalWatch]:
        """:func:`watch_signals` for one group's ``wait()``: a stop signal sets
        ``changed``, a second one calls ``escalate(why)``; a forwarded signal
        goes to every worker of ``workers``."""
        return watch_signals(
            lambda sig: changed.set(),
            stop=self.stop,
            forward=self.forward,
            on_repeat=lambda sig: escalate(f"second {sig.name}"),
            on_forward=lambda sig: forward_signal(workers.values(), sig, name),
        )

    def env(self, folder: str | None = None) -> dict[str, str]:
        """What every worker's environment gets.

        The file is ``{folder}/stop_deadline`` (the group's private folder, so
        that a supervisor killed by SIGKILL leaves it there, not in the temp
        folder), made by :meth:`make_file`; without ``folder``, a unique file
        in the temp folder, made now.
        """
        if folder is not None and not self._deadline_file and not self._released:
            self._deadline_file = os.path.join(folder, _DEADLINE_NAME)
        if not self._deadline_file and not self._released:
            try:
                fd, self._deadline_file = tempfile.mkstemp(
                    prefix="aiolaunch_stop_deadline_", dir=folder
                )
            except OSError as exc:
                # No writable temp folder: the workers still start, without a deadline file.
                logger.warning("aiolaunch: no stop deadline file for the workers: %s", exc)
                self._released = True
            else:
                os.close(fd)
        return {
            SHUTDOWN_TIMEOUT_ENV: repr(float(self.shutdown_timeout)),
            STOP_DEADLINE_FILE_ENV: self._deadline_file,
        }

    def make_file(self) -> None:
        """Make the (empty) deadline file that :meth:`env` named; never raises."""
        if not self._deadline_file or self._released:
            return
        try:
            os.close(os.open(self._deadline_file, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError as exc:  # the workers run on; set_deadline() tries again
            logger.warning("aiolaunch: no stop deadline file for the workers: %s", exc)

    def set_deadline(self, grace: float) -> None:
        """Record that survivors get SIGKILL ``grace`` seconds from now."""
        if not self._deadline_file:
            return
        tmp = self._deadline_file + ".tmp"
        try:
            try:
                f = open(tmp, "w")  # noqa: SIM115
            except FileNotFoundError:
                # Stopped before the folder was made (make_file's caller).
                os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
                f = open(tmp, "w")  # noqa: SIM115
            with f:
                f.write(f"{time.time() + max(0.0, grace):.3f}\n")
            os.replace(tmp, self._deadline_file)  # a worker never reads half of it
        except OSError as exc:  # e.g. /tmp full: the signal still goes out
            logger.warning("aiolaunch: could not write the stop deadline: %s", exc)

    def release(self) -> None:
        """Remove the deadline file (idempotent)."""
        self._released = True
        if self._deadline_file:
            with contextlib.suppress(OSError):
                os.unlink(self._deadline_file)
            self._deadline_file = ""
