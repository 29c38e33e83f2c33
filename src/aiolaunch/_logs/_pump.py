"""The async reader of one worker pipe: bytes in, sinks fed, drained on exit."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

from .._cancel import move_on_after
from .._workers._fds import read_pipe_rest

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._sink import Sink

__all__ = ["StreamPump"]

# After a worker is gone, how long its pipe may take to reach EOF before we
# read what the kernel buffers and close our end (a surviving descendant in
# another session may hold it).
DRAIN_TIMEOUT = 0.25


class StreamPump(asyncio.Protocol):
    """Reads one pipe with asyncio's pipe transport and feeds every sink.

    Exit detection never waits on this pump (a grandchild may hold the pipe
    open forever); instead :meth:`drain` is called once the worker is gone: it
    waits a bounded time for EOF, then reads synchronously whatever the kernel
    still buffers - every byte the worker wrote before exiting is there - and
    closes our end.

    Backpressure: after each chunk, a sink without :meth:`~Sink.room` pauses
    reading (the worker blocks on the full pipe) until it calls back
    (:meth:`~Sink.when_room`).

    Fd ownership: the read end belongs to the transport from :meth:`open` on;
    the transport closes it after EOF or :meth:`drain`'s ``close()``. The pump
    keeps no fd number (a closed number is reused at once by the next
    ``os.pipe()``, another rank's blocking pipe): the synchronous read goes
    through the transport's file object, only while it is not closing.
    """

    def __init__(self, sinks: Sequence[Sink], rank: int = -1) -> None:
        self.sinks = list(sinks)
        self.rank = rank
        #: time.monotonic() of the last chunk read
        self._last: float | None = None
        self.transport: asyncio.ReadTransport | None = None
        self.eof = asyncio.Event()
        self._closed = False
        #: reading paused: a sink has no room
        self._paused = False
        #: not started yet (the worker is being spawned)
        self._held = True

    @classmethod
    async def open(cls, read_fd: int, sinks: Sequence[Sink], rank: int = -1) -> StreamPump:
        """Open ``read_fd`` for reading, held until :meth:`start`.

        Ownership of ``read_fd`` passes to the pump at the call (it is closed
        here if the transport cannot be made).
        """
        pump = cls(sinks, rank)
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        try:
            await loop.connect_read_pipe(lambda: pump, pipe)
        except BaseException:
            pipe.close()
            raise
        # Held: nothing is read before start(), so a line listener that
        # starts with the worker sees its first line.
        if pump.transport is not None:
            pump.transport.pause_reading()
        return pump

    def start(self) -> None:
        """Begin reading (the worker runs)."""
        if self._held:
            self._held = False
            if not self._paused:
                self._set_reading(True)

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._last = time.monotonic()
        for sink in self.sinks:
            sink.feed(data)
        if not self._paused:
            self._check_room()

    def eof_received(self) -> bool | None:
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof.set()

    # -- ours -------------------------------------------------------------
    def age(self) -> float | None:
        """Seconds since the last chunk was read, or ``None`` (nothing yet)."""
        return None if self._last is None else time.monotonic() - self._last

    def _check_room(self) -> None:
        """Pause reading while a sink has no room; resume once all have."""
        for sink in self.sinks:
            if not sink.room():
                if not self._paused:
                    self._paused = True
                    self._set_reading(False)
                sink.when_room(self._check_room)
                return
        if self._paused:
            self._paused = False
            self._set_reading(True)

    def _set_reading(self, on: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self._closed or self._held:
            return
        if on:
            transport.resume_reading()
        else:
            transport.pause_reading()

    def _read_rest(self) -> None:
        read_pipe_rest(self.transport, self.data_received)

    async def abandon(self) -> None:
        """Close without waiting (the worker never started)."""
        await self.drain(0)

    async def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        """Finish the stream: EOF within ``timeout`` or read what is buffered; close.

        Called after the writer exited. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._held = False
        transport = self.transport
        if transport is not None and not self.eof.is_set():
            if not transport.is_closing():
                transport.resume_reading()
            if timeout > 0:
                async with move_on_after(timeout):
                    await self.eof.wait()
            if not self.eof.is_set():
                # A descendant still holds the pipe: take what is buffered, then
                # close our end (the holder gets SIGPIPE on its next write).
                self._read_rest()
                transport.close()
        for sink in self.sinks:
            await sink.aclose()
