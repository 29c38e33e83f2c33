"""The FILE route: the worker writes its log file, we follow the file.

A redirected stream's fd 1/2 *is* its log file (``O_APPEND``), as in torch:
the worker's bytes go straight to the page cache, nothing is copied through
the supervisor, and every byte written before a SIGKILL is in the file.
:class:`FileFollower` reads what the worker appends only when a sink wants
it - the tee console, the line tap (a readiness probe, ``LogLine``
consumers, the progress regex) - woken by inotify (``_inotify``), never by a
timer.

Each sink has its own position in the file (a cursor): a sink without room
(:meth:`Sink.room`: the console, behind) falls behind and catches up from the
file when it has room again, while the others go on. The file is the
buffer: the worker is never slowed by a slow console, and memory stays
bounded.
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from typing import TYPE_CHECKING

import anyio

from ._console import CONSOLE_FLUSH_TIMEOUT, console

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._inotify import Inotify
    from ._sink import Sink

__all__ = ["FileFollower"]

_CHUNK = 1 << 20
# Bytes fed per loop callback before yielding to other callbacks.
_BUDGET = 8 << 20
# A listener that starts mid-stream begins at most this far back.
_RESUME_BACK = 64 * 1024


class _Cursor:
    """One sink's position in the followed file."""

    __slots__ = ("done", "known", "offset", "sink", "waiting")

    def __init__(self, sink: Sink, offset: int) -> None:
        self.sink = sink
        #: the next byte to feed; None while the sink wants nothing (skipping)
        self.offset: int | None = offset
        #: where a skipping sink stopped (it resumes no earlier)
        self.known = offset
        #: a when_room callback is pending
        self.waiting = False
        #: given up on (fed nothing more)
        self.done = False


class FileFollower:
    """Feeds ``sinks`` what is appended to one log file after it was opened.

    :param fd: our fd of the log file (the worker gets a copy); the follower
        reads through its own read-only fd of the same inode.
    """

    def __init__(self, fd: int, sinks: Sequence[Sink], rank: int, inotify: Inotify) -> None:
        # Re-open the same inode (not the path: it may have been replaced).
        self._fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._start = os.fstat(self._fd).st_size
        except BaseException:
            os.close(self._fd)
            raise
        self._cursors = [_Cursor(s, self._start) for s in sinks]
        self._inotify = inotify
        self._wd: int | None = None
        self.rank = rank
        self._scheduled = False
        self._closed = False

    def start(self) -> None:
        """Begin following (the worker runs): watch the file, read what is there."""
        if self._closed or self._wd is not None:
            return
        self._wd = self._inotify.watch(f"/proc/self/fd/{self._fd}", self._modified)
        self._pump()

    # -- following --------------------------------------------------------
    def _modified(self) -> None:
        if not self._scheduled:
            self._pump()

    def _pump(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        budget = _BUDGET
        while budget > 0:
            n = self._feed_next(None)
            if not n:
                return
            budget -= n
        # More may be there: continue after the loop's other callbacks.
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pump)

    def _feed_next(self, end: int | None) -> int:
        """Read one chunk for the sinks furthest behind that can take it; feed them.

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
        size = _CHUNK if end is None else min(_CHUNK, end - offset)
        data = os.pread(self._fd, size, offset) if size > 0 else b""
        for c in group:
            c.sink.feed(data)
            c.offset = offset + len(data)
        return len(data)

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
        return True

    def _room(self, c: _Cursor) -> None:
        c.waiting = False
        if not self._scheduled:
            self._pump()

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
        if self._wd is not None:
            self._inotify.unwatch(self._wd, self._modified)
            self._wd = None

    async def drain(self, stall: float = CONSOLE_FLUSH_TIMEOUT) -> None:
        """The writer is gone: feed what it appended, then close the sinks.

        A sink that takes nothing for ``stall`` seconds (a stuck console) is
        given up on, with a marker; the file keeps every byte. Idempotent.
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
                behind = [
                    c
                    for c in self._cursors
                    if c.waiting and not c.done and c.offset is not None and c.offset < end
                ]
                if not behind:
                    break
                c = behind[0]
                if await self._wait_room(c.sink, stall):
                    c.waiting = False
                else:
                    self._give_up(c, end, stall)
            for c in self._cursors:
                await c.sink.aclose()
        finally:
            os.close(self._fd)

    async def _wait_room(self, sink: Sink, stall: float) -> bool:
        writer = console()
        while not sink.room():
            before = writer.written
            room = asyncio.Event()
            sink.when_room(room.set)
            with anyio.move_on_after(stall):
                await room.wait()
                continue
            if writer.written == before:
                return False
        return True

    def _give_up(self, c: _Cursor, end: int, stall: float) -> None:
        console().write(
            "stderr",
            f"[aiolaunch]: the console took nothing for {stall:g}s; "
            f"{end - (c.offset or 0)} bytes of rank {self.rank}'s log "
            "are not shown (the log file has them)\n",
        )
        c.done = True

    async def abandon(self) -> None:
        """Stop without reading (the worker never started); close the sinks. Idempotent."""
        if self._closed:
            return
        self._unwatch()
        os.close(self._fd)
        for c in self._cursors:
            await c.sink.aclose()
