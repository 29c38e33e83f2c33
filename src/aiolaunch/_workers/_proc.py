"""``/proc``: the supervisor side's one door to it.

Every path under ``/proc`` that the supervisor reads is named here, and every
format it reads is parsed here (proc(5)); the rest of the package asks these
functions and never opens ``/proc`` itself. Worker-side code has its own door
(:mod:`aiolaunch._child._proc`), and the guardian's shell script its own
scan (it runs where the supervisor is gone).

Each reading degrades to a documented "not known" (``None``, ``""``, an
empty collection) where the process is gone, the file unreadable (another
user's), or there is no procfs (macOS): callers then fall back to what they
can see without it.

Files read every sampling period are held open (:class:`ProcFile`) and
re-read with ``pread``: a third of the cost of open+read+close, and a held fd
can never read a recycled pid (it fails with ``ESRCH`` once the process is gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from typing import NamedTuple

__all__ = [
    "HAVE_PROC",
    "ProcFile",
    "ProcStat",
    "boot_time",
    "children",
    "cmdline",
    "descendants",
    "environ",
    "fd_path",
    "fd_target",
    "handles_signal",
    "is_process",
    "last_pid",
    "mapped_files",
    "open_fds",
    "parse_pid_list",
    "parse_schedstat",
    "parse_sigmasks",
    "parse_stat",
    "parse_wchar",
    "proc_pids",
    "read_proc_file",
    "read_stat",
    "sigmasks",
    "sysctl",
    "task_ids",
    "wchan",
]

#: whether this machine has a procfs (Linux)
HAVE_PROC = os.path.isdir("/proc/self/fd")
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


class ProcFile:
    """``/proc/<pid>/<name>``, opened on the first :meth:`read` and re-read with
    ``pread`` (see the module docstring). Where the process is out of fds it
    is read by path each time instead. Not thread-safe; :meth:`close` it."""

    __slots__ = ("_fd", "_path")

    def __init__(self, pid: int | str, name: str) -> None:
        self._path = f"/proc/{pid}/{name}"
        self._fd: int | None = -1  # -1: not opened yet; None: read by path

    def read(self, size: int = 4096) -> bytes | None:
        """The file's first ``size`` bytes now; ``None`` once the process is gone
        (or the file cannot be read)."""
        fd = self._fd
        if fd == -1:
            try:
                fd = os.open(self._path, _FLAGS)
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    return None
                fd = None  # out of fds: read by path each time instead
            self._fd = fd
        try:
            if fd is None:
                with open(self._path, "rb", buffering=0) as f:
                    return f.read(size)
            return os.pread(fd, size, 0)
        except OSError:
            return None

    def close(self) -> None:
        """Close the held fd. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd is not None and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __repr__(self) -> str:
        return f"<ProcFile {self._path} fd={self._fd}>"


