"""The process context: a started group of workers, awaited as one.

``PContext`` assembles the parts of a group and is its public face; each part
has one job and one owner:

- ``_group.GroupState``: the group's state (workers, exits, restarts, forced
  failures) and its one wake-up (``Wakeup``);
- ``_ending.GroupEnding``: the one way a group ends (outcome, then aftermath);
- ``_logs.LogWiring``: the streams; ``_ready.Readiness``: the probes;
  ``_restart.Restarts``: the restart policies; ``_forensics.Forensics``:
  stacks, watchdog, status and the control socket; ``_events.EventBus``.

Exit flow: a worker exits -> its handle's exit callback runs on the loop ->
``GroupState.gone`` (or a restart) notifies the wake-up -> ``wait()`` checks
``GroupState.decided()`` and ends the group through ``GroupEnding.begin``.
No step polls.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from typing import TYPE_CHECKING, Any

from ._cancel import shielded
from ._deadline import StopDeadline
from ._ending import GroupEnding
from ._errors import fd_limit_error
from ._events import Event, EventBus, LogLines, worker_exited, worker_started
from ._group import GroupState
from ._hangs._forensics import Forensics
from ._live._metrics import url_of
from ._ready import Readiness, ReadinessProbe
from ._restart import RestartPolicy, Restarts
from ._validate import check_seconds, check_signal
from ._workers._proc import new_context_token

if TYPE_CHECKING:
    import socket
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ._hangs._watchdog import Watchdog
    from ._live._status import WorkerStatus
    from ._logs import LogWiring
    from ._results import RunProcsResult
    from ._signals._plan import SignalPlan
    from ._workers._handle import WorkerHandle

__all__ = ["PContext"]

# Right after the last rank's spawn: that worker runs on this process's CPU
# (a vfork child execs where its parent ran, and the parent wakes there too);
# yielding gives it the CPU now, not after the bookkeeping that follows here
# and in the caller (wait()'s set-up): on a 2-core host its first instruction
# came ~0.3 ms sooner (#26), and yielding before its own bookkeeping rather
# than after it, 7% sooner again at N=1 and 4 (100 trials a side,
# 2026-11-27). Not after every spawn: that slowed N=4 and 64.
_sched_yield = getattr(os, "sched_yield", lambda: None)


async def _start_ranks(
    nprocs: int,
    start_one: Callable[[int], Awaitable[None]],
    signals: SignalPlan,
    ending: GroupEnding,
    state: GroupState,
) -> None:
    """Start ranks ``0..nprocs-1`` in order, watching the group's stop signals as ``wait()`` does.

    A worker forked from a zygote runs its script at once, before the caller
    reaches ``wait()``: a stop signal must not meet the default action. One
    received stops the workers started so far (death signal, grace; no
    further rank starts) and raises ``SignalException``. SIGINT is left to
    the application meanwhile (asyncio.run's handler cancels the start, which
    SIGKILLs what started; a bare loop's KeyboardInterrupt does the same).
    """
    watch = signals.watch(
        state.wakeup.notify,
        ending.escalate,
        state.workers,
        state.name,
        leave=frozenset({signal.SIGINT}),
    )
    with watch as sig:
        for rank in range(nprocs):
            await start_one(rank)
            if sig.received is not None:
                break
        # The spawns may never yield: a cancellation meanwhile (Ctrl-C) must land here.
        await asyncio.sleep(0)  # allowed: one loop turn, not a wait
        if sig.received is not None:
            await sig.stop_group(ending.sent, ending.begin(sig.received, signals.shutdown_timeout))


class PContext:
    """A group of ``nprocs`` workers started by :func:`aiolaunch.start_processes`.

    Attributes mirror torch's ``PContext``: ``name``, ``nprocs``,
    ``entrypoint``, ``args``, ``envs``, ``stdouts``, ``stderrs``,
    ``error_files`` (rank -> path; ``""`` for a stream that is not redirected).

    Use it as an async context manager, or call :meth:`close` yourself:
    leaving the block - normally, by exception or by cancellation - stops every
    worker and its descendants.
    """

    def __init__(
        self,
        *,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs: LogWiring,
        start_method: str,
        signal_plan: SignalPlan,
        ready: dict[int, ReadinessProbe] | None = None,
        restart: dict[int, RestartPolicy] | None = None,
        watchdog: Watchdog | None = None,
        metrics: socket.socket | None = None,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.nprocs = len(args)
        self.start_method = start_method
        self.stdouts = dict(logs.dest.stdouts)
        self.stderrs = dict(logs.dest.stderrs)
        self.error_files = dict(logs.dest.error_files)
        # torch's attributes: the files of the duplicate filters, or None.
        self.filtered_stdout = logs.filtered_file("stdout")
        self.filtered_stderr = logs.filtered_file("stderr")
        self._logs = logs
        self._signals = signal_plan
        self._state = GroupState(name, self.nprocs)
        self._bus = EventBus()
        self._restarts = Restarts(
            restart or {}, self._state, bus=self._bus, drain=logs.drain_rank, start=self._start_one
        )
        self._readiness = Readiness(
            self._state, ready or {}, bus=self._bus, error_files=self.error_files
        )
        self._forensics = Forensics(
            self._state, watchdog, logs=logs, bus=self._bus, restartable=self._restarts.has_policy,
            metrics=metrics,
        )  # fmt: skip
        #: ``http://127.0.0.1:PORT/metrics`` with ``start_processes(metrics_port=)``, else None
        self.metrics_url = None if metrics is None else url_of(metrics)
        self._ending = GroupEnding(
            self._state,
            logs=logs,
            forensics=self._forensics,
            observers=(self._readiness, self._restarts),
            bus=self._bus,
            # The group's folder: a supervisor killed by SIGKILL leaves it there.
            deadline=StopDeadline(self._forensics.private_dir, signal_plan.shutdown_timeout),
            token=new_context_token(),
        )
        # The line consumers of the log pipeline: probes, LogLine events, progress.
        self._readiness.lines_wanted = logs.lines.subscribe(self._readiness)
        self._bus.lines_wanted = logs.lines.subscribe(LogLines(self._bus))
        if self._forensics.progress_lines is not None:
            logs.lines.subscribe(self._forensics.progress_lines)

    # -- start ------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker, in rank order (``start_processes`` calls this).

        A failure part-way SIGKILLs the workers already started, then raises; running out
        of fds raises an ``OSError`` saying how many ranks started and how to raise the limit.
        A stop signal meanwhile is the group's, as in :meth:`wait`: the workers started
        so far are stopped, then :class:`SignalException` is raised.
        """
        ending = self._ending
        try:
            await _start_ranks(self.nprocs, self._start_one, self._signals, ending, self._state)
            self._forensics.start(self._ending.deadline.make)
        except BaseException as exc:
            await shielded(self._ending.begin(signal.SIGKILL, 0.0))
            await self._ending.finished()
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(exc, len(self._state.pids()), self.nprocs) from exc
            raise

    async def _start_one(self, rank: int) -> None:
        # Streams are read from the block's end on (after started()); closed if the spawn fails.
        async with self._logs.open(rank) as streams:
            handle = await self._spawn(rank, streams.stdout, streams.stderr)
            if rank == self.nprocs - 1:
                _sched_yield()  # the last worker runs now (see _sched_yield)
            self._state.started(handle)
            self._bus.emit(worker_started(handle))
            self._readiness.started(rank, handle)
            handle.on_exit = self._on_exit
            if not handle.alive:  # it exited while we were still wiring it up
                self._on_exit(handle)

    async def _spawn(self, rank: int, stdout: int | None, stderr: int | None) -> WorkerHandle:
        raise NotImplementedError

    def _env(self, rank: int) -> dict[str, str]:
        # Later layers win: the user's, then the restart count, then ours.
        env = {**self.envs[rank], **self._restarts.env(rank), **self._forensics.env()}
        return env | self._ending.env()

    def _on_exit(self, handle: WorkerHandle) -> None:
        self._bus.emit(worker_exited(handle))
        if not self._restarts.after_exit(handle):  # its last incarnation: no restart follows
            self._state.gone(handle.local_rank)

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of every started worker."""
        return self._state.pids()

    def status(self) -> list[WorkerStatus]:
        """Every rank's state now, as :class:`WorkerStatus` (the control socket's answer).

        Reads ``/proc`` of each live worker (a few microseconds each); CPU %
        is measured over at least the last half second (or since the start).
        """
        return self._forensics.status()

    async def dump_stacks(
        self, ranks: list[int] | None = None, timeout: float = 5.0
    ) -> dict[int, str]:
        """The Python stacks of every thread of each live worker, ``{rank: text}``.

        Also written to ``{log_dir}/{rank}/stacks-<n>.txt`` (``n``: the dump's
        number). Only registered workers are signalled (function workers,
        Python programs run by the CLI or ``python -m aiolaunch._child._bootstrap``);
        any other rank, or one silent for ``timeout`` seconds (at most 30),
        gets a line saying why (or a ``py-spy dump`` where installed).
        :meth:`StackReport.from_dumps` gives the verdict. One round runs at a
        time; a dump of every rank joins one under way.

        :raises ValueError: an unknown rank, or ``timeout`` not a finite
            number of seconds > 0.
        """
        return await self._forensics.dump_stacks(ranks, timeout)

    def events(self, *, lines: bool = False, maxsize: int = 10_000) -> AsyncIterator[Event]:
        """Iterate over the group's lifecycle events, in order, until it stops.

        Yields :class:`WorkerStarted`, :class:`WorkerReady`, :class:`WorkerExited`,
        :class:`WorkerRestarting`, :class:`WorkerStalled` (with a watchdog) and,
        last, :class:`GroupStopped`; with ``lines=True`` also a :class:`LogLine`
        per line of every stream the supervisor reads (redirected, tee'd or
        probed). Earlier events are replayed first. Each of several consumers
        has a buffer of ``maxsize`` events: one that falls behind loses its
        oldest and receives an :class:`EventsDropped` with the count.

        :raises TypeError: ``maxsize`` is not an int (at the call, not later).
        :raises ValueError: ``maxsize`` is below 1 (at the call).
        """
        return self._bus.iterate(lines=lines, maxsize=maxsize)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker's readiness probe succeeded.

        Ranks without a probe are ready once started. A worker that exits
        before it is ready (and is not restarted) fails the wait with
        :class:`ChildFailedError` carrying its failure - not a timeout.

        A probe that raises fails the wait promptly with a :class:`RuntimeError`
        naming the rank and probe, the probe's exception as its ``__cause__``.

        :raises TimeoutError: ``timeout`` seconds passed first.
        """
        check_seconds("wait_ready(timeout)", timeout)
        await self._readiness.wait_ready(timeout)

    async def wait(
        self, timeout: float | None = None, period: float | None = None
    ) -> RunProcsResult | None:
        """Wait for the group's outcome.

        Returns a :class:`RunProcsResult` once every worker succeeded, or at
        the first failure after stopping the others (death signal, SIGKILL
        after ``shutdown_timeout``); ``None`` if ``timeout`` seconds pass first
        (``None`` or negative: forever; ``0``: poll). Woken by the exit itself,
        it returns within milliseconds (``period``: torch's, ignored). By then
        every worker is reaped, its group and process tree signalled, every
        pipe drained into its log file and console, and error files read.
        The aftermath, which :meth:`close` (or leaving ``async with``) awaits,
        stops escaped descendants (double-forked daemons, found by the
        context token in ``/proc``: death signal, then SIGKILL), writes the
        failure report and prunes temporary folders; if the loop ends first
        (``asyncio.run`` without ``close()``), the daemons get SIGKILL at once.

        While it runs in the main thread, a stop signal sent to the supervisor
        (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default; *Signals* in the API
        docs) goes to every worker's process group, survivors get SIGKILL
        after ``shutdown_timeout`` (at once on a second one), then
        :class:`SignalException` is raised. The application's own handler
        (not a SIGINT one: that stands for ``KeyboardInterrupt``) runs once
        the workers were sent the signal; ``SIG_IGN`` stays ignored; handlers
        are restored on return. Outside the main thread: no race (a warning).

        *Cancellation*: cancelling the task that awaits ``wait()`` stops the
        waiting only; the workers stop when the context is closed.
        """
        check_seconds("wait(timeout)", timeout, forever="None or negative: wait forever")
        try:
            return await self._ending.wait(timeout, self._signals)
        finally:  # the outcome is out: the aftermath may start (not ahead of our caller)
            if self._ending.result is not None:
                self._ending.handed_over()

    async def close(self, death_sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop every worker and its whole process tree; release everything.

        Sends ``death_sig`` to each worker's process group and descendants,
        SIGKILLs survivors after ``timeout`` seconds (a warning names rank and
        pid), reaps them, drains and closes every pipe and log file, and
        awaits the aftermath (see :meth:`wait`). Idempotent; shielded from
        cancellation (re-raised once done); a *second* cancellation (counting
        the one that made ``async with`` call it) SIGKILLs at once, with a
        warning. Bad arguments raise before any signal.

        :raises TypeError: ``death_sig`` or ``timeout`` has the wrong type.
        :raises ValueError: ``death_sig`` is not a signal number (0 included)
            or ``timeout`` is negative.
        """
        check_signal("close(death_sig)", death_sig)
        check_seconds("close(timeout)", timeout)
        await self._ending.close(death_sig, timeout, cancelled=False)

    async def __aenter__(self) -> PContext:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        await self._ending.close(
            signal.SIGTERM, self._signals.shutdown_timeout, cancelled=cancelled
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} nprocs={self.nprocs} "
            f"state={self._ending.describe()} pids={self.pids()}>"
        )
