"""The FILE route: the worker writes its log file, we follow the file.

A redirected stream's fd 1/2 *is* its log file (``O_APPEND``), as in torch:
the worker's bytes go straight to the page cache, nothing is copied through
the supervisor, and every byte written before a SIGKILL is in the file.
:class:`FileFollower` reads what the worker appends only when a sink wants
it - the tee console, the line tap (a readiness probe that waits,
``LogLine`` consumers, the progress regex) - woken by inotify (``_inotify``),
never by a timer. The file is watched only while a sink wants its bytes:
otherwise the worker's writes wake nothing here, and the output age is the
file's mtime, read on demand.

Each sink has its own position in the file (a cursor): a sink without room
(:meth:`Sink.room`: the console, behind) falls behind and catches up from the
file when it has room again, while the others go on. The file is the
buffer: the worker is never slowed by a slow console, and memory stays
bounded.

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
:meth:`FileFollower.start`). A quiet file is watched; no timer runs for it.

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
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from typing import TYPE_CHECKING

from ._inotify import HOLD_S
from ._sink import FileRest

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._inotify import Watches
    from ._sink import Sink
    from ._tap import LineTap

__all__ = ["FileFollower"]

_CHUNK = 1 << 20
# Bytes fed per loop callback before yielding to other callbacks.
_BUDGET = 8 << 20
# A listener that starts mid-stream begins at most this far back.
_RESUME_BACK = 64 * 1024
# Bytes kept per sink to see that the file was rewritten under us.
_TAIL = 16
# A file streams (see the docstring) after this many events in a row, each
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


def reads_behind(grown: int, seconds: float, since_read: float) -> bool:
    """Whether a streaming file that grew ``grown`` bytes in the last
    ``seconds`` is left unread for now: it grows at least
    :data:`_FAST_BYTES_PER_S` and its sinks were fed less than
    :data:`_BEHIND_S` ago."""
    return grown >= _FAST_BYTES_PER_S * seconds and since_read < _BEHIND_S


class _Cursor:
    """One sink's position in the followed file."""

    __slots__ = ("done", "known", "offset", "sink", "tail", "waiting")

    def __init__(self, sink: Sink, offset: int) -> None:
        self.sink = sink
        #: the next byte to feed; None while the sink wants nothing (skipping)
        self.offset: int | None = offset
        #: where a skipping sink stopped (it resumes no earlier)
        self.known = offset
        #: a when_room callback is pending
        self.waiting = False
        #: finished (handed over)
        self.done = False
        #: the last bytes fed: still there before ``offset`` unless the file
        #: was truncated and rewritten under us
        self.tail = b""


class _Growth:
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
        self._closed = False

    def stream(self) -> None:
        """Begin as a streaming file (the tick, no watch)."""
        if self._streaming is None and self._wd is None and not self._closed:
            self._streaming = os.fstat(self._fd).st_size
            self._ticked_at = self._fed_at = asyncio.get_running_loop().time()
            self._watches.repeat(self._tick)

    def want(self) -> None:
        """Someone needs the bytes: watch the file, unless it streams."""
        if self._wd is None and self._streaming is None and not self._closed:
            self._wd = self._watches.watch(f"/proc/self/fd/{self._fd}", self._modified)
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

    def _tick(self) -> bool:
        """While streaming: ``grew()`` if the file did; ``False`` once it stopped."""
        if self._closed or not self._wanted():
            self._streaming = None
            return False
        size = os.fstat(self._fd).st_size
        if size != self._streaming:
            now = asyncio.get_running_loop().time()
            grown, seconds = size - (self._streaming or 0), now - self._ticked_at
            self._streaming, self._ticked_at = size, now
            if reads_behind(grown, seconds, now - self._fed_at):
                return True
            self._fed_at = now
            self._grew(size)
            return True
        # Quiet for a period: the watch back on, then the bytes written
        # before it was (their events went to no watch).
        self._streaming = None
        self.want()
        self._grew(None)
        return False


