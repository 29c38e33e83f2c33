"""The line sink: a stream's lines to a callback (readiness probes, ``LogLine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._framer import LineFramer
from ._sink import Sink

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LineSink"]


class LineSink(Sink):
    """Calls ``on_line(text)`` for each complete line, as the console would show it.

    Feeds readiness probes and ``LogLine`` events. While ``wanted()`` is false
    (nobody listens) chunks are skipped at no cost, so a listener that starts
    mid-stream sees lines from its next full line on. A final partial line is
    delivered at close.
    """

    def __init__(self, on_line: Callable[[str], None], wanted: Callable[[], bool]) -> None:
        self._on_line = on_line
        self._wanted = wanted
        self._framer = LineFramer()
        self._synced = True

    def wanted(self) -> bool:
        return self._wanted()

    def skip(self) -> None:
        self._synced = False

    def feed(self, data: bytes) -> None:
        if not self._wanted():
            self._synced = False
            return
        if not self._synced:
            # Resume at a line boundary with a fresh decoder.
            nl = data.find(b"\n")
            if nl < 0:
                return
            data = data[nl + 1 :]
            self._framer.reset()
            self._synced = True
        self._deliver(self._framer.feed(data))

    async def aclose(self) -> None:
        if not self._synced:
            return
        block = self._framer.finish()
        if block and self._wanted():
            self._deliver(block)

    def _deliver(self, block: str | None) -> None:
        if block:
            for line in block[:-1].split("\n"):
                self._on_line(line)
