"""What a worker's helpers do: its other threads, and its descendants
(DataLoader workers, a child it waits on, the Python behind a shell wrapper).
Linux ``/proc`` only.

*Wanting* the CPU counts, not only getting it: on a loaded host a busy
thread may get a few percent of a core (the kernel gives each session an
equal share, and a function worker shares its session with the supervisor),
yet it waits on the run queue the rest of the time. ``schedstat`` has both
(time on a CPU, time runnable but waiting), per thread.

Both are read only while the worker's own threads look idle (the caller's
choice: a worker whose threads visibly work needs no helpers):

- :class:`Descendants`: each look reads the children of the worker's main
  thread and of every known descendant's (``/proc/<pid>/task/<pid>/children``,
  held open: one ``pread``, and just that for a worker with no children), and
  each descendant's main-thread ``schedstat`` and ``io``. Children that a
  *helper thread* started hang off that thread instead; a ``full`` look (the
  caller asks when a rank has rested a while) reads every thread's children
  file, at most every :data:`RESCAN_S`.
- :class:`Threads`: how long the other threads waited on the run queue
  (their time on a CPU is in ``/proc/<pid>/stat`` already): a read per
  thread, so only on request, and at most as often as the caller says.

A process or thread counts from its second reading on (the first is its base).
"""

from __future__ import annotations

from .._workers._proc import (
    ProcFile,
    descendants,
    parse_pid_list,
    parse_schedstat,
    parse_wchar,
    read_proc_file,
    task_ids,
)

__all__ = ["Descendants", "HelperActivity", "Threads"]

#: Seconds between two full lookups of a worker's tree.
RESCAN_S = 10.0
#: The most bytes of a children file read (thousands of pids).
_CHILDREN_SIZE = 1 << 16


class HelperActivity:
    """CPU seconds wanted (on a CPU or waiting for one), and whether they
    wrote, since the previous look."""

    __slots__ = ("cpu_s", "wrote")

    def __init__(self, cpu_s: float = 0.0, wrote: bool = False) -> None:
        self.cpu_s = cpu_s
        self.wrote = wrote


_NOTHING = HelperActivity()


class _Proc:
    """One descendant: its files, held open, and its last readings."""

    __slots__ = ("children", "cpu", "io", "sched", "wchar")

    def __init__(self, pid: int) -> None:
        self.sched = ProcFile(pid, "schedstat")
        self.io = ProcFile(pid, "io")
        self.children = ProcFile(pid, f"task/{pid}/children")
        self.cpu: float | None = None
        self.wchar: int | None = None

    def close(self) -> None:
        for f in (self.sched, self.io, self.children):
            f.close()


class Descendants:
    """The live descendants of one worker process, and what they did."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._procs: dict[int, _Proc] = {}
        self._children = ProcFile(pid, f"task/{pid}/children")  # its main thread's
        self._full: float | None = None

    def close(self) -> None:
        """Close every held fd. Idempotent."""
        for p in self._procs.values():
            p.close()
        self._procs.clear()
        self._children.close()

    def look(self, now: float, *, full: bool = False) -> HelperActivity:
        """What the descendants did since the previous look (nothing at the first)."""
        if full and (self._full is None or now - self._full >= RESCAN_S):
            self._full = now
            found = descendants(self.pid)
        else:
            kids = _children(self._children)
            if not kids and not self._procs:
                return _NOTHING  # the usual case: one pread
            found = self._quick_tree(kids)
        for pid in [p for p in self._procs if p not in found]:
            self._procs.pop(pid).close()
        out = HelperActivity()
        for pid in found:
            p = self._procs.get(pid)
            if p is None:
                p = self._procs[pid] = _Proc(pid)
            if not self._read(p, out):
                self._procs.pop(pid).close()
        return out

    def _read(self, p: _Proc, out: HelperActivity) -> bool:
        raw = p.sched.read(128)
        times = None if raw is None else parse_schedstat(raw)
        if times is None:
            return False  # gone: a held fd reads ESRCH then
        cpu = times[0] + times[1]
        if p.cpu is not None:
            out.cpu_s += max(0.0, cpu - p.cpu)
        p.cpu = cpu
        raw = p.io.read(1024)
        wchar = None if raw is None else parse_wchar(raw)
        if wchar is not None:
            out.wrote |= p.wchar is not None and wchar != p.wchar
            p.wchar = wchar
        return True

    def _quick_tree(self, kids: list[int]) -> set[int]:
        found: set[int] = set()
        stack = [*kids, *self._procs]
        while stack:
            pid = stack.pop()
            if pid in found or pid == self.pid:
                continue
            found.add(pid)
            p = self._procs.get(pid)
            if p is not None:
                stack += _children(p.children)
        return found


class Threads:
    """How long every thread but the main one of a process waited for a CPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._last: dict[int, float] = {}
        self._at: float | None = None

    def look(self, now: float, every: float) -> float | None:
        """Seconds the other threads spent runnable on the run queue since
        the previous reading; ``None`` when not read (less than ``every``
        seconds since the previous one, or the first)."""
        if self._at is not None and now - self._at < every:
            return None
        tids = task_ids(self.pid)
        if tids is None:
            return None
        waited = 0.0
        seen: dict[int, float] = {}
        for tid in tids:
            if tid == self.pid:
                continue
            raw = read_proc_file(self.pid, f"task/{tid}/schedstat", 128)
            times = None if raw is None else parse_schedstat(raw)
            if times is None:
                continue
            seen[tid] = times[1]
            if tid in self._last:
                waited += max(0.0, seen[tid] - self._last[tid])
        first, self._last, self._at = self._at is None, seen, now
        return None if first else waited


def _children(f: ProcFile) -> list[int]:
    raw = f.read(_CHILDREN_SIZE)
    return [] if raw is None else parse_pid_list(raw)
