"""What a worker's descendants do: CPU and writes of DataLoader workers, a child
it waits on, the Python behind a shell wrapper. Linux ``/proc`` only.

Found through ``/proc/<pid>/task/<tid>/children`` (every thread's children,
recursively), which costs a read per thread: so the tree is looked up again
only every :data:`RESCAN_S` seconds (or when one of them is gone), and read at
all only while the worker itself looks idle (the caller's choice: a worker
whose own threads work needs no helpers to look active). Each descendant's
``stat`` and ``io`` are kept open and re-read with ``pread``; one born since
the previous look counts from its second look on.
"""

from __future__ import annotations

import contextlib
import os

from ._workers._proc import parse_stat

__all__ = ["Descendants", "HelperActivity"]

#: Seconds between two lookups of a worker's tree.
RESCAN_S = 10.0


class HelperActivity:
    """CPU seconds and written bytes of the descendants, since the previous look."""

    __slots__ = ("cpu_s", "wrote")

    def __init__(self, cpu_s: float = 0.0, wrote: bool = False) -> None:
        self.cpu_s = cpu_s
        self.wrote = wrote


class _Proc:
    __slots__ = ("cpu", "io_fd", "stat_fd", "wchar")

    def __init__(self, stat_fd: int, io_fd: int | None) -> None:
        self.stat_fd, self.io_fd = stat_fd, io_fd
        self.cpu: float | None = None
        self.wchar: int | None = None


class Descendants:
    """The live descendants of one worker process, and what they did."""

    def __init__(self, pid: int, clk_tck: int) -> None:
        self.pid = pid
        self._tck = clk_tck
        self._procs: dict[int, _Proc] = {}
        self._scanned: float | None = None

    def close(self) -> None:
        """Close every held fd. Idempotent."""
        for p in self._procs.values():
            _close(p.stat_fd)
            _close(p.io_fd)
        self._procs.clear()
        self._scanned = None

    def look(self, now: float) -> HelperActivity:
        """What the descendants did since the previous look (nothing at the first)."""
        if self._scanned is None or now - self._scanned >= RESCAN_S:
            self._rescan(now)
        out = HelperActivity()
        gone: list[int] = []
        for pid, p in self._procs.items():
            try:
                stat = parse_stat(os.pread(p.stat_fd, 4096, 0))
            except OSError:
                stat = None
            if stat is None or not stat.alive:
                gone.append(pid)
                continue
            cpu = (stat.utime + stat.stime) / self._tck
            if p.cpu is not None:
                out.cpu_s += max(0.0, cpu - p.cpu)
            p.cpu = cpu
            if p.io_fd is not None:
                wchar = _wchar(p.io_fd)
                if wchar is not None:
                    out.wrote |= p.wchar is not None and wchar != p.wchar
                    p.wchar = wchar
        for pid in gone:
            p = self._procs.pop(pid)
            _close(p.stat_fd)
            _close(p.io_fd)
            self._scanned = None  # the tree changed: look it up again next time
        return out

    def _rescan(self, now: float) -> None:
        self._scanned = now
        found = _tree(self.pid)
        for pid in list(self._procs):
            if pid not in found:
                p = self._procs.pop(pid)
                _close(p.stat_fd)
                _close(p.io_fd)
        for pid in found:
            if pid in self._procs:
                continue
            try:
                stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # gone already, or out of fds: skip it
                continue
            try:
                io_fd: int | None = os.open(f"/proc/{pid}/io", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                io_fd = None
            self._procs[pid] = _Proc(stat_fd, io_fd)


def _tree(pid: int) -> set[int]:
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


def _wchar(fd: int) -> int | None:
    try:
        data = os.pread(fd, 1024, 0)
    except OSError:
        return None
    i = data.find(b"wchar:")
    return None if i < 0 else int(data[i + 6 : data.index(b"\n", i)])


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
