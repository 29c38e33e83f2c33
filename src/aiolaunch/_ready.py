"""Readiness: when is a started worker ready to serve?

Give probes to ``start_processes(..., ready=probe)`` (every rank) or
``ready={rank: probe}``, then ``await ctx.wait_ready(timeout=...)``.

- :class:`ReadyLine` - a line matching a regular expression appears on the
  worker's stdout or stderr (event-driven: the supervisor feeds it the lines
  as they arrive).
- :class:`ReadyPort` - a TCP port accepts connections.
- :class:`ReadyFile` - a file exists.

Port and file probes have nothing to wait on, so they try every ``interval``
seconds (20 ms by default) - the one place aiolaunch polls, by necessity.
A port or path may be a callable of the local rank: ``ReadyPort(lambda r: 8000 + r)``.

:class:`Readiness` (private) is one group's bookkeeping: a per-rank event,
one probe task per started worker (raced against the worker's exit), and
``wait_ready()``.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._cancel import move_on_after
from ._errors import ChildFailedError
from ._events import WorkerReady
from ._observer import GroupObserver
from ._results import not_ready_failure
from ._validate import check_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from ._events import EventBus
    from ._group import GroupState
    from ._results import ProcessFailure
    from ._workers._handle import WorkerHandle

__all__ = ["Readiness", "ReadinessProbe", "ReadyFile", "ReadyLine", "ReadyPort"]


class ReadinessProbe:
    """Base class of the readiness probes.

    A subclass overrides :meth:`wait_ready`; one that reads the worker's
    output also overrides :meth:`reads` and gets the lines in ``lines``.
    """

    def reads(self, stream: str) -> bool:
        """Whether the probe reads the lines of the worker's ``stream``
        (``"stdout"`` or ``"stderr"``). The supervisor then pipes that stream
        (never lets the worker inherit it) and passes its lines to
        :meth:`wait_ready`."""
        return False

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        """Return once ``rank`` is ready; raise if it cannot become ready.

        Cancelled when the worker exits first. An exception fails
        ``wait_ready()`` of the group, with this exception as its cause.

        :param lines: for a probe whose :meth:`reads` is true: the worker's
            lines of the streams it reads, in order, as they arrive; else
            not passed.
        """
        raise NotImplementedError  # pragma: no cover - overridden


@dataclass(frozen=True)
class ReadyLine(ReadinessProbe):
    """Ready when a line of the worker's output matches ``pattern`` (``re.search``).

    :param stream: ``"stdout"``, ``"stderr"`` or ``"any"``.
    """

    pattern: str
    stream: str = "any"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(
                f"ReadyLine(pattern={self.pattern!r}) must be a str regular expression, "
                f"e.g. ReadyLine(r'listening on port \\d+')"
            )
        if self.stream not in ("stdout", "stderr", "any"):
            raise ValueError(
                f"ReadyLine(stream={self.stream!r}) must be 'stdout', 'stderr' or 'any'"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"ReadyLine(pattern={self.pattern!r}) is not a regex: {exc}") from exc

    def reads(self, stream: str) -> bool:
        """Whether ``stream`` is the one given (or any stream for ``"any"``)."""
        return self.stream in (stream, "any")

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        """Return at the first line that matches; lines are fed by the supervisor."""
        if lines is None:
            raise TypeError("ReadyLine.wait_ready() needs the worker's lines")
        regex = re.compile(self.pattern)
        async for line in lines:
            if regex.search(line) is not None:
                return


@dataclass(frozen=True)
class ReadyPort(ReadinessProbe):
    """Ready when ``host:port`` accepts a TCP connection."""

    port: int | Callable[[int], int]
    host: str = "127.0.0.1"
    interval: float = 0.02

    def __post_init__(self) -> None:
        if not callable(self.port):
            check_port("ReadyPort(port)", self.port)
        if not isinstance(self.host, str) or not self.host:
            raise TypeError(f"ReadyPort(host={self.host!r}) must be a non-empty str")
        _check_interval("ReadyPort", self.interval)

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        """Return once a connection to the rank's port succeeds."""
        port = self.port(rank) if callable(self.port) else self.port
        while True:
            try:
                _, writer = await asyncio.open_connection(self.host, port)
            except OSError:
                await asyncio.sleep(self.interval)  # allowed: nothing to wait on but time
                continue
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
            return


