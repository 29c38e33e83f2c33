"""The sink interface: where one worker stream's bytes go.

Like httpx's ``AsyncBaseTransport`` (one method to implement, the rest with
sensible defaults), a sink implements :meth:`Sink.feed`; backpressure is part
of the interface, not a type check in the reader: a reader asks
:meth:`Sink.room` before it feeds more, and when a sink has none it stops
reading (a pipe: the worker blocks on it; a followed file: this sink falls
behind and catches up from the file) until :meth:`Sink.when_room` calls back.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["FileRest", "Sink"]


class FileRest:
    """The unread end of a log file whose writer is gone: bytes
    ``[offset, end)`` of ``fd``, which this object owns (:meth:`close`)."""

    def __init__(self, fd: int, offset: int, end: int) -> None:
        self._fd = fd
        self.offset = offset
        self.end = end

    def read(self, size: int) -> bytes:
        """The next at most ``size`` bytes; ``b""`` at the end."""
        if self._fd < 0 or self.offset >= self.end:
            return b""
        data = os.pread(self._fd, min(size, self.end - self.offset), self.offset)
        self.offset += len(data)
        if not data:
            self.end = self.offset  # the file shrank: nothing more to read
        return data

    def close(self) -> None:
        """Close the fd (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Sink:
    """Receives a stream's bytes in order: ``feed(data)`` calls on the event-loop
    thread, then one ``aclose()``. A sink never blocks the loop.

    Only :meth:`feed` must be implemented; a sink that can fall behind (the
    console) also overrides :meth:`room` and :meth:`when_room`.
    """

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    def room(self) -> bool:
        """Whether the sink takes more now. A reader that sees ``False``
        feeds it nothing more until :meth:`when_room` called back."""
        return True

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, on the loop, when :meth:`room` may be true again."""
        asyncio.get_running_loop().call_soon(callback)

    def wanted(self) -> bool:
        """Whether this sink needs bytes now (a stream nobody needs is not read)."""
        return True

    def skip(self) -> None:
        """Bytes went by unread (nobody wanted them): resume at a line boundary."""

    def hand_over(self, rest: FileRest) -> bool:
        """The writer is gone and this sink has no room: take the rest of the
        stream (``rest``, now yours) and deliver it in order on your own time,
        off the loop; then this sink is finished (no :meth:`aclose`).

        Returns ``False`` (the default) where the sink cannot: the reader
        then waits for room.
        """
        return False

    async def aclose(self) -> None:
        """Flush everything fed so far and release resources. Idempotent."""