class ProcStat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` that aiolaunch reads (proc(5))."""

    comm: str
    #: one letter: ``R``, ``S``, ``D``, ``T``, ``Z`` (zombie), ``X`` (dead)...
    state: str
    ppid: int
    pgid: int
    #: CPU time in user and kernel mode, in clock ticks (``SC_CLK_TCK``)
    utime: int
    stime: int
    #: start time after boot, in clock ticks: with the pid, names one process
    starttime: int
    #: resident set size, in pages
    rss_pages: int
    #: CPU time of its reaped children (those it waited for), in clock ticks
    cutime: int = 0
    cstime: int = 0
    num_threads: int = 1
    #: page faults of the children this process waited for (reaped), minor
    #: and major: non-zero once it reaped any child; -1 when not known
    cminflt: int = -1
    cmajflt: int = -1
    #: the ignored and the caught signals (bit ``n - 1`` for signal ``n``;
    #: proc(5) calls them obsolete, they are still there); -1 when not known
    sigignore: int = -1
    sigcatch: int = -1
    #: a zombie's raw wait status (what ``waitpid`` will give its parent); -1
    #: when not known (the field is 0 for a live process, or one we may not trace)
    exit_status: int = -1

    @property
    def alive(self) -> bool:
        """Running or sleeping: neither a zombie nor dead."""
        return self.state not in ("Z", "X")

    @property
    def may_have_lost_children(self) -> bool:
        """Whether a child of this process may have died, leaving its own
        children re-parented away (out of the tree below this process).

        A child that dies leaves a trace: its parent reaps it (the parent's
        ``cminflt``/``cmajflt`` grow by the child's page faults - every
        process that ran has some) or it stays a zombie (it is then in the
        tree itself). Without a trace only when the parent ignores SIGCHLD
        or handles it (``SA_NOCLDWAIT``: reaped by the kernel, counted
        nowhere): that counts as a trace here. So does anything unknown.
        """
        if min(self.cminflt, self.cmajflt, self.sigignore, self.sigcatch) < 0:
            return True
        if not self.alive or self.cminflt or self.cmajflt:
            return True
        return bool((self.sigignore | self.sigcatch) & _SIGCHLD_BIT)


_SIGCHLD_BIT = 1 << (signal.SIGCHLD - 1)


def read_proc_file(pid: int | str, name: str, size: int = 4096) -> bytes | None:
    """The first ``size`` bytes of ``/proc/<pid>/<name>`` in one read; ``None``
    when it cannot be read (the process is gone, or there is no ``/proc``)."""
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None


def read_stat(pid: int | str) -> ProcStat | None:
    """Read and parse ``/proc/<pid>/stat``; ``None`` when it cannot be read
    (the process is gone, or there is no ``/proc``)."""
    raw = read_proc_file(pid, "stat")
    return None if raw is None else parse_stat(raw)


def parse_stat(raw: bytes) -> ProcStat | None:
    """Parse the contents of a ``/proc/<pid>/stat`` file (the one parser:
    callers that keep the file open read it themselves); ``None`` if malformed."""
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses,
    # so split after the last ')'.
    lpar, rpar = raw.find(b"("), raw.rfind(b")")
    fields = raw[rpar + 2 :].split()
    if lpar < 0 or len(fields) < 22:
        return None
    try:
        more = (
            {"cminflt": int(fields[8]), "cmajflt": int(fields[10])}
            | {"sigignore": int(fields[30]), "sigcatch": int(fields[31])}
            if len(fields) >= 32
            else {}
        )
        if len(fields) >= 50:  # Linux >= 3.5
            more["exit_status"] = int(fields[49])
        return ProcStat(
            comm=raw[lpar + 1 : rpar].decode(errors="replace"),
            state=fields[0].decode(errors="replace"),
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            utime=int(fields[11]),
            stime=int(fields[12]),
            starttime=int(fields[19]),
            rss_pages=int(fields[21]),
            cutime=int(fields[13]),
            cstime=int(fields[14]),
            num_threads=int(fields[17]),
            **more,
        )
    except ValueError:
        return None


def parse_schedstat(raw: bytes) -> tuple[float, float] | None:
    """``schedstat``: seconds on a CPU and seconds runnable waiting for one."""
    try:
        on_cpu, waiting, _ = raw.split(None, 2)
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except ValueError:
        return None


def parse_wchar(raw: bytes) -> int | None:
    """``io``: the bytes the process passed to ``write()`` and friends (``wchar``)."""
    i = raw.find(b"wchar:")
    if i < 0:
        return None
    try:
        return int(raw[i + 6 : raw.index(b"\n", i)])
    except ValueError:
        return None


def parse_pid_list(raw: bytes) -> list[int]:
    """A thread's ``children`` file: the pids of its children."""
    try:
        return [int(k) for k in raw.split()]
    except ValueError:
        return []


def parse_sigmasks(raw: bytes, sig: int) -> dict[bytes, bool]:
    """Whether ``sig`` is in each ``Sig*`` mask of a ``status`` file
    (``SigCgt``: caught, ``SigIgn``: ignored, ``SigBlk``: blocked, ``SigPnd``)."""
    masks: dict[bytes, bool] = {}
    for line in raw.splitlines():
        if line.startswith(b"Sig") and line[6:7] == b":":
            with contextlib.suppress(ValueError, IndexError):
                masks[line[:6]] = bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return masks


def sigmasks(pid: int, sig: int) -> dict[bytes, bool]:
    """:func:`parse_sigmasks` of ``/proc/<pid>/status``; ``{}`` if it is gone."""
    raw = read_proc_file(pid, "status")
    return {} if raw is None else parse_sigmasks(raw, sig)


def handles_signal(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler installed for ``sig`` (``SigCgt``)."""
    return sigmasks(pid, sig).get(b"SigCgt", False)


def wchan(pid: int) -> str:
    """The kernel function a sleeping process waits in (``""`` if unknown)."""
    raw = read_proc_file(pid, "wchan", 256)
    w = "" if raw is None else raw.decode(errors="replace").strip()
    return "" if w == "0" else w


def task_ids(pid: int | str = "self") -> list[int] | None:
    """The thread ids of ``pid``; ``None`` when it is gone or there is no procfs."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return None


def children(pid: int, tid: int | None = None) -> list[int]:
    """The children of thread ``tid`` of ``pid`` (its main thread by default)."""
    raw = read_proc_file(pid, f"task/{pid if tid is None else tid}/children", 1 << 20)
    return [] if raw is None else parse_pid_list(raw)


def descendants(pid: int) -> set[int]:
    """Every descendant of ``pid``, through every thread's children file (a
    child started by a helper thread hangs off that thread)."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        parent = stack.pop()
        for tid in task_ids(parent) or ():
            for child in children(parent, tid):
                if child not in found and child != pid:
                    found.add(child)
                    stack.append(child)
    return found


def environ(pid: int) -> bytes | None:
    """The environment ``pid`` was exec'd with (NUL separated); ``None`` if
    unreadable (gone, another user's). A zombie's reads empty."""
    return _read_all(f"/proc/{pid}/environ")


def cmdline(pid: int) -> list[str] | None:
    """``pid``'s command line; ``None`` if unreadable, ``[]`` for a zombie."""
    raw = _read_all(f"/proc/{pid}/cmdline")
    return None if raw is None else [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def open_fds(pid: int | str = "self") -> list[int] | None:
    """The open fds of ``pid``; ``None`` without a procfs (or when it is gone)."""
    try:
        return [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")]
    except (OSError, ValueError):
        return None


def fd_path(fd: int) -> str:
    """A path naming what this process's ``fd`` is open on: opening it opens
    the same inode (even once the file was renamed or replaced)."""
    return f"/proc/self/fd/{fd}"


def fd_target(fd: int, pid: int | str = "self") -> str | None:
    """What ``fd`` of ``pid`` (this process by default) points to
    (``"pipe:[123]"``, a path...); ``None`` once it is closed, when the
    process is gone or another user's, or without a procfs."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def mapped_files(pid: int) -> set[str]:
    """The files ``pid`` has mapped (its libraries, a device's memory...);
    empty when it is gone or unreadable."""
    raw = _read_all(f"/proc/{pid}/maps")
    if raw is None:
        return set()
    out = set()
    for line in raw.decode(errors="replace").splitlines():
        path = line.rpartition(" ")[2]
        if path.startswith("/"):
            out.add(path)
    return out


def boot_time() -> int | None:
    """When the machine booted (Unix seconds), from ``/proc/stat``."""
    raw = _read_all("/proc/stat")
    if raw is None:
        return None
    for line in raw.splitlines():
        if line.startswith(b"btime "):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1])
    return None


def sysctl(name: str) -> str | None:
    """The value of the kernel setting ``name`` (``"net/ipv4/ip_nonlocal_bind"``)."""
    raw = read_proc_file("sys", name, 256)
    return None if raw is None else raw.decode(errors="replace").strip()


def proc_pids(since: int = 0) -> list[int]:
    """The pids listed in ``/proc`` that may belong to processes born after ``since``.

    Those at least ``since`` - and, once the pid counter wrapped around (the
    last pid handed out is below ``since``; pid_max is 32768 on many hosts,
    which a long test suite wraps), also those up to that last pid. ``[]``
    without ``/proc``.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = [int(e) for e in entries if e.isdigit()]
    if since <= 1:
        return pids
    # Read after the listing: every pid listed that was handed out after a
    # wrap is at most this one.
    wrapped_to = last_pid()
    if wrapped_to >= since:
        wrapped_to = 0
    return [p for p in pids if p >= since or p <= wrapped_to]


def last_pid() -> int:
    """The last pid (or thread id) handed out in our pid namespace; 0 when unknown."""
    last = read_proc_file("sys/kernel", "ns_last_pid", 32)
    try:
        return int(last) if last is not None else 0
    except ValueError:
        return 0


#####ISPROC
def is_process(pid: int) -> bool:
    """Whether ``pid`` is a process (a thread group's leader), not another thread."""
    raw = read_proc_file(pid, "status")
    if raw is None:
        return False
    for line in raw.splitlines():
        if line.startswith(b"Tgid:"):
            return line[5:].strip() == str(pid).encode()
    return False


def _read_all(path: str) -> bytes | None:
    # open + read(s) + close: a third of the system calls of open(path, "rb").read()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
