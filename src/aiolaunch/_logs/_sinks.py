"""Where a worker's bytes go: a log file (exact bytes) and/or the console (lines).

A sink takes ``feed(data)`` calls on the event-loop thread, in order, and a
final ``aclose()``. Sinks never block the loop:

- :class:`FileSink` batches chunks and writes them with ``os.write`` on a small
  dedicated thread pool, one write in flight per file, so bytes stay in order.
  Past a high-water mark it asks its pump to pause reading: the worker then
  blocks on a full pipe instead of the supervisor growing without bound.
- :class:`ConsoleSink` frames lines, prefixes them, decodes UTF-8 incrementally
  (replacing bad bytes on the console only) and hands each batch of whole
  lines to the console writer thread (``_console``), which writes it to the
  ``sys.stdout``/``sys.stderr`` of the moment (so a Jupyter cell shows it).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ._console import console

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "ConsoleDedup",
    "ConsoleSink",
    "FileSink",
    "LineSink",
    "PassthroughSink",
    "Sink",
    "open_log_file",
]

_HIGH_WATER = 16 * 1024 * 1024
_LOW_WATER = 4 * 1024 * 1024
# The longest console line; longer ones go out in pieces, each prefixed.
_MAX_LINE = 64 * 1024
# How long a partial line (a prompt without newline) may wait for its end.
_PARTIAL_DELAY = 0.1

_executor: ThreadPoolExecutor | None = None
_executor_pid = 0
_executor_lock = threading.Lock()


def _file_executor() -> ThreadPoolExecutor:
    # Our own pool: the loop's default executor may be saturated by user work
    # (to_thread calls), and log writes must not queue behind it.
    global _executor, _executor_pid
    with _executor_lock:
        if _executor is None or _executor_pid != os.getpid():
            _executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="aiolaunch-log")
            _executor_pid = os.getpid()
        return _executor


def open_log_file(path: str) -> int:
    """Create ``path`` for appending without following a planted symlink.

    Mode 0o666 filtered by the user's umask, like ``open()``.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    return os.open(path, flags, 0o666)


class Sink:
    """Base class: receives a stream's bytes in order."""

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Flush everything fed so far and release resources. Idempotent."""


def _write_all(fd: int, chunks: list[bytes]) -> None:
    data = b"".join(chunks) if len(chunks) > 1 else chunks[0]
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FileSink(Sink):
    """Exact bytes to one file, written off the loop thread, in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_log_file(path)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._in_flight: asyncio.Future[None] | None = None
        # Set while nothing is queued or being written.
        self._drained = asyncio.Event()
        self._drained.set()
        self._closed = False
        self.error: BaseException | None = None
        #: set by the pump: called with True to pause reading, False to resume
        self.flow_control: Callable[[bool], None] | None = None
        self._paused = False

    def feed(self, data: bytes) -> None:
        if self._closed or self.error is not None:
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._in_flight is None:
            self._start_write()
        elif self._pending_bytes > _HIGH_WATER and not self._paused and self.flow_control:
            self._paused = True
            self.flow_control(True)

    def _start_write(self) -> None:
        chunks, self._pending = self._pending, []
        self._pending_bytes = 0
        self._drained.clear()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(_file_executor(), _write_all, self._fd, chunks)
        self._in_flight = fut
        fut.add_done_callback(self._write_done)

    def _write_done(self, fut: asyncio.Future[None]) -> None:
        self._in_flight = None
        exc = fut.exception() if not fut.cancelled() else None
        if exc is not None:
            # A full disk or a removed directory: keep the worker running and
            # report it; later bytes for this file are dropped.
            self.error = exc
            logging.getLogger("aiolaunch").warning(
                "aiolaunch: cannot write log file %s (%s: %s); the rest of this "
                "stream is dropped from the file",
                self.path,
                type(exc).__name__,
                exc,
            )
            self._pending.clear()
            self._pending_bytes = 0
        elif self._pending:
            self._start_write()
        if self._in_flight is None:
            self._drained.set()
        if self._paused and self._pending_bytes < _LOW_WATER and self.flow_control:
            self._paused = False
            self.flow_control(False)

    async def flush(self) -> None:
        """Wait until every byte fed so far is written (or the file failed)."""
        await self._drained.wait()

    async def aclose(self) -> None:
        if self._closed:
            return
        await self.flush()
        self._closed = True
        os.close(self._fd)


class _LineDecoder:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, data: bytes, final: bool = False) -> str:
        return self._decoder.decode(data, final)


