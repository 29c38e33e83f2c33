"""Lifecycle events of a process context, as an async iterator.

Every event is an immutable dataclass with the local ``rank`` (``None`` for the
group), the ``pid`` where one applies, and ``time``: ``time.monotonic()`` when
the supervisor observed it (comparable with ``time.monotonic()`` in workers on
the same machine).

Delivery: each ``ctx.events()`` iterator has its own bounded buffer. Lifecycle
events that happened before the iterator was created are replayed first, so a
consumer that starts late still sees every ``WorkerStarted``. A consumer that
does not keep up loses the *oldest* buffered events first and is told how many
with one :class:`EventsDropped` before the next event it receives. Iteration
ends after :class:`GroupStopped`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._signals._names import exit_signal_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ._workers._handle import WorkerHandle

__all__ = [
    "Event",
    "EventBus",
    "EventsDropped",
    "GroupStopped",
    "LogLine",
    "LogLines",
    "WorkerExited",
    "WorkerReady",
    "WorkerRestarting",
    "WorkerStalled",
    "WorkerStarted",
]


@dataclass(frozen=True)
class Event:
    """Base class of every lifecycle event."""

    rank: int | None
    time: float


@dataclass(frozen=True)
class WorkerStarted(Event):
    """A worker process started (also after a restart: see ``attempt``)."""

    pid: int
    attempt: int = 0


@dataclass(frozen=True)
class WorkerReady(Event):
    """The worker's readiness probe succeeded."""

    pid: int


@dataclass(frozen=True)
class WorkerExited(Event):
    """A worker exited: ``exitcode`` as in torch (``-signum`` when killed),
    ``signal`` the signal's name or ``None``; ``stopped`` when the supervisor
    stopped it on purpose."""

    pid: int
    exitcode: int
    signal: str | None
    stopped: bool


def group_stopped(failed: bool) -> GroupStopped:
    """The :class:`GroupStopped` event, now."""
    return GroupStopped(rank=None, time=time.monotonic(), failed=failed)


def worker_started(handle: WorkerHandle) -> WorkerStarted:
    """The :class:`WorkerStarted` event of ``handle``, spawned just now."""
    return WorkerStarted(
        rank=handle.local_rank, time=time.monotonic(), pid=handle.pid, attempt=handle.attempt
    )


def worker_exited(handle: WorkerHandle) -> WorkerExited:
    """The :class:`WorkerExited` event of ``handle``, which was reaped just now."""
    rc = handle.returncode
    assert rc is not None
    return WorkerExited(
        rank=handle.local_rank,
        time=time.monotonic(),
        pid=handle.pid,
        exitcode=rc,
        signal=exit_signal_name(rc),
        stopped=handle.stopped_by_us,
    )


@dataclass(frozen=True)
class WorkerRestarting(Event):
    """A worker will be started again after ``delay`` seconds: by its restart
    policy, or as a rank of the next attempt of an agent's job (``attempt``:
    the restart's number, as ``WorkerStarted.attempt`` will say)."""

    attempt: int
    delay: float


@dataclass(frozen=True)
class WorkerStalled(Event):
    """The watchdog found a worker stalled (see :class:`aiolaunch.Watchdog`).

    Emitted once per stall, before any stack dump or action: ``idle_s`` is
    how long it had no activity, ``reason`` says which kind (no output and
    no CPU, no progress line, or D state) and, where the ranks serve their
    collective records (torch.distributed), ends with the collectives'
    verdict: ``...; collectives: rank 3 never entered all_reduce #5 of
    default_pg, in which ranks 0-2 wait``.
    """

    idle_s: float
    reason: str


@dataclass(frozen=True)
class WorkerStraggling(Event):
    """The watchdog names a straggler (``Watchdog(stragglers=period)``): a
    rank its peers wait for in ``torch.distributed`` collectives.

    ``source`` says how it was measured:

    - ``"collectives"`` (the ranks serve their collective records): each
      rank's arrival at each collective, against the earliest rank's;
      ``lateness_s`` is the rank's median lateness over the window,
      ``wait_share`` the fraction of those collectives in which it waited for
      a later rank (was not the last to arrive), ``peers_wait_share`` the
      same for the other ranks together;
    - ``"stacks"`` (no record: stack samples): ``wait_share`` is the fraction
      of its stack samples inside a collective, ``peers_wait_share`` the same
      for the other ranks together; ``lateness_s`` is ``None``.

    Emitted once per straggling spell: again only after the rank was back
    among its peers in between.
    """

    wait_share: float
    peers_wait_share: float
    lateness_s: float | None = None
    source: str = "stacks"


