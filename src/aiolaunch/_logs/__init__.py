"""The log pipeline (private): pipe readers feeding file and console sinks.

Data flow: worker fd 1/2 -> pipe -> :class:`StreamPump` (asyncio read-pipe
transport) -> ``FileSink`` (exact bytes, off-loop writes) and/or
``ConsoleSink`` (prefixed whole lines) / ``PassthroughSink`` (unchanged text).
"""

from __future__ import annotations

import os
import sys

from ._console import console, set_console_hook
from ._pump import StreamPump
from ._sinks import ConsoleDedup, ConsoleSink, FileSink, LineSink, PassthroughSink, Sink

__all__ = [
    "ConsoleDedup",
    "ConsoleSink",
    "FileSink",
    "LineSink",
    "PassthroughSink",
    "Sink",
    "StreamPump",
    "console",
    "console_is_fd",
    "plan_stream",
    "set_console_hook",
]

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