@dataclass(frozen=True)
class ReadyFile(ReadinessProbe):
    """Ready when ``path`` exists."""

    path: str | os.PathLike[str] | Callable[[int], str | os.PathLike[str]]
    interval: float = 0.02

    def __post_init__(self) -> None:
        if not (callable(self.path) or isinstance(self.path, str | os.PathLike)) or (
            isinstance(self.path, str) and not self.path
        ):
            raise TypeError(
                f"ReadyFile(path={self.path!r}) must be a file path (str or os.PathLike) or a "
                "callable of the local rank returning one, e.g. ReadyFile('/tmp/ready')"
            )
        _check_interval("ReadyFile", self.interval)

    async def wait_ready(self, rank: int, lines: AsyncIterator[str] | None = None) -> None:
        """Return once the rank's path exists."""
        path = self.path(rank) if callable(self.path) else self.path
        while not os.path.exists(path):  # noqa: ASYNC240 - one stat() call, no I/O wait
            await asyncio.sleep(self.interval)  # allowed: nothing to wait on but time


def _check_interval(cls: str, interval: object) -> None:
    if (
        isinstance(interval, bool)
        or not isinstance(interval, int | float)
        or not 0 < interval < float("inf")
    ):
        raise ValueError(
            f"{cls}(interval={interval!r}) must be a number of seconds > 0 between tries, e.g. 0.02"
        )


def _nothing() -> None:
    pass


