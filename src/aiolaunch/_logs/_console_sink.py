"""The tee sink: a stream's lines, prefixed, to the parent's console."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ._console import console
from ._framer import LineFramer
from ._sink import Sink

if TYPE_CHECKING:
    from ._dedup import ConsoleDedup

__all__ = ["ConsoleSink"]

# The longest console line; longer ones go out in pieces, each prefixed.
_MAX_LINE = 64 * 1024

#: CSI (colors, cursor moves), OSC (titles, hyperlinks; BEL or ST ended) and
#: two-byte escapes (ECMA-48). Used by ConsoleSink(strip_ansi=True).
_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


class ConsoleSink(Sink):
    """Prefixed, line-atomic text to the parent's console.

    - Each batch of whole lines is one console write: lines of different
      workers never mix within a line.
    - ``\\r`` progress updates are coalesced: the latest state is shown in
      place on a TTY (bounded rate) and otherwise only once the line ends, so a
      tqdm bar in a worker never floods the console with one line per update.
    - A final line without newline is flushed, with a newline, at EOF.
    - With ``strip_ansi`` escape sequences are removed from the console copy.
    - ``lossless``: the feeder bounds the console backlog itself (a followed
      log file), so the console never drops these lines.
    """

    def __init__(
        self,
        stream: str,
        prefix: str,
        dedup: ConsoleDedup | None = None,
        rank: int = 0,
        strip_ansi: bool = False,
        lossless: bool = False,
    ) -> None:
        self._lossless = lossless
        self._strip = strip_ansi
        self._stream = stream
        self._prefix = prefix
        self._framer = LineFramer(_MAX_LINE)
        self._status = False
        self._dedup = dedup
        self._rank = rank

    def feed(self, data: bytes) -> None:
        block = self._framer.feed(data)
        if block is None:
            return
        if block:
            self._clear_status()
            self._write_block(block)
        state = self._framer.status
        if state is not None:
            console().set_status(self._stream, self, self._prefix + state)
            self._status = True

    async def aclose(self) -> None:
        block = self._framer.finish()
        self._clear_status()
        if block:
            self._write_block(block)

    def _clear_status(self) -> None:
        if self._status:
            console().set_status(self._stream, self, None)
            self._status = False

    def _write_block(self, block: str) -> None:
        # Escape sequences never span lines: strip whole lines only, so one
        # cut by a read boundary is still complete here.
        if self._dedup is not None:
            if self._strip:
                block = _ANSI_RE.sub("", block)
            self._dedup.add(self._stream, self._rank, block[:-1].split("\n"))
            return
        # Prefix every line with one C-level replace, not a Python loop.
        prefix = self._prefix
        framed = "".join((prefix, block[:-1].replace("\n", "\n" + prefix), "\n"))
        if self._strip:
            framed = _ANSI_RE.sub("", framed)
        console().write(self._stream, framed, self._lossless)
