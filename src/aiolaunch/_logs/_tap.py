"""The line tap: one group's worker lines, for whoever listens.

Every stream the supervisor reads (a followed log file, a pipe) has one
:class:`~._line.LineSink` from :meth:`LineTap.sink`, framed by the one
:class:`~._framer.LineFramer`; its lines go to the tap's listeners: readiness
probes (``ReadyLine``), ``LogLine`` events, the watchdog's progress regex,
the duplicate filters. A new line consumer is one :meth:`LineTap.subscribe`.

A stream is framed only while some listener :meth:`~LineListener.wants` its
lines: nobody listening costs nothing (a followed file is not even read).
A listener whose wants may have *risen* (a probe starts waiting, an
``events(lines=True)`` consumer arrives) calls the notifier that
:meth:`LineTap.subscribe` returned, so followers start reading again.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Protocol

from ._line import LineSink

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["LineListener", "LineTap"]


class LineListener(Protocol):
    """A consumer of worker lines (rank, ``"stdout"``/``"stderr"``, text)."""

    def reads(self, rank: int, stream: str) -> bool:
        """Whether this stream must reach the supervisor at all: then it is
        never inherited or sent to ``/dev/null`` but piped or followed (a
        probe reads it; the progress regex reads every stream)."""
        ...

    def wants(self, rank: int, stream: str) -> bool:
        """Whether this listener needs the stream's lines *now*."""
        ...

    def line(self, rank: int, stream: str, text: str) -> None:
        """One line (without its newline), called only while :meth:`wants` is true."""
        ...


class LineTap:
    """The listeners of one group's lines, and the followers to wake when
    their demand rises."""

    def __init__(self) -> None:
        self._listeners: list[LineListener] = []
        self._demand: list[Callable[[], None]] = []

    def subscribe(self, listener: LineListener) -> Callable[[], None]:
        """Add ``listener``; returns the notifier to call when its wants rose."""
        self._listeners.append(listener)
        self.demand_changed()
        return self.demand_changed

    def reads(self, rank: int, stream: str) -> bool:
        """Whether any listener needs ``rank``'s ``stream`` to reach the supervisor."""
        return any(listener.reads(rank, stream) for listener in self._listeners)

    def wants(self, rank: int, stream: str) -> bool:
        """Whether any listener needs ``rank``'s ``stream``'s lines now."""
        return any(listener.wants(rank, stream) for listener in self._listeners)

    def sink(self, rank: int, stream: str) -> LineSink:
        """The sink that frames ``rank``'s ``stream`` into lines for the listeners."""
        return LineSink(partial(self._line, rank, stream), partial(self.wants, rank, stream))

    def _line(self, rank: int, stream: str, text: str) -> None:
        for listener in self._listeners:
            if listener.wants(rank, stream):
                listener.line(rank, stream, text)

    # -- demand -------------------------------------------------------------
    def on_demand(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever a listener's wants may have risen."""
        self._demand.append(callback)

    def off_demand(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` (idempotent)."""
        if callback in self._demand:
            self._demand.remove(callback)

    def demand_changed(self) -> None:
        """A listener's wants may have risen: wake every follower."""
        for callback in list(self._demand):
            callback()
