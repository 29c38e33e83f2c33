"""The single console writer: worker lines to ``sys.stdout``/``sys.stderr``.

Sinks on the event loop hand text to :class:`ConsoleWriter` and return at once;
one writer thread does the (possibly slow) writes. So a slow console - a
terminal being scrolled, a pipe nobody reads fast, a busy notebook - never
stalls the event loop or the log files. No line is ever dropped: writers
stop feeding while the console is more than ``MAX_PENDING`` characters
behind (:meth:`ConsoleWriter.room`) and resume on
:meth:`ConsoleWriter.when_room` - a followed log file keeps every byte
meanwhile, a pipe holds its worker back - so memory stays bounded.

A stuck console (Ctrl-S, a stopped reader) may slow the end of the run, never
lose output: the rest of a finished worker's log file is handed to the
console thread (:meth:`ConsoleWriter.write_later`), ``wait()`` returns after
a bounded flush, and at interpreter exit the process waits until the console
took everything queued (Ctrl-C gives up).

Progress bars:

- a worker's ``\\r`` updates arrive as *status* text, not lines. On a TTY the
  latest status is drawn in place on one bottom line at most every
  ``STATUS_INTERVAL`` seconds; elsewhere nothing is drawn until the line ends.
- ordinary lines clear the status line, print, and redraw it.
- if the parent shows its own tqdm bar, writes go through
  ``tqdm.external_write_mode`` so the bar is cleared and redrawn, not garbled.
- :func:`set_console_hook` lets any other progress library do the same.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable

from .._types import PerProcess
from .._workers._proc import HAVE_PROC
from ._stdio import ConsoleHook, console_stream, set_console_hook, write_text

__all__ = ["ConsoleHook", "ConsoleWriter", "console", "set_console_hook"]

#: called on the console thread for more text: ``(text, done)``
Producer = Callable[[], tuple[str, bool]]

MAX_PENDING = 8 * 1024 * 1024
# Tee'd lines are on the console before wait()/close() return - unless the
# console takes nothing for this long (stuck), which must not hang the
# supervisor. A console that is merely slow is waited for: no line is lost.
CONSOLE_FLUSH_TIMEOUT = 5.0
# The console thread joins small writes into writes of at most this size.
_PIECE = 1 << 20
STATUS_INTERVAL = 0.1
_CLEAR_LINE = "\r\x1b[K"
#: How much nicer than the supervisor the console thread runs (Linux: nice
#: is per thread). Copying a megabyte of lines to the console costs about a
#: millisecond of CPU; under contention that millisecond goes to the workers
#: first - a training step, a burst of output - and the console catches up
#: from the log files (lossless, bounded by MAX_PENDING) when a CPU is free.
#: Idle CPUs run it at once, so latency on an unloaded host is unchanged.
#: It buys the writers' own rate (benchmarks/README.md, "tee"); against a
#: nice-0 hog per CPU the console still gets ~10% of one.
CONSOLE_NICENESS = 10


class ConsoleWriter:
    """Orders and performs console writes on one daemon thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, str | Producer]] = deque()
        self._pending = 0
        self._busy = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        # (stream, key) -> latest status text; shown on TTYs only
        self._status: dict[tuple[str, object], str] = {}
        self._status_dirty = False
        self._status_shown: dict[str, bool] = {"stdout": False, "stderr": False}
        self._last_draw = 0.0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._room: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        #: characters written so far (progress of a slow console)
        self.written = 0

    # -- called on the event loop -----------------------------------------
    def write(self, stream: str, text: str) -> None:
        """Queue whole lines (or unprefixed passthrough text) for ``stream``.

        Never dropped: a writer keeps the backlog bounded itself
        (:meth:`room`, :meth:`when_room`).
        """
        with self._cond:
            self._queue.append((stream, text))
            self._pending += len(text)
            self._ensure_thread()
            self._cond.notify()

    def write_parts(self, stream: str, parts: tuple[str, ...]) -> None:
        """:meth:`write` of ``"".join(parts)`` without joining them here.

        The parts are queued together (nothing of another writer comes
        between them) and written in order; a big part goes out as one write
        of its own, so a megabyte of lines is never copied once more just to
        glue a line onto it.
        """
        with self._cond:
            self._queue.extend((stream, p) for p in parts if p)
            self._pending += sum(len(p) for p in parts)
            self._ensure_thread()
            self._cond.notify()

    def write_later(self, stream: str, produce: Producer) -> None:
        """Queue a producer of text for ``stream``: the console thread calls
        ``produce()`` for the next ``(text, done)`` and writes it, until done,
        before anything queued after it (a handed-over log file: memory stays
        bounded however long the console is stuck)."""
        with self._cond:
            self._queue.append((stream, produce))
            self._ensure_thread()
            self._cond.notify()

    @property
    def backlog(self) -> int:
        """Characters queued and not yet taken by the console thread."""
        return self._pending

    def room(self) -> bool:
        """Whether the backlog is within ``MAX_PENDING``: a lossless writer may queue more."""
        return self._pending <= MAX_PENDING

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once on this loop when the console thread takes its next batch."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._queue and not self._busy:
                loop.call_soon(callback)
                return
            self._room.append((loop, callback))

    async def settle(self, stall: float) -> bool:
        """Wait until everything queued so far is written, as long as the console
        keeps making progress: ``False`` if it wrote nothing for ``stall`` seconds."""
        from .._cancel import move_on_after

        while True:
            before = self.written
            async with move_on_after(stall):
                await self.flush()
                return True
            if self.written == before:
                return False

    def set_status(self, stream: str, key: object, text: str | None) -> None:
        """Show ``text`` as ``key``'s in-place status line (TTY only); ``None`` clears."""
        with self._cond:
            if text is None:
                if self._status.pop((stream, key), None) is None:
                    return
            else:
                self._status[(stream, key)] = text
            self._status_dirty = True
            self._ensure_thread()
            self._cond.notify()

    async def flush(self) -> None:
        """Wait until everything queued so far has been written."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if not self._queue and not self._busy:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
            self._cond.notify()
        await fut

    # -- the thread --------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid():
            if self._thread is None:
                atexit.register(self._at_exit)
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="aiolaunch-console", daemon=True)
            self._thread.start()

    def _at_exit(self) -> None:
        """Interpreter exit: wait until the console took everything queued.

        A stuck console (Ctrl-S, a stopped reader) delays the exit instead of
        losing the lines (torchrun's tee waits the same way); Ctrl-C gives up.
        """
        thread = self._thread
        if thread is None or self._pid != os.getpid() or not thread.is_alive():
            return
        try:
            with self._cond:
                while self._queue or self._busy:
                    self._cond.wait()
        except KeyboardInterrupt:
            pass

    def _run(self) -> None:
        _lower_priority(CONSOLE_NICENESS)
        while True:
            with self._cond:
                while (
                    not self._queue
                    and not self._waiters
                    and not self._room
                    and not self._status_dirty
                ):
                    self._cond.wait()
                batch = list(self._queue)
                self._queue.clear()
                self._pending = 0
                waiters, self._waiters = self._waiters, []
                room, self._room = self._room, []
                status_changed = self._status_dirty
                self._busy = bool(batch)
            for loop, callback in room:
                try:
                    loop.call_soon_threadsafe(callback)
                except RuntimeError:  # loop closed
                    pass
            self._emit(batch, status_changed)
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # _at_exit
            for loop, fut in waiters:
                try:
                    loop.call_soon_threadsafe(_resolve, fut)
                except RuntimeError:  # loop closed
                    pass
            if status_changed and not batch:
                # Bounded redraw rate for in-place progress.
                wait = STATUS_INTERVAL - (time.monotonic() - self._last_draw)
                if wait > 0:
                    time.sleep(wait)  # allowed: rate limit on the console thread

    def _emit(self, batch: list[tuple[str, str | Producer]], status_changed: bool) -> None:
        # Merge consecutive writes to the same stream into writes of up to
        # _PIECE characters: few syscalls for many small lines, no copy of a
        # big part (it goes out alone), and progress (`written`) a slow
        # console's flush can see. A producer is run to its end where it is.
        runs: list[tuple[str, list[str]]] = []
        size = 0
        for stream, item in batch:
            if callable(item):
                status_changed = self._write_runs(runs, status_changed)
                runs, size = [], 0
                self._produce(stream, item)
            elif runs and runs[-1][0] == stream and size + len(item) <= _PIECE:
                runs[-1][1].append(item)
                size += len(item)
            else:
                runs.append((stream, [item]))
                size = len(item)
        status_changed = self._write_runs(runs, status_changed)
        if status_changed:
            with self._cond:
                self._status_dirty = False
                status = dict(self._status)
            self._draw_status(status)

    def _write_runs(self, runs: list[tuple[str, list[str]]], status_changed: bool) -> bool:
        for stream, parts in runs:
            text = parts[0] if len(parts) == 1 else "".join(parts)
            status_changed = self._write_text(stream, text) or status_changed
        return status_changed

    def _write_text(self, stream: str, text: str) -> bool:
        """Write ``text``; ``True`` if it cleared an in-place status (redraw it)."""
        cleared = bool(self._status_shown.get(stream))
        if cleared:
            text = _CLEAR_LINE + text
            self._status_shown[stream] = False
        write_text(stream, text)
        self.written += len(text)
        return cleared

    def _produce(self, stream: str, produce: Producer) -> None:
        done = False
        while not done:
            try:
                text, done = produce()
            except Exception:  # pragma: no cover - a broken producer ends, the rest goes on
                return
            if text and self._write_text(stream, text):
                with self._cond:
                    self._status_dirty = True

    def _draw_status(self, status: dict[tuple[str, object], str]) -> None:
        self._last_draw = time.monotonic()
        for stream_name in ("stdout", "stderr"):
            texts = [t for (s, _), t in status.items() if s == stream_name]
            stream = console_stream(stream_name)
            try:
                tty = stream is not None and stream.isatty()
            except (AttributeError, ValueError):
                tty = False
            if not tty:
                continue
            if texts:
                width = shutil.get_terminal_size().columns - 1
                write_text(stream_name, _CLEAR_LINE + " | ".join(texts)[: max(width, 10)])
                self._status_shown[stream_name] = True
            elif self._status_shown.get(stream_name):
                write_text(stream_name, _CLEAR_LINE)
                self._status_shown[stream_name] = False


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_CONSOLE: PerProcess[ConsoleWriter] = PerProcess(ConsoleWriter)


def console() -> ConsoleWriter:
    """The process-wide console writer (one per process, created on first use)."""
    return _CONSOLE.get()


def _lower_priority(by: int) -> None:
    """Make the calling thread ``by`` nicer (Linux; elsewhere, or where it is
    refused, nothing changes). Relative: a supervisor started under ``nice``
    keeps its console thread below itself, never above."""
    getpriority = getattr(os, "getpriority", None)
    if getpriority is None or not HAVE_PROC:
        return  # not Linux: a thread id is no process id for setpriority()
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # refused (a sandbox's seccomp filter): as it was
        os.setpriority(os.PRIO_PROCESS, tid, min(19, getpriority(os.PRIO_PROCESS, tid) + by))
