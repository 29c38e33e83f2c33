"""The one owner of ending a group: the outcome, then the aftermath.

Every way a group ends - ``wait()`` seeing the outcome, a stop signal,
``close()``, leaving ``async with``, a failed start - calls
:meth:`GroupEnding.begin`, and the first call starts the one task that
ends it; later callers await the same task. It runs in two steps:

1. **The outcome** (what ``wait()`` returns after): the observers stop (the
   hang forensics, the live view, readiness probes, pending restarts), every
   worker and its process tree gets the death signal, a grace period, SIGKILL
   (``_terminate.terminate``), every stream is drained, and the result is
   built once from the group's state (forced failures included).
2. **The aftermath** (what no outcome depends on, started once ``wait()``
   handed the result over, awaited by ``close()``): escaped descendants (by
   the context token) get the death signal then SIGKILL; the stop-deadline
   file goes, the observers conclude (the failure report, the control
   socket's files), the group's folder and empty temporary folders are pruned.

:class:`Phase` says where it is, and is what the code branches on. The
decision to stop on a stop signal is taken here too: the signal race
(``_signals``) only reports what it received.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import signal
from typing import TYPE_CHECKING, Any, NoReturn

from ._cancel import move_on_after, shielded
from ._compat import task_cancelling, task_uncancel
from ._errors import SignalException
from ._events import group_stopped
from ._results import build_result
from ._terminate import Escalation, sweep_tagged, terminate
from ._workers._processes import CONTEXT_ENV

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._deadline import StopDeadline
    from ._events import EventBus
    from ._group import GroupState
    from ._logs import LogWiring
    from ._logs._folder import GroupFolder
    from ._observer import GroupObserver
    from ._results import RunProcsResult
    from ._signals._plan import SignalPlan
    from ._signals._watch import SignalWatch
    from ._workers._handle import WorkerHandle


__all__ = ["FILES_DELAY", "GroupEnding", "Phase"]

logger = logging.getLogger("aiolaunch")

#: Seconds between the last spawn and the group's own files (the stop-deadline
#: file, the guardian's note of the stacks folder): off the launch path.
FILES_DELAY = 0.02


class Phase(enum.Enum):
    """Where the ending of a group is."""

    #: The workers are starting or running; nothing has begun to end the group.
    RUNNING = "running"
    #: Reached by the first :meth:`GroupEnding.begin`: observers stop, workers
    #: are signalled and reaped, streams drain. The outcome is not known yet.
    STOPPING = "stopping"
    #: Reached when the outcome task returns: :attr:`GroupEnding.result` is
    #: final; the aftermath waits for ``wait()`` to hand the result over.
    ENDED = "ended"
    #: Reached when the result was handed over (or ``close()`` awaits it):
    #: escaped descendants are swept, the files released.
    AFTERMATH = "aftermath"
    #: Reached when the aftermath finished: nothing of the group is left.
    CLOSED = "closed"


class GroupEnding:
    """The ending of one group (see the module docstring).

    :param state: the group; told when the end begins (``state.ending``).
    :param logs: the streams, drained (and their temp folders pruned).
    :param observers: stopped when the end begins, in this order; asked
        before the stop, told the result, concluded in the aftermath.
    :param folder: the group's folder, released last.
    :param bus: gets :class:`GroupStopped` with the outcome.
    :param deadline: the stop-deadline file the workers read.
    :param token: the context token every descendant inherits (``CONTEXT_ENV``).
    """

    def __init__(
        self,
        state: GroupState,
        *,
        logs: LogWiring,
        observers: Sequence[GroupObserver],
        folder: GroupFolder,
        bus: EventBus,
        deadline: StopDeadline,
        token: str,
    ) -> None:
        self.phase = Phase.RUNNING
        #: the outcome, once known (:attr:`Phase.ENDED` on)
        self.result: RunProcsResult | None = None
        #: set once the death signal went out to every worker
        self.sent = asyncio.Event()
        self.deadline = deadline
        self.token = token
        self._state = state
        self._logs = logs
        self._observers = observers
        self._folder = folder
        self._bus = bus
        self._kill_now = Escalation()  # ends the grace period: escalate()
        self._files: asyncio.TimerHandle | None = None
        self._outcome: asyncio.Task[RunProcsResult] | None = None
        self._aftermath: asyncio.Task[None] | None = None
        # The aftermath's sweep for escaped daemons: the workers' pids (a
        # decided group), set with the result; empty where none is due.
        self._sweep: list[int] = []
        self._grace = 0.0
        self._death_sig: int = signal.SIGTERM

    def env(self) -> dict[str, str]:
        """What every worker's environment gets: the token, inherited by every
        descendant, by which escaped daemons are found, and the deadline file."""
        return {CONTEXT_ENV: self.token, **self.deadline.env()}

    def describe(self) -> str:
        """``"running"``, ``"closing"``, then ``"done"`` or ``"failed"`` (reprs)."""
        if self.phase is Phase.RUNNING:
            return "running"
        if self.phase is Phase.STOPPING or self.result is None:
            return "closing"
        return "failed" if self.result.is_failed() else "done"

    def group_started(self) -> None:
        """Every rank started: the group's own files :data:`FILES_DELAY` from
        now (not beside the workers just spawned), and the observers told."""
        loop = asyncio.get_running_loop()
        self._files = loop.call_later(FILES_DELAY, self._make_files)
        for observer in self._observers:
            observer.group_started()

    def _make_files(self) -> None:
        self._files = None
        # The stacks folder (made by the first worker that registers for
        # dumps) is removed by the guardian if the supervisor dies first.
        self._folder.guard()
        self.deadline.make()

    # -- commands -------------------------------------------------------------
    async def wait(self, timeout: float | None, signals: SignalPlan) -> RunProcsResult | None:
        """``PContext.wait()``: race the group's outcome against ``signals``.

        Returns the result once the group is decided
        (:meth:`GroupState.decided`) and ended, or ``None`` after ``timeout``
        seconds (``None`` or negative: no limit). A stop signal received
        meanwhile ends the group and raises ``SignalException``.
        """
        if self.phase is not Phase.RUNNING:  # the outcome is known, or on its way
            return self.result or await shielded(self.begin(signal.SIGTERM, 0.0))
        state = self._state
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None or timeout < 0 else loop.time() + timeout
        grace = signals.shutdown_timeout
        with signals.watch(state.wakeup.notify, self.escalate, state.workers, state.name) as watch:
            while True:
                seen = state.wakeup.version  # before the checks (see _group.Wakeup)
                if watch.received is not None:
                    await self._stop_on_signal(watch, grace)
                if state.decided() or self.phase is not Phase.RUNNING:
                    return await shielded(self.begin(signal.SIGTERM, grace, decided=True))
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                if remaining == math.inf:
                    await state.wakeup.changed(seen)
                    continue
                async with move_on_after(remaining):
                    await state.wakeup.changed(seen)

    async def _stop_on_signal(self, watch: SignalWatch, grace: float) -> NoReturn:
        """End the group for the stop signal ``watch`` received, then raise
        :class:`SignalException`.

        Once the death signal went out (or the end finished first) the
        application's own handler may run (``watch.signalled()`` - also when
        the caller was cancelled meanwhile); then the end is awaited, shielded.
        """
        sig = watch.take()
        end = self.begin(sig, grace)
        try:
            await shielded(_first_of(self.sent, end))
        finally:
            watch.signalled()
        await shielded(end)
        raise SignalException(f"Process {os.getpid()} got signal: {sig.value}", sigval=sig)

    def begin(
        self, death_sig: int, grace: float, *, decided: bool = False, closing: bool = False
    ) -> asyncio.Task[RunProcsResult]:
        """The task that ends the group, started by the first call (later
        calls' arguments are ignored).

        ``decided``: ``wait()`` saw the outcome and awaits this: before the
        result only the workers, groups and trees; the token scan for escaped
        daemons (~60 us a process) and the deadline file (not even written
        when no worker is left to read it) are left to the aftermath.
        ``closing``: ``close()`` calls, and awaits the aftermath at once: with
        nothing to sweep, the files are released in this same task.
        """
        if self._outcome is None:
            self.phase = Phase.STOPPING
            self._state.end_begun()
            self._death_sig, self._grace = death_sig, grace
            self._outcome = asyncio.ensure_future(self._end(death_sig, grace, decided, closing))
        return self._outcome

    def escalate(self, why: str) -> None:
        """End the grace period (now, or once the end begins): SIGKILL. Once
        only, and only while something is still to be stopped (the workers,
        or the aftermath's sweep); logs a warning with ``why``."""
        if self._kill_now.is_set():
            return
        if self.phase in (Phase.ENDED, Phase.AFTERMATH) and not self._sweep:
            return
        if self.phase is Phase.CLOSED:
            return
        self._kill_now.set()
        self.deadline.set(0.0)
        logger.warning("aiolaunch: %s during shutdown; sending SIGKILL to the workers now", why)

    async def close(self, death_sig: int, grace: float, *, cancelled: bool) -> None:
        """Begin (if nobody did) and await the end and its aftermath, shielded;
        a second cancellation escalates.

        ``cancelled``: the caller leaves ``async with`` because of a
        cancellation, which counts as the first.
        """
        # Cancellations the task had when close() began (leaving ``async with``
        # for one: __aexit__ sees it, Task.cancelling() too): the next is the second.
        before = max(int(cancelled), task_cancelling(asyncio.current_task()))

        def on_cancel(count: int) -> None:
            if before + count >= 2:
                self.escalate("second cancellation of close()")

        await shielded(self.begin(death_sig, grace, closing=True), on_cancel)
        await self.finished(on_cancel)

    def handed_over(self) -> None:
        """``wait()`` returned the result to its caller: the aftermath starts."""
        if self.phase is Phase.ENDED:
            self.phase = Phase.AFTERMATH
            self._aftermath = asyncio.ensure_future(self._after())

    async def finished(self, on_cancel: Callable[[int], None] | None = None) -> None:
        """Start the aftermath (if the outcome is known and it is due) and await it, shielded."""
        self.handed_over()
        if self._aftermath is not None:
            await shielded(self._aftermath, on_cancel)

    # -- the outcome ----------------------------------------------------------
    async def _end(
        self, death_sig: int, grace: float, decided: bool, closing: bool
    ) -> RunProcsResult:
        workers = self._state.workers()
        failed: list[int] | None = None
        torn_down = False
        try:
            if decided:  # a rank failed: where the others are, before they are stopped
                for observer in self._observers:
                    await observer.before_stop()
            await self._stop_observers()
            workers = self._state.workers()
            await self._stop(workers, death_sig, grace, decided)
            # Those it signalled were stopped on purpose, unless failing on their own.
            failed = self._state.failed_ranks()
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit) as exc:
            # Cut short: by the loop's teardown (its cancellation; callers
            # await this task shielded) or a KeyboardInterrupt raised into it
            # (docs/ARCHITECTURE.md, "Signals"). SIGKILL now, not the guardian
            # after the exit; a cancellation is taken back, the end goes on.
            torn_down = isinstance(exc, asyncio.CancelledError)
            if torn_down:
                task_uncancel(asyncio.current_task())
            self.escalate(
                "cancellation of the event loop's tasks" if torn_down else type(exc).__name__
            )
            if failed is None:  # taken before the SIGKILL (stopped on purpose)
                failed = self._state.failed_ranks()
            await terminate(self._state.workers(), signal.SIGKILL, 0.0, token=self.token)
            if not torn_down:
                raise
            await self._stop_observers()  # again: the cancellation may have cut it short
        assert failed is not None
        await self._logs.aclose()
        for w in workers:
            w.release()
        dest = self._logs.dest
        result = build_result(self._state, failed, dest.error_files, dest.stdouts, dest.stderrs)
        for observer in self._observers:
            observer.annotate(result)
        self.result = result
        # No sweep where the SIGKILL above scanned for escaped daemons already,
        # or where the group was not decided (terminate() scanned with the token).
        self._sweep = [w.pid for w in workers] if decided and not torn_down else []
        self.phase = Phase.ENDED
        self._bus.emit(group_stopped(result.is_failed()))
        if torn_down or (closing and not self._sweep):
            # Only file I/O: in this task - close() saves a task's loop turns,
            # and a teardown might never run another one.
            self.phase = Phase.AFTERMATH
            await self._release_files(result)
        return result

    async def _stop_observers(self) -> None:
        """Stop every observer (and the group's files timer). Idempotent."""
        if self._files is not None:
            self._files.cancel()
            self._files = None
        for observer in self._observers:  # in turn: no task each (most have nothing to stop)
            await observer.aclose()

    async def _stop(
        self, workers: Sequence[WorkerHandle], death_sig: int, grace: float, decided: bool
    ) -> None:
        now = death_sig == signal.SIGKILL or self._kill_now.is_set()
        if not decided or any(w.alive for w in workers):
            self.deadline.set(0.0 if now else grace)
        try:
            await terminate(
                workers,
                death_sig,
                grace,
                on_sent=self.sent.set,
                escalate=self._kill_now,
                token=None if decided else self.token,
            )
        except BaseException:
            self.deadline.remove()
            raise
        if not decided:
            self.deadline.remove()

    # -- the aftermath --------------------------------------------------------
    async def _release_files(self, result: RunProcsResult) -> None:
        try:  # the deadline file, the observers' files (the report), the folders
            self.deadline.remove()
            for observer in self._observers:
                observer.conclude(result)
            self._folder.release()
            await self._logs.prune_temp_dirs()
        finally:
            self.phase = Phase.CLOSED

    async def _after(self) -> None:
        # Escaped descendants first (SIGKILL at once if the loop cancels this:
        # asyncio.run ending without close()), then the files. On the loop: a
        # thread waits for the GIL before each small syscall.
        result, sweep = self.result, self._sweep
        assert result is not None
        try:
            if sweep:
                await sweep_tagged(
                    self.token,
                    min(sweep),
                    sweep,
                    self._death_sig,
                    self._grace,
                    escalate=self._kill_now,
                )
        except asyncio.CancelledError:
            task_uncancel(asyncio.current_task())
            if sweep:
                await sweep_tagged(self.token, min(sweep), sweep, signal.SIGKILL, 0.0)
        finally:
            self._sweep = []
            await self._release_files(result)


async def _first_of(event: asyncio.Event, end: asyncio.Future[Any]) -> None:
    # Whichever comes first: the event is set, or ``end`` finished.
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, end}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
