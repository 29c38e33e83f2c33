"""How a followed log file's growth reaches its follower: a watch or the tick.

A file that keeps growing is read without its watch (interrupt mitigation,
as a network card's driver does under load): with a watch, each ``write()``
of the worker queues an inotify event in the kernel - measured on this
project's 2-core host, 128-byte writes (``print(..., flush=True)``) ran at
97 MB/s watched against 148 unwatched, with nothing reading the events. So
:data:`_STREAMING_EVENTS` events in a row, each less than :data:`_STREAMING_S`
after the one before (or :data:`_STREAMING_BYTES` after it: a loop that is
late to read them sees them farther apart), take the watch off, and the
group's tick (:meth:`Watches.repeat`, every ``STREAM_TICK_S``) reads the file while
it grew since the last tick; the first tick that finds it unchanged puts the
watch back and reads once more (the bytes of the gap). A file begins so (at
:meth:`~._follow.FileFollower.start`). A quiet file is watched; no timer runs for it.

A file written in bulk, at :data:`_FAST_BYTES_PER_S` or more (an event that
brought :data:`_FAST_BYTES`, a tick that found that much more per second),
is read behind its writer: the tick leaves it unread until the writer pauses
(the first quiet tick reads it all) or :data:`_BEHIND_S` after the last read.
Copying beside it took from its rate (on two cores the copy, the console's
reader and the writer share the CPUs and the memory bus): 16 MiB in 1 MiB
writes ran at 3337 MB/s tee'd, 3722 redirected, 3694 in torch's tee (whose
0.1 s poll reads after it); read behind it, 3855 (30 interleaved trials).
Line writers (``print()``, a few hundred MB/s) stay under the rate: their
console keeps pace.

Under contention a bulk writer's own rate says too little: 16 workers writing
1 MiB blocks on 2 cores each get an eighth of a core (~200 MB/s apiece, the
rate of print() lines) while together they write GB/s. So a tick also reads
behind while the *other* files of the group grew at
:data:`_FAST_BYTES_PER_S` or more in the tick's period (each tick measures
every file first, then decides: :class:`~._inotify.Ticked`): a file whose
writer is done waits, with the same bound, until the group's bulk is over.
And the first read after a worker starts leaves a file that already holds
:data:`_FAST_BYTES` to the tick (:meth:`Growth.leave_to_tick`): the workers
spawned first had written megabytes by the time the spawns of the others
let the loop run. Measured (16 MiB per worker in 1 MiB writes, the share of
the bytes the tee read while the writers wrote, median of 16 runs): 4
workers 23% -> 0%, 16 workers 12% -> 6%; 1 worker 0% before and after.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from .._workers._proc import fd_path
from ._inotify import HOLD_S

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._inotify import Watches

__all__ = ["Growth", "reads_behind"]

# A file streams (the module docstring) after this many events in a row, each
# less than _STREAMING_S or _STREAMING_BYTES after the one before. Events
# come at most once per HOLD_S while they keep coming (_inotify), so a
# writer that streams is seen at HOLD_S apart; one that writes a line every
# few milliseconds keeps its watch (its events cost it little), and so does
# print(), whose line and newline may be two write()s.
_STREAMING_EVENTS = 3
_STREAMING_S = 2 * HOLD_S
_STREAMING_BYTES = 64 * 1024
# Read behind its writer (the module docstring): a file growing this fast -
# bulk writes at GB/s, not print() lines at ~150-250 MB/s - or an event that
# brought _FAST_BYTES (that rate over HOLD_S, the least time between two
# events); _BEHIND_S after the last read at the latest (torch's tee period).
_FAST_BYTES_PER_S = 512e6
_FAST_BYTES = int(_FAST_BYTES_PER_S * HOLD_S)
_BEHIND_S = 0.1


def reads_behind(grown: int, seconds: float, since_read: float, others: float = 0.0) -> bool:
    """Whether a streaming file that grew ``grown`` bytes in the last
    ``seconds`` is left unread for now: it grows at least
    :data:`_FAST_BYTES_PER_S`, or the group's other files do (``others``,
    bytes per second), and its sinks were fed less than :data:`_BEHIND_S`
    ago."""
    fast = grown > 0 and grown >= _FAST_BYTES_PER_S * seconds
    fast = fast or others >= _FAST_BYTES_PER_S
    return fast and since_read < _BEHIND_S


class Growth:
    """How a follower learns that its file grew: the file's inotify watch
    while it is quiet, the group's tick while it streams (the module
    docstring). Calls ``grew(size)`` on the loop after the file grew
    (``size``: its size just read, or ``None``); ``wanted()`` says whether
    anyone needs its bytes (else: neither watch nor tick)."""

    def __init__(
        self,
        fd: int,
        watches: Watches,
        grew: Callable[[int | None], None],
        wanted: Callable[[], bool],
    ) -> None:
        self._fd = fd
        self._watches = watches
        self._grew = grew
        self._wanted = wanted
        self._wd: int | None = None
        #: the file's size at the last tick while streaming (the watch off), else None
        self._streaming: int | None = None
        #: the loop time of the last event
        self._event_at = -1.0
        #: the file's size at the last event
        self._event_size = 0
        #: events in a row that came soon after the one before
        self._soon = 0
        #: while streaming: loop times of the last tick and of the last feed
        self._ticked_at = self._fed_at = 0.0
        #: the size the tick's first pass read (:meth:`measure`)
        self._size: int | None = None
        self._closed = False

    def stream(self) -> None:
        """Begin as a streaming file (the tick, no watch)."""
        if self._streaming is None and self._wd is None and not self._closed:
            self._streaming = os.fstat(self._fd).st_size
            self._ticked_at = self._fed_at = asyncio.get_running_loop().time()
            self._watches.repeat(self)

    def leave_to_tick(self) -> bool:
        """While streaming: whether the file holds :data:`_FAST_BYTES` or
        more since the last tick (or since it began streaming). The first
        read after :meth:`~._follow.FileFollower.start` asks: a bulk
        writer's first megabytes, written while the next ranks were
        spawned, are the tick's to read by its rule - behind the writer -
        not that read's, beside it. A worker's first lines are read at once."""
        if self._streaming is None or self._closed:
            return False
        return os.fstat(self._fd).st_size - self._streaming >= _FAST_BYTES

    def want(self) -> None:
        """Someone needs the bytes: watch the file, unless it streams."""
        if self._wd is None and self._streaming is None and not self._closed:
            self._wd = self._watches.watch(fd_path(self._fd), self._modified)
            self._event_size = os.fstat(self._fd).st_size

    def unwant(self) -> None:
        """Nobody needs the bytes: no wakeup per write from now on (a tick
        that runs ends at its next turn)."""
        if self._wd is not None:
            self._watches.unwatch(self._wd, self._modified)
            self._wd = None

    def close(self) -> None:
        """Neither watch nor tick from now on. Idempotent."""
        self._closed = True
        self.unwant()

    def _modified(self) -> None:
        size = os.fstat(self._fd).st_size
        now = asyncio.get_running_loop().time()
        if size - self._event_size >= _FAST_BYTES:
            # A bulk write: stream from now on, and read behind the writer
            # (not now: it may still be writing).
            self._soon = 0
            self._event_at, self._event_size = now, size
            self.unwant()
            self.stream()
            return
        self._grew(size)
        soon = now - self._event_at < _STREAMING_S or size - self._event_size >= _STREAMING_BYTES
        self._soon = self._soon + 1 if soon else 0
        self._event_at, self._event_size = now, size
        if self._soon + 1 >= _STREAMING_EVENTS and self._wd is not None:
            # It streams: no event per write from now on (the module docstring).
            self._soon = 0
            self.unwant()
            self.stream()

    def measure(self) -> int:
        """The tick's first pass (:class:`~._inotify.Ticked`): the bytes the
        file grew since the tick before."""
        if self._closed or not self._wanted():
            return 0
        self._size = os.fstat(self._fd).st_size
        return self._size - (self._streaming or 0)

    def tick(self, others: float) -> bool:
        """The second pass: ``grew()`` if the file did, unless it is read
        behind (``others``: the group's other files, bytes per second);
        ``False`` once it stopped."""
        size, self._size = self._size, None
        if self._closed or not self._wanted():
            self._streaming = None
            return False
        if size is None:  # wanted since the first pass
            size = os.fstat(self._fd).st_size
        now = asyncio.get_running_loop().time()
        grown, seconds = size - (self._streaming or 0), now - self._ticked_at
        self._streaming, self._ticked_at = size, now
        if reads_behind(grown, seconds, now - self._fed_at, others):
            return True
        if grown:
            self._fed_at = now
            self._grew(size)
            return True
        # Quiet for a period: the watch back on, then the bytes written
        # before it was (their events went to no watch).
        self._streaming = None
        self.want()
        self._grew(None)
        return False
