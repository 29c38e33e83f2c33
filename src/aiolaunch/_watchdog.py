"""The stall watchdog's settings (:class:`Watchdog`) and its /proc sampler.

What counts as activity, per worker process, between two samples:

- output: ``wchar`` in ``/proc/<pid>/io`` advanced - every ``write()`` the
  worker made, whatever its streams are wired to (pipe, log file written
  directly, inherited terminal). With ``progress=regex`` only a line matching
  the regex counts instead (read from the supervisor's pipes);
- CPU: user+system time advanced by at least 10 % of one core;

and a worker is *stalled* when it had neither for ``stall_after`` seconds. A
process in uninterruptible sleep (D state) has neither, so it is caught the
same way; its state (and the kernel function it waits in) is read when it is
flagged, and named in the reason.

Sampling costs two small ``/proc`` reads per worker, kept open and re-read
with ``pread``: ``schedstat`` (CPU time) and, when the CPU did not advance,
``io`` (``wchar``), at most once a second per group; for
long ``stall_after`` the period grows to ``stall_after / 10`` (at most 30 s),
so detection comes at most two periods after ``stall_after``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from dataclasses import dataclass

from ._descendants import Descendants, Threads
from ._stall_rule import RankSample
from ._workers._proc import parse_stat

__all__ = ["RankActivity", "Watchdog", "wchan"]

_ACTIONS = ("observe", "fail", "restart")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: CPU time below this fraction of one core between samples is "not advancing"
CPU_BUSY_FRACTION = 0.10
_IDLE = RankSample()


@dataclass(frozen=True)
class Watchdog:
    """Detect workers that hang, without changing the worker's code.

    Pass it as ``start_processes(..., watchdog=Watchdog(...))`` (or
    ``WorkerSpec(watchdog=...)``, CLI ``--stall-timeout``). A worker is
    *stalled* when for ``stall_after`` seconds it wrote nothing (with
    ``progress``: no line matching it) **and** its CPU time did not advance
    by 10 % of a core. A worker in uninterruptible sleep (D state) has
    neither, and its reason then names the D state and the kernel function
    it waits in. A worker that keeps writing is never stalled.

    On a stall the context emits :class:`aiolaunch.WorkerStalled` once per
    stall (again only after the worker was active in between), dumps the
    stacks of *every* rank to ``{log_dir}/{rank}/stacks-<n>.txt`` before
    anything is stopped, writes ``{log_dir}/report.json``/``report.txt`` and
    logs a warning naming them; then, by ``action``:

    - ``"observe"``: nothing more; the group keeps running.
    - ``"fail"``: the group is stopped and :meth:`PContext.wait` returns a
      failure for the stalled rank(s), whose ``ProcessFailure.message`` names
      "stalled", the idle time and the rank's place in the outlier verdict.
    - ``"restart"``: a stalled rank with a :class:`RestartPolicy` is killed and
      restarted by it; otherwise as ``"fail"`` (an agent then restarts the
      group within ``max_restarts``).

    Linux: activity is read from ``/proc`` (elsewhere no worker is ever
    flagged). The sampling period is ``stall_after / 10`` within [1, 30] s.

    :param stall_after: seconds without activity, > 0.
    :param progress: a regular expression: only lines matching it count as
        output (streams the supervisor reads; a non-redirected stream is then
        piped through the supervisor).
    :param action: ``"observe"``, ``"fail"`` or ``"restart"``.
    :raises ValueError: a bad ``stall_after``, ``progress`` or ``action``.
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
                f"Watchdog(stall_after={self.stall_after!r}) must be a number of seconds > 0"
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
                re.compile(self.progress)
            except re.error as exc:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) is not a valid regular expression: {exc}"
                ) from None

    @property
    def period(self) -> float:
        """Seconds between two /proc samples: ``stall_after / 10`` within [1, 30]."""
        return min(max(1.0, self.stall_after / 10), 30.0)


def _parse_wchar(data: bytes) -> int | None:
    i = data.find(b"wchar:")
    if i < 0:
        return None
    return int(data[i + 6 : data.index(b"\n", i)])


