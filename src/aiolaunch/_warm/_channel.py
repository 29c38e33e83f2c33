"""The supervisor's end of a zygote's control socket, on the running event loop.

Frames are :mod:`aiolaunch._child._wire`'s (the codec the zygote uses too); a
request's fds travel with its first byte.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

from .._child._wire import Decoder, encode

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._child._wire import Message, Request

__all__ = ["Channel"]


class Channel:
    """The supervisor's end of a zygote's control socket, on the running loop.

    Replies in (``on_message``, in order; ``on_eof`` once) and requests out
    (:meth:`send`, one at a time, fds with the first byte). Rebound when the
    loop changes (another ``asyncio.run``); unread frames wait in the socket
    meanwhile.
    """

    def __init__(self, sock: socket.socket, on_message: Callable[[Message], None]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.on_message = on_message
        self.on_eof: Callable[[], None] = lambda: None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock: asyncio.Lock | None = None
        self._decoder = Decoder()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = asyncio.Lock()
        if self.sock.fileno() >= 0:
            loop.add_reader(self.sock.fileno(), self._on_readable)

    def unbind(self) -> None:
        loop, self.loop = self.loop, None
        if loop is not None and not loop.is_closed() and self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())

    def close(self) -> None:
        self.unbind()
        self.sock.close()

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.unbind()
            self.on_eof()
            return
        for msg in self._decoder.feed(data):
            self.on_message(msg)

    async def send(self, msg: Request, fds: list[int]) -> None:
        """Write one whole frame (the caller holds :attr:`lock`)."""
        assert self.loop is not None
        frame = encode(msg)
        sent = 0
        while sent < len(frame):
            try:
                if sent == 0 and fds:
                    sent += socket.send_fds(self.sock, [frame], fds)
                else:
                    sent += self.sock.send(frame[sent:])
            except (BlockingIOError, InterruptedError):
                writable = self.loop.create_future()
                self.loop.add_writer(self.sock.fileno(), writable.set_result, None)
                try:
                    await writable
                finally:
                    self.loop.remove_writer(self.sock.fileno())