class FileFollower:
    """Feeds ``sinks`` what is appended to one log file after it was opened.

    :param fd: our fd of the log file (the worker gets a copy); the follower
        reads through its own read-only fd of the same inode.
    :param tap: the group's line tap: its demand rising (a probe starts
        waiting, a ``LogLine`` consumer arrives) restarts the watch.
    """

    def __init__(
        self, fd: int, sinks: Sequence[Sink], rank: int, watches: Watches, tap: LineTap
    ) -> None:
        # Re-open the same inode (not the path: it may have been replaced).
        self._fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._start = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise
        self._cursors = [_Cursor(s, self._start) for s in sinks]
        self._growth = _Growth(self._fd, watches, self._grew, self._wanted)
        self._tap = tap
        self.rank = rank
        self._scheduled = False
        self._closed = False

    def start(self) -> None:
        """Begin following (the worker runs): from now on, while a sink wants
        the bytes, the file is watched (or ticked) and read."""
        if not self._closed:
            self._tap.on_demand(self._demand)
            if self._wanted():
                # Begin as a streaming file: the worker may write before the
                # loop runs again (the spawns of the next ranks block it), and
                # a watch would queue an event per write, interleaved across
                # files, so not merged - 16 workers filled the kernel's
                # 16384-event queue that way.
                self._growth.stream()
                # The first read on the loop's next turn, not here: start()
                # runs inside the spawn loop, and what this worker wrote while
                # the next ranks were spawned would be framed there, between
                # two spawns (measured: 16 tee'd workers of 16 MiB, ~15 ms of
                # the loop thread's CPU in the spawn loop, every later rank
                # started that much later; #26).
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._pump)

    def _wanted(self) -> bool:
        return any(c.sink.wanted() for c in self._cursors)

    def _demand(self) -> None:
        """A sink may want bytes now: watch the file (if not yet) and read it."""
        if self._closed or not self._wanted():
            return
        self._growth.want()
        self._grew()

    # -- following --------------------------------------------------------
    def _grew(self, size: int | None = None) -> None:
        if not self._scheduled:
            self._pump(size)

    def _pump(self, size: int | None = None) -> None:
        """Feed the sinks up to ``size`` (the file's size, just read by the
        caller), or up to the size now."""
        self._scheduled = False
        if self._closed:
            return
        if not self._wanted():
            self._growth.unwant()
        # Up to the end as of now, not on: bytes appended from here on bring
        # an event of their own. Chasing a writer that writes a line per
        # write() would read a few KiB per pread in a tight loop beside it
        # (measured: 1259 reads for 4 MiB, a core busy, the writer slowed).
        end = os.fstat(self._fd).st_size if size is None else size
        budget = _BUDGET
        while budget > 0:
            n = self._feed_next(end)
            if not n:
                return
            budget -= n
        # More may be there: continue after the loop's other callbacks.
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pump)

    def _feed_next(self, end: int) -> int:
        """Read one chunk (up to ``end``) for the sinks furthest behind that can
        take it; feed them.

        Returns the bytes fed (0: none can take any, or nothing is new).
        """
        offset: int | None = None
        group: list[_Cursor] = []
        for c in self._cursors:
            if not self._ready(c) or c.offset is None:
                continue
            if offset is None or c.offset < offset:
                offset, group = c.offset, [c]
            elif c.offset == offset:
                group.append(c)
        if offset is None:
            return 0
        size = min(_CHUNK, end - offset)
        tail = group[0].tail
        if tail and os.pread(self._fd, len(tail), offset - len(tail)) != tail:
            self._truncated()  # rewritten since our last read
            return self._feed_next(end)
        data = os.pread(self._fd, size, offset) if size > 0 else b""
        if not data:
            if os.fstat(self._fd).st_size < offset:
                self._truncated()
                return self._feed_next(end)
            return 0
        tail = data[-_TAIL:]
        for c in group:
            c.sink.feed(data)
            c.offset = offset + len(data)
            c.tail = tail
        return len(data)

    def _truncated(self) -> None:
        """The file was truncated under us: a worker's ``echo x > /dev/stdout``
        reopens its log file with ``O_TRUNC`` (README, *Known limits*). What it
        holds now was written since: every sink follows it from its start
        (``tail -F``'s rule), so the tee does not fall silent."""
        for c in self._cursors:
            if c.offset is not None:
                c.offset = 0
            c.known = 0
            c.tail = b""
        self._start = 0

    def _ready(self, c: _Cursor) -> bool:
        """Whether ``c``'s sink takes bytes now (else it is skipped or waits for room)."""
        if c.waiting or c.done:
            return False
        sink = c.sink
        if not sink.wanted():
            # Nobody listens: read nothing; a later listener resumes near the end.
            if c.offset is not None:
                c.known, c.offset = c.offset, None
            return False
        if not sink.room():
            c.waiting = True
            sink.when_room(partial(self._room, c))
            return False
        if c.offset is None:
            end = os.fstat(self._fd).st_size
            c.offset = max(c.known, end - _RESUME_BACK)
            if c.offset > c.known:
                sink.skip()  # bytes went by unread: resume at a line boundary
                c.tail = b""
        return True

    def _room(self, c: _Cursor) -> None:
        c.waiting = False
        self._grew()

    def age(self) -> float | None:
        """Seconds since the worker last wrote here (the file's mtime), or ``None``."""
        try:
            st = os.fstat(self._fd)
        except OSError:
            return None
        if st.st_size <= self._start:
            return None
        return max(0.0, time.time() - st.st_mtime)

    # -- finishing --------------------------------------------------------
    def _unwatch(self) -> None:
        self._closed = True
        self._tap.off_demand(self._demand)
        self._growth.close()

    async def drain(self) -> None:
        """The writer is gone: feed what it appended, then close the sinks.

        A sink without room (a stuck console) is handed the rest of the file
        (:meth:`Sink.hand_over`) so that the others - and ``wait()`` - need
        not wait for it; one that cannot take it is waited for. Nothing is
        given up on. Idempotent.
        """
        if self._closed:
            return
        self._unwatch()
        try:
            end = os.fstat(self._fd).st_size
            fed = 0
            while True:
                n = self._feed_next(end)
                if n:
                    fed += n
                    if fed >= _BUDGET:
                        fed = 0
                        await asyncio.sleep(0)  # allowed: a yield between chunks, not a poll
                    continue
                behind = [c for c in self._cursors if self._behind(c, end)]
                if not behind:
                    break
                c = behind[0]
                assert c.offset is not None
                rest = FileRest(os.dup(self._fd), c.offset, end)
                if c.sink.hand_over(rest):
                    c.done = True  # the sink finishes itself
                else:
                    rest.close()
                    await _room(c.sink)
                    c.waiting = False
            for c in self._cursors:
                if not c.done:
                    await c.sink.aclose()
        finally:
            os.close(self._fd)

    def _behind(self, c: _Cursor, end: int) -> bool:
        """A sink that wants bytes it has no room for."""
        return c.waiting and not c.done and c.offset is not None and c.offset < end

    async def abandon(self) -> None:
        """Stop without reading (the worker never started); close the sinks. Idempotent."""
        if self._closed:
            return
        self._unwatch()
        os.close(self._fd)
        for c in self._cursors:
            await c.sink.aclose()


async def _room(sink: Sink) -> None:
    """Wait until ``sink`` has room."""
    while not sink.room():
        room = asyncio.Event()
        sink.when_room(room.set)
        await room.wait()