def wchan(pid: int) -> str:
    """The kernel function a sleeping process waits in (``""`` if unknown)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            w = f.read().strip()
    except OSError:
        return ""
    return "" if w == "0" else w


class RankActivity:
    """Activity bookkeeping of one worker process between samples.

    Each :meth:`sample` reads the CPU of the whole process (``stat``: every
    thread, plus the children it reaped), its main thread's (``schedstat``:
    time on a CPU *and* waiting for one) and its writes (``io``); and - only
    while its own threads look idle - its helpers' (:mod:`._descendants`:
    other threads that want the CPU, descendants). What the interval showed
    is :attr:`interval` (a :class:`RankSample` without a stack, for the stall
    rule); :attr:`last_active` is the end of the last interval with output or
    with CPU anywhere in the worker.
    """

    def __init__(self, pid: int, now: float, *, suspect_after: float = 2.0) -> None:
        self.pid = pid
        #: after resting this long, the costlier looks: every thread's CPU,
        #: the children of every thread (each at most every few seconds)
        self.suspect_after = suspect_after
        self.last_active = now
        self.last_output: float | None = None
        self.cpu_percent = 0.0
        self.rss = 0
        self.state = "?"
        #: what the last sample saw, since the one before
        self.interval = RankSample()
        self._t = now
        self._main: tuple[float, float] | None = None
        self._whole: float | None = None
        self._wchar: int | None = None
        self._discount = 0
        #: a progress line matched since the last sample
        self.progressed = False
        # /proc/<pid>/stat and io kept open and re-read with pread(): a third
        # of the cost of open+read+close each period (and a held fd can never
        # read a recycled pid: it fails with ESRCH once the process is gone).
        self._fds: dict[str, int | None] = {}
        self._schedstat = True
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

    def _wchar_now(self) -> int | None:
        data = self._pread("io", 1024)
        return None if data is None else _parse_wchar(data)

    def refresh_stat(self) -> bool:
        """Read state and RSS from ``/proc/<pid>/stat``; ``False`` if it is gone."""
        raw = self._pread("stat", 4096)
        s = None if raw is None else parse_stat(raw)
        if s is None:
            return False
        self.state, self.rss = s.state, s.rss_pages * _PAGE
        return True

    def _whole_now(self) -> tuple[float, int] | None:
        """CPU seconds of every thread of the process and of the children it
        reaped, and its number of threads; ``None`` when it is gone."""
        raw = self._pread("stat", 4096)
        if not raw:
            return None
        # Only utime, stime, cutime, cstime and num_threads (fields 14-17, 20).
        fields = raw[raw.rfind(b")") + 2 :].split(None, 18)
        try:
            return sum(map(int, fields[11:15])) / _CLK_TCK, int(fields[17])
        except (ValueError, IndexError):
            return None

    def _main_now(self) -> tuple[float, float] | None:
        """The main thread's seconds on a CPU and runnable waiting for one
        (``schedstat``), or ``None``."""
        if self._schedstat:
            raw = self._pread("schedstat", 128)
            if raw:
                with contextlib.suppress(ValueError):
                    on_cpu, waiting, _ = raw.split(None, 2)
                    return int(on_cpu) / 1e9, int(waiting) / 1e9
            self._schedstat = False  # none here: one number for every thread
        return None

    def sample(self, now: float, *, progress: bool, output: bool = False) -> bool:
        """Take a sample; update :attr:`interval` and activity. ``False`` when
        the process is gone.

        ``output``: read the writes even when the CPU already says "active"
        (the stall rule of a sampled rank needs both). State and RSS are not
        read here (see :meth:`refresh_stat`): a process in D state has no CPU
        and no output anyway, so it is caught as idle.
        """
        reading = self._whole_now()
        if reading is None:
            return False
        whole, threads = reading
        main = self._main_now()
        dt = now - self._t
        floor = CPU_BUSY_FRACTION * dt
        main_busy = helpers_busy = False
        if self._whole is not None and dt > 0:
            used = max(0.0, whole - self._whole)
            self.cpu_percent = 100.0 * used / dt
            if main is not None and self._main is not None:
                main_cpu = main[0] - self._main[0]
                # Wanting the CPU counts: on a loaded host a busy thread may
                # get a few percent of a core and wait on the run queue.
                main_busy = main_cpu + main[1] - self._main[1] >= floor
                helpers_busy = used - main_cpu >= floor
            else:
                main_busy = used >= floor  # one number for every thread
            if not main_busy and not helpers_busy:
                # The process's own threads look idle: do its helpers work?
                idle = now - self.last_active
                suspect = idle >= self.suspect_after
                if suspect and threads > 1:
                    # A read per thread: once a second at first, then less
                    # often the longer the rank rests (a hung rank, observed).
                    wanted = self._threads.look(now, every=min(max(1.0, idle / 4), 30.0))
                    helpers_busy = wanted is not None and wanted >= CPU_BUSY_FRACTION
                if not helpers_busy:
                    helpers = self._descendants.look(now, full=suspect)
                    helpers_busy = helpers.cpu_s >= floor or helpers.wrote
        busy = main_busy or helpers_busy
        wrote = False
        if not progress:
            # Skip the read when the CPU already says "active", unless asked.
            skip = busy and not output and self._wchar is not None
            wchar = None if skip else self._wchar_now()
            if wchar is not None:
                if self._wchar is not None:
                    wrote = wchar - self._wchar > self._discount
                self._wchar, self._discount = wchar, 0
        else:
            wrote, self.progressed = self.progressed, False
        if wrote:
            self.last_output = now
        if busy or wrote:
            self.last_active = now
        if wrote or busy:
            self.interval = RankSample(
                output=wrote, main_busy=main_busy, helpers_busy=helpers_busy,
                cpu_percent=round(self.cpu_percent, 1),
            )  # fmt: skip
        else:
            self.interval = _IDLE
        self._t, self._whole, self._main = now, whole, main
        return True

    @property
    def sees_writes(self) -> bool:
        """Whether ``wchar`` could be read (it counts every write, to any fd)."""
        return self._wchar is not None

    def seen(self, when: float) -> None:
        """Output was seen at ``when`` (monotonic) by other means (the pipe readers)."""
        if self.last_output is None or when > self.last_output:
            self.last_output = when
        self.last_active = max(self.last_active, when)

    def discount(self, nbytes: int) -> None:
        """The worker wrote ``nbytes`` of a stack dump since the last sample:
        not output."""
        self._discount += nbytes

    def rebase(self) -> None:
        """Forget writes made since the last sample (our own stack dump, say)."""
        wchar = self._wchar_now()
        if wchar is not None:
            self._wchar = wchar
