"""The sink of un-redirected streams where the console is not fd 1/2."""

from __future__ import annotations

import asyncio

from ._console import console
from ._framer import Utf8Decoder
from ._sink import Sink

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
    """

    def __init__(self, stream: str) -> None:
        self._stream = stream
        self._decoder = Utf8Decoder()
        self._partial = ""
        self._timer: asyncio.TimerHandle | None = None

    def feed(self, data: bytes) -> None:
        text = self._partial + self._decoder.decode(data)
        cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        if cut:
            console().write(self._stream, text[:cut])
        self._partial = text[cut:]
        if self._partial and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(_PARTIAL_DELAY, self._flush_partial)

    def _flush_partial(self) -> None:
        self._timer = None
        if self._partial:
            console().write(self._stream, self._partial)
            self._partial = ""

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._partial += self._decoder.decode(b"", final=True)
        self._flush_partial()
