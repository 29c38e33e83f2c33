"""WriteCount: a worker's count of written bytes (``wchar``), read as output seen.

``/proc/<pid>/io``'s ``wchar`` counts every byte the process passed to
``write()`` and its kin - to its streams whatever they are wired to (a pipe,
a log file written directly, an inherited terminal), and to any file. The
watchdog and the output age read it as output: the process wrote when the
count grew between two readings, less the bytes of our own stack dumps
(:meth:`WriteCount.discount`). A count has no time stamp: a write is dated
by the reading that first sees it.

The first reading only sets the baseline - unless the process started at
most :data:`FRESH_S` ago: a new process starts at 0, so what it wrote so
far is output seen now (a rank that printed its banner and went quiet has
an output age from its first reading on).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .._workers._proc import parse_wchar

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["FRESH_S", "WriteCount", "process_age"]

#: a process first read within this many seconds of its start: its writes
#: so far count as output (``wchar`` starts at 0 in a new process)
FRESH_S = 5.0

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_age(starttime: int) -> float:
    """Seconds since a process started (``starttime``: ``/proc/<pid>/stat``'s,
    clock ticks after boot)."""
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    if boot is None:  # pragma: no cover - Linux has it
        return float("inf")
    return time.clock_gettime(boot) - starttime / _CLK_TCK


class WriteCount:
    """One process's ``wchar`` between readings (see the module docstring)."""

    def __init__(self) -> None:
        self._wchar: int | None = None
        self._discount = 0

    def update(self, io: bytes | None, starttime: Callable[[], int | None]) -> bool:
        """A new reading; whether the process wrote output since the previous one.

        :param io: the contents of ``/proc/<pid>/io`` (``None``: unreadable,
            nothing changes).
        :param starttime: the process's start time (``/proc/<pid>/stat``),
            asked at the first reading only: a process at most
            :data:`FRESH_S` old counts from 0.
        """
        wchar = None if io is None else parse_wchar(io)
        if wchar is None:
            return False
        if self._wchar is None:
            started = starttime()
            if started is not None and process_age(started) <= FRESH_S:
                self._wchar = 0  # a new process: everything it wrote is output
        wrote = self._wchar is not None and wchar - self._wchar > self._discount
        self._wchar, self._discount = wchar, 0
        return wrote

    def discount(self, nbytes: int) -> None:
        """The process wrote ``nbytes`` of a stack dump since the last reading: not output."""
        self._discount += nbytes

    def rebase(self, io: bytes | None) -> None:
        """Forget the writes up to this reading of ``/proc/<pid>/io`` (our own
        stack dump, say)."""
        wchar = None if io is None else parse_wchar(io)
        if wchar is not None:
            self._wchar = wchar
