"""The process context: a started group of workers, awaited as one.

Exit flow: a worker exits -> its handle's exit callback (subprocess protocol or
pidfd reader) runs on the loop -> ``_changed`` is set -> ``wait()`` wakes,
decides (all succeeded / first failure) and finishes the group through the one
shutdown path (:func:`aiolaunch._shutdown.terminate`), then drains every pipe
into its sinks before returning. No step polls. Work no outcome depends on -
the ``/proc`` scan for escaped daemons, the failure report, folder cleanup -
runs after ``wait()`` returned (``GroupShutdown.follow``), awaited by ``close()``.
"""

from __future__ import annotations

import asyncio
import errno
import math
import signal
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import fd_limit_error
from ._events import Event, EventBus, LogLines, group_stopped, worker_exited, worker_started
from ._forensics import Forensics
from ._ready import Readiness, ReadinessProbe
from ._restart import RespawnSteps, RestartPolicy, Restarts
from ._results import RunProcsResult, build_result, decided, failed_ranks, not_ready_failure
from ._shutdown import GroupShutdown, shielded
from ._validate import check_seconds, check_signal
from ._workers._proc import new_context_token

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ._control import WorkerStatus
    from ._logs import LogWiring
    from ._signals import SignalPlan
    from ._watchdog import Watchdog
    from ._workers._handle import WorkerHandle

