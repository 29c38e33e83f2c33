"""The async reader of one worker pipe: bytes in, sinks fed, drained on exit."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import anyio

from ._file import FileSink

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._sink import Sink

__all__ = ["StreamPump"]

_READ_SIZE = 1 << 20


class StreamPump(asyncio.Protocol):
    """Reads one pipe with asyncio's pipe transport and feeds every sink.

    Exit detection never waits on this pump (a grandchild may hold the pipe
    open forever); instead :meth:`drain` is called once the worker is gone: it
    waits a bounded time for EOF, then reads synchronously whatever the kernel
    still buffers - every byte the worker wrote before exiting is there - and
    closes our end.

    Fd ownership: the read end belongs to the transport from :meth:`open` on;
    the transport closes it after EOF or :meth:`drain`'s ``close()``. The pump
    keeps no fd number (a closed number is reused at once by the next
    ``os.pipe()``, another rank's blocking pipe): the synchronous read goes
    through the transport's file object, only while it is not closing.
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        rank: int = -1,
        on_data: Callable[[int], None] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self._on_data = on_data
        self.rank = rank
        self.transport: asyncio.ReadTransport | None = None
        self.eof = asyncio.Event()
        self._closed = False
        for sink in self.sinks:
            if isinstance(sink, FileSink):
                sink.flow_control = self._flow_control

    @classmethod
    async def open(
        cls,
        read_fd: int,
        sinks: Sequence[Sink],
        rank: int = -1,
        on_data: Callable[[int], None] | None = None,
    ) -> StreamPump:
        """Start reading ``read_fd`` (ownership passes to the pump's transport).

        ``on_data(rank)`` is called for every chunk read (the output age).
        """
        pump = cls(sinks, rank, on_data)
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        try:
            await loop.connect_read_pipe(lambda: pump, pipe)
        except BaseException:
            pipe.close()
            raise
        return pump

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._on_data is not None:
            self._on_data(self.rank)
        for sink in self.sinks:
            sink.feed(data)

    def eof_received(self) -> bool | None:
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof.set()

    # -- ours -------------------------------------------------------------
    def _flow_control(self, pause: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if pause:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _read_rest(self) -> None:
        transport = self.transport
        # A closing transport either saw EOF (every byte was delivered) or was
        # closed by us; its fd may already be closed and its number reused.
        if transport is None or transport.is_closing():
            return
        pipe = transport.get_extra_info("pipe")
        if pipe is None:  # pragma: no cover - every pipe transport sets it
            return
        # The transport made the fd non-blocking; read until the pipe is empty.
        while True:
            try:
                data = os.read(pipe.fileno(), _READ_SIZE)
            except (BlockingIOError, InterruptedError, OSError):
                return
            if not data:
                return
            self.data_received(data)

    async def drain(self, timeout: float) -> None:
        """Finish the stream: EOF within ``timeout`` or read what is buffered; close.

        Called after the writer exited. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        transport = self.transport
        if transport is not None and not self.eof.is_set():
            if not transport.is_closing():
                transport.resume_reading()
            if timeout > 0:
                with anyio.move_on_after(timeout):
                    await self.eof.wait()
            if not self.eof.is_set():
                # A descendant still holds the pipe: take what is buffered, then
                # close our end (the holder gets SIGPIPE on its next write).
                self._read_rest()
                transport.close()
        for sink in self.sinks:
            await sink.aclose()
