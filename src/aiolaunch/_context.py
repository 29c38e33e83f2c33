"""The process context: a started group of workers, awaited as one.

Exit flow: a worker exits -> its handle's exit callback (subprocess protocol or
pidfd reader) runs on the loop -> ``_changed`` is set -> ``wait()`` wakes,
decides (all succeeded / first failure) and finishes the group through the one
shutdown path (:func:`aiolaunch._shutdown.terminate`), then drains every pipe
into its sinks before returning. No step polls.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import ChildFailedError, SignalException
from ._events import (
    Event,
    EventBus,
    GroupStopped,
    LogLine,
    WorkerExited,
    WorkerReady,
    WorkerRestarting,
    WorkerStarted,
)
from ._logs import (
    DEVNULL,
    INHERIT,
    ConsoleDedup,
    LineSink,
    Sink,
    StreamPump,
    console,
    plan_stream,
)
from ._logs._filters import open_duplicate_filters
from ._ready import ReadinessProbe, ReadyLine
from ._restart import RestartPolicy, RestartTracker
from ._results import ProcessFailure, RunProcsResult
from ._shutdown import shielded, terminate
from ._signals import watch_signals

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from types import TracebackType
    from typing import TextIO

    from ._logs_specs import LogsDest
    from ._workers._handle import WorkerHandle

__all__ = ["MultiprocessContext", "PContext", "SubprocessContext"]

# After a worker is gone, how long its pipes may take to reach EOF before we
# read what the kernel buffers and close our end (a surviving descendant in
# another session may hold them).
_DRAIN_TIMEOUT = 0.25
_CONSOLE_FLUSH_TIMEOUT = 5.0


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
    ) -> None:
        self._strip_ansi = console_strip_ansi
        self.name = name
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.nprocs = len(args)
        self.start_method = start_method
        self.stdouts = dict(logs_dest.stdouts)
        self.stderrs = dict(logs_dest.stderrs)
        self.error_files = dict(logs_dest.error_files)
        self._dest = logs_dest
        self._prefixes = log_line_prefixes or {}
        self._shutdown_timeout = shutdown_timeout
        self._workers: dict[int, WorkerHandle] = {}
        self._pumps: list[StreamPump] = []
        self._changed = asyncio.Event()
        self._end: asyncio.Task[RunProcsResult] | None = None
        self._result: RunProcsResult | None = None
        self._exit_order: list[int] = []
        self._bus = EventBus()
        self._dedup = ConsoleDedup(name, console_dedup) if console_dedup else None
        self._probes = ready or {}
        self._ready: dict[int, asyncio.Event] = {r: asyncio.Event() for r in range(self.nprocs)}
        self._trackers = {r: RestartTracker(p) for r, p in (restart or {}).items()}
        self._attempts: dict[int, int] = dict.fromkeys(range(self.nprocs), 0)
        self._restarting: set[int] = set()
        self._pending_restarts: dict[int, int] = {}
        self._restart_locks: dict[int, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # torch's duplicate filters: tee'd lines matching a filter, copied
        # into one file per stream (``filtered_stdout`` is torch's attribute).
        self._filters = open_duplicate_filters(
            logs_dest, duplicate_stdout_filters, duplicate_stderr_filters
        )
        self.filtered_stdout: TextIO | None = getattr(self._filters.get("stdout"), "file", None)
        self.filtered_stderr: TextIO | None = getattr(self._filters.get("stderr"), "file", None)

    # -- start ------------------------------------------------------------
    def _prefix(self, rank: int) -> str:
        return self._prefixes.get(rank, f"[{self.name}{rank}]:")

    async def _start(self) -> None:
        rank = 0
        try:
            for rank in range(self.nprocs):
                await self._start_one(rank)
        except BaseException as exc:
            await shielded(self._finish(signal.SIGKILL, 0.0))
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise _fd_limit_error(exc, rank, self.nprocs) from exc
            raise

    async def _start_one(self, rank: int) -> None:
        probe = self._probes.get(rank)
        fds: list[int] = []
        plans: list[tuple[int | None, int | None, list[Sink]]] = []
        try:
            for stream, path, tees in (
                ("stdout", self.stdouts[rank], self._dest.tee_stdouts),
                ("stderr", self.stderrs[rank], self._dest.tee_stderrs),
            ):
                watch = isinstance(probe, ReadyLine) and probe.stream in (stream, "any")
                dedup = self._dedup if rank not in self._prefixes else None
                mode, sinks = plan_stream(
                    path, rank in tees, stream, self._prefix(rank), watch, dedup, rank,
                    self._strip_ansi,
                )
                if mode == INHERIT:
                    plans.append((None, None, sinks))
                elif mode == DEVNULL:
                    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                    fds.append(null)
                    plans.append((null, None, sinks))
                else:
                    sinks.append(self._line_sink(rank, stream, watch))
                    if stream in self._filters and rank in tees:
                        sinks.append(self._filters[stream].sink(self._prefix(rank)))
                    r, w = os.pipe()
                    fds += [r, w]
                    _widen_pipe(w)
                    plans.append((w, r, sinks))
            handle = await self._spawn(rank, plans[0][0], plans[1][0])
        except BaseException:
            for fd in fds:
                _close_quietly(fd)
            for _, _, sinks in plans:
                for sink in sinks:
                    await sink.aclose()
            raise
        handle.attempt = self._attempts[rank]
        self._workers[rank] = handle
        self._bus.emit(
            WorkerStarted(rank=rank, time=time.monotonic(), pid=handle.pid, attempt=handle.attempt)
        )
        if probe is None:
            self._mark_ready(rank, handle.pid)
        handle.on_exit = self._on_exit
        if not handle.alive:  # it exited while we were still wiring it up
            self._on_exit(handle)
        for w_end, r_end, sinks in plans:
            if w_end is not None:
                _close_quietly(w_end)  # the child has its copy
            if r_end is not None:
                # Await first: `self._pumps.append(await ...)` would bind the list
                # before the await, and a restart may replace it meanwhile.
                pump = await StreamPump.open(r_end, sinks, rank)
                self._pumps.append(pump)
        if probe is not None and not isinstance(probe, ReadyLine):
            self._spawn_task(self._run_probe(rank, probe, handle))

    def _line_sink(self, rank: int, stream: str, watch: bool) -> LineSink:
        # Splits lines only while someone listens: a readiness probe not yet
        # satisfied, or an events(lines=True) consumer.
        probe = self._probes.get(rank)
        matches = probe.matcher() if watch and isinstance(probe, ReadyLine) else None
        ready = self._ready[rank]

        def wanted() -> bool:
            return bool(self._bus.wants_lines) or (matches is not None and not ready.is_set())

        def on_line(line: str) -> None:
            if matches is not None and not ready.is_set() and matches(line):
                w = self._workers.get(rank)
                self._mark_ready(rank, w.pid if w is not None else 0)
            if self._bus.wants_lines:
                self._bus.emit(LogLine(rank=rank, time=time.monotonic(), stream=stream, text=line))

        return LineSink(on_line, wanted)

    def _mark_ready(self, rank: int, pid: int) -> None:
        if not self._ready[rank].is_set():
            self._ready[rank].set()
            self._bus.emit(WorkerReady(rank=rank, time=time.monotonic(), pid=pid))
            self._changed.set()

    async def _run_probe(self, rank: int, probe: ReadinessProbe, handle: WorkerHandle) -> None:
        probe_task = asyncio.ensure_future(probe.wait_ready(rank))
        exit_task = asyncio.ensure_future(handle.exited.wait())
        try:
            await asyncio.wait({probe_task, exit_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            probe_task.cancel()
            exit_task.cancel()
        if probe_task.done() and not probe_task.cancelled() and probe_task.exception() is None:
            self._mark_ready(rank, handle.pid)

    def _spawn_task(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self, rank: int, stdout: int | None, stderr: int | None) -> WorkerHandle:
        raise NotImplementedError

    def _env(self, rank: int) -> dict[str, str]:
        env = dict(self.envs[rank])
        if rank in self._trackers:
            env["AIOLAUNCH_RESTART_COUNT"] = str(self._attempts[rank])
        return env

    def _on_exit(self, handle: WorkerHandle) -> None:
        rank = handle.local_rank
        rc = handle.returncode
        assert rc is not None
        self._bus.emit(
            WorkerExited(
                rank=rank,
                time=time.monotonic(),
                pid=handle.pid,
                exitcode=rc,
                signal=_signal_name(rc),
                stopped=handle.stopped_by_us,
            )
        )
        tracker = self._trackers.get(rank)
        if tracker is not None and not handle.stopped_by_us and self._end is None:
            failed = rc != 0 or handle.failure_reason is not None
            delay = tracker.next_delay(1 if failed else 0, time.monotonic())
            if delay is not None:
                self._restarting.add(rank)
                self._pending_restarts[rank] = self._pending_restarts.get(rank, 0) + 1
                self._ready[rank].clear()
                self._bus.emit(
                    WorkerRestarting(
                        rank=rank, time=time.monotonic(), attempt=tracker.attempts, delay=delay
                    )
                )
                self._spawn_task(self._restart(rank, delay))
                return
        self._exit_order.append(rank)
        self._changed.set()

    async def _restart(self, rank: int, delay: float) -> None:
        try:
            # One restart of a rank at a time: a new incarnation that exits while
            # it is still being wired up queues its own restart behind this one.
            async with self._restart_locks.setdefault(rank, asyncio.Lock()):
                # Finish the old incarnation's pipes first: its bytes precede the
                # new one's. Shielded: a cancelled drain would lose bytes and fds.
                old = [p for p in self._pumps if p.rank == rank]
                self._pumps[:] = [p for p in self._pumps if p.rank != rank]
                if old:
                    await shielded(asyncio.gather(*(p.drain(_DRAIN_TIMEOUT) for p in old)))
                old_handle = self._workers[rank]
                old_handle.release()
                await asyncio.sleep(delay)  # allowed: the policy's backoff
                if self._end is not None:
                    return
                self._attempts[rank] += 1
                try:
                    # Shielded: once a process is spawned its pipes must be wired.
                    await shielded(self._start_one(rank))
                except Exception:
                    old_handle.failure_reason = old_handle.failure_reason or "restart failed"
                    self._exit_order.append(rank)
                    raise
        finally:
            self._pending_restarts[rank] -= 1
            if not self._pending_restarts[rank]:
                self._restarting.discard(rank)
            self._changed.set()

    # -- queries ----------------------------------------------------------
    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of every started worker."""
        return {rank: w.pid for rank, w in self._workers.items()}

    def _failed_ranks(self) -> list[int]:
        failed = []
        for rank in self._exit_order:
            w = self._workers[rank]
            if w.stopped_by_us or rank in self._restarting or w.alive:
                continue
            if w.returncode != 0 or w.failure_reason is not None:
                failed.append(rank)
        return failed

    def _decided(self) -> bool:
        if self._failed_ranks():
            return True
        return (
            len(self._workers) == self.nprocs
            and not self._restarting
            and all(not w.alive for w in self._workers.values())
        )

    # -- orchestration ----------------------------------------------------
    def events(self, *, lines: bool = False, maxsize: int = 10_000) -> AsyncIterator[Event]:
        """Iterate over the group's lifecycle events, in order, until it stops.

        Yields :class:`WorkerStarted`, :class:`WorkerReady`,
        :class:`WorkerExited`, :class:`WorkerRestarting` and, last,
        :class:`GroupStopped`; with ``lines=True`` also a :class:`LogLine` per
        line of every stream the supervisor reads (redirected, tee'd or
        probed). Events from before the call are replayed first. Several
        consumers may iterate at once, each with its own buffer of ``maxsize``
        events: one that falls behind loses its oldest events and receives an
        :class:`EventsDropped` with the count.
        """
        return self._bus.iterate(lines=lines, maxsize=maxsize)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker's readiness probe succeeded.

        Ranks without a probe are ready once started. A worker that exits
        before it is ready (and is not restarted) fails the wait with
        :class:`ChildFailedError` carrying its failure - not a timeout.

        :raises TimeoutError: ``timeout`` seconds passed first.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            self._changed.clear()
            if all(ev.is_set() for ev in self._ready.values()) and not self._restarting:
                return
            dead = [
                r
                for r in self._exit_order
                if not self._ready[r].is_set() and r not in self._restarting
            ]
            if dead or self._end is not None:
                failures = {
                    r: ProcessFailure(
                        local_rank=r,
                        pid=self._workers[r].pid,
                        exitcode=self._workers[r].returncode or 0,
                        error_file=self.error_files.get(r, ""),
                    )
                    for r in dead
                }
                raise ChildFailedError(self.name, failures)
            remaining = math.inf if deadline is None else deadline - loop.time()
            if remaining <= 0:
                not_ready = sorted(r for r, ev in self._ready.items() if not ev.is_set())
                raise TimeoutError(f"ranks {not_ready} of {self.name!r} not ready after {timeout}s")
            with anyio.move_on_after(remaining):
                await self._changed.wait()

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
        into its log file and console, and :meth:`close` is a no-op.

        While it runs in the main thread, SIGTERM, SIGINT, SIGHUP and SIGQUIT
        sent to the supervisor are forwarded to every worker's process group;
        survivors get SIGKILL after ``shutdown_timeout``; then
        :class:`SignalException` is raised. Previous handlers are restored on
        return. Outside the main thread there is no such race (logged once).

        *Cancellation*: cancelling the task that awaits ``wait()`` stops the
        waiting only; the workers stop when the context is closed.
        """
        if self._result is not None:
            return self._result
        if self._end is not None:
            return await shielded(self._end)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None or timeout < 0 else loop.time() + timeout
        with watch_signals(lambda sig: self._changed.set()) as watch:
            while True:
                self._changed.clear()
                if watch.received is not None:
                    watch.consumed = True
                    sig = watch.received
                    await shielded(self._finish(sig, self._shutdown_timeout))
                    raise SignalException(
                        f"Process {os.getpid()} got signal: {sig.value}", sigval=sig
                    )
                if self._decided() or self._end is not None:
                    return await shielded(self._finish(signal.SIGTERM, self._shutdown_timeout))
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
        cleanup finished).
        """
        await shielded(self._finish(death_sig, timeout))

    def _finish(self, death_sig: int, grace: float) -> asyncio.Task[RunProcsResult]:
        if self._end is None:
            self._end = asyncio.ensure_future(self._shutdown(death_sig, grace))
        return self._end

    async def _shutdown(self, death_sig: int, grace: float) -> RunProcsResult:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._restarting.clear()
        workers = list(self._workers.values())
        failed_before = set(self._failed_ranks())
        await terminate(workers, death_sig, grace)
        if self._pumps:
            await asyncio.gather(*(p.drain(_DRAIN_TIMEOUT) for p in self._pumps))
            if self._dedup is not None:
                self._dedup.flush()
            # Tee'd lines are on the console before wait()/close() return - unless
            # the console is stuck, which must not hang the supervisor.
            with anyio.move_on_after(_CONSOLE_FLUSH_TIMEOUT):
                await console().flush()
        for dup in self._filters.values():
            dup.close()
        for w in workers:
            w.release()
        self._result = self._build_result(failed_before)
        self._bus.emit(
            GroupStopped(rank=None, time=time.monotonic(), failed=self._result.is_failed())
        )
        return self._result

    def _build_result(self, failed: set[int]) -> RunProcsResult:
        failures: dict[int, ProcessFailure] = {}
        for rank in self._exit_order:
            if rank not in failed:
                continue
            w = self._workers[rank]
            error_file = self.error_files.get(rank, "")
            if w.failure_reason is not None and error_file and error_file != os.devnull:
                _record_reason(error_file, w.failure_reason)
            assert w.returncode is not None
            failures[rank] = ProcessFailure(
                local_rank=rank, pid=w.pid, exitcode=w.returncode, error_file=error_file
            )
        return_values: dict[int, Any] = {}
        if not failures:
            for rank, w in sorted(self._workers.items()):
                if w.returncode == 0 and not w.stopped_by_us:
                    return_values[rank] = w.return_value
        return RunProcsResult(
            return_values=return_values,
            failures=failures,
            stdouts=dict(self.stdouts),
            stderrs=dict(self.stderrs),
        )

    # -- context manager --------------------------------------------------
    async def __aenter__(self) -> PContext:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(timeout=self._shutdown_timeout)

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