__all__ = ["PContext"]


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
        self._logs = logs
        # torch's attributes: the files of the duplicate filters, or None.
        self.filtered_stdout = self._logs.filtered_file("stdout")
        self.filtered_stderr = self._logs.filtered_file("stderr")
        self._signals = signal_plan
        self._workers: dict[int, WorkerHandle] = {}
        self._changed = asyncio.Event()
        self._stop = GroupShutdown(self._signals, new_context_token())
        self._exit_order: list[int] = []
        self._bus = EventBus()
        steps = RespawnSteps(
            drain=self._logs.drain_rank,
            start=self._start_one,
            ending=lambda: self._stop.task is not None,
            planned=lambda rank: self._readiness.reset(rank),
            gone=self._gone,
        )
        self._restarts = Restarts(
            restart or {}, self.nprocs, self._changed.set, bus=self._bus, steps=steps
        )
        self._readiness = Readiness(
            name,
            self.nprocs,
            ready or {},
            bus=self._bus,
            changed=self._changed,
            restarting=self._restarts.pending,
            exited=self._exit_order,
            failure=lambda r: not_ready_failure(self._workers[r], self.error_files.get(r, "")),
        )
        self._forensics = Forensics(self, watchdog)
        # The line consumers of the log pipeline: probes, LogLine events, progress.
        logs.lines.subscribe(self._readiness)
        logs.lines.subscribe(LogLines(self._bus))
        if self._forensics.progress_lines is not None:
            logs.lines.subscribe(self._forensics.progress_lines)

    # -- start ------------------------------------------------------------
    async def _start(self) -> None:
        rank = 0
        try:
            for rank in range(self.nprocs):
                await self._start_one(rank)
            # The spawns may never yield: a cancellation that came meanwhile
            # (Ctrl-C) must land inside this try.
            await asyncio.sleep(0)  # allowed: one loop turn, not a wait
            await self._forensics.start(self._signals.make_file)
        except BaseException as exc:
            await shielded(self._finish(signal.SIGKILL, 0.0))
            await self._stop.cleaned()
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(exc, rank, self.nprocs) from exc
            raise

    async def _start_one(self, rank: int) -> None:
        # The streams are read from the end of the block on (after started()),
        # and closed if the spawn fails.
        async with self._logs.open(rank) as streams:
            handle = await self._spawn(rank, streams.stdout, streams.stderr)
            handle.attempt = self._restarts.attempts[rank]
            self._workers[rank] = handle
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
        return env | self._signals.env(self._forensics.stacks_dir) | self._stop.env()

    def _on_exit(self, handle: WorkerHandle) -> None:
        self._bus.emit(worker_exited(handle))
        if not self._restarts.after_exit(handle):  # no restart follows
            self._gone(handle.local_rank)

    def _gone(self, rank: int) -> None:
        self._exit_order.append(rank)  # its last incarnation: no restart follows
        self._changed.set()

    # -- queries ----------------------------------------------------------
    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of every started worker."""
        return {rank: w.pid for rank, w in self._workers.items()}

    def status(self) -> list[WorkerStatus]:
        """Every rank's state now, as :class:`WorkerStatus` (the control socket's answer).

        Reads ``/proc`` of each live worker (a few microseconds each); CPU %
        is measured since the previous sample (watchdog period or call).
        """
        return self._forensics.status()

    async def dump_stacks(
        self, ranks: list[int] | None = None, timeout: float = 5.0
    ) -> dict[int, str]:
        """The Python stacks of every thread of each live worker, ``{rank: text}``.

        Also written to ``{log_dir}/{rank}/stacks-<n>.txt`` (``n``: the group's
        dump count). Only registered workers are signalled (function workers;
        Python programs run by the CLI or ``python -m aiolaunch._bootstrap``):
        any other rank, or one silent for ``timeout`` seconds (stopped, D
        state), gets a line saying why (or a ``py-spy dump`` where installed),
        never a signal that would kill it. :meth:`StackReport.from_dumps`
        gives the verdict.

        :raises ValueError: an unknown rank, or ``timeout`` not > 0.
        """
        return await self._forensics.dump_stacks(ranks, timeout)

    # -- orchestration ----------------------------------------------------
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

    # -- wait / close -----------------------------------------------------
    async def wait(
        self, timeout: float | None = None, period: float | None = None
    ) -> RunProcsResult | None:
        """Wait for the group's outcome.

        Returns a :class:`RunProcsResult` once every worker succeeded, or at
        the first failure after stopping the others (death signal, SIGKILL
        after ``shutdown_timeout``); ``None`` if ``timeout`` seconds pass first
        (``None`` or negative: forever; ``0``: poll). Woken by the exit itself,
        it returns within milliseconds of it (``period``: torch's, ignored).
        After a result every worker is reaped, every pipe drained into its
        log file and console, its group and process tree signalled, and error
        files read. The rest follows in a cleanup task that :meth:`close` (or
        leaving ``async with``) awaits: escaped descendants (double-forked
        daemons, found by the context token in ``/proc``) get the death
        signal, then SIGKILL; the failure report is written; temporary
        folders are pruned. If the loop ends first (``asyncio.run`` without
        ``close()``), the daemons get SIGKILL at once.

        While it runs in the main thread, a stop signal sent to the supervisor
        (SIGTERM, SIGINT, SIGHUP, SIGQUIT by default; see *Signals* in the API
        docs) goes to every worker's process group, survivors get SIGKILL after
        ``shutdown_timeout`` (at once on a second such signal), then
        :class:`SignalException` is raised. The application's own handler for
        it (not a SIGINT one: that stands for ``KeyboardInterrupt``) is called
        once the workers were sent it; ``SIG_IGN`` stays ignored; previous
        handlers are restored on return. Outside the main thread there is no
        such race (a warning, once).

        *Cancellation*: cancelling the task that awaits ``wait()`` stops the
        waiting only; the workers stop when the context is closed.
        """
        check_seconds("wait(timeout)", timeout, forever="None or negative: wait forever")
        try:
            return await self._wait(timeout)
        finally:  # the outcome is out: the cleanup may start (not ahead of our caller)
            if self._stop.result is not None:
                self._stop.handed_over()

    async def _wait(self, timeout: float | None) -> RunProcsResult | None:
        if self._stop.task is not None:  # the outcome is known, or on its way
            return self._stop.result or await shielded(self._stop.task)
        deadline = math.inf if timeout is None or timeout < 0 else anyio.current_time() + timeout
        grace = self._signals.shutdown_timeout
        with self._signals.watch(
            self._changed, self._stop.escalate, self._workers, self.name
        ) as watch:
            while True:
                self._changed.clear()
                if watch.received is not None:
                    end = self._finish(watch.received, grace)
                    await watch.stop_group(self._stop.sent, end)
                pending = self._restarts.pending
                ended = decided(self._workers, self.nprocs, self._exit_order, pending)
                if ended or self._forensics.failing or self._stop.task is not None:
                    return await shielded(self._finish(signal.SIGTERM, grace, decided=True))
                if anyio.current_time() >= deadline:
                    return None
                with anyio.CancelScope(deadline=deadline):
                    await self._changed.wait()

    async def close(self, death_sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop every worker and its whole process tree; release everything.

        Sends ``death_sig`` to each worker's process group and descendants,
        SIGKILLs survivors after ``timeout`` seconds (a warning names rank and
        pid), reaps them, drains and closes every pipe and log file. Idempotent;
        shielded from cancellation (re-raised once done). A *second*
        cancellation (counting the one that made ``async with`` call it) ends
        the grace period at once: survivors get SIGKILL with a warning, as on a
        second Ctrl-C in ``wait()``. Bad arguments raise before any signal.

        :raises TypeError: ``death_sig`` or ``timeout`` has the wrong type.
        :raises ValueError: ``death_sig`` is not a signal number (0 included)
            or ``timeout`` is negative.
        """
        check_signal("close(death_sig)", death_sig)
        check_seconds("close(timeout)", timeout)
        await self._stop.close(lambda: self._finish(death_sig, timeout), cancelled=False)

    def _finish(
        self, death_sig: int, grace: float, *, decided: bool = False
    ) -> asyncio.Task[RunProcsResult]:
        # ``decided``: wait() saw the outcome (see GroupShutdown.stop).
        if self._stop.task is None:
            self._readiness.closing()
        return self._stop.begin(lambda: self._shutdown(death_sig, grace, decided))

    async def _shutdown(self, death_sig: int, grace: float, decided: bool) -> RunProcsResult:
        await self._forensics.stop()
        await asyncio.gather(self._readiness.aclose(), self._restarts.aclose())
        workers = list(self._workers.values())
        failed_before = set(failed_ranks(self._workers, self._exit_order, self._restarts.pending))
        await self._stop.stop(workers, death_sig, grace, decided=decided)
        await self._logs.aclose()
        for w in workers:
            w.release()
        failed = [r for r in self._exit_order if r in failed_before]
        result = build_result(self._workers, failed, self.error_files, self.stdouts, self.stderrs)
        # The report and the folder cleanup follow the result (off wait()'s
        # path), then the pruning (after the error files are written).
        self._stop.result = result = self._forensics.finish(result, conclude=False)
        self._stop.follow(
            [w.pid for w in workers] if decided else None,
            death_sig,
            grace,
            lambda: self._forensics.conclude(result),
            self._logs.prune_temp_dirs,
        )
        self._bus.emit(group_stopped(result.is_failed()))
        return result

    # -- context manager --------------------------------------------------
    async def __aenter__(self) -> PContext:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        grace = self._signals.shutdown_timeout
        await self._stop.close(lambda: self._finish(signal.SIGTERM, grace), cancelled=cancelled)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} name={self.name!r} nprocs={self.nprocs} "
            f"state={self._stop.state} pids={self.pids()}>"
        )