@dataclass(frozen=True)
class GroupStopped(Event):
    """The context finished: every worker is gone. The last event."""

    failed: bool


@dataclass(frozen=True)
class LogLine(Event):
    """One line a worker wrote (opt-in: ``ctx.events(lines=True)``)."""

    stream: str
    text: str


@dataclass(frozen=True)
class EventsDropped(Event):
    """This consumer fell behind: ``count`` older events were discarded."""

    count: int


class _Subscriber:
    def __init__(self, maxsize: int, lines: bool) -> None:
        self.queue: deque[Event] = deque()
        self.maxsize = maxsize
        self.lines = lines
        self.dropped = 0
        self.wakeup = asyncio.Event()
        self.closed = False

    def put(self, event: Event) -> None:
        if len(self.queue) >= self.maxsize:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(event)
        self.wakeup.set()


def _nothing() -> None:
    pass


class LogLines:
    """The bus as a line listener of the log pipeline: a :class:`LogLine` per
    line while an ``events(lines=True)`` consumer listens."""

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus

    def reads(self, rank: int, stream: str) -> bool:
        return False  # only the streams the supervisor reads anyway

    def wants(self, rank: int, stream: str) -> bool:
        return self._bus.wants_lines > 0

    def line(self, rank: int, stream: str, text: str) -> None:
        self._bus.emit(LogLine(rank=rank, time=time.monotonic(), stream=stream, text=text))


class EventBus:
    """Fans events out to every live iterator; keeps the lifecycle history.

    :param record: a list that outlives the bus (a job's, over its attempts)
        to which every lifecycle event is appended too.
    """

    def __init__(self, record: list[Event] | None = None) -> None:
        self.history: list[Event] = []
        self._record = record
        self._subscribers: list[_Subscriber] = []
        self.closed = False
        self.wants_lines = 0
        #: set by the group to its line tap's notifier: a lines consumer arrived
        self.lines_wanted: Callable[[], None] = _nothing

    def emit(self, event: Event) -> None:
        if not isinstance(event, LogLine):
            self.history.append(event)
            if self._record is not None:
                self._record.append(event)
        for sub in self._subscribers:
            if isinstance(event, LogLine) and not sub.lines:
                continue
            sub.put(event)
        if isinstance(event, GroupStopped):
            self.closed = True

    def iterate(self, *, lines: bool = False, maxsize: int = 10_000) -> AsyncIterator[Event]:
        """A new consumer's iterator; arguments are checked here, at the call.

        At its first step it replays the history whole, then yields what
        came after, through a buffer of ``maxsize`` events: when it falls
        behind, the oldest are dropped and an :class:`EventsDropped` says
        how many.

        :raises TypeError: ``maxsize`` is not an int.
        :raises ValueError: ``maxsize`` is below 1.
        """
        if isinstance(maxsize, bool) or not isinstance(maxsize, int):
            raise TypeError(
                f"events(maxsize={maxsize!r}) must be an int >= 1 (events buffered per consumer)"
            )
        if maxsize < 1:
            raise ValueError(
                f"events(maxsize={maxsize}) must be >= 1: it is how many events a consumer "
                "that falls behind keeps (e.g. the default, 10000)"
            )
        return self._iterate(lines=bool(lines), maxsize=maxsize)

    async def _iterate(self, *, lines: bool, maxsize: int) -> AsyncIterator[Event]:
        sub = _Subscriber(maxsize, lines)
        # The history is replayed whole, before anything newer: the buffer
        # (maxsize) holds what comes after. A lines consumer's arrival may
        # feed it at once every line already in a log file (lines_wanted):
        # those must not push the group's start out of its replay.
        backlog = list(self.history)
        self._subscribers.append(sub)
        if lines:
            self.wants_lines += 1
            self.lines_wanted()
        try:
            for event in backlog:
                yield event
                if isinstance(event, GroupStopped):
                    return
            while True:
                if not sub.queue:
                    if self.closed:
                        return
                    sub.wakeup.clear()
                    await sub.wakeup.wait()
                    continue
                if sub.dropped:
                    count, sub.dropped = sub.dropped, 0
                    yield EventsDropped(rank=None, time=time.monotonic(), count=count)
                event = sub.queue.popleft()
                yield event
                if isinstance(event, GroupStopped):
                    return
        finally:
            self._subscribers.remove(sub)
            if lines:
                self.wants_lines -= 1