class SubprocessContext(PContext):
    """Binary workers (``entrypoint`` is a str): asyncio subprocesses.

    Each leads its own process group, inherits the parent's environment plus
    ``envs[rank]`` and ``TORCHELASTIC_ERROR_FILE``, and is killed by the
    kernel if the supervisor dies (Linux; the worker's own children are
    reached only through ``close()``).
    """

    async def _spawn(self, rank: int, stdout: int | None, stderr: int | None) -> WorkerHandle:
        from ._workers._binary import spawn_binary

        assert isinstance(self.entrypoint, str)
        env = {**os.environ, **self._env(rank)}
        argv = [self.entrypoint, *(str(a) for a in self.args[rank])]
        return await spawn_binary(rank, argv, env, stdout, stderr)


class MultiprocessContext(PContext):
    """Function workers (``entrypoint`` is callable): multiprocessing children.

    The function and its args travel by value where plain pickle cannot name
    them (``__main__``, notebook cells, lambdas, closures). ``envs[rank]`` is
    applied before they are unpickled. The return value is sent back as soon
    as the function returns and lands in ``result.return_values[rank]``.
    """

    def __init__(self, *, fn_bytes: bytes, args_bytes: dict[int, bytes], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fn_bytes = fn_bytes
        self._args_bytes = args_bytes

    async def _spawn(self, rank: int, stdout: int | None, stderr: int | None) -> WorkerHandle:
        from ._workers._function import spawn_function

        return await spawn_function(
            local_rank=rank,
            name=self.name,
            start_method=self.start_method,
            fn=self._fn_bytes,
            args=self._args_bytes[rank],
            env=self._env(rank),
            stdout=stdout,
            stderr=stderr,
            error_file=self.error_files.get(rank, ""),
        )


def _widen_pipe(fd: int) -> None:
    # 1 MiB instead of 64 KiB: bursts don't block the worker, and each wakeup
    # of the reader moves more bytes (Linux; elsewhere a no-op).
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ImportError):
        pass


def _fd_limit_error(exc: OSError, rank: int, nprocs: int) -> OSError:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OSError(
        exc.errno,
        f"{exc.strerror} while starting local rank {rank} of {nprocs} (the {rank} "
        f"started were stopped): the open-file limit RLIMIT_NOFILE is {soft} (hard "
        f"{hard}), and each worker holds up to 4 fds (2 pipes, 2 log files) until the "
        "group ends. Raise it (`ulimit -n 65536`, or resource.setrlimit("
        "resource.RLIMIT_NOFILE, (hard, hard)) in the supervisor) or redirect fewer "
        "streams",
    )


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _record_reason(path: str, reason: str) -> None:
    if os.path.exists(path):
        return
    from ._error_file import write_error_file

    try:
        write_error_file(path, RuntimeError(reason))
    except OSError:
        print(f"aiolaunch: {reason}", file=sys.stderr)  # noqa: T201
