"""The process context: a started group of workers, awaited as one.

Exit flow: a worker exits -> its handle's exit callback (subprocess protocol or
pidfd reader) runs on the loop -> ``_changed`` is set -> ``wait()`` wakes,
decides (all succeeded / first failure) and finishes the group through the one
shutdown path (:func:`aiolaunch._shutdown.terminate`), then drains every pipe
into its sinks before returning. No step polls. Work no outcome depends on -
the ``/proc`` scan for escaped daemons, the failure report, folder cleanup -
runs after ``wait()`` returned (``_cleanup``), awaited by ``close()``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import signal
import time
from typing import TYPE_CHECKING, Any

import anyio

from ._compat import task_cancelling, task_uncancel
from ._errors import fd_limit_error
from ._events import (
    Event,
    EventBus,
    GroupStopped,
    WorkerRestarting,
    WorkerStarted,
    worker_exited,
)
from ._forensics import Forensics
from ._logs import LogWiring
from ._ready import Readiness, ReadinessProbe
from ._restart import RestartPolicy, Restarts
from ._results import RunProcsResult, build_result, failed_ranks, not_ready_failure
from ._shutdown import shielded, sweep_tagged, terminate_group
from ._signals import STOP_SIGNALS, SignalPlan, forward_signal, watch_signals
from ._validate import check_seconds, check_signal
from ._workers._proc import CONTEXT_ENV, new_context_token

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from types import TracebackType

    from ._control import WorkerStatus
    from ._logs import LineSink
    from ._logs_specs import LogsDest
    from ._watchdog import Watchdog
    from ._workers._handle import WorkerHandle

__all__ = ["PContext"]

logger = logging.getLogger("aiolaunch")


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
        logs_dest: LogsDest,
        log_line_prefixes: dict[int, str] | None,
        shutdown_timeout: float,
        start_method: str,
        ready: dict[int, ReadinessProbe] | None = None,
        restart: dict[int, RestartPolicy] | None = None,
        console_dedup: float | None = None,
        console_strip_ansi: bool = False,
        duplicate_stdout_filters: Sequence[str] | None = None,
        duplicate_stderr_filters: Sequence[str] | None = None,
        watchdog: Watchdog | None = None,
        signal_plan: SignalPlan | None = None,
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.nprocs = len(args)
        self.start_method = start_method
        self.stdouts = dict(logs_dest.stdouts)
        self.stderrs = dict(logs_dest.stderrs)
        self.error_files = dict(logs_dest.error_files)
        self._logs = LogWiring(
            name=name,
            dest=logs_dest,
            prefixes=log_line_prefixes,
            dedup_window=console_dedup,
            strip_ansi=console_strip_ansi,
            stdout_filters=duplicate_stdout_filters,
            stderr_filters=duplicate_stderr_filters,
        )
        # torch's attributes: the files of the duplicate filters, or None.
        self.filtered_stdout = self._logs.filtered_file("stdout")
        self.filtered_stderr = self._logs.filtered_file("stderr")
        self._shutdown_timeout = shutdown_timeout
        self._signals = signal_plan or SignalPlan(
            frozenset(STOP_SIGNALS), frozenset(), shutdown_timeout
        )
        self._workers: dict[int, WorkerHandle] = {}
        self._changed = asyncio.Event()
        self._end: asyncio.Task[RunProcsResult] | None = None
        # What follows the result off wait()'s path (the escaped-descendant
        # sweep, pruning temp folders); close() awaits it.
        self._after: asyncio.Task[None] | None = None
        # Set once wait() handed the result over (or close() wants the
        # cleanup): the cleanup starts then, not ahead of wait()'s caller.
        self._handed = asyncio.Event()
        # Set once the death signal went out; set to end the grace period now.
        self._sent = asyncio.Event()
        self._kill_now = asyncio.Event()
        #: in every worker's environment (CONTEXT_ENV): close() finds escaped descendants
        self._token = new_context_token()
        self._result: RunProcsResult | None = None
        self._exit_order: list[int] = []
        self._bus = EventBus()
        self._restarts = Restarts(restart or {}, self.nprocs, self._changed.set)
        self._readiness = Readiness(
            name,
            self.nprocs,
            ready or {},
            bus=self._bus,
            changed=self._changed,
            restarting=self._restarts.pending,
            failure=lambda r: not_ready_failure(self._workers[r], self.error_files.get(r, "")),
        )
        self._forensics = Forensics(self, watchdog)

    # -- start ------------------------------------------------------------
    async def _start(self) -> None:
        rank = 0
        try:
            for rank in range(self.nprocs):
                await self._start_one(rank)
            await self._forensics.start()
        except BaseException as exc:
            await shielded(self._finish(signal.SIGKILL, 0.0))
            self._handed.set()
            if self._after is not None:
                await shielded(self._after)
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(exc, rank, self.nprocs) from exc
            raise

    async def _start_one(self, rank: int) -> None:
        def watch(stream: str) -> bool:
            # Lines are needed by a readiness probe or the watchdog's progress regex.
            return self._readiness.reads(rank, stream) or self._forensics.needs_lines

        def line_sink(stream: str) -> LineSink:
            return self._readiness.line_sink(rank, stream, watch(stream))

        streams = await self._logs.open(rank, watch=watch, line_sink=line_sink)
        try:
            handle = await self._spawn(rank, streams.stdout, streams.stderr)
        except BaseException:
            await self._logs.discard(streams)
            raise
        handle.attempt = self._restarts.attempts[rank]
        self._workers[rank] = handle
        self._bus.emit(
            WorkerStarted(rank=rank, time=time.monotonic(), pid=handle.pid, attempt=handle.attempt)
        )
        self._readiness.started(rank, handle)
        handle.on_exit = self._on_exit
        if not handle.alive:  # it exited while we were still wiring it up
            self._on_exit(handle)
        await self._logs.connect(streams)

    async def _spawn(self, rank: int, stdout: int | None, stderr: int | None) -> WorkerHandle:
        raise NotImplementedError

    def _env(self, rank: int) -> dict[str, str]:
        return {
            **self.envs[rank],
            **self._restarts.env(rank),
            **self._forensics.env(),
            **self._signals.env(self._forensics.stacks_dir),
            # Inherited by every descendant: close() finds daemons by it.
            CONTEXT_ENV: self._token,
        }

    def _on_exit(self, handle: WorkerHandle) -> None:
        rank = handle.local_rank
        self._bus.emit(worker_exited(handle))
        if not handle.stopped_by_us and self._end is None:
            planned = self._restarts.after_exit(handle, time.monotonic())
            if planned is not None:
                delay, attempt = planned
                self._readiness.reset(rank)
                self._bus.emit(
                    WorkerRestarting(rank=rank, time=time.monotonic(), attempt=attempt, delay=delay)
                )
                # A new incarnation that exits while it is still being wired up
                # queues its own restart behind this one.
                self._restarts.run(rank, lambda: self._restart(rank, delay))
                return
        self._gone(rank)

    def _gone(self, rank: int) -> None:
        # The rank's last incarnation exited: no restart follows.
        self._exit_order.append(rank)
        self._readiness.gone(rank)
        self._changed.set()

    async def _restart(self, rank: int, delay: float) -> None:
        # Finish the old incarnation's pipes first: its bytes precede the new
        # one's. Shielded: a cancelled drain would lose bytes and fds.
        await shielded(self._logs.drain_rank(rank))
        old_handle = self._workers[rank]
        old_handle.release()
        await asyncio.sleep(delay)  # allowed: the policy's backoff
        if self._end is not None:
            return
        self._restarts.attempts[rank] += 1
        try:
            # Shielded: once a process is spawned its pipes must be wired.
            await shielded(self._start_one(rank))
        except Exception:
            old_handle.failure_reason = old_handle.failure_reason or "restart failed"
            self._gone(rank)
            raise

    # -- queries ----------------------------------------------------------
    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of every started worker."""
        return {rank: w.pid for rank, w in self._workers.items()}

    def _failed_ranks(self) -> list[int]:
        return failed_ranks(self._workers, self._exit_order, self._restarts.pending)

    def _decided(self) -> bool:
        if self._failed_ranks() or self._forensics.failing:
            return True
        return (
            len(self._workers) == self.nprocs
            and not self._restarts.pending
            and all(not w.alive for w in self._workers.values())
        )

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

        Also written to ``{log_dir}/{rank}/stacks-<n>.txt`` (``n`` counts the
        dumps of this group). Workers are signalled only if they registered
        for it (function workers; Python programs run through the CLI or
        ``python -m aiolaunch._bootstrap``); any other rank gets one line
        saying why (or a ``py-spy dump`` where py-spy is installed) - never
        a signal that would kill it. A worker that does not answer within
        ``timeout`` seconds (stopped, D state) gets a line saying so. Use
        :meth:`StackReport.from_dumps` for the verdict.

        :raises ValueError: an unknown rank, or ``timeout`` not > 0.
        """
        return await self._forensics.dump_stacks(ranks, timeout)

    # -- orchestration ----------------------------------------------------
    def events(self, *, lines: bool = False, maxsize: int = 10_000) -> AsyncIterator[Event]:
        """Iterate over the group's lifecycle events, in order, until it stops.

        Yields :class:`WorkerStarted`, :class:`WorkerReady`,
        :class:`WorkerExited`, :class:`WorkerRestarting`,
        :class:`WorkerStalled` (with a watchdog) and, last,
        :class:`GroupStopped`; with ``lines=True`` also a :class:`LogLine` per
        line of every stream the supervisor reads (redirected, tee'd or
        probed). Events from before the call are replayed first. Several
        consumers may iterate at once, each with its own buffer of ``maxsize``
        events: one that falls behind loses its oldest events and receives an
        :class:`EventsDropped` with the count.

        :raises TypeError: ``maxsize`` is not an int (at the call, not at
            the first iteration).
        :raises ValueError: ``maxsize`` is below 1 (also at the call).
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
        the first failure after stopping the others (death signal, then
        SIGKILL after ``shutdown_timeout``). Returns ``None`` if ``timeout``
        seconds pass first (``None`` or negative: wait forever; ``0``: poll).
        Returns within milliseconds of the deciding exit: it is woken by the
        exit itself (``period`` is accepted for torch compatibility and
        ignored). After a result every worker is reaped, every pipe drained
        into its log file and console, its group and process tree signalled,
        and error files read. What no outcome depends on follows the return,
        in a cleanup task that :meth:`close` (or leaving ``async with``)
        awaits and that is otherwise all :meth:`close` does: escaped
        descendants (double-forked daemons, found by the context token in
        ``/proc``) get the death signal, then SIGKILL; the failure report is
        written; temporary folders are pruned. Should the loop end first
        (``asyncio.run`` returning without ``close()``), the daemons get
        SIGKILL at once.

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
        if self._result is not None:
            return self._result
        if self._end is not None:
            return await shielded(self._end)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None or timeout < 0 else loop.time() + timeout
        with watch_signals(
            lambda sig: self._changed.set(),
            stop=self._signals.stop,
            forward=self._signals.forward,
            on_repeat=lambda sig: self._escalate(f"second {sig.name}"),
            on_forward=lambda sig: forward_signal(self._workers.values(), sig, self.name),
        ) as watch:
            while True:
                self._changed.clear()
                if watch.received is not None:
                    end = self._finish(watch.received, self._shutdown_timeout)
                    await watch.stop_group(self._sent, end)
                if self._decided() or self._end is not None:
                    end = self._finish(signal.SIGTERM, self._shutdown_timeout, decided=True)
                    try:
                        return await shielded(end)
                    finally:
                        self._handed.set()
                remaining = math.inf if deadline is None else deadline - loop.time()
                if remaining <= 0:
                    return None
                with anyio.move_on_after(remaining):
                    await self._changed.wait()

    async def close(self, death_sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop every worker and its whole process tree; release everything.

        Sends ``death_sig`` to each worker's process group and descendants,
        SIGKILLs survivors after ``timeout`` seconds (logging a warning naming
        rank and pid), reaps them, drains and closes every pipe and log file.
        Idempotent; shielded from cancellation (a cancel is re-raised after the
        cleanup finished). A *second* cancellation - counting the one that
        made an ``async with`` block call ``close()`` - ends the grace period
        at once: the survivors get SIGKILL (as a second Ctrl-C does in
        ``wait()``), with a warning in the log.

        :raises TypeError: ``death_sig`` or ``timeout`` has the wrong type -
            before any worker is signalled.
        :raises ValueError: ``death_sig`` is not a signal number (0 included)
            or ``timeout`` is negative - before any worker is signalled.
        """
        check_signal("close(death_sig)", death_sig)
        check_seconds("close(timeout)", timeout)
        await self._close(death_sig, timeout, cancelled=False)

    async def _close(self, death_sig: int, timeout: float, *, cancelled: bool) -> None:
        # Cancellations the task already had when close() began (leaving
        # ``async with`` because of one - seen by __aexit__ on every Python,
        # by Task.cancelling() on 3.11+): the next one is the second.
        before = max(int(cancelled), task_cancelling(asyncio.current_task()))

        def on_cancel(count: int) -> None:
            if before + count >= 2:
                self._escalate("second cancellation of close()")

        await shielded(self._finish(death_sig, timeout), on_cancel)
        self._handed.set()
        if self._after is not None:
            await shielded(self._after, on_cancel)

    def _escalate(self, why: str) -> None:
        """End the grace period of the shutdown (now or once it starts): SIGKILL."""
        if self._kill_now.is_set() or (
            self._result is not None and (self._after is None or self._after.done())
        ):
            return
        self._kill_now.set()
        self._signals.set_deadline(0.0)
        logger.warning("aiolaunch: %s during shutdown; sending SIGKILL to the workers now", why)

    def _finish(
        self, death_sig: int, grace: float, *, decided: bool = False
    ) -> asyncio.Task[RunProcsResult]:
        # ``decided``: wait() saw the outcome; the scan for escaped descendants
        # then runs after the result (see _shutdown), not on wait()'s path.
        if self._end is None:
            self._end = asyncio.ensure_future(self._shutdown(death_sig, grace, decided))
            self._readiness.closing()
        return self._end

    async def _shutdown(self, death_sig: int, grace: float, decided: bool) -> RunProcsResult:
        await self._forensics.stop()
        await asyncio.gather(self._readiness.aclose(), self._restarts.aclose())
        workers = list(self._workers.values())
        failed_before = set(self._failed_ranks())
        now = death_sig == signal.SIGKILL or self._kill_now.is_set()
        # The deadline file tells live workers when SIGKILL comes: with none
        # left (wait() saw every exit) nobody reads it - skip the file I/O.
        if not decided or any(w.alive for w in workers):
            self._signals.set_deadline(0.0 if now else grace)
        try:
            await terminate_group(
                workers,
                death_sig,
                grace,
                on_sent=self._sent.set,
                escalate=self._kill_now,
                # wait() deciding: the workers, their groups and process trees
                # go before the result; the /proc/*/environ scan for escaped
                # daemons (a thread hop and ~60 us per process on the host)
                # follows it, in _cleanup(), which close() awaits.
                token=None if decided else self._token,
                on_torn_down=lambda: self._escalate("cancellation of the event loop's tasks"),
            )
        except BaseException:
            self._signals.release()
            raise
        if not decided:
            self._signals.release()  # else in _cleanup(): file I/O off wait()'s path
        await self._logs.aclose()
        for w in workers:
            w.release()
        self._result = build_result(
            self._workers,
            [r for r in self._exit_order if r in failed_before],
            self.error_files,
            self.stdouts,
            self.stderrs,
        )
        # The report and folder cleanup follow in _cleanup(), off wait()'s path.
        self._result = self._forensics.finish(self._result, conclude=False)
        self._after = asyncio.ensure_future(
            self._cleanup(death_sig, grace, [w.pid for w in workers] if decided else None)
        )
        self._bus.emit(
            GroupStopped(rank=None, time=time.monotonic(), failed=self._result.is_failed())
        )
        return self._result

    async def _cleanup(self, death_sig: int, grace: float, sweep: list[int] | None) -> None:
        """After the result: the group's own files, the escaped descendants
        (``sweep``: the worker pids, when wait() decided and terminate() did
        not scan for them), then the temp folders (after the error files).

        Off wait()'s path: it starts once wait() handed the result over (file
        I/O and ``/proc`` scans in threads), and close() awaits it. If the loop
        cancels it (``asyncio.run`` ending without close()), the escapees get
        SIGKILL at once instead.
        """
        try:
            await self._handed.wait()
            await asyncio.to_thread(self._drop_files)
            if sweep:
                await sweep_tagged(
                    self._token, min(sweep), sweep, death_sig, grace, escalate=self._kill_now
                )
        except asyncio.CancelledError:
            task_uncancel(asyncio.current_task())
            self._drop_files()  # idempotent
            if sweep:
                await sweep_tagged(self._token, min(sweep), sweep, signal.SIGKILL, 0.0)
        finally:
            await self._logs.prune_temp_dirs()

    def _drop_files(self) -> None:
        # The stop deadline file, the failure report, the forensics folders:
        # before the pruning, which keeps a folder that still holds anything.
        self._signals.release()
        if self._result is not None:
            self._forensics.conclude(self._result)  # idempotent: cleanup() once

    # -- context manager --------------------------------------------------
    async def __aenter__(self) -> PContext:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        await self._close(signal.SIGTERM, self._shutdown_timeout, cancelled=cancelled)

    def __repr__(self) -> str:
        if self._result is not None:
            state = "failed" if self._result.is_failed() else "done"
        elif self._end is not None:
            state = "closing"
        else:
            state = "running"
        return (
            f"<{type(self).__name__} name={self.name!r} nprocs={self.nprocs} "
            f"state={state} pids={self.pids()}>"
        )
