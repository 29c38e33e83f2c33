"""The process context: a started group of workers, awaited as one.

``PContext`` assembles the parts of a group and is its public face; each part
has one job and one owner:

- ``_group.GroupState``: the group's state (workers, exits, restarts, forced
  failures, attach sessions) and its one wake-up (``Wakeup``);
- ``_launch.RankLauncher``: starting each incarnation of a rank, through the
  kind's ``Spawner`` (``_kinds``);
- ``_ending.GroupEnding``: the one way a group ends (outcome, then aftermath);
- the observers (``_observer.GroupObserver``), each told of the group's
  moments and acting only through its commands: ``_hangs.HangObserver``
  (stacks, watchdog, stragglers, report), ``_live.LiveObserver`` (control
  socket, metrics, attach), ``_ready.Readiness`` (the probes),
  ``_restart.Restarts`` (the restart policies);
- ``_logs.LogWiring``: the streams; ``_logs.GroupFolder``: the group's
  folder; ``_events.EventBus``: the events.

Exit flow: a worker exits -> its handle's exit callback runs on the loop ->
the launcher hands it to the restart policies, or ``GroupState.gone``
notifies the wake-up -> ``wait()`` checks ``GroupState.decided()`` and ends
the group through ``GroupEnding.begin``. No step polls.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._cancel import shielded
from ._deadline import StopDeadline
from ._ending import GroupEnding
from ._errors import fd_limit_error
from ._events import Event, EventBus, LogLines, WorkerRestarting
from ._group import GroupState
from ._hangs._observer import HangObserver
from ._launch import RankLauncher
from ._live._observer import LiveObserver
from ._live._status import worker_statuses
from ._logs._folder import GroupFolder
from ._ready import Readiness, ReadinessProbe
from ._restart import RestartPolicy, Restarts
from ._validate import check_seconds, check_signal
from ._workers._processes import new_context_token

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ._hangs._watchdog import Watchdog
    from ._launch import Spawner
    from ._live._metrics import MetricsEndpoint
    from ._live._status import WorkerStatus
    from ._logs import LogWiring
    from ._results import RunProcsResult
    from ._signals._plan import SignalPlan

__all__ = ["JobAttempt", "PContext"]


@dataclass(frozen=True)
class JobAttempt:
    """What a group knows of the job it is one attempt of (the elastic agent's):
    how many times the job restarted before it (``restarts``: every rank's
    restart count starts there, and its first events say each rank restarts),
    the delay before it, the job's metrics endpoint (``None``: none; it
    outlives the group) and the job's lifecycle events so far (``history``,
    the agent's list: the group appends its own, and its ``events`` command
    replays the earlier attempts' first, so that a follower misses none, even
    of an attempt too short to be seen)."""

    restarts: int = 0
    delay: float = 0.0
    metrics: MetricsEndpoint | None = None
    #: whether the attempt follows a failure (its ranks restart); ``False``
    #: after a change of membership (new processes, the same restart count)
    restarting: bool = True
    history: list[Event] | None = None


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
        spawner: Spawner,
        ready: dict[int, ReadinessProbe] | None = None,
        restart: dict[int, RestartPolicy] | None = None,
        watchdog: Watchdog | None = None,
        metrics: MetricsEndpoint | None = None,
        job: JobAttempt | None = None,
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
        self._signals = signal_plan
        self._logs = logs
        job = job or JobAttempt()
        self._state = state = GroupState(name, self.nprocs, restarts=job.restarts)
        earlier = () if job.history is None else tuple(job.history)
        self._bus = bus = EventBus(record=job.history)
        if job.restarts and job.restarting:  # the job's ranks, restarted
            for rank in range(self.nprocs):
                bus.emit(
                    WorkerRestarting(
                        rank=rank, time=time.monotonic(), attempt=job.restarts, delay=job.delay
                    )
                )
        owns_metrics = job.metrics is None
        if job.metrics is not None:
            metrics = job.metrics
        folder = GroupFolder(logs.dest.root, self.error_files)
        restarts = Restarts(restart or {}, state, bus=bus)
        self._readiness = Readiness(state, ready or {}, bus=bus, error_files=self.error_files)
        self._hangs = HangObserver(
            state,
            watchdog,
            folder,
            last_output=logs.last_output,
            stderrs=self.stderrs,
            emit=bus.emit,
            restartable=restarts.has_policy,
            unread=logs.unread,
        )
        live = LiveObserver(
            state,
            folder,
            metrics,
            owns_metrics=owns_metrics,
            status=self.status,
            dump=self._hangs.dump,
            events=bus.iterate,
            earlier=earlier,
        )
        #: ``http://127.0.0.1:PORT/metrics`` with ``start_processes(metrics_port=)``, else None
        self.metrics_url = None if metrics is None else metrics.url
        observers = (self._hangs, live, self._readiness, restarts)
        self._ending = GroupEnding(
            state,
            logs=logs,
            observers=observers,
            folder=folder,
            bus=bus,
            # The group's folder: a supervisor killed by SIGKILL leaves it there.
            deadline=StopDeadline(folder.private_dir, signal_plan.shutdown_timeout),
            token=new_context_token(),
        )
        self._launcher = RankLauncher(
            state,
            spawner,
            logs=logs,
            bus=bus,
            envs=envs,
            observers=observers,
            restarts=restarts,
            group_env=self._ending.env,
        )
        # The line consumers of the log pipeline: probes, LogLine events, progress.
        self._readiness.lines_wanted = logs.lines.subscribe(self._readiness)
        bus.lines_wanted = logs.lines.subscribe(LogLines(bus))
        if self._hangs.progress_lines is not None:
            logs.lines.subscribe(self._hangs.progress_lines)

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
            await ending.start_watched(self.nprocs, self._launcher.start, self._signals)
            ending.group_started()
        except BaseException as exc:
            await shielded(self._ending.begin(signal.SIGKILL, 0.0))
            await self._ending.finished()
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(exc, len(self._state.pids()), self.nprocs) from exc
            raise

    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of every started worker."""
        return self._state.pids()

    def status(self) -> list[WorkerStatus]:
        """Every rank's state now, as :class:`WorkerStatus` (the control socket's answer).

        Reads ``/proc`` of each live worker (a few microseconds each); CPU %
        is measured over at least the last half second (or since the start).
        """
        return worker_statuses(self._state, self._hangs)

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
        return await self._hangs.dump_stacks(ranks, timeout)

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
