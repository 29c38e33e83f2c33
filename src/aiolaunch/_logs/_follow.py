"""The direct-write path: the worker writes its log file, we follow the file.

A redirected stream's fd 1/2 *is* its log file (``O_APPEND``), as in torch:
the worker's bytes go straight to the page cache, nothing is copied through
the supervisor, and every byte written before a SIGKILL is in the file.
:class:`FileFollower` reads what the worker appends only when someone needs
it - the tee console, a readiness probe, a ``LogLine`` consumer - woken by
inotify (``_inotify``), never by a timer.

The tee console is lossless: the follower reads no further while the console
is more than ``MAX_PENDING`` characters behind, and catches up from the file
(which has every byte) when the console thread takes the backlog. The worker
is never slowed by a slow console, and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

import anyio

from ._console import MAX_PENDING, console

if TYPE_CHECKING:
    from ._inotify import Inotify
    from ._sink import Sink

__all__ = ["FileFollower"]

_CHUNK = 1 << 20
# Bytes fed per loop callback before yielding to other callbacks.
_BUDGET = 8 << 20
# A listener that starts mid-stream begins at most this far back.
_RESUME_BACK = 64 * 1024


class FileFollower:
    """Feeds ``sinks`` what is appended to one log file after it was opened.

    :param fd: our fd of the log file (the worker gets a copy); the follower
        reads through its own read-only fd of the same inode.
    :param tee: a lossless console sink is among ``sinks``: respect the
        console backlog.
    """

    def __init__(
        self, fd: int, sinks: list[Sink], rank: int, inotify: Inotify, tee: bool = False
    ) -> None:
        # Re-open the same inode (not the path: it may have been replaced).
        proc = f"/proc/self/fd/{fd}"
        self._fd = os.open(proc, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(self._fd)
            self._start = self._offset_known = st.st_size
            self._offset: int | None = st.st_size
            self._inotify = inotify
            self._wd = inotify.watch(proc, self._modified)
        except BaseException:
            os.close(self._fd)
            raise
        self.sinks = sinks
        self.rank = rank
        self._tee = tee
        self._scheduled = False
        self._waiting_room = False
        self._closed = False

    # -- following --------------------------------------------------------
    def _modified(self) -> None:
        if not self._scheduled:
            self._pump()

    def _wanted(self) -> bool:
        return any(s.wanted() for s in self.sinks)

    def _console_full(self) -> bool:
        return self._tee and console().backlog > MAX_PENDING

    def _pump(self) -> None:
        self._scheduled = False
        if self._closed or self._waiting_room:
            return
        if not self._wanted():
            # Nobody listens: read nothing; a later listener resumes near the end.
            if self._offset is not None:
                self._offset_known = self._offset
                self._offset = None
                for sink in self.sinks:
                    sink.skip()
            return
        budget = _BUDGET
        while budget > 0:
            if self._console_full():
                self._waiting_room = True
                console().when_room(self._room)
                return
            n = self._read(_CHUNK)
            if not n:
                return
            budget -= n
        # More may be there: continue after the loop's other callbacks.
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._pump)

    def _room(self) -> None:
        self._waiting_room = False
        self._pump()

    def _read(self, size: int) -> int:
        if self._offset is None:
            end = os.fstat(self._fd).st_size
            self._offset = max(self._offset_known, end - _RESUME_BACK)
        data = os.pread(self._fd, size, self._offset)
        if data:
            self._offset += len(data)
            for sink in self.sinks:
                sink.feed(data)
        return len(data)

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
    async def drain(self, stall: float) -> None:
        """The writer is gone: feed what it appended, then close the sinks.

        A console that takes nothing for ``stall`` seconds is given up on
        (with a marker); the file keeps every byte. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._inotify.unwatch(self._wd, self._modified)
        try:
            if self._wanted():
                end = os.fstat(self._fd).st_size
                fed = 0
                while self._offset is None or self._offset < end:
                    if self._console_full() and not await self._wait_room(stall):
                        console().write(
                            "stderr",
                            f"[aiolaunch]: the console took nothing for {stall:g}s; "
                            f"{end - (self._offset or 0)} bytes of rank {self.rank}'s log "
                            "are not shown (the log file has them)\n",
                        )
                        break
                    n = self._read(min(_CHUNK, end - (self._offset or 0)))
                    if not n:
                        break
                    fed += n
                    if fed >= _BUDGET:
                        fed = 0
                        await asyncio.sleep(0)  # allowed: a yield between chunks, not a poll
            for sink in self.sinks:
                await sink.aclose()
        finally:
            os.close(self._fd)

    async def _wait_room(self, stall: float) -> bool:
        writer = console()
        while self._console_full():
            before = writer.written
            room: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(room: asyncio.Future[None] = room) -> None:
                if not room.done():
                    room.set_result(None)

            writer.when_room(wake)
            with anyio.move_on_after(stall):
                await room
                continue
            if writer.written == before:
                return False
        return True

    def discard(self) -> None:
        """Stop without reading (the worker never started). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._inotify.unwatch(self._wd, self._modified)
        os.close(self._fd)
