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
from typing import TYPE_CHECKING

from ._workers._proc import ProcStat, parse_stat, read_proc_file, read_stat

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "ProcSample",
    "ProgressLines",
    "RankActivity",
    "Watchdog",
    "matches_every_line",
    "read_proc",
]

_ACTIONS = ("observe", "fail", "restart")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: CPU time below this fraction of one core between samples is "not advancing"
CPU_BUSY_FRACTION = 0.10


def matches_every_line(pattern: str) -> bool:
    """Whether ``pattern``, searched in each line, matches every line: it
    matches the empty string (``""``, ``".*"``, ``"x?"``).

    :raises re.error: not a regular expression.
    """
    return re.compile(pattern).search("") is not None


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


@dataclass(frozen=True)
class ProcSample:
    """One reading of ``/proc/<pid>``."""

    state: str
    cpu_s: float
    rss: int
    wchar: int | None


def read_proc(pid: int, with_io: bool = True) -> ProcSample | None:
    """Read ``/proc/<pid>/stat`` (and ``io``); ``None`` when the process is gone."""
    stat = read_stat(pid)
    if stat is None:
        return None
    return _sample(stat, _read_wchar(pid) if with_io else None)


def _parse_stat(raw: bytes, wchar: int | None) -> ProcSample | None:
    stat = parse_stat(raw)
    return None if stat is None else _sample(stat, wchar)


def _sample(stat: ProcStat, wchar: int | None) -> ProcSample:
    cpu = (stat.utime + stat.stime) / _CLK_TCK
    return ProcSample(stat.state, cpu, stat.rss_pages * _PAGE, wchar)


def _read_wchar(pid: int) -> int | None:
    data = read_proc_file(pid, "io", 1024)
    return None if data is None else _parse_wchar(data)


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
    """Activity bookkeeping of one worker process between samples."""

    def __init__(self, pid: int, now: float) -> None:
        self.pid = pid
        self.last_active = now
        self.last_output: float | None = None
        self.cpu_percent = 0.0
        self.rss = 0
        self.state = "?"
        self._t = now
        self._cpu: float | None = None
        self._wchar: int | None = None
        #: a progress line matched since the last sample
        self.progressed = False
        # /proc/<pid>/stat and io kept open and re-read with pread(): a third
        # of the cost of open+read+close each period (and a held fd can never
        # read a recycled pid: it fails with ESRCH once the process is gone).
        self._fds: dict[str, int | None] = {}
        self._schedstat = True

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

    def _wchar_now(self) -> int | None:
        data = self._pread("io", 1024)
        return None if data is None else _parse_wchar(data)

    def refresh_stat(self) -> bool:
        """Read state and RSS from ``/proc/<pid>/stat``; ``False`` if it is gone."""
        raw = self._pread("stat", 4096)
        s = None if raw is None else _parse_stat(raw, None)
        if s is None:
            return False
        self.state, self.rss = s.state, s.rss
        return True

    def _cpu_now(self) -> float | None:
        # schedstat (CPU time in ns) is three times cheaper to read than stat.
        if self._schedstat:
            raw = self._pread("schedstat", 128)
            if raw:
                with contextlib.suppress(ValueError):
                    return int(raw.split(None, 1)[0]) / 1e9
        raw = self._pread("stat", 4096)
        s = None if raw is None else _parse_stat(raw, None)
        if s is None:
            return None  # gone
        self._schedstat = False  # the process is there, its schedstat is not
        return s.cpu_s

    def sample(self, now: float, *, progress: bool) -> bool:
        """Take a sample; update activity. ``False`` when the process is gone.

        State and RSS are not read here (see :meth:`refresh_stat`): a process
        in D state has no CPU and no output anyway, so it is caught as idle.
        """
        cpu = self._cpu_now()
        if cpu is None:
            return False
        dt = now - self._t
        busy = False
        if self._cpu is not None and dt > 0:
            used = cpu - self._cpu
            self.cpu_percent = 100.0 * used / dt
            busy = used >= CPU_BUSY_FRACTION * dt
        wrote = False
        if not progress:
            # Skip the second read when the CPU already says "active".
            wchar = None if busy and self._wchar is not None else self._wchar_now()
            if wchar is not None:
                wrote = self._wchar is not None and wchar != self._wchar
                self._wchar = wchar
        else:
            wrote, self.progressed = self.progressed, False
        if wrote:
            self.last_output = now
        if busy or wrote:
            self.last_active = now
        self._t, self._cpu = now, cpu
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

    def rebase(self) -> None:
        """Forget writes made since the last sample (our own stack dump, say)."""
        wchar = self._wchar_now()
        if wchar is not None:
            self._wchar = wchar


class ProgressLines:
    """``Watchdog(progress=regex)``: a line listener of the group's log pipeline.

    Needs every stream (none is inherited), and marks the rank whose line
    matches as progressing until the next sample.

    :param activity: the watchdog's per-rank activity (a rank not sampled
        yet is not marked).
    """

    def __init__(self, regex: str, activity: Mapping[int, RankActivity]) -> None:
        self.regex = re.compile(regex)
        self._activity = activity

    def reads(self, rank: int, stream: str) -> bool:
        return True

    def wants(self, rank: int, stream: str) -> bool:
        return True

    def line(self, rank: int, stream: str, text: str) -> None:
        act = self._activity.get(rank)
        if act is not None and self.regex.search(text) is not None:
            act.progressed = True
