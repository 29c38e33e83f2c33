"""The sink of un-redirected streams where the console is not fd 1/2."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from ._console import console
from ._framer import Utf8Decoder
from ._sink import Sink

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["PassthroughSink"]

# How long a partial line (a prompt without newline) may wait for its end.
_PARTIAL_DELAY = 0.1


class PassthroughSink(Sink):
    """Unprefixed text to the console, for streams not redirected.

    Used where ``sys.stdout`` is not the process's fd 1 (a Jupyter kernel):
    there, inheriting the fd would send the worker's output to the server's
    terminal instead of the cell. Text is passed on up to the last ``\\n`` or
    ``\\r``, so lines of different workers do not mix; a trailing partial
    line (a prompt) follows after at most ``_PARTIAL_DELAY`` seconds.
    Lossless: without console room its pump stops reading, and the worker
    waits on the pipe (as it would on a terminal).
    """

    def __init__(self, stream: str) -> None:
        self._stream = stream
        self._decoder = Utf8Decoder()
        self._partial = ""
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        #: when bytes last came, and when this sink last had no room (its
        #: pump paused reading then): a partial line is a prompt only once
        #: the stream was quiet since both
        self._fed_at = self._full_at = -_PARTIAL_DELAY

    def room(self) -> bool:
        if console().room():
            return True
        self._full_at = time.monotonic()
        return False

    def when_room(self, callback: Callable[[], None]) -> None:
        console().when_room(callback)

    def feed(self, data: bytes) -> None:
        self._fed_at = time.monotonic()
        text = self._partial + self._decoder.decode(data)
        cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        if cut:
            console().write(self._stream, text[:cut])
        self._partial = text[cut:]
        self._arm()

    def _flush_partial(self) -> None:
        self._timer = None
        if not self._partial:
            return
        if not console().room():
            # The pump is held back by the console: the line's end is still in
            # the pipe, not a prompt. Look again once the console took its batch.
            console().when_room(self._arm)
            return
        quiet = time.monotonic() - max(self._fed_at, self._full_at)
        if quiet < _PARTIAL_DELAY:
            self._arm(_PARTIAL_DELAY - quiet)  # the line's end may be on its way
            return
        console().write(self._stream, self._partial)
        self._partial = ""

    def _arm(self, delay: float = _PARTIAL_DELAY) -> None:
        if self._partial and self._timer is None and not self._closed:
            self._timer = asyncio.get_running_loop().call_later(delay, self._flush_partial)

    async def aclose(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._partial += self._decoder.decode(b"", final=True)
        if self._partial:
            console().write(self._stream, self._partial)
            self._partial = ""
