"""The one line framer: bytes in, whole lines out, as a terminal would show them.

Every line-based sink (console, readiness/``LogLine`` lines) frames through
:class:`LineFramer`, so they agree on what a line is:

- UTF-8 is decoded incrementally (a character cut by a read boundary is
  whole on the next feed); invalid bytes become U+FFFD.
- ``"a\\rb\\rc"`` is the line ``"c"`` (carriage-return progress updates keep
  only their latest state); a trailing ``\\r`` leaves the pending line as an
  in-place *status*.
- With ``max_line``, longer lines (and an unterminated pending line past that
  length) come out in ``max_line`` pieces, each a line.
"""

from __future__ import annotations

import codecs

__all__ = ["LineFramer", "Utf8Decoder", "latest_state"]


class Utf8Decoder:
    """Incremental UTF-8 decoding, bad bytes replaced."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, data: bytes, final: bool = False) -> str:
        return self._decoder.decode(data, final)

    @property
    def pending(self) -> bool:
        """Whether bytes of an incomplete character are held for the next call."""
        return bool(self._decoder.getstate()[0])


def latest_state(line: str) -> str:
    """What a terminal shows of ``line``: ``"a\\rb\\rc"`` -> ``"c"``.

    A trailing ``"\\r"`` means the next update overwrites: the last non-empty
    part is kept, with its ``"\\r"``.
    """
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    last = parts[-1] if parts else ""
    return last + "\r" if line.endswith("\r") else last


def _lines_within(text: str, end: int, limit: int) -> bool:
    """Whether no line of ``text[:end]`` (whose last char is a newline) exceeds ``limit``.

    Steps from the last newline of each ``limit + 1`` window: about
    ``len / limit`` C-level searches, not one string per line.
    """
    pos = 0
    while end - pos > limit:
        nl = text.rfind("\n", pos, pos + limit + 1)
        if nl < 0:
            return False
        pos = nl + 1
    return True


class LineFramer:
    """Frames one stream's bytes into whole lines.

    :meth:`feed` returns a *block*: zero or more whole lines, each ending in
    ``"\\n"`` and containing no other ``"\\n"`` or ``"\\r"`` - or ``None`` when
    the bytes completed no character. :meth:`finish` returns the final
    unterminated line the same way (``""`` if there is none).
    """

    def __init__(self, max_line: int | None = None) -> None:
        self._max = max_line
        self._decoder = Utf8Decoder()
        self._partial = ""

    @property
    def status(self) -> str | None:
        """The pending line's progress state, if it holds a ``\\r`` update (else ``None``)."""
        if "\r" not in self._partial:
            return None
        return self._partial.rstrip("\r") or None

    @property
    def idle(self) -> bool:
        """Whether nothing is held: no pending line, no partial character."""
        return not self._partial and not self._decoder.pending

    def reset(self) -> None:
        """Forget the pending line and decoder state (resume at a line boundary)."""
        self._decoder = Utf8Decoder()
        self._partial = ""

    def feed(self, data: bytes) -> str | None:
        new = self._decoder.decode(data)
        if not new:
            return None
        text = self._partial + new
        cut = text.rfind("\n")
        limit = self._max
        if (
            cut >= 0
            and "\r" not in text
            and (limit is None or (len(text) - cut <= limit and _lines_within(text, cut, limit)))
        ):
            # Fast path (no progress bars, no over-long line): one slice, no
            # Python loop over the lines.
            self._partial = text[cut + 1 :]
            return text[: cut + 1]
        lines = text.split("\n")
        self._partial = latest_state(lines.pop())
        out: list[str] = []
        for line in lines:
            out.extend(self._split(latest_state(line).rstrip("\r")))
        if limit is not None:
            while len(self._partial) > limit:
                out.append(self._partial[:limit] + "\n")
                self._partial = self._partial[limit:]
        return "".join(out)

    def finish(self) -> str:
        """Flush the decoder; the final unterminated line as a block (``""`` if none)."""
        tail = self._decoder.decode(b"", final=True)
        last = latest_state(self._partial + tail).rstrip("\r")
        self._partial = ""
        return "".join(self._split(last)) if last else ""

    def _split(self, line: str) -> list[str]:
        limit = self._max
        if limit is None or len(line) <= limit:
            return [line + "\n"]
        return [line[i : i + limit] + "\n" for i in range(0, len(line), limit)]
