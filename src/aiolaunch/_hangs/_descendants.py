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

import contextlib
import os

__all__ = ["Descendants", "HelperActivity", "Threads", "read_schedstat"]

#: Seconds between two full lookups of a worker's tree.
RESCAN_S = 10.0
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def read_schedstat(fd: int | None) -> float | None:
    """Seconds on a CPU plus seconds runnable on the run queue (``schedstat``)."""
    if fd is None:
        return None
    try:
        on_cpu, waiting, _ = os.pread(fd, 128, 0).split(None, 2)
        return (int(on_cpu) + int(waiting)) / 1e9
    except (OSError, ValueError):
        return None


class HelperActivity:
    """CPU seconds wanted (on a CPU or waiting for one), and whether they
    wrote, since the previous look."""

    __slots__ = ("cpu_s", "wrote")

    def __init__(self, cpu_s: float = 0.0, wrote: bool = False) -> None:
        self.cpu_s = cpu_s
        self.wrote = wrote


_NOTHING = HelperActivity()


class _Proc:
    __slots__ = ("children_fd", "cpu", "io_fd", "sched_fd", "wchar")

    def __init__(self, pid: int) -> None:
        self.sched_fd = os.open(f"/proc/{pid}/schedstat", _FLAGS)
        self.io_fd = _open(f"/proc/{pid}/io")
        self.children_fd = _open(f"/proc/{pid}/task/{pid}/children")
        self.cpu: float | None = None
        self.wchar: int | None = None

    def close(self) -> None:
        for fd in (self.sched_fd, self.io_fd, self.children_fd):
            _close(fd)


class Descendants:
    """The live descendants of one worker process, and what they did."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._procs: dict[int, _Proc] = {}
        self._children_fd: int | None = -1  # the worker's main thread's (-1: not opened)
        self._full: float | None = None

    def close(self) -> None:
        """Close every held fd. Idempotent."""
        for p in self._procs.values():
            p.close()
        self._procs.clear()
        if self._children_fd is not None and self._children_fd >= 0:
            _close(self._children_fd)
        self._children_fd = -1

    def look(self, now: float, *, full: bool = False) -> HelperActivity:
        """What the descendants did since the previous look (nothing at the first)."""
        if full and (self._full is None or now - self._full >= RESCAN_S):
            self._full = now
            found = _tree(self.pid)
        else:
            if self._children_fd == -1:
                self._children_fd = _open(f"/proc/{self.pid}/task/{self.pid}/children")
            kids = _children(self._children_fd)
            if not kids and not self._procs:
                return _NOTHING  # the usual case: one pread
            found = self._quick_tree(kids)
        for pid in [p for p in self._procs if p not in found]:
            self._procs.pop(pid).close()
        out = HelperActivity()
        for pid in found:
            p = self._procs.get(pid)
            if p is None:
                try:
                    p = self._procs[pid] = _Proc(pid)
                except OSError:  # gone already, or out of fds: skip it
                    continue
            if not self._read(p, out):
                self._procs.pop(pid).close()
        return out

    def _read(self, p: _Proc, out: HelperActivity) -> bool:
        cpu = read_schedstat(p.sched_fd)
        if cpu is None:
            return False  # gone (a held fd reads ESRCH then)
        if p.cpu is not None:
            out.cpu_s += max(0.0, cpu - p.cpu)
        p.cpu = cpu
        wchar = _wchar(p.io_fd)
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
                stack += _children(p.children_fd)
        return found


class Threads:
    """How long every thread but the main one of a process waited for a CPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._last: dict[str, float] = {}
        self._at: float | None = None

    def look(self, now: float, every: float) -> float | None:
        """Seconds the other threads spent runnable on the run queue since
        the previous reading; ``None`` when not read (less than ``every``
        seconds since the previous one, or the first)."""
        if self._at is not None and now - self._at < every:
            return None
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        waited = 0.0
        seen: dict[str, float] = {}
        for tid in tids:
            if tid == str(self.pid):
                continue
            try:
                fd = os.open(f"/proc/{self.pid}/task/{tid}/schedstat", _FLAGS)
            except OSError:
                continue
            try:
                wait = os.pread(fd, 128, 0).split()[1]
                seen[tid] = int(wait) / 1e9
            except (OSError, ValueError, IndexError):
                continue
            finally:
                os.close(fd)
            if tid in self._last:
                waited += max(0.0, seen[tid] - self._last[tid])
        first, self._last, self._at = self._at is None, seen, now
        return None if first else waited


def _tree(pid: int) -> set[int]:
    """Every descendant, through every thread's children file."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                    kids = f.read().split()
            except OSError:
                continue
            for kid in kids:
                child = int(kid)
                if child not in found and child != pid:
                    found.add(child)
                    stack.append(child)
    return found


def _children(fd: int | None) -> list[int]:
    if fd is None or fd < 0:
        return []
    try:
        data = os.pread(fd, 4096, 0)
        if len(data) == 4096:  # hundreds of children: read them all
            data = os.pread(fd, 1 << 20, 0)
        return [int(k) for k in data.split()]
    except (OSError, ValueError):
        return []


def _wchar(fd: int | None) -> int | None:
    if fd is None:
        return None
    try:
        data = os.pread(fd, 1024, 0)
        i = data.find(b"wchar:")
        return None if i < 0 else int(data[i + 6 : data.index(b"\n", i)])
    except (OSError, ValueError):
        return None


def _open(path: str) -> int | None:
    try:
        return os.open(path, _FLAGS)
    except OSError:
        return None


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
