"""The stall watchdog's settings (:class:`Watchdog`) and its /proc sampler.

What counts as activity, per worker process, between two samples:

- output: ``wchar`` in ``/proc/<pid>/io`` advanced - every ``write()`` the
  worker made, whatever its streams are wired to (pipe, log file written
  directly, inherited terminal). With ``progress=regex`` only a line matching
  the regex counts instead (read from the supervisor's pipes);
- CPU: user+system time advanced by at least 10 % of one core;

and a worker is *stalled* when it had neither for ``stall_after`` seconds, or
sat in uninterruptible sleep (D state) for ``stall_after`` seconds.

Sampling costs two small ``/proc`` reads per worker (the ``io`` read is
skipped when the CPU already advanced), at most once a second per group; for
long ``stall_after`` the period grows to ``stall_after / 10`` (at most 30 s),
so detection comes at most two periods after ``stall_after``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["ProcSample", "RankActivity", "Watchdog", "read_proc"]

_ACTIONS = ("observe", "fail", "restart")
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: CPU time below this fraction of one core between samples is "not advancing"
CPU_BUSY_FRACTION = 0.10


@dataclass(frozen=True)
class Watchdog:
    """Detect workers that hang, without changing the worker's code.

    Pass it as ``start_processes(..., watchdog=Watchdog(...))`` (or
    ``WorkerSpec(watchdog=...)``, CLI ``--stall-timeout``). A worker is
    *stalled* when for ``stall_after`` seconds it wrote nothing (with
    ``progress``: no line matching it) **and** its CPU time did not advance
    by 10 % of a core, or it sat in uninterruptible sleep (D state) that long.
    A worker that keeps writing is never stalled.

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
                re.compile(self.progress)
            except re.error as exc:
                raise ValueError(
                    f"Watchdog(progress={self.progress!r}) is not a valid regular expression: {exc}"
                ) from None

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
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 22:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    wchar = _read_wchar(pid) if with_io else None
    return ProcSample(fields[0].decode(), cpu, int(fields[21]) * _PAGE, wchar)


def _read_wchar(pid: int) -> int | None:
    try:
        fd = os.open(f"/proc/{pid}/io", os.O_RDONLY)
        try:
            data = os.read(fd, 1024)
        finally:
            os.close(fd)
    except OSError:
        return None
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
        self.d_since: float | None = None
        self.cpu_percent = 0.0
        self.rss = 0
        self.state = "?"
        self._t = now
        self._cpu: float | None = None
        self._wchar: int | None = None
        #: a progress line matched since the last sample
        self.progressed = False

    def sample(self, now: float, *, progress: bool) -> ProcSample | None:
        """Take a sample; update activity. ``None`` when the process is gone."""
        s = read_proc(self.pid, with_io=False)
        if s is None:
            return None
        dt = now - self._t
        busy = False
        if self._cpu is not None and dt > 0:
            used = s.cpu_s - self._cpu
            self.cpu_percent = 100.0 * used / dt
            busy = used >= CPU_BUSY_FRACTION * dt
        wrote = False
        if not progress:
            # Skip the second read when the CPU already says "active".
            wchar = None if busy and self._wchar is not None else _read_wchar(self.pid)
            if wchar is not None:
                wrote = self._wchar is not None and wchar != self._wchar
                self._wchar = wchar
        else:
            wrote, self.progressed = self.progressed, False
        if wrote:
            self.last_output = now
        if busy or wrote:
            self.last_active = now
        self.state, self.rss = s.state, s.rss
        if s.state == "D":
            self.d_since = self.d_since if self.d_since is not None else now
        else:
            self.d_since = None
        self._t, self._cpu = now, s.cpu_s
        return s

    def seen(self, when: float) -> None:
        """Output was seen at ``when`` (monotonic) by other means (the pipe readers)."""
        if self.last_output is None or when > self.last_output:
            self.last_output = when
        self.last_active = max(self.last_active, when)

    def rebase(self) -> None:
        """Forget writes made since the last sample (our own stack dump, say)."""
        wchar = _read_wchar(self.pid)
        if wchar is not None:
            self._wchar = wchar
