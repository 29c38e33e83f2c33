"""The watchdog's ``/proc`` sampler: what a live rank is doing, read from outside.

The sampler (:class:`RankActivity`, one per live worker process) reads what
the stall rule (``_stall.py``) judges, for the whole worker: CPU time of
every thread (and the children it reaped) and the process state from
``/proc/<pid>/stat``; the main thread's time on a CPU and waiting for one
from ``schedstat``; ``wchar`` from ``/proc/<pid>/io`` - every ``write()`` the
worker made, whatever its streams are wired to (pipe, log file written
directly, inherited terminal) - as the time output was last seen; and, while
its own threads rest, its helpers' (:mod:`aiolaunch._hangs._descendants`). A
process in uninterruptible sleep (D state) also gets the kernel function it
waits in (``wchan``), named in the stall's reason. The stacks the rule
compares come from :class:`aiolaunch._hangs._stack_sampler.StackSampler`.

Sampling costs three small ``/proc`` reads per worker (plus one for a
worker's children while it rests), kept open and re-read with ``pread``, at
most once a second per group; for long ``stall_after`` the period grows to
``stall_after / 10`` (at most 30 s), so detection comes at most two periods
after ``stall_after``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .._workers._proc import ProcFile, parse_schedstat, parse_stat, wchan
from ._descendants import Descendants, Threads
from ._stall import CPU_BUSY_FRACTION, Sample
from ._writes import WriteCount

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["CPU_WINDOW", "RankActivity", "Sampler"]

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: the shortest window ``RankActivity.cpu_percent`` is measured over (seconds)
CPU_WINDOW = 0.5


class RankActivity:
    """The ``/proc`` readings of one worker process, kept between samples.

    :meth:`read` returns a :class:`~aiolaunch._hangs._stall.Sample` for the stall
    rule: the CPU of every thread and of the children it reaped (``stat``),
    its main thread's wanted CPU (``schedstat``: on a CPU or waiting for one)
    and, cumulated, its helpers' - its other threads', and, while its own
    threads rest, its descendants' (:mod:`aiolaunch._hangs._descendants`). It keeps
    what ``status()`` shows: :attr:`cpu_percent` since the previous reading,
    :attr:`rss`, :attr:`state`, and :attr:`last_output` (monotonic time
    ``wchar`` of it or of a descendant last advanced, or output seen by the
    log pipeline: :meth:`seen`); ``wchar`` as output:
    :class:`~aiolaunch._hangs._writes.WriteCount`.

    :param suspect_after: after resting this long, the costlier looks: every
        thread's run-queue wait, every thread's children (each at most every
        few seconds).
    """

    def __init__(self, pid: int, now: float, *, suspect_after: float = 2.0) -> None:
        self.pid = pid
        self.suspect_after = suspect_after
        self.last_output: float | None = None
        self.cpu_percent = 0.0
        #: CPU seconds of the process (every thread) at the last reading
        self.cpu_s = 0.0
        self.rss = 0
        self.state = "?"
        self._t = now
        self._cpu: float | None = None
        self._main: tuple[float, float] | None = None
        self._helpers = 0.0
        self._rested_since = now
        self._writes = WriteCount()
        self._schedstat = True
        # Held open and re-read each period (see ProcFile).
        self._stat = ProcFile(pid, "stat")
        self._sched = ProcFile(pid, "schedstat")
        self._io = ProcFile(pid, "io")
        self._descendants = Descendants(pid)
        self._threads = Threads(pid)

    def close(self) -> None:
        """Close the held /proc fds. Idempotent."""
        for f in (self._stat, self._sched, self._io):
            f.close()
        self._descendants.close()

    def _main_now(self) -> tuple[float, float] | None:
        """The main thread's seconds on a CPU and runnable waiting for one
        (``schedstat``), or ``None``."""
        if self._schedstat:
            raw = self._sched.read(128)
            main = None if not raw else parse_schedstat(raw)
            if main is not None:
                return main
            self._schedstat = False  # none here: stat's one number for every thread
        return None

    def read(self, now: float, *, writes: bool = True) -> Sample | None:
        """Read ``/proc`` now; ``None`` when the process is gone.

        ``writes``: also read ``wchar`` (off when only progress lines count).
        """
        raw = self._stat.read(4096)
        stat = None if raw is None else parse_stat(raw)
        if stat is None:
            return None
        # Every thread of the process (cpu_s), and the children it waited for.
        self.cpu_s = (stat.utime + stat.stime) / _CLK_TCK
        cpu = self.cpu_s + (stat.cutime + stat.cstime) / _CLK_TCK
        main = self._main_now()
        dt = now - self._t
        # CPU time comes in clock ticks (10 ms): a percentage (and a helpers'
        # share) over less than CPU_WINDOW would be noise (two readers a few ms
        # apart - top, a scrape, the watchdog - would see 0 % or 100 %), so the
        # window only moves on once it is that long; until then the last
        # figures stand (the stall rule reads cumulative times: unaffected).
        if self._cpu is None or dt >= CPU_WINDOW:
            if self._cpu is not None:
                self._helping(now, dt, cpu - self._cpu, main, stat.num_threads)
            self._t, self._cpu, self._main = now, cpu, main
        self.state, self.rss = stat.state, stat.rss_pages * _PAGE
        if writes:
            self._wrote(now)
        where = wchan(self.pid) if stat.state == "D" else ""
        return Sample(
            self.pid,
            cpu,
            self.last_output,
            None,
            stat.state,
            where,
            main_s=None if main is None else main[0] + main[1],
            helpers_s=None if main is None else self._helpers,
            main_run_s=None if main is None else main[0],
        )

    def read_writes(self, now: float) -> float | None:
        """Read ``wchar`` alone now (one small read): :attr:`last_output` moves
        to ``now`` when the process wrote since the previous reading.

        :returns: :attr:`last_output`.
        """
        self._wrote(now)
        return self.last_output

    def _wrote(self, now: float) -> None:
        if self._writes.update(self._io.read(1024), self._starttime):
            self.last_output = self._rested_since = now

    def _starttime(self) -> int | None:
        raw = self._stat.read(4096)
        stat = None if raw is None else parse_stat(raw)
        return None if stat is None else stat.starttime

    def _helping(
        self, now: float, dt: float, used: float, main: tuple[float, float] | None, threads: int
    ) -> None:
        """Count what the helpers did since the previous reading."""
        self.cpu_percent = 100.0 * used / dt
        floor = CPU_BUSY_FRACTION * dt
        if main is None or self._main is None:
            if used >= floor:
                self._rested_since = now
            return
        main_on = main[0] - self._main[0]
        others = max(0.0, used - main_on)  # other threads on a CPU, reaped children
        self._helpers += others
        if main_on + main[1] - self._main[1] >= floor or others >= floor:
            self._rested_since = now  # its own threads work: no need to look further
            return
        rested = now - self._rested_since
        suspect = rested >= self.suspect_after
        if suspect and threads > 1:
            # Starved helper threads wait on the run queue: a read per thread,
            # once a second at first, less often the longer it rests.
            waited = self._threads.look(now, every=min(max(1.0, rested / 4), 30.0))
            self._helpers += waited or 0.0
        helpers = self._descendants.look(now, full=suspect)
        self._helpers += helpers.cpu_s
        if helpers.wrote:
            self.last_output = now
        if helpers.cpu_s >= floor or helpers.wrote:
            self._rested_since = now

    def seen(self, when: float) -> None:
        """Output was seen at ``when`` (monotonic) by other means (the log pipeline)."""
        if self.last_output is None or when > self.last_output:
            self.last_output = when

    def discount(self, nbytes: int) -> None:
        """The worker wrote ``nbytes`` of a stack dump since the last reading:
        not output."""
        self._writes.discount(nbytes)

    def rebase(self) -> None:
        """Forget writes made since the last reading (our own stack dump, say)."""
        self._writes.rebase(self._io.read(1024))


class Sampler:
    """The ``/proc`` readings of a group: one :class:`RankActivity` per live rank.

    Shared by ``status()`` and the watchdog. ``output_age(rank)``: seconds
    since the log pipeline last saw output of ``rank`` (``None``: unknown),
    merged into :attr:`RankActivity.last_output`.
    """

    def __init__(
        self, output_age: Callable[[int], float | None], *, suspect_after: float = 2.0
    ) -> None:
        self._output_age = output_age
        self._ranks: dict[int, RankActivity] = {}
        #: see :class:`RankActivity` (the watchdog sets a third of ``stall_after``)
        self.suspect_after = suspect_after

    def _activity(self, rank: int, pid: int, now: float) -> RankActivity:
        act = self._ranks.get(rank)
        if act is None or act.pid != pid:  # first sight, or a restarted rank
            if act is not None:
                act.close()
            act = self._ranks[rank] = RankActivity(pid, now, suspect_after=self.suspect_after)
        age = self._output_age(rank)
        if age is not None:
            act.seen(now - age)
        return act

    def sample(self, rank: int, pid: int, now: float, *, writes: bool = True) -> Sample | None:
        """Read ``rank``'s process ``pid`` now; ``None`` when it is gone."""
        return self._activity(rank, pid, now).read(now, writes=writes)

    def writes(self, rank: int, pid: int, now: float) -> float | None:
        """Read only whether ``rank``'s process ``pid`` wrote since the last
        reading (``wchar``); its :attr:`RankActivity.last_output` (monotonic),
        ``None`` while unknown."""
        act = self._ranks.get(rank)
        if act is None or act.pid != pid:
            act = self._activity(rank, pid, now)
        return act.read_writes(now)

    def reading(self, rank: int, pid: int, now: float) -> RankActivity | None:
        """Read ``rank``'s process now; its activity (CPU %, RSS, state,
        last output), or ``None`` when it is gone."""
        act = self._activity(rank, pid, now)
        return act if act.read(now) is not None else None

    def rebase(self, pids: Mapping[int, int]) -> None:
        """Forget the writes of these ``{rank: pid}`` since their last reading."""
        for rank, pid in pids.items():
            act = self._ranks.get(rank)
            if act is not None and act.pid == pid:
                act.rebase()

    def discount(self, pid: int, rank: int, nbytes: int) -> None:
        """``rank``'s process ``pid`` wrote ``nbytes`` of a stack sample: not output."""
        act = self._ranks.get(rank)
        if act is not None and act.pid == pid:
            act.discount(nbytes)

    def forget(self, rank: int) -> None:
        """``rank``'s process is gone: close what is held for it."""
        act = self._ranks.pop(rank, None)
        if act is not None:
            act.close()

    def close(self) -> None:
        """Close every held ``/proc`` fd. Idempotent."""
        for rank in list(self._ranks):
            self.forget(rank)
