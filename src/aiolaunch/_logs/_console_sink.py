"""The tee sink: a stream's lines, prefixed, to the parent's console."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ._console import console
from ._framer import LineFramer
from ._sink import Sink

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._dedup import ConsoleDedup
    from ._sink import FileRest

__all__ = ["ConsoleSink"]

# The longest console line; longer ones go out in pieces, each prefixed.
_MAX_LINE = 64 * 1024
# A handed-over file is read in pieces of this size by the console thread.
_CHUNK = 1 << 20

#: CSI (colors, cursor moves), OSC (titles, hyperlinks; BEL or ST ended) and
#: two-byte escapes (ECMA-48). Used by ConsoleSink(strip_ansi=True).
_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


_allocator_warm = False


def _warm_allocator() -> None:
    """Raise glibc malloc's dynamic thresholds once per process.

    A tee'd megabyte costs three buffers of about a megabyte (the read, the
    prefixed bytes, the decoded text), freed a moment later. Under glibc's
    default thresholds each is a fresh ``mmap`` or the heap top is trimmed
    and grown again, so every page faults anew: measured 0.65-0.70 ms/MiB of
    framing instead of 0.30. Freeing one 8 MiB block raises the mmap
    threshold to 8 MiB and the trim threshold to 16 MiB (glibc's documented
    dynamic adjustment, what any process that once freed such a buffer gets),
    so the buffers are reused from the heap. It costs no page: ``bytes(n)``
    is a ``calloc`` of untouched memory. Elsewhere it is a no-op in effect.
    """
    global _allocator_warm
    if not _allocator_warm:
        _allocator_warm = True
        block = bytes(8 << 20)
        del block


def _lines_within(data: bytes, pos: int, end: int, limit: int) -> bool:
    """Whether no line of ``data[pos:end]`` (``data[end]`` is a newline) is
    longer than ``limit`` bytes: about ``len / limit`` C-level searches."""
    while end - pos > limit:
        nl = data.rfind(b"\n", pos, pos + limit + 1)
        if nl < 0:
            return False
        pos = nl + 1
    return True


class ConsoleSink(Sink):
    """Prefixed, line-atomic text to the parent's console.

    - Each batch of whole lines is one console write: lines of different
      workers never mix within a line.
    - ``\\r`` progress updates are coalesced: the latest state is shown in
      place on a TTY (bounded rate) and otherwise only once the line ends, so a
      tqdm bar in a worker never floods the console with one line per update.
    - A final line without newline is flushed, with a newline, at EOF.
    - With ``strip_ansi`` escape sequences are removed from the console copy.
    - Lossless: the sink has no :meth:`room` while the console is
      ``MAX_PENDING`` behind, and its feeder waits (a pipe: the worker
      blocks; a followed file: this sink falls behind and catches up from the
      file). A followed file whose writer is gone while the console is
      stuck is handed over to the console thread (:meth:`hand_over`), which
      writes the rest when the console takes it again.
    """

    def __init__(
        self,
        stream: str,
        prefix: str,
        dedup: ConsoleDedup | None = None,
        rank: int = 0,
        strip_ansi: bool = False,
    ) -> None:
        self._strip = strip_ansi
        self._stream = stream
        self._prefix = prefix
        self._framer = LineFramer(_MAX_LINE)
        self._status = False
        self._dedup = dedup
        self._rank = rank
        _warm_allocator()
        # The byte-level fast path (see _feed_fast): plain prefixed lines only.
        self._fast = dedup is None and not strip_ansi
        try:
            self._nl_prefix = b"\n" + prefix.encode()
        except UnicodeEncodeError:  # a lone surrogate: the framer's path keeps it
            self._nl_prefix = b""
            self._fast = False
        #: the fast path's pending line: undecoded bytes, no "\n" or "\r"
        self._carry = b""
        #: where framed text goes: the console's queue (None), or, once handed
        #: over, the list the console thread takes it from
        self._held: list[str] | None = None

    def room(self) -> bool:
        return console().room()

    def when_room(self, callback: Callable[[], None]) -> None:
        console().when_room(callback)

    def hand_over(self, rest: FileRest) -> bool:
        # Whatever the dedup holds goes out first, then the rest unmerged (the
        # dedup's timers live on the loop; the rest is framed on the console
        # thread, which is the only user of this sink from now on).
        if self._dedup is not None:
            self._dedup.flush()
            self._dedup = None
            self._fast = not self._strip and bool(self._nl_prefix)
        held: list[str] = []
        self._held = held

        def produce() -> tuple[str, bool]:
            try:
                data = rest.read(_CHUNK)
            except OSError:  # the file is gone: what was read is shown
                data = b""
            if data:
                self.feed(data)
            else:
                self._finish()
                rest.close()
            text = "".join(held)
            held.clear()
            return text, not data

        console().write_later(self._stream, produce)
        return True

    def _out(self, parts: tuple[str, ...]) -> None:
        if self._held is None:
            console().write_parts(self._stream, parts)
        else:
            self._held.extend(parts)

    def feed(self, data: bytes) -> None:
        if self._fast and self._framer.idle and self._feed_fast(data):
            return
        carry, self._carry = self._carry, b""
        block = self._framer.feed(carry + data if carry else data)
        if block is None:
            return
        if block:
            self._clear_status()
            self._write_block(block)
        state = self._framer.status
        if state is not None:
            console().set_status(self._stream, self, self._prefix + state)
            self._status = True

    def _feed_fast(self, data: bytes) -> bool:
        """Frame ``data`` without a Python string per line or per chunk copy.

        Handles the common case - no ``\r``, no line over ``_MAX_LINE`` -
        on bytes, where a replace costs a third of ``str.replace``: each
        newline but the last is followed by the prefix with one
        ``bytes.replace``, and the lines are decoded once, from a view of
        that. Lines end on ``\n``, which is never inside a UTF-8 character,
        so decoding whole lines apart gives what the incremental decoder
        would. Returns ``False`` (nothing consumed) where the framer must
        decide; the pending bytes then go to the framer with ``data``.
        """
        if b"\r" in data:
            return False
        carry = self._carry
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(carry) + len(data) > _MAX_LINE:
                return False
            self._carry = carry + data
            return True
        first = data.find(b"\n")
        # Byte lengths bound character lengths: within the limit in bytes is
        # within it in characters (else the framer splits exactly).
        if (
            len(carry) + first > _MAX_LINE
            or len(data) - cut - 1 > _MAX_LINE
            or not _lines_within(data, first + 1, cut, _MAX_LINE)
        ):
            return False
        self._clear_status()
        nl_prefix = self._nl_prefix
        head = self._prefix + str(carry + data[: first + 1], "utf-8", "replace")
        if first == cut:
            body = ""
        else:
            # framed[first:] is "\n" + prefix + line 2 + ... + last "\n" + prefix + tail
            framed = data.replace(b"\n", nl_prefix)
            end = framed.rfind(b"\n")
            with memoryview(framed) as view:
                body = str(view[first + 1 : end + 1], "utf-8", "replace")
        self._carry = data[cut + 1 :]
        self._out((head, body))
        return True

    async def aclose(self) -> None:
        self._finish()

    def _finish(self) -> None:
        carry, self._carry = self._carry, b""
        block = (self._framer.feed(carry) or "") if carry else ""
        block += self._framer.finish()
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
        self._out((framed,))
