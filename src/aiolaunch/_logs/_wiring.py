"""Stream wiring of one group: which fd each worker gets, who reads it, and the
flush order at shutdown.

The process context spawns each worker inside :meth:`LogWiring.open`::

    async with logs.open(rank) as fds:
        handle = await spawn(rank, fds.stdout, fds.stderr)

Before the block the rank's log files, pipes and sinks are made (a
:class:`~._plan.StreamPlan` per stream); as the block ends the readers start
and our copies of the child's ends are closed - or, if the block raised,
everything made is closed (trio's ``always_cleanup`` / ``cleanup_on_fail``
exit stacks). A restart finishes the old incarnation with
:meth:`LogWiring.drain_rank` before the new one is opened, so a rank's bytes
stay in order. :meth:`LogWiring.aclose`, once every worker is gone, is the
one place that owns the shutdown order: drain every stream -> flush the
console dedup -> flush the console.

Lines go to the group's :class:`~._tap.LineTap` (:attr:`LogWiring.lines`):
readiness probes, ``LogLine`` events, the progress regex and the duplicate
filters subscribe there.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._console import CONSOLE_FLUSH_TIMEOUT, console
from ._file import open_log_file
from ._filters import DuplicateFilters
from ._follow import FileFollower
from ._inotify import Watches
from ._plan import Route, StreamPlanner, inherits_console
from ._pump import StreamPump
from ._specs import prune_empty_dirs
from ._tap import LineTap

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from typing import Protocol, TextIO

    from ._plan import StreamPlan, StreamTarget
    from ._specs import LogsDest

__all__ = ["LogWiring", "RankStreams"]

if TYPE_CHECKING:

    class _Reader(Protocol):
        """A stream's reader: a StreamPump (PIPE) or a FileFollower (FILE)."""

        rank: int

        def start(self) -> None: ...
        def age(self) -> float | None: ...
        async def drain(self) -> None: ...
        async def abandon(self) -> None: ...


@dataclass(frozen=True)
class RankStreams:
    """What one worker's spawn gets: an fd per stream, or ``None`` to inherit."""

    stdout: int | None
    stderr: int | None


#: :meth:`LogWiring.open` of a rank that inherits both streams (reusable: it holds nothing)
_INHERITED: AbstractAsyncContextManager[RankStreams] = nullcontext(RankStreams(None, None))


