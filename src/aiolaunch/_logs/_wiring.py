"""Stream wiring of one group: which fd each worker gets, who reads it, and the
flush order at shutdown.

The process context asks for a rank's streams before it spawns the worker
(:meth:`LogWiring.open`), hands the returned fds to the spawn, then either
:meth:`LogWiring.connect` (spawned: start reading) or :meth:`LogWiring.discard`
(the spawn failed: close everything). A restart finishes the old incarnation
with :meth:`LogWiring.drain_rank` before the new one is opened, so a rank's
bytes stay in order. :meth:`LogWiring.aclose`, once every worker is gone, is
the one place that owns the shutdown order: drain every stream -> flush the
console dedup -> flush the console.

Which path a stream takes (see docs/ARCHITECTURE.md):

- redirected to a file, on Linux: **direct** - the worker's fd is the log
  file itself (torch's way: no copy through the supervisor, the page cache is
  the limit, bytes written before a SIGKILL are kept). A
  :class:`~._follow.FileFollower` reads appended bytes, woken by inotify, only
  for the tee console (lossless, catching up from the file), a readiness
  probe or ``LogLine`` consumers; the output age is the file's mtime.
- redirected, where inotify is unavailable: a pipe read by a
  :class:`StreamPump` into a :class:`FileSink` (and the console sink).
- the console, when ``sys.stdout`` is fd 1: inherited (zero copies); else (a
  Jupyter kernel) or when a probe must see it: a pipe into a
  :class:`PassthroughSink`.
- ``os.devnull``: ``/dev/null``, unless a probe must see it (a pipe).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._logs_specs import prune_empty_dirs
from ._console import console
from ._console_sink import ConsoleSink
from ._dedup import ConsoleDedup
from ._file import FileSink, open_log_file
from ._filters import open_duplicate_filters
from ._follow import FileFollower
from ._inotify import Inotify
from ._passthrough import PassthroughSink
from ._pump import StreamPump

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TextIO

    from .._logs_specs import LogsDest
    from ._line import LineSink
    from ._sink import Sink

__all__ = ["LogWiring", "RankStreams", "console_is_fd", "plan_stream"]

# After a worker is gone, how long its pipes may take to reach EOF before we
# read what the kernel buffers and close our end (a surviving descendant in
# another session may hold them).
DRAIN_TIMEOUT = 0.25
# Tee'd lines are on the console before wait()/close() return - unless the
# console takes nothing for this long (stuck), which must not hang the
# supervisor. A console that is merely slow is waited for: no line is lost.
CONSOLE_FLUSH_TIMEOUT = 5.0


INHERIT = "inherit"
DEVNULL = "devnull"
PIPE = "pipe"


def console_is_fd(stream: str) -> bool:
    """Whether ``sys.stdout``/``sys.stderr`` writes to the process's own fd 1/2.

    Then an un-redirected worker can simply inherit the fd (zero copies). In a
    Jupyter kernel it does not, and the worker's output must be carried to the
    Python-level stream to show in the cell.
    """
    obj = sys.stdout if stream == "stdout" else sys.stderr
    want = 1 if stream == "stdout" else 2
    try:
        return obj is not None and obj.fileno() == want
    except (AttributeError, OSError, ValueError):
        return False


def plan_stream(
    path: str,
    tee: bool,
    stream: str,
    prefix: str,
    need_pipe: bool = False,
    dedup: ConsoleDedup | None = None,
    rank: int = 0,
    strip_ansi: bool = False,
) -> tuple[str, list[Sink]]:
    """Decide how one worker stream is wired.

    :param path: the destination from ``LogsDest``: ``""`` for the console,
        ``os.devnull`` to discard, else a log file path.
    :param tee: also show the stream, prefixed, on the console.
    :param dedup: merge identical console lines of several ranks.
    :param need_pipe: the supervisor must see the bytes (a readiness probe
        reads this stream): never inherit.
    :returns: ``(INHERIT | DEVNULL | PIPE, sinks)``; sinks are only built for
        ``PIPE`` (log files are created here, before any process starts).
    """
    if path == "":
        if console_is_fd(stream) and not need_pipe:
            return INHERIT, []
        return PIPE, [PassthroughSink(stream)]
    if path == os.devnull:
        return (PIPE, []) if need_pipe else (DEVNULL, [])
    sinks: list[Sink] = [FileSink(path)]
    if tee:
        sinks.append(ConsoleSink(stream, prefix, dedup, rank, strip_ansi))
    return PIPE, sinks


@dataclass
class RankStreams:
    """One incarnation's streams between :meth:`LogWiring.open` and ``connect``.

    ``stdout``/``stderr`` are what the spawn gets: an fd, or ``None`` to
    inherit the supervisor's.
    """

    rank: int
    stdout: int | None = None
    stderr: int | None = None
    #: the child's ends: closed by us once the child has its copies
    child_ends: list[int] = field(default_factory=list)
    #: (read end, sinks) for every stream the supervisor reads
    readers: list[tuple[int, list[Sink]]] = field(default_factory=list)
    #: every sink built (closed by discard)
    sinks: list[Sink] = field(default_factory=list)
    #: log files the worker writes itself, followed by the supervisor
    followers: list[FileFollower] = field(default_factory=list)


class LogWiring:
    """Owns every worker stream of one group: pipes, pumps, sinks, flush order.

    :param prefixes: per-rank console prefixes (default ``[{name}{rank}]:``);
        a rank with a custom prefix is never merged by the dedup.
    :param dedup_window: ``console_dedup`` seconds, or ``None`` (off).
    :param stdout_filters: torch's duplicate filters (and ``stderr_filters``):
        tee'd lines matching one are copied into ``dest.filtered_stdout``
        (``filtered_stderr``), opened here (:meth:`filtered_file`), closed by
        :meth:`aclose`. An empty list or ``None`` opens no file.
    """

    def __init__(
        self,
        *,
        name: str,
        dest: LogsDest,
        prefixes: dict[int, str] | None = None,
        dedup_window: float | None = None,
        strip_ansi: bool = False,
        stdout_filters: Sequence[str] | None = None,
        stderr_filters: Sequence[str] | None = None,
    ) -> None:
        self._name = name
        self._filters = open_duplicate_filters(dest, stdout_filters, stderr_filters)
        self._dest = dest
        self._prefixes = prefixes or {}
        self._strip_ansi = strip_ansi
        self._dedup_window = dedup_window
        self._dedup: ConsoleDedup | None = None
        self._pumps: list[StreamPump] = []
        self._followers: list[FileFollower] = []
        #: None: not decided yet (needs the loop); False: unavailable (pipes)
        self._inotify: Inotify | bool | None = None
        self._used = False
        self._closed = False
        self._last_output: dict[int, float] = {}

    @property
    def dest(self) -> LogsDest:
        """Where each rank's streams and error file go."""
        return self._dest

    def filtered_file(self, stream: str) -> TextIO | None:
        """The open duplicate-filter file of ``stream``, or ``None`` (no filter)."""
        dup = self._filters.get(stream)
        return None if dup is None else dup.file

    async def prune_temp_dirs(self) -> None:
        """Remove the empty folders of the temp log folders made for this run
        only (``log_dir=None``; torch's ``LogsDest`` has none).

        Call it after the error files are written: a folder that holds one is
        kept. On the loop (one rmdir per rank folder, ~10 us each): a thread
        would wait for the GIL before each one while the loop is busy.
        """
        temp_dirs = list(getattr(self._dest, "temp_dirs", None) or ())
        if temp_dirs:
            prune_empty_dirs(temp_dirs, self._name)

    def prefix(self, rank: int) -> str:
        """The console prefix of ``rank``'s tee'd lines."""
        return self._prefixes.get(rank, f"[{self._name}{rank}]:")

    async def open(
        self,
        rank: int,
        *,
        watch: Callable[[str], bool],
        line_sink: Callable[[str], LineSink],
    ) -> RankStreams:
        """Create ``rank``'s log files and pipes, before its worker is spawned.

        :param watch: ``watch(stream)``: the supervisor must see this stream's
            lines (a readiness probe reads it), so it is never inherited.
        :param line_sink: ``line_sink(stream)``: the sink that turns a read
            stream into lines for probes and ``LogLine`` events.
        """
        rank_dirs = getattr(self._dest, "rank_dirs", None)
        if rank_dirs is not None:
            rank_dirs.wait(rank)  # made in the background while earlier ranks spawned
        streams = RankStreams(rank)
        # The inotify instance (an fd and a loop reader) only where a stream
        # goes to a file, or the dedup asks: a group whose output goes to the
        # console pays nothing for it.
        files = (self._dest.stdouts[rank], self._dest.stderrs[rank])
        direct = any(p not in ("", os.devnull) for p in files)
        if self._dedup_window and self._dedup is None:
            direct = True  # its losslessness depends on inotify being there
        inotify = self._direct() if direct else None
        if self._dedup_window and self._dedup is None:
            self._dedup = ConsoleDedup(self._name, self._dedup_window, lossless=bool(inotify))
        try:
            for stream, path, tees in (
                ("stdout", self._dest.stdouts[rank], self._dest.tee_stdouts),
                ("stderr", self._dest.stderrs[rank], self._dest.tee_stderrs),
            ):
                dedup = self._dedup if rank not in self._prefixes else None
                child: int | None = None
                if inotify is not None and path not in ("", os.devnull):
                    child = self._open_direct(
                        streams, inotify, rank, stream, path, rank in tees, dedup, line_sink
                    )
                    if stream == "stdout":
                        streams.stdout = child
                    else:
                        streams.stderr = child
                    continue
                mode, sinks = plan_stream(
                    path,
                    rank in tees,
                    stream,
                    self.prefix(rank),
                    watch(stream),
                    dedup,
                    rank,
                    self._strip_ansi,
                )
                streams.sinks += sinks
                if mode == INHERIT:
                    pass
                elif mode == DEVNULL:
                    child = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                    streams.child_ends.append(child)
                else:
                    line = line_sink(stream)
                    sinks.append(line)
                    streams.sinks.append(line)
                    if stream in self._filters and rank in tees:
                        dup = self._filters[stream].sink(self.prefix(rank))
                        sinks.append(dup)
                        streams.sinks.append(dup)
                    r, child = os.pipe()
                    streams.readers.append((r, sinks))
                    streams.child_ends.append(child)
                    _widen_pipe(child)
                if stream == "stdout":
                    streams.stdout = child
                else:
                    streams.stderr = child
        except BaseException:
            await self.discard(streams)
            raise
        return streams

    def _direct(self) -> Inotify | None:
        if self._inotify is None:
            self._inotify = Inotify.create() or False
        return self._inotify if isinstance(self._inotify, Inotify) else None

    def _open_direct(
        self,
        streams: RankStreams,
        inotify: Inotify,
        rank: int,
        stream: str,
        path: str,
        tee: bool,
        dedup: ConsoleDedup | None,
        line_sink: Callable[[str], LineSink],
    ) -> int:
        fd = open_log_file(path)
        streams.child_ends.append(fd)
        sinks: list[Sink] = []
        if tee:
            sinks.append(
                ConsoleSink(stream, self.prefix(rank), dedup, rank, self._strip_ansi, lossless=True)
            )
        sinks.append(line_sink(stream))
        if stream in self._filters and tee:
            sinks.append(self._filters[stream].sink(self.prefix(rank)))
        streams.sinks += sinks
        streams.followers.append(FileFollower(fd, sinks, rank, inotify, tee=tee))
        return fd

    async def discard(self, streams: RankStreams) -> None:
        """The spawn failed: close ``streams``' fds and sinks."""
        _close_all(streams)
        for follower in streams.followers:
            follower.discard()
        streams.followers.clear()
        for sink in streams.sinks:
            await sink.aclose()

    async def connect(self, streams: RankStreams) -> None:
        """The worker is spawned: close the child's ends and start reading."""
        for fd in streams.child_ends:
            _close_quietly(fd)  # the child has its copy
        streams.child_ends.clear()
        self._followers += streams.followers
        if streams.followers:
            self._used = True
        streams.followers = []
        readers, streams.readers = streams.readers, []
        for i, (r_end, sinks) in enumerate(readers):
            try:
                # Await first: `self._pumps.append(await ...)` would bind the
                # list before the await, and a drain may replace it meanwhile.
                pump = await StreamPump.open(r_end, sinks, streams.rank, self._seen)
            except BaseException:
                for rest, rest_sinks in readers[i + 1 :]:
                    _close_quietly(rest)
                    for sink in rest_sinks:
                        await sink.aclose()
                raise
            self._pumps.append(pump)
            self._used = True

    def _seen(self, rank: int) -> None:
        self._last_output[rank] = time.monotonic()

    def last_output(self, rank: int) -> float | None:
        """Seconds since ``rank`` last wrote to a redirected or read stream.

        Pipes: when the supervisor last read from it; direct log files: the
        file's mtime (kept by the kernel, nothing polled). ``None`` if it wrote
        nothing so far, or its streams are neither redirected nor read
        (inherited, discarded).
        """
        ages = [f.age() for f in self._followers if f.rank == rank]
        seen = self._last_output.get(rank)
        if seen is not None:
            ages.append(time.monotonic() - seen)
        known = [a for a in ages if a is not None]
        return min(known) if known else None

    async def drain_rank(self, rank: int) -> None:
        """Finish ``rank``'s current streams (its worker exited; before a restart).

        Shielded by the caller: a cancelled drain would lose bytes and fds.
        """
        old = [p for p in self._pumps if p.rank == rank]
        self._pumps[:] = [p for p in self._pumps if p.rank != rank]
        followed = [f for f in self._followers if f.rank == rank]
        self._followers[:] = [f for f in self._followers if f.rank != rank]
        await asyncio.gather(
            *(p.drain(DRAIN_TIMEOUT) for p in old),
            *(f.drain(CONSOLE_FLUSH_TIMEOUT) for f in followed),
        )

    async def aclose(self) -> None:
        """Every worker is gone: drain every stream, flush the dedup, flush the console.

        In that order, so a line is on the console before ``wait()``/``close()``
        return; the console flush is bounded (a stuck console must not hang
        the supervisor). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        rank_dirs = getattr(self._dest, "rank_dirs", None)
        if rank_dirs is not None:
            rank_dirs.close()  # a failed start: no folder appears after this
        pumps, self._pumps = self._pumps, []
        followers, self._followers = self._followers, []
        try:
            await asyncio.gather(
                *(p.drain(DRAIN_TIMEOUT) for p in pumps),
                *(f.drain(CONSOLE_FLUSH_TIMEOUT) for f in followers),
            )
        finally:
            if isinstance(self._inotify, Inotify):
                self._inotify.close()
        for dup in self._filters.values():
            dup.close()  # every line fed: the drains above closed their sinks
        if not self._used:
            return
        if self._dedup is not None:
            self._dedup.flush()
        await console().settle(CONSOLE_FLUSH_TIMEOUT)


def _widen_pipe(fd: int) -> None:
    # 1 MiB instead of 64 KiB: bursts don't block the worker, and each wakeup
    # of the reader moves more bytes (Linux; elsewhere a no-op).
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ImportError):
        pass


def _close_all(streams: RankStreams) -> None:
    for fd in streams.child_ends:
        _close_quietly(fd)
    streams.child_ends.clear()
    for r_end, _ in streams.readers:
        _close_quietly(r_end)
    streams.readers.clear()


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
