"""The log-file sink: a stream's exact bytes to its file, off the loop thread.

:class:`FileSink` batches chunks and writes them with ``os.write`` on a small
dedicated thread pool, one write in flight per file, so bytes stay in order.
Past a high-water mark it has no :meth:`~FileSink.room`: its pump pauses
reading, and the worker blocks on a full pipe instead of the supervisor
growing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .._types import PerProcess
from ._sink import Sink

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["FileSink", "file_executor", "open_log_file"]

_HIGH_WATER = 16 * 1024 * 1024
_LOW_WATER = 4 * 1024 * 1024

# Our own pool: the loop's default executor may be saturated by user work
# (to_thread calls), and log writes must not queue behind it.
_EXECUTOR: PerProcess[ThreadPoolExecutor] = PerProcess(
    lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="aiolaunch-log")
)


def file_executor() -> ThreadPoolExecutor:
    """The process's log-writer pool (also closes inotify instances off the loop)."""
    return _EXECUTOR.get()


def open_log_file(path: str) -> int:
    """Create ``path`` for appending without following a planted symlink.

    Mode 0o666 filtered by the user's umask, like ``open()``.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags, 0o666)


def _write_all(fd: int, chunks: list[bytes]) -> None:
    data = b"".join(chunks) if len(chunks) > 1 else chunks[0]
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FileSink(Sink):
    """Exact bytes to one file, written off the loop thread, in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_log_file(path)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._in_flight: asyncio.Future[None] | None = None
        # Set while nothing is queued or being written.
        self._drained = asyncio.Event()
        self._drained.set()
        self._closed = False
        self.error: BaseException | None = None
        #: when_room callbacks, called once the backlog is below the low-water mark
        self._room: list[Callable[[], None]] = []

    def feed(self, data: bytes) -> None:
        if self._closed or self.error is not None:
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._in_flight is None:
            self._start_write()

    def room(self) -> bool:
        return self._pending_bytes <= _HIGH_WATER

    def when_room(self, callback: Callable[[], None]) -> None:
        if self._pending_bytes < _LOW_WATER:
            asyncio.get_running_loop().call_soon(callback)
        else:
            self._room.append(callback)

    def _start_write(self) -> None:
        chunks, self._pending = self._pending, []
        self._pending_bytes = 0
        self._drained.clear()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(file_executor(), _write_all, self._fd, chunks)
        self._in_flight = fut
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut: asyncio.Future[None]) -> None:
        self._in_flight = None
        exc = fut.exception() if not fut.cancelled() else None
        if exc is not None:
            # A full disk or a removed directory: keep the worker running and
            # report it; later bytes for this file are dropped.
            self.error = exc
            logging.getLogger("aiolaunch").warning(
                "aiolaunch: cannot write log file %s (%s: %s); the rest of this "
                "stream is dropped from the file",
                self.path,
                type(exc).__name__,
                exc,
            )
            self._pending.clear()
            self._pending_bytes = 0
        elif self._pending:
            self._start_write()
        if self._in_flight is None:
            self._drained.set()
        if self._room and self._pending_bytes < _LOW_WATER:
            room, self._room = self._room, []
            for callback in room:
                callback()

    async def flush(self) -> None:
        """Wait until every byte fed so far is written (or the file failed)."""
        await self._drained.wait()

    async def aclose(self) -> None:
        if self._closed:
            return
        await self.flush()
        self._closed = True
        os.close(self._fd)
