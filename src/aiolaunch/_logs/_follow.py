"""The FILE route: the worker writes its log file, we follow the file.

A redirected stream's fd 1/2 *is* its log file (``O_APPEND``), as in torch:
the worker's bytes go straight to the page cache, nothing is copied through
the supervisor, and every byte written before a SIGKILL is in the file.
:class:`FileFollower` reads what the worker appends only when a sink wants
it - the tee console, the line tap (a readiness probe that waits,
``LogLine`` consumers, the progress regex) - woken by inotify (``_inotify``)
or, while the file keeps growing, by the group's tick. The file is watched
only while a sink wants its bytes: otherwise the worker's writes wake
nothing here, and the output age is the file's mtime, read on demand.

Each sink has its own position in the file (a cursor): a sink without room
(:meth:`Sink.room`: the console, behind) falls behind and catches up from the
file when it has room again, while the others go on. The file is the
buffer: the worker is never slowed by a slow console, and memory stays
bounded.

How the follower learns that the file grew - its watch while it is quiet,
the group's tick while it streams, read behind a bulk writer - is
:class:`~._growth.Growth`.
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from typing import TYPE_CHECKING

from .._workers._proc import fd_path
from ._growth import Growth
from ._sink import FileRest

if TYPE_CHECKING:
    from collections.abc import Sequence

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
        self._fd = os.open(fd_path(fd), os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._start = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise
        self._cursors = [_Cursor(s, self._start) for s in sinks]
        self._growth = Growth(self._fd, watches, self._grew, self._wanted)
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
                # two spawns, and every later rank would start that much later.
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._first_pump)

    def _first_pump(self) -> None:
        if not self._closed and self._growth.leave_to_tick():
            self._scheduled = False  # a bulk writer: the tick reads behind it
            return
        self._pump()

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