class _Lines:
    """The lines of one worker incarnation, from the log pipeline to its probe.

    Unbounded, but fed only while the probe still waits (see
    :meth:`Readiness.listening`), so it holds at most what arrives in one
    loop iteration.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[str] = asyncio.Queue()

    def put(self, line: str) -> None:
        self._queue.put_nowait(line)

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        return await self._queue.get()


class Readiness(GroupObserver):
    """The readiness of one group's ranks.

    Per rank: an event set once the current incarnation is ready (at start
    for a rank without probe), the probe's task, and the lines fed to a probe
    that reads output. A probe that raises is recorded and fails
    :meth:`wait_ready` promptly. Ranks restarting count as not ready, and not
    as dead; the group's state (:class:`~aiolaunch._group.GroupState`) says
    which, and its wake-up is notified when a rank becomes ready.

    :param error_files: ``{rank: path}``, for the failure of a rank that
        exited before it was ready.
    """

    def __init__(
        self,
        state: GroupState,
        probes: Mapping[int, ReadinessProbe],
        *,
        bus: EventBus,
        error_files: Mapping[int, str],
    ) -> None:
        self._state = state
        self._probes = dict(probes)
        self._bus = bus
        self._error_files = error_files
        self._ready = {r: asyncio.Event() for r in range(state.nprocs)}
        self._lines: dict[int, _Lines] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._errors: dict[int, BaseException] = {}
        #: set by the group to its line tap's notifier: a probe starts waiting
        #: for lines (the log pipeline reads the stream again)
        self.lines_wanted: Callable[[], None] = _nothing

    # -- wiring -------------------------------------------------------------
    def reads(self, rank: int, stream: str) -> bool:
        """Whether ``rank``'s probe reads the lines of ``stream``."""
        probe = self._probes.get(rank)
        return probe is not None and probe.reads(stream)

    def listening(self, rank: int) -> bool:
        """Whether ``rank``'s probe still waits for lines (else feeding is moot)."""
        return rank in self._lines and not self._ready[rank].is_set()

    def feed(self, rank: int, line: str) -> None:
        """Pass one line of ``rank``'s output to its probe (if it still waits)."""
        if self.listening(rank):
            self._lines[rank].put(line)

    def wants(self, rank: int, stream: str) -> bool:
        """Line listener: whether ``rank``'s probe waits for ``stream``'s lines now."""
        return self.reads(rank, stream) and self.listening(rank)

    def line(self, rank: int, stream: str, text: str) -> None:
        """Line listener: one line of ``rank``'s ``stream``, for its probe."""
        self.feed(rank, text)

    # -- lifecycle ----------------------------------------------------------
    def worker_started(self, handle: WorkerHandle) -> None:
        """A new incarnation of its rank runs: ready now without a probe, else
        start its probe, raced against ``handle``'s exit (an earlier
        incarnation's readiness no longer counts)."""
        rank = handle.local_rank
        self.reset(rank)
        probe = self._probes.get(rank)
        if probe is None:
            self._mark(rank, handle.pid)
            return
        lines = None
        if probe.reads("stdout") or probe.reads("stderr"):
            lines = self._lines[rank] = _Lines()
            self.lines_wanted()
        self._tasks[rank] = asyncio.ensure_future(self._probe(rank, probe, handle, lines))

    def reset(self, rank: int) -> None:
        """``rank`` is not ready until its next incarnation is."""
        self._ready[rank].clear()
        self._lines.pop(rank, None)
        task = self._tasks.pop(rank, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        """The group is ending: stop every probe (waiters fail: ``state.ending``)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _probe(
        self, rank: int, probe: ReadinessProbe, handle: WorkerHandle, lines: _Lines | None
    ) -> None:
        waiting = probe.wait_ready(rank) if lines is None else probe.wait_ready(rank, lines)
        probe_task = asyncio.ensure_future(waiting)
        exit_task = asyncio.ensure_future(handle.exited.wait())
        try:
            await asyncio.wait({probe_task, exit_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            probe_task.cancel()
            exit_task.cancel()
            if lines is not None and self._lines.get(rank) is lines:
                del self._lines[rank]  # nobody reads them any more: stop feeding
        if not probe_task.done() or probe_task.cancelled():
            return
        error = probe_task.exception()
        if error is None:
            self._mark(rank, handle.pid)
        else:
            self._errors[rank] = error
            self._state.wakeup.notify()

    def _mark(self, rank: int, pid: int) -> None:
        if not self._ready[rank].is_set():
            self._ready[rank].set()
            self._lines.pop(rank, None)
            self._bus.emit(WorkerReady(rank=rank, time=time.monotonic(), pid=pid))
            self._state.wakeup.notify()

    # -- waiting ------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every rank is ready (see :meth:`PContext.wait_ready`).

        :raises RuntimeError: a probe raised (the probe's exception is the
            ``__cause__``).
        :raises ChildFailedError: a rank exited for good before it was ready,
            or the group was closed.
        :raises TimeoutError: ``timeout`` seconds passed first.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        state = self._state
        while True:
            seen = state.wakeup.version  # before the checks (see Wakeup)
            if self._errors:
                rank, error = next(iter(self._errors.items()))
                raise RuntimeError(
                    f"the readiness probe {self._probes[rank]!r} of rank {rank} of "
                    f"{state.name!r} raised {type(error).__name__}: {error}"
                ) from error
            if all(ev.is_set() for ev in self._ready.values()) and not state.any_restarting():
                return
            dead = [
                r
                for r in state.exit_order
                if not self._ready[r].is_set() and not state.restarting(r)
            ]
            if dead or state.ending:
                raise ChildFailedError(state.name, {r: self._failure(r) for r in dead})
            remaining = math.inf if deadline is None else deadline - loop.time()
            if remaining <= 0:
                not_ready = sorted(r for r, ev in self._ready.items() if not ev.is_set())
                raise TimeoutError(
                    f"ranks {not_ready} of {state.name!r} not ready after {timeout}s"
                )
            async with move_on_after(remaining):
                await state.wakeup.changed(seen)

    def _failure(self, rank: int) -> ProcessFailure:
        w = self._state.worker(rank)
        assert w is not None
        return not_ready_failure(w, self._error_files.get(rank, ""))
