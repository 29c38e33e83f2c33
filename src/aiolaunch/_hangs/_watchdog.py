"""The stall watchdog's settings (:class:`Watchdog`) and its ``/proc`` sampler.

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

import contextlib
import errno
import os
import re
from dataclasses import dataclass

from .._workers._proc import parse_stat
from ._descendants import Descendants, Threads
from ._stall import CPU_BUSY_FRACTION, Sample
from ._writes import WriteCount

__all__ = [
    "MAX_STALL_AFTER",
    "MIN_STALL_AFTER",
    "RankActivity",
    "Watchdog",
    "matches_every_line",
    "stall_after_problem",
    "wchan",
]

_ACTIONS = ("observe", "fail", "restart")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: the shortest window ``RankActivity.cpu_percent`` is measured over (seconds)
CPU_WINDOW = 0.5
#: the shortest ``stall_after``: the watchdog reads ``/proc`` at most once a
#: second, so a shorter one would flag every rank at its first quiet second
MIN_STALL_AFTER = 1.0
#: the longest ``stall_after`` (30 days): a longer one never fires in a real job
MAX_STALL_AFTER = 30 * 86400.0


def matches_every_line(pattern: str) -> bool:
    """Whether ``pattern``, searched in each line, matches every line: it
    matches the empty string (``""``, ``".*"``, ``"x?"``).

    :raises re.error: not a regular expression.
    """
    return re.compile(pattern).search("") is not None


def stall_after_problem(seconds: float) -> str | None:
    """What is wrong with a ``stall_after`` of ``seconds`` (a number > 0), or ``None``."""
    if seconds < MIN_STALL_AFTER:
        return (
            f"is shorter than the watchdog's sampling period ({MIN_STALL_AFTER:g} s): every "
            "rank would be flagged at its first quiet second"
        )
    if seconds > MAX_STALL_AFTER:
        return "is longer than 30 days: the watchdog would never flag a stall"
    return None


@dataclass(frozen=True)
class Watchdog:
    """Detect workers that hang, and name stragglers, without changing the worker's code.

    Pass it as ``start_processes(..., watchdog=Watchdog(...))`` (or
    ``WorkerSpec(watchdog=...)``, CLI ``--stall-timeout``). A worker is
    *stalled* when for ``stall_after`` seconds it shows no activity:

    - no output (with ``progress``: no line matching it - other output,
      heartbeats included, is not progress; a rank that never prints one, as
      ranks other than 0 usually don't, goes by the group's progress lines);
    - and its stack did not move: a Python worker started by aiolaunch (a
      function worker, or a script run by the CLI) is sampled through the
      dump signal once a period while its main thread burns CPU without
      output, and a main thread at the same frames in every sample is
      *spinning* - a GPU rank in ``.item()`` or an NCCL wait, a Python wait
      loop - stalled whatever its CPU. A stack that moves is work (a silent
      compute phase is healthy). Without ``progress``, a main thread that
      waits while its helpers work (other threads, DataLoader workers, a
      child it waits on) is active too.
    - A worker that cannot be sampled (a binary, a program not started
      through the bootstrap, a Python worker finalizing) keeps the rule from
      before stacks were sampled: no CPU anywhere in it (every thread, its
      descendants) for ``stall_after``.

    CPU counts as *wanted* (on a CPU or waiting on the run queue), so a busy
    worker starved by a loaded host is not idle; a sampled worker whose main
    thread wanted most of a core but ran under 10 % of it is judged by that
    rule too (its stack had no chance to move). A worker in uninterruptible
    sleep (D state) is caught as idle, and its reason names the D state and
    the kernel function it waits in. Limits: a Python wait loop that
    alternates between functions looks like work (its stack moves), and one
    call into C that computes longer than ``stall_after`` without output
    looks like a spin.

    On a stall the context emits :class:`aiolaunch.WorkerStalled` once per
    stall (again only after the worker was active in between), dumps the
    stacks of *every* rank to ``{log_dir}/{rank}/stacks-<n>.txt`` before
    anything is stopped, writes ``{log_dir}/report.json``/``report.txt`` and
    logs a warning naming them; then, by ``action``:

    - ``"observe"``: nothing more; the group keeps running.
    - ``"fail"``: the group is stopped and :meth:`PContext.wait` returns a
      failure whose ``ProcessFailure.message`` names "stalled", the reason
      and the rank's place in the outlier verdict. One story: when the
      stalled ranks wait in one place and another rank is elsewhere (the odd
      one out of the verdict), that rank is the failure and the root cause,
      whether idle, spinning or printing; the others are "stopped by
      aiolaunch".
    - ``"restart"``: a stalled rank with a :class:`RestartPolicy` is killed and
      restarted by it; otherwise as ``"fail"`` (an agent then restarts the
      group within ``max_restarts``).

    With a watchdog, the first failure of a rank also dumps every other live
    rank's stacks (at most ~2 s) before they are stopped: the report and the
    ``ChildFailedError`` summary (``others``) show where each rank was.

    ``stragglers`` (a stack-sample period in seconds, off by default): every
    rank's stack is sampled that often (jittered), each sample classified as
    waiting inside a ``torch.distributed`` collective or not, and a rank that
    waits far less than its peers over a window (they wait for it) is named:
    :class:`aiolaunch.WorkerStraggling`, a warning, ``"straggling"`` in
    ``status()`` and the report. The statistic (``aiolaunch._hangs._straggler``)
    asks for a large gap, a one-sided Fisher exact test at 1e-6 on effective
    samples, consistency across the window and persistence, so a balanced
    run never names anyone; a rank waiting 4 % of the time among peers at
    40 % is named after ~30-60 samples. DDP's gradient all-reduce runs in C++
    inside ``backward()``: there only explicit collectives are measured.

    Linux: activity is read from ``/proc`` (elsewhere no worker is ever
    flagged). The sampling period is ``stall_after / 10`` within [1, 30] s.

    :param stall_after: seconds without activity, from 1 (the sampling
        period's floor) to 30 days (:data:`MAX_STALL_AFTER`).
    :param progress: a regular expression: only lines matching it count as
        output (streams the supervisor reads; a non-redirected stream is then
        piped through the supervisor).
    :param action: ``"observe"``, ``"fail"`` or ``"restart"``.
    :param stragglers: seconds between two straggler samples (>= 0.1), or
        ``None`` (off). CLI ``--straggler-sample``.
    :raises ValueError: a bad ``stall_after``, ``progress``, ``action`` or
        ``stragglers``.
    """

    stall_after: float = 600.0
    progress: str | None = None
    action: str = "fail"
    stragglers: float | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.stall_after, bool)
            or not isinstance(self.stall_after, int | float)
            or not self.stall_after > 0
            or self.stall_after == float("inf")
        ):
            raise ValueError(
                f"Watchdog(stall_after={self.stall_after!r}) must be a number of seconds > 0, "
                "e.g. stall_after=600"
            )
        why = stall_after_problem(self.stall_after)
        if why is not None:
            raise ValueError(
                f"Watchdog(stall_after={self.stall_after!r}) {why}; pass e.g. stall_after=600, "
                "or watchdog=None"
            )
        if self.stragglers is not None and (
            isinstance(self.stragglers, bool)
            or not isinstance(self.stragglers, int | float)
            or not 0.1 <= self.stragglers < float("inf")
        ):
            raise ValueError(
                f"Watchdog(stragglers={self.stragglers!r}) must be a stack-sample period in "
                "seconds >= 0.1, or None (off)"
            )
        if self.action not in _ACTIONS:
            raise ValueError(
                f"Watchdog(action={self.action!r}) must be one of {', '.join(map(repr, _ACTIONS))}"
            )
        if self.progress is not None:
            if not isinstance(self.progress, str):
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) must be a regular expression (a str)"
                )
            try:
                every = matches_every_line(self.progress)
            except re.error as exc:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) is not a valid regular expression: {exc}"
                ) from None
            if every:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) matches every line (it matches an "
                    "empty one), so any output would count as progress; pass a pattern of "
                    "your progress lines, e.g. progress=r'^step \\d+', or None for any output"
                )

    @property
    def period(self) -> float:
        """Seconds between two /proc samples: ``stall_after / 10`` within [1, 30]."""
        return min(max(1.0, self.stall_after / 10), 30.0)


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
        # /proc/<pid>/stat and io kept open and re-read with pread(): a third
        # of the cost of open+read+close each period (and a held fd can never
        # read a recycled pid: it fails with ESRCH once the process is gone).
        self._fds: dict[str, int | None] = {}
        self._descendants = Descendants(pid)
        self._threads = Threads(pid)

    def _pread(self, name: str, size: int) -> bytes | None:
        fd = self._fds.get(name, -1)
        if fd == -1:
            try:
                fd = os.open(f"/proc/{self.pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    fd = None  # out of fds: read by path each time instead
                else:
                    return None
            self._fds[name] = fd
        try:
            if fd is None:
                with open(f"/proc/{self.pid}/{name}", "rb", buffering=0) as f:
                    return f.read(size)
            return os.pread(fd, size, 0)
        except OSError:
            return None

    def close(self) -> None:
        """Close the held /proc fds. Idempotent."""
        for fd in self._fds.values():
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds.clear()
        self._descendants.close()

    def _main_now(self) -> tuple[float, float] | None:
        """The main thread's seconds on a CPU and runnable waiting for one
        (``schedstat``), or ``None``."""
        if self._schedstat:
            raw = self._pread("schedstat", 128)
            if raw:
                with contextlib.suppress(ValueError):
                    on_cpu, waiting, _ = raw.split(None, 2)
                    return int(on_cpu) / 1e9, int(waiting) / 1e9
            self._schedstat = False  # none here: stat's one number for every thread
        return None

    def read(self, now: float, *, writes: bool = True) -> Sample | None:
        """Read ``/proc`` now; ``None`` when the process is gone.

        ``writes``: also read ``wchar`` (off when only progress lines count).
        """
        raw = self._pread("stat", 4096)
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
            self.pid, cpu, self.last_output, None, stat.state, where,
            main_s=None if main is None else main[0] + main[1],
            helpers_s=None if main is None else self._helpers,
            main_run_s=None if main is None else main[0],
        )  # fmt: skip

    def read_writes(self, now: float) -> float | None:
        """Read ``wchar`` alone now (one small read): :attr:`last_output` moves
        to ``now`` when the process wrote since the previous reading.

        :returns: :attr:`last_output`.
        """
        self._wrote(now)
        return self.last_output

    def _wrote(self, now: float) -> None:
        if self._writes.update(self._pread("io", 1024), self._starttime):
            self.last_output = self._rested_since = now

    def _starttime(self) -> int | None:
        raw = self._pread("stat", 4096)
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
        self._writes.rebase(self._pread("io", 1024))


def wchan(pid: int) -> str:
    """The kernel function a sleeping process waits in (``""`` if unknown)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            w = f.read().strip()
    except OSError:
        return ""
    return "" if w == "0" else w
