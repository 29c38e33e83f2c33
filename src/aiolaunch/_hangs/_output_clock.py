"""OutputClock: the output age of ranks whose output the supervisor does not read.

A rank that writes the console itself (inherited streams: torchrun's
default, and the CLI's without ``-r``/``-t``) or ``/dev/null`` has no reader
in the log pipeline to say when it last wrote. Its age comes from the
kernel's count of the bytes it wrote (``wchar`` in ``/proc/<pid>/io``, read
by :class:`~aiolaunch._hangs._activity.Sampler`): any ``write()`` of the
worker's, to its streams or to a file, counts.

A count has no time stamp, so the clock reads it: each such rank
:data:`FIRST_READING` after its process started (a new process counts from
0: what it printed before is output, seen then), then again at an interval
that grows with its age - one second while it writes, a tenth of its age
once quiet, at most :data:`MAX_INTERVAL`. ``status()``, ``aiolaunch top`` and ``/metrics`` read
the count too when they ask, so the age they show is off by at most that
interval (a second for a rank that writes), and known from the first look.

Costs one small ``/proc`` read (~3 us) per such rank and interval, on the
loop, which wakes only when a reading is due or a rank starts. Never while
a stack dump is under way: the dump's own writes are not output (the dumper
discounts them when it is done).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._group import GroupState
    from ._activity import Sampler

__all__ = ["FIRST_READING", "MAX_INTERVAL", "TICK", "OutputClock"]

#: the shortest interval between two readings of a rank (seconds)
TICK = 1.0
#: the longest interval between two readings of a quiet rank (seconds)
MAX_INTERVAL = 10.0
#: seconds from a rank's start to its first reading: not beside its spawn
#: (reading ``/proc/<pid>/io`` waits while the process still execs: 0.1-0.4
#: ms a rank on the launch path); what it wrote meanwhile still counts
FIRST_READING = 0.05


class OutputClock:
    """Keeps :attr:`RankActivity.last_output` of unread ranks current (module docstring).

    :param state: the group.
    :param sampler: the group's ``/proc`` readings, shared with ``status()``
        and the watchdog.
    :param unread: whether the log pipeline misses some of ``rank``'s output
        (a stream inherited or discarded): only those ranks are read.
    :param dumps: held while a stack dump is under way (nothing is read then).
    """

    def __init__(
        self,
        state: GroupState,
        sampler: Sampler,
        unread: Callable[[int], bool],
        dumps: asyncio.Lock,
    ) -> None:
        self._state = state
        self._sampler = sampler
        self._unread = unread
        self._dumps = dumps
        # rank -> (pid, first seen, next reading), monotonic
        self._due: dict[int, tuple[int, float, float]] = {}
        # The next reading's timer: a timer, not a task, so that stopping
        # is synchronous and costs the group's end no turn of the loop.
        self._timer: asyncio.TimerHandle | None = None
        self._running = False

    def start(self) -> None:
        """Start (on the running loop): every unread rank is read
        :data:`FIRST_READING` seconds later."""
        if not self._running:
            self._running = True
            self._read_in(FIRST_READING)

    def rank_started(self) -> None:
        """A rank's new process runs: it is read :data:`FIRST_READING`
        seconds later (what it wrote meanwhile counts as fresh)."""
        if self._running:
            self._read_in(FIRST_READING)

    def _read_in(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._read)

    def stop(self) -> None:
        """Stop reading. Idempotent."""
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def tick(self, now: float) -> float | None:
        """Read the ranks that are due at ``now`` (monotonic).

        :returns: seconds until the next reading is due (``None``: no rank
            to read; :data:`TICK` while a stack dump is under way).
        """
        if self._dumps.locked():
            return TICK
        nearest: float | None = None
        for w in self._state.workers():
            rank = w.local_rank
            if not w.alive or self._state.restarting(rank) or not self._unread(rank):
                self._due.pop(rank, None)
                continue
            pid, seen, due = self._due.get(rank, (0, now, 0.0))
            if pid != w.pid:  # a new process (a restarted rank too)
                seen, due = now, 0.0
            if now >= due:
                last = self._sampler.writes(rank, w.pid, now)
                quiet = now - (seen if last is None else last)
                due = now + min(max(TICK, quiet / 10), MAX_INTERVAL)
                self._due[rank] = (w.pid, seen, due)
            nearest = due if nearest is None else min(nearest, due)
        return None if nearest is None else max(0.0, nearest - now)

    def _read(self) -> None:
        # Wakes only when a reading is due or a rank starts, never at every
        # change of the group (each exit would cost wait() a turn of the
        # loop). Each wake-up of an idle supervisor costs ~0.15 ms of CPU on
        # a small VM: a quiet group wakes every MAX_INTERVAL, not every TICK.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        delay = self.tick(time.monotonic())
        if delay is not None and self._running:
            self._timer = asyncio.get_running_loop().call_later(delay, self._read)
