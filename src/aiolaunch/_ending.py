"""The one owner of ending a group: the outcome, then the aftermath.

Every way a group ends - ``wait()`` seeing the outcome, a stop signal,
``close()``, leaving ``async with``, a failed start - calls
:meth:`GroupEnding.begin`, and the first call starts the one task that
ends it; later callers await the same task. It runs in two steps:

1. **The outcome** (what ``wait()`` returns after): observers stop (the
   watchdog and control socket, readiness probes, pending restarts), every
   worker and its process tree gets the death signal, a grace period, SIGKILL
   (``_terminate.terminate``), every stream is drained, and the result is
   built once from the group's state (forced failures included).
2. **The aftermath** (what no outcome depends on, started once ``wait()``
   handed the result over, awaited by ``close()``): the stop-deadline file
   and the forensic files go, the failure report is written, escaped
   descendants (by the context token) get the death signal then SIGKILL,
   and empty temporary folders are pruned.

:class:`Phase` says where it is.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import signal
from typing import TYPE_CHECKING

from ._cancel import move_on_after, shielded
from ._compat import task_cancelling, task_uncancel
from ._events import group_stopped
from ._results import build_result
from ._terminate import Escalation, sweep_tagged, terminate
from ._workers._proc import CONTEXT_ENV

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Protocol

    from ._deadline import StopDeadline
    from ._events import EventBus
    from ._group import GroupState
    from ._hangs._forensics import Forensics
    from ._logs import LogWiring
    from ._results import RunProcsResult
    from ._signals._plan import SignalPlan
    from ._workers._handle import WorkerHandle

    class Observer(Protocol):
        """Anything that watches a running group and must stop before its end."""

        async def aclose(self) -> None: ...


__all__ = ["GroupEnding", "Phase"]

logger = logging.getLogger("aiolaunch")


class Phase(enum.Enum):
    """Where the ending of a group is."""

    #: The workers are starting or running; nothing has begun to end the group.
    RUNNING = "running"
    #: Reached by the first :meth:`GroupEnding.begin`: observers stop, workers
    #: are signalled and reaped, streams drain. The outcome is not known yet.
    STOPPING = "stopping"
    #: Reached when the outcome task returns: :attr:`GroupEnding.result` is
    #: final; the aftermath waits for the hand-over or runs.
    ENDED = "ended"
    #: Reached when the aftermath finished: nothing of the group is left.
    CLOSED = "closed"


class GroupEnding:
    """The ending of one group (see the module docstring).

    :param state: the group; told when the end begins (``state.ending``).
    :param logs: the streams, drained (and their temp folders pruned).
    :param forensics: stopped first; concludes (report, files) in the aftermath.
    :param observers: stopped beside it (readiness probes, restarts).
    :param bus: gets :class:`GroupStopped` with the outcome.
    :param deadline: the stop-deadline file the workers read.
    :param token: the context token every descendant inherits (``CONTEXT_ENV``).
    """

    def __init__(
        self,
        state: GroupState,
        *,
        logs: LogWiring,
        forensics: Forensics,
        observers: Sequence[Observer],
        bus: EventBus,
        deadline: StopDeadline,
        token: str,
    ) -> None:
        self.phase = Phase.RUNNING
        #: the outcome, once known
        self.result: RunProcsResult | None = None
        #: set once the death signal went out to every worker
        self.sent = asyncio.Event()
        self.deadline = deadline
        self.token = token
        self._state = state
        self._logs = logs
        self._forensics = forensics
        self._observers = observers
        self._bus = bus
        self._kill_now = Escalation()  # ends the grace period: escalate()
        self._outcome: asyncio.Task[RunProcsResult] | None = None
        self._aftermath: asyncio.Task[None] | None = None
        self._handed = asyncio.Event()
        # close() was called: it awaits the aftermath too (see _end)
        self._closing = False

    def env(self) -> dict[str, str]:
        """What every worker's environment gets: the token, inherited by every
        descendant, by which escaped daemons are found, and the deadline file."""
        return {CONTEXT_ENV: self.token, **self.deadline.env()}

    @property
    def begun(self) -> bool:
        """Whether :meth:`begin` was called."""
        return self._outcome is not None

    def describe(self) -> str:
        """``"running"``, ``"closing"``, then ``"done"`` or ``"failed"`` (reprs)."""
        if self.result is not None:
            return "failed" if self.result.is_failed() else "done"
        return "closing" if self.begun else "running"

    # -- commands -------------------------------------------------------------
    async def wait(self, timeout: float | None, signals: SignalPlan) -> RunProcsResult | None:
        """``PContext.wait()``: race the group's outcome against ``signals``.

        Returns the result once the group is decided
        (:meth:`GroupState.decided`) and ended, or ``None`` after ``timeout``
        seconds (``None`` or negative: no limit). A stop signal received
        meanwhile ends the group and raises ``SignalException``.
        """
        if self.begun:  # the outcome is known, or on its way
            return self.result or await shielded(self.begin(signal.SIGTERM, 0.0))
        state = self._state
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None or timeout < 0 else loop.time() + timeout
        grace = signals.shutdown_timeout
        with signals.watch(state.wakeup.notify, self.escalate, state.workers, state.name) as watch:
            while True:
                seen = state.wakeup.version  # before the checks (see _group.Wakeup)
                if watch.received is not None:
                    await watch.stop_group(self.sent, self.begin(watch.received, grace))
                if state.decided() or self.begun:
                    return await shielded(self.begin(signal.SIGTERM, grace, decided=True))
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                if remaining == math.inf:
                    await state.wakeup.changed(seen)
                    continue
                async with move_on_after(remaining):
                    await state.wakeup.changed(seen)

    def begin(
        self, death_sig: int, grace: float, *, decided: bool = False
    ) -> asyncio.Task[RunProcsResult]:
        """The task that ends the group, started by the first call (later
        calls' arguments are ignored).

        ``decided``: ``wait()`` saw the outcome and awaits this: before the
        result only the workers, groups and trees; the token scan for escaped
        daemons (~60 us a process) and the deadline file (not even written
        when no worker is left to read it) are left to the aftermath.
        """
        if self._outcome is None:
            self.phase = Phase.STOPPING
            self._state.end_begun()
            self._outcome = asyncio.ensure_future(self._end(death_sig, grace, decided))
        return self._outcome

    def escalate(self, why: str) -> None:
        """End the grace period (now, or once the end begins): SIGKILL. Once
        only, not once the group is closed; logs a warning with ``why``."""
        if self._kill_now.is_set() or self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.ENDED and (self._aftermath is None or self._aftermath.done()):
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

        self._closing = True
        await shielded(self.begin(death_sig, grace), on_cancel)
        await self.finished(on_cancel)

    def handed_over(self) -> None:
        """``wait()`` returned the result to its caller: the aftermath may start."""
        self._handed.set()

    async def finished(self, on_cancel: Callable[[int], None] | None = None) -> None:
        """Let the aftermath start (if the outcome is known) and await it, shielded."""
        self._handed.set()
        if self._aftermath is not None:
            await shielded(self._aftermath, on_cancel)

    # -- the outcome ----------------------------------------------------------
    async def _end(self, death_sig: int, grace: float, decided: bool) -> RunProcsResult:
        workers = self._state.workers()
        failed: list[int] | None = None
        torn_down = False
        try:
            if decided:  # a rank failed: where the others are, before they are stopped
                await self._forensics.before_stop()
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
        self._forensics.annotate(result)
        self.result = result
        self.phase = Phase.ENDED
        self._bus.emit(group_stopped(result.is_failed()))
        if torn_down or (self._closing and not decided):
            # No sweep due (torn down: the SIGKILL scanned for escaped daemons),
            # only file I/O: no task of its own - close() saves its loop turns
            # (~0.15 ms of ~2; #26), a teardown might never run it.
            await self._release_files(result)
            return result
        sweep = [w.pid for w in workers] if decided else None
        self._aftermath = asyncio.ensure_future(self._after(result, sweep, death_sig, grace))
        return result

    async def _stop_observers(self) -> None:
        """Stop the forensics (watchdog, control socket) and observers. Idempotent."""
        await self._forensics.stop()
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
        try:  # the deadline and forensic files (the report written), empty temp folders
            self.deadline.remove()
            self._forensics.conclude(result)
            await self._logs.prune_temp_dirs()
        finally:
            self.phase = Phase.CLOSED

    async def _after(
        self, result: RunProcsResult, sweep: Sequence[int] | None, death_sig: int, grace: float
    ) -> None:
        # Escaped descendants first (SIGKILL at once if the loop cancels this:
        # asyncio.run ending without close()), then the files. On the loop: a
        # thread waits for the GIL before each small syscall (#27 item 5).
        try:
            await self._handed.wait()
            if sweep:
                await sweep_tagged(
                    self.token, min(sweep), sweep, death_sig, grace, escalate=self._kill_now
                )
        except asyncio.CancelledError:
            task_uncancel(asyncio.current_task())
            if sweep:
                await sweep_tagged(self.token, min(sweep), sweep, signal.SIGKILL, 0.0)
        finally:
            await self._release_files(result)
