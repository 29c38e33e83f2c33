"""The log pipeline (private): worker streams to log files and the console.

One concept per module:

- ``_specs``: ``LogsSpecs`` / ``LogsDest``, where each stream goes;
- ``_plan``: each stream's :class:`StreamPlan` - its :class:`Route` (the
  worker writes the file and a ``_follow`` follower reads it, or a pipe and a
  ``_pump`` pump) and its sinks;
- the sinks (:class:`Sink`, with backpressure): ``_file`` (exact bytes to a
  log file, pipe route), ``_console_sink`` (prefixed lines, tee; through the
  ``_dedup`` when enabled, to the console writer thread of ``_console``),
  ``_passthrough`` (unchanged text to a console that is not fd 1/2), ``_line``
  (lines for the ``_tap``);
- ``_tap``: :class:`LineTap`, the group's lines for its listeners (readiness
  probes, ``LogLine`` events, the progress regex, the ``_filters``);
- ``_wiring``: :class:`LogWiring`, the streams of one group and the shutdown
  order.

Every line-based sink frames through the one ``LineFramer`` (``_framer``).
"""

from __future__ import annotations

from ._console import console, set_console_hook
from ._console_sink import ConsoleSink
from ._dedup import ConsoleDedup
from ._file import FileSink
from ._line import LineSink
from ._passthrough import PassthroughSink
from ._plan import Route, StreamPlan, console_is_fd
from ._pump import StreamPump
from ._sink import Sink
from ._tap import LineListener, LineTap
from ._wiring import LogWiring, RankStreams

__all__ = [
    "ConsoleDedup",
    "ConsoleSink",
    "FileSink",
    "LineListener",
    "LineSink",
    "LineTap",
    "LogWiring",
    "PassthroughSink",
    "RankStreams",
    "Route",
    "Sink",
    "StreamPlan",
    "StreamPump",
    "console",
    "console_is_fd",
    "set_console_hook",
]
