"""The plan of one worker stream: its route, and the sinks fed from it.

One plan for every route (see docs/ARCHITECTURE.md, *Bytes*):

- :attr:`Route.FILE` - redirected to a file, on Linux: the worker's fd is
  the log file itself (torch's way: no copy through the supervisor; bytes
  written before a SIGKILL are kept). A :class:`~._follow.FileFollower`
  feeds the sinks from the file, only while one wants bytes.
- :attr:`Route.PIPE` - a pipe read by a :class:`~._pump.StreamPump`: a file
  where inotify is unavailable (a :class:`~._file.FileSink` writes it), the
  console where ``sys.stdout`` is not fd 1 (Jupyter), or a stream a line
  listener must see that would otherwise be inherited or discarded.
- :attr:`Route.INHERIT` - the supervisor's own fd 1/2 (zero copies).
- :attr:`Route.DEVNULL` - ``/dev/null``.

The route only picks the reader (follower or pump); the sinks are the same
for both: the console's (tee), the line tap's, and for a piped file the
file's. :meth:`StreamPlanner.plan` is the one place where sinks are chosen.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._console_sink import ConsoleSink
from ._dedup import ConsoleDedup
from ._file import FileSink
from ._passthrough import PassthroughSink

if TYPE_CHECKING:
    from contextlib import AsyncExitStack

    from ._sink import Sink
    from ._tap import LineTap

__all__ = [
    "Route",
    "StreamPlan",
    "StreamPlanner",
    "StreamTarget",
    "console_is_fd",
    "inherits_console",
    "plan_route",
]


class Route(enum.Enum):
    """How a worker stream leaves the worker."""

    #: the worker writes its log file; a FileFollower reads it for the sinks
    FILE = "file"
    #: a pipe; a StreamPump feeds the sinks
    PIPE = "pipe"
    #: the supervisor's own fd 1/2
    INHERIT = "inherit"
    #: /dev/null
    DEVNULL = "devnull"


@dataclass(frozen=True)
class StreamTarget:
    """Where one worker stream goes, from the group's ``LogsDest``.

    :param path: ``""`` for the console, ``os.devnull`` to discard, else a
        log file.
    :param tee: also show it, prefixed, on the console.
    :param lines: a line listener must see it (never inherit or discard it).
    """

    rank: int
    stream: str
    path: str
    tee: bool = False
    lines: bool = False


@dataclass(frozen=True)
class StreamPlan:
    """A stream's route and the sinks its reader feeds (none for INHERIT/DEVNULL)."""

    route: Route
    sinks: tuple[Sink, ...] = ()


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


def inherits_console(path: str, stream: str, lines: bool) -> bool:
    """Whether a stream goes by :attr:`Route.INHERIT`: to the console (``path``
    ``""``), which is our own fd, with no line listener (``lines``) to feed."""
    return path == "" and not lines and console_is_fd(stream)


def plan_route(target: StreamTarget, *, direct: bool) -> Route:
    """The route of ``target``; ``direct``: the FILE route is available (inotify)."""
    if target.path == "":
        return Route.INHERIT if inherits_console("", target.stream, target.lines) else Route.PIPE
    if target.path == os.devnull:
        return Route.PIPE if target.lines else Route.DEVNULL
    return Route.FILE if direct else Route.PIPE


class StreamPlanner:
    """Plans the streams of one group: routes, and every sink, in one place.

    :param prefix: the console prefix of a rank.
    :param custom_prefix: ranks with a prefix of their own (never merged by
        the dedup).
    :param dedup_window: ``console_dedup`` seconds, or ``None`` (off).
    """

    def __init__(
        self,
        *,
        name: str,
        tap: LineTap,
        prefix: dict[int, str],
        dedup_window: float | None,
        strip_ansi: bool,
    ) -> None:
        self._name = name
        self._tap = tap
        self._prefixes = prefix
        self._dedup_window = dedup_window
        self._strip_ansi = strip_ansi
        self._dedup: ConsoleDedup | None = None

    @property
    def dedup(self) -> ConsoleDedup | None:
        """The console dedup, once a plan made it (flushed at the end)."""
        return self._dedup

    def prefix(self, rank: int) -> str:
        """The console prefix of ``rank``'s tee'd lines."""
        return self._prefixes.get(rank, f"[{self._name}{rank}]:")

    def target(self, rank: int, stream: str, path: str, tee: bool) -> StreamTarget:
        """``rank``'s ``stream`` with what the line listeners need of it."""
        return StreamTarget(rank, stream, path, tee, self._tap.reads(rank, stream))

    def plan(self, target: StreamTarget, *, direct: bool, stack: AsyncExitStack) -> StreamPlan:
        """The plan of ``target``: its route and its sinks, each made here.

        Every sink made is closed by ``stack`` (until the reader owns it: the
        caller pops the stack then). Log files are created here, before the
        worker is spawned.
        """
        route = plan_route(target, direct=direct)
        if route in (Route.INHERIT, Route.DEVNULL):
            return StreamPlan(route)
        sinks: list[Sink] = []

        def add(sink: Sink) -> None:
            stack.push_async_callback(sink.aclose)
            sinks.append(sink)

        if route is Route.PIPE and target.path == "":
            add(PassthroughSink(target.stream))
        elif route is Route.PIPE and target.path != os.devnull:
            add(FileSink(target.path))
        if target.tee:
            rank = target.rank
            dedup = self._console_dedup() if rank not in self._prefixes else None
            add(ConsoleSink(target.stream, self.prefix(rank), dedup, rank, self._strip_ansi))
        add(self._tap.sink(target.rank, target.stream))
        return StreamPlan(route, tuple(sinks))

    def _console_dedup(self) -> ConsoleDedup | None:
        if self._dedup_window and self._dedup is None:
            self._dedup = ConsoleDedup(self._name, self._dedup_window)
        return self._dedup