class ConsoleSink(Sink):
    """Prefixed, line-atomic text to the parent's console.

    - Each batch of whole lines is one console write: lines of different
      workers never mix within a line.
    - ``\\r`` progress updates are coalesced: the latest state is shown in
      place on a TTY (bounded rate) and otherwise only once the line ends, so a
      tqdm bar in a worker never floods the console with one line per update.
    - A final line without newline is flushed, with a newline, at EOF.
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
        self._decoder = _LineDecoder()
        self._partial = ""
        self._status = False
        self._dedup = dedup
        self._rank = rank

    def _write_lines(self, framed: str) -> None:
        # ``framed``: whole lines, each already prefixed.
        if self._dedup is None:
            console().write(self._stream, framed)
            return
        cut = len(self._prefix)
        lines = [line[cut:] for line in framed.split("\n")[:-1]]
        self._dedup.add(self._stream, self._rank, lines)

    def feed(self, data: bytes) -> None:
        self._emit(self._decoder.decode(data))

    def _write_framed(self, framed: str) -> None:
        # Escape sequences never span lines: strip whole framed lines only, so
        # one cut by a read boundary is still complete here.
        self._write_lines(_ANSI_RE.sub("", framed) if self._strip else framed)

    def _emit(self, text: str) -> None:
        if not text:
            return
        text = self._partial + text
        cut = text.rfind("\n")
        if (
            cut >= 0
            and "\r" not in text
            and len(text) - cut <= _MAX_LINE
            and (cut <= _MAX_LINE or max(map(len, text[:cut].split("\n"))) <= _MAX_LINE)
        ):
            # Fast path (no progress bars, no over-long line): prefix with one
            # C-level replace instead of a Python loop over the lines.
            self._partial = text[cut + 1 :]
            if self._status:
                console().set_status(self._stream, self, None)
                self._status = False
            prefix = self._prefix
            self._write_framed(prefix + text[:cut].replace("\n", "\n" + prefix) + "\n")
            return
        lines = text.split("\n")
        self._partial = _latest_state(lines.pop())
        out: list[str] = []
        for line in lines:
            out.extend(self._frame(_latest_state(line).rstrip("\r")))
        while len(self._partial) > _MAX_LINE:
            out.append(self._prefix + self._partial[:_MAX_LINE] + "\n")
            self._partial = self._partial[_MAX_LINE:]
        writer = console()
        if out:
            if self._status:
                writer.set_status(self._stream, self, None)
                self._status = False
            self._write_framed("".join(out))
        if "\r" in self._partial:
            state = self._partial.rstrip("\r")
            if state:
                writer.set_status(self._stream, self, self._prefix + state)
                self._status = True

    def _frame(self, line: str) -> list[str]:
        if len(line) <= _MAX_LINE:
            return [self._prefix + line + "\n"]
        return [
            self._prefix + line[i : i + _MAX_LINE] + "\n" for i in range(0, len(line), _MAX_LINE)
        ]

    async def aclose(self) -> None:
        tail = self._decoder.decode(b"", final=True)
        self._partial = _latest_state(self._partial + tail).rstrip("\r")
        writer = console()
        if self._status:
            writer.set_status(self._stream, self, None)
            self._status = False
        if self._partial:
            self._write_framed("".join(self._frame(self._partial)))
            self._partial = ""


#: CSI (colors, cursor moves), OSC (titles, hyperlinks; BEL or ST ended) and
#: two-byte escapes (ECMA-48). Used by ConsoleSink(strip_ansi=True).
_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def _latest_state(line: str) -> str:
    # "a\rb\rc" shows as "c" on a terminal; keep what a terminal would show
    # (a trailing "\r" means the next update overwrites: keep the last non-empty one).
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    last = parts[-1] if parts else ""
    return last + "\r" if line.endswith("\r") else last


class ConsoleDedup:
    """Shows a line that several ranks print within ``window`` seconds once.

    ``[trainer0-3,6]:epoch 1 done`` instead of five copies. Lines are held at
    most ``window`` seconds; each rank's own lines keep their order (a line is
    merged into an earlier copy only if that copy comes after the rank's
    previous line). Off by default: ``start_processes(console_dedup=0.05)``.
    """

    def __init__(self, name: str, window: float) -> None:
        self.name = name
        self.window = window
        self._entries: list[tuple[str, str, set[int]]] = []
        self._index: dict[tuple[str, str], int] = {}
        self._last: dict[tuple[int, str], int] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, stream: str, rank: int, lines: list[str]) -> None:
        entries = self._entries
        for line in lines:
            key = (stream, line)
            pos = self._index.get(key)
            last = self._last.get((rank, stream), -1)
            if pos is not None and rank not in entries[pos][2]:
                ranks = entries[pos][2]
                if pos < last:
                    # Merging here would put this line before the rank's
                    # previous one. Move the entry to the end instead - allowed
                    # only if it is still the last line of every rank in it.
                    if any(self._last.get((r, stream)) != pos for r in ranks):
                        pos = None
                    else:
                        entries[pos] = (stream, "", set())  # tombstone
                        pos = len(entries)
                        entries.append((stream, line, ranks))
                        self._index[key] = pos
                        for r in ranks:
                            self._last[(r, stream)] = pos
                if pos is not None:
                    ranks.add(rank)
            else:
                pos = None
            if pos is None:
                pos = len(entries)
                entries.append((stream, line, {rank}))
                self._index[key] = pos
            self._last[(rank, stream)] = pos
        if entries and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window, self.flush)

    def flush(self) -> None:
        """Write everything held now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        entries, self._entries = self._entries, []
        self._index.clear()
        self._last.clear()
        out: list[tuple[str, list[str]]] = []
        for stream, line, ranks in entries:
            if not ranks:
                continue  # moved later
            text = f"[{self.name}{_rank_ranges(ranks)}]:{line}\n"
            if out and out[-1][0] == stream:
                out[-1][1].append(text)
            else:
                out.append((stream, [text]))
        for stream, texts in out:
            console().write(stream, "".join(texts))


def _rank_ranges(ranks: set[int]) -> str:
    """``{0, 1, 2, 3, 6}`` -> ``"0-3,6"``."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


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
        self._decoder = _LineDecoder()
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
        self._decoder = _LineDecoder()
        self._partial = ""
        self._synced = True

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
            self._decoder = _LineDecoder()
            self._partial = ""
            self._synced = True
        text = self._decoder.decode(data)
        if not text:
            return
        lines = (self._partial + text).split("\n")
        self._partial = _latest_state(lines.pop())
        for line in lines:
            self._on_line(_latest_state(line).rstrip("\r"))

    async def aclose(self) -> None:
        if not self._synced:
            return
        tail = _latest_state(self._partial + self._decoder.decode(b"", final=True)).rstrip("\r")
        self._partial = ""
        if tail and self._wanted():
            self._on_line(tail)
