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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Sink"]


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

    async def aclose(self) -> None:
        """Flush everything fed so far and release resources. Idempotent."""