class LogWiring:
    """Owns every worker stream of one group: pipes, followers, sinks, flush order.

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
        self._dest = dest
        #: the group's lines: subscribe a LineListener
        self.lines = LineTap()
        self._planner = StreamPlanner(
            name=name,
            tap=self.lines,
            prefix=prefixes or {},
            dedup_window=dedup_window,
            strip_ansi=strip_ansi,
        )
        self._filters = DuplicateFilters(dest, stdout_filters, stderr_filters, self.prefix)
        self.lines.subscribe(self._filters)
        self._readers: list[_Reader] = []
        # by rank too: status() asks each rank's output age (64 ranks x 128
        # streams made it 1.7 ms a call when it scanned the list per rank)
        self._by_rank: dict[int, list[_Reader]] = {}
        #: the group's inotify watches (the instance is made at the first watch)
        self._watches = Watches()
        self._used = False
        self._closed = False

    @property
    def dest(self) -> LogsDest:
        """Where each rank's streams and error file go."""
        return self._dest

    def filtered_file(self, stream: str) -> TextIO | None:
        """The open duplicate-filter file of ``stream``, or ``None`` (no filter)."""
        return self._filters.file(stream)

    def prefix(self, rank: int) -> str:
        """The console prefix of ``rank``'s tee'd lines."""
        return self._planner.prefix(rank)

    async def prune_temp_dirs(self) -> None:
        """Remove the empty folders of the temp log folders made for this run
        only (``log_dir=None``; torch's ``LogsDest`` has none).

        Call it after the error files are written: a folder that holds one is
        kept. On the loop (one rmdir per rank folder, ~10 us each): a thread
        would wait for the GIL before each one while the loop is busy.
        """
        temp_dirs = list(self._dest.temp_dirs)
        if temp_dirs:
            prune_empty_dirs(temp_dirs, self._name)

    # -- start ----------------------------------------------------------------
    def inherits(self, rank: int) -> bool:
        """Whether ``rank``'s worker writes the console itself, both streams
        (torchrun's default): no log file, pipe, sink or reader to make, close
        or start (:meth:`open` then skips the async generator and the two
        stream plans: ~20 us a rank on the spawn path)."""
        dest = self._dest
        return inherits_console(
            dest.stdouts[rank], "stdout", self.lines.reads(rank, "stdout")
        ) and inherits_console(dest.stderrs[rank], "stderr", self.lines.reads(rank, "stderr"))

    def open(self, rank: int) -> AbstractAsyncContextManager[RankStreams]:
        """Wire ``rank``'s streams around its spawn (see the module docstring).

        Before the block: its rank folder exists, its log files, pipes and
        sinks are made. After the block: the child's ends are closed (it has
        its copies) and the readers start; if the block raised, everything
        made here is closed instead. A rank that :meth:`inherits` gets a
        block that does nothing.
        """
        return _INHERITED if self.inherits(rank) else self._wire_rank(rank)

    @asynccontextmanager
    async def _wire_rank(self, rank: int) -> AsyncIterator[RankStreams]:
        dest = self._dest
        paths = {"stdout": dest.stdouts[rank], "stderr": dest.stderrs[rank]}
        tees = {"stdout": dest.tee_stdouts, "stderr": dest.tee_stderrs}
        targets = [
            self._planner.target(rank, stream, path, rank in tees[stream])
            for stream, path in paths.items()
        ]
        readers: list[_Reader] = []
        async with AsyncExitStack() as always_cleanup, AsyncExitStack() as cleanup_on_fail:
            fds: list[int | None] = []
            for target in targets:
                direct = self._direct(target)
                async with AsyncExitStack() as sinks_owned:
                    plan = self._planner.plan(target, direct=direct, stack=sinks_owned)
                    fd, reader = await self._wire(plan, target, always_cleanup)
                    sinks_owned.pop_all()  # the reader owns them now
                if reader is not None:
                    cleanup_on_fail.push_async_callback(reader.abandon)
                    readers.append(reader)
                fds.append(fd)
            yield RankStreams(fds[0], fds[1])
            # Spawned: the child has its copies (always_cleanup closes ours).
            cleanup_on_fail.pop_all()
        self._readers += readers
        for reader in readers:
            self._by_rank.setdefault(reader.rank, []).append(reader)
        self._used = self._used or bool(readers)
        for reader in readers:
            reader.start()

    async def _wire(
        self,
        plan: StreamPlan,
        target: StreamTarget,
        always_cleanup: AsyncExitStack,
    ) -> tuple[int | None, _Reader | None]:
        """The child's fd for ``plan``'s route, and the reader that feeds its sinks."""
        route = plan.route
        if route is Route.INHERIT:
            return None, None
        if route is Route.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            always_cleanup.callback(os.close, fd)
            return fd, None
        if route is Route.FILE:
            fd = open_log_file(target.path)
            always_cleanup.callback(os.close, fd)
            return fd, FileFollower(fd, plan.sinks, target.rank, self._watches, self.lines)
        r_end, fd = os.pipe()
        always_cleanup.callback(os.close, fd)
        _widen_pipe(fd)
        return fd, await StreamPump.open(r_end, plan.sinks, target.rank)

    def _direct(self, target: StreamTarget) -> bool:
        """Whether a file of ``target`` may take the FILE route (inotify).

        A stream followed from the start (tee, a line listener that reads
        it) makes the group's inotify instance now, to know; for the others
        it is made only when something wants their bytes later (an
        ``events(lines=True)`` consumer): a redirect-only group has none.
        """
        if target.path in ("", os.devnull):
            return False
        if target.tee or target.lines:
            return self._watches.ensure()
        return self._watches.available()

    # -- output age -------------------------------------------------------------
    def last_output(self, rank: int) -> float | None:
        """Seconds since ``rank`` last wrote to a redirected or read stream.

        Pipes: when the supervisor last read from it; log files: the file's
        mtime (kept by the kernel, read on demand). ``None`` if it wrote
        nothing so far, or its streams are neither redirected nor read
        (inherited, discarded).
        """
        ages = [r.age() for r in self._by_rank.get(rank, ())]
        known = [a for a in ages if a is not None]
        return min(known) if known else None

    def unread(self, rank: int) -> bool:
        """Whether some of ``rank``'s output has no reader here (a stream
        inherited or discarded): :meth:`last_output` cannot see it."""
        return len(self._by_rank.get(rank, ())) < 2

    # -- finish -----------------------------------------------------------------
    async def drain_rank(self, rank: int) -> None:
        """Finish ``rank``'s current streams (its worker exited; before a restart).

        Shielded by the caller: a cancelled drain would lose bytes and fds.
        """
        old = self._by_rank.pop(rank, [])
        self._readers[:] = [r for r in self._readers if r.rank != rank]
        await asyncio.gather(*(r.drain() for r in old))

    async def aclose(self) -> None:
        """Every worker is gone: drain every stream, flush the dedup, flush the console.

        In that order, so a line is on the console before ``wait()``/``close()``
        return; the console flush is bounded (a stuck console must not hang
        the supervisor). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        readers, self._readers = self._readers, []
        self._by_rank.clear()
        try:
            await asyncio.gather(*(r.drain() for r in readers))
        finally:
            self._watches.close()
        self._filters.close()  # every line fed: the drains above closed their sinks
        if not self._used:
            return
        dedup = self._planner.dedup
        if dedup is not None:
            dedup.flush()
        await console().settle(CONSOLE_FLUSH_TIMEOUT)


def _widen_pipe(fd: int) -> None:
    # 1 MiB instead of 64 KiB: bursts don't block the worker, and each wakeup
    # of the reader moves more bytes (Linux; elsewhere a no-op).
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (OSError, ImportError):
        pass
