"""The log pipeline (private): worker streams to log files and the console.

Data flow: worker fd 1/2 -> pipe -> :class:`StreamPump` (asyncio read-pipe
transport) -> sinks, one module per concept:

- ``_file``: :class:`FileSink`, exact bytes to the log file (off-loop writes);
- ``_console_sink``: :class:`ConsoleSink`, prefixed whole lines (tee), through
  ``_dedup`` (:class:`ConsoleDedup`) when enabled, to the console writer
  thread (``_console``);
- ``_passthrough``: :class:`PassthroughSink`, unchanged text to a console that
  is not fd 1/2 (Jupyter);
- ``_line``: :class:`LineSink`, lines for readiness probes and ``LogLine``.

Every line-based sink frames through the one :class:`LineFramer`
(``_framer``). ``_wiring`` (:class:`LogWiring`) decides each stream's path and
owns the shutdown order.
"""

from __future__ import annotations

from ._console import console, set_console_hook
from ._console_sink import ConsoleSink
from ._dedup import ConsoleDedup
from ._file import FileSink
from ._line import LineSink
from ._passthrough import PassthroughSink
from ._pump import StreamPump
from ._sink import Sink
from ._wiring import LogWiring, RankStreams, console_is_fd, plan_stream

__all__ = [
    "ConsoleDedup",
    "ConsoleSink",
    "FileSink",
    "LineSink",
    "LogWiring",
    "PassthroughSink",
    "RankStreams",
    "Sink",
    "StreamPump",
    "console",
    "console_is_fd",
    "plan_stream",
    "set_console_hook",
]
