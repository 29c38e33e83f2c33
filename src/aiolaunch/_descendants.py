"""What a worker's descendants do: CPU and writes of DataLoader workers, a child
it waits on, the Python behind a shell wrapper. Linux ``/proc`` only.

Read only while the worker's own threads rest (the caller's choice: a worker
whose threads work needs no helpers to look active). Each :meth:`look` reads
the children of the worker's main thread and of every known descendant's
(``/proc/<pid>/task/<pid>/children``, held open: one ``pread`` each, and
just that for a worker with no children) and each known descendant's ``stat``
and ``io``. Children that a *helper thread* started hang off that thread
instead; a ``full`` look (the caller asks when a rank has rested for a while,
at most every :data:`RESCAN_S`) reads every thread's children file. A
descendant counts from its second look on (its first reading is the base).
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["Descendants", "HelperActivity"]

#: Seconds between two full lookups of a worker's tree.
RESCAN_S = 10.0
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


class HelperActivity:
    """CPU seconds and whether they wrote, since the previous look."""

    __slots__ = ("cpu_s", "wrote")

    def __init__(self, cpu_s: float = 0.0, wrote: bool = False) -> None:
        self.cpu_s = cpu_s
        self.wrote = wrote


_NOTHING = HelperActivity()


class _Proc:
    __slots__ = ("children_fd", "cpu", "io_fd", "stat_fd", "wchar")

    def __init__(self, pid: int) -> None:
        self.stat_fd = os.open(f"/proc/{pid}/stat", _FLAGS)
        self.io_fd = _open(f"/proc/{pid}/io")
        self.children_fd = _open(f"/proc/{pid}/task/{pid}/children")
        self.cpu: float | None = None
        self.wchar: int | None = None

    def close(self) -> None:
        for fd in (self.stat_fd, self.io_fd, self.children_fd):
            _close(fd)


class Descendants:
    """The live descendants of one worker process, and what they did."""

    def __init__(self, pid: int, clk_tck: int) -> None:
        self.pid = pid
        self._tck = clk_tck
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
        try:
            raw = os.pread(p.stat_fd, 4096, 0)
            fields = raw[raw.rfind(b")") + 2 :].split(None, 13)
            if fields[0] in (b"Z", b"X"):
                return False
            cpu = (int(fields[11]) + int(fields[12])) / self._tck
        except (OSError, ValueError, IndexError):
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
