"""Platform bits behind a tiny interface: exit fds and the process tree.

Supervisor code never branches on ``sys.platform``; it calls these functions,
each of which degrades to a documented no-op where the OS lacks the feature.

- :func:`open_exit_fd` - a ``pidfd`` (Linux >= 5.3) that becomes readable when
  the process exits, or ``None``.
- :func:`signal_tree` - signal a worker's process group *and* every descendant
  found in ``/proc`` (so grandchildren that called ``setsid()`` are reached
  too, as long as their parent chain is intact when we look).
"""

from __future__ import annotations

import errno
import os
import signal
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

__all__ = [
    "CONTEXT_ENV",
    "ProcStat",
    "ProcTable",
    "find_tagged",
    "new_context_token",
    "open_exit_fd",
    "parse_stat",
    "proc_pids",
    "read_stat",
    "signal_tree",
]


#: Environment variable carrying a per-context token into every worker; every
#: descendant that inherits the environment carries it too, so ``close()``
#: finds double-forked daemons (re-parented away, in a session of their own)
#: that neither the process group nor the parent chain reaches.
CONTEXT_ENV = "AIOLAUNCH_CONTEXT"


def new_context_token() -> str:
    """A token unique to one context of one supervisor process."""
    return f"{os.getpid()}-{os.urandom(8).hex()}"


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


#: Pids at most that :class:`ProcTable` tries one by one instead of listing
#: ``/proc`` (a miss costs ~4 us; the listing ~40 us warm, 250 us cold).
PROBE_SPAN = 64


def find_tagged(
    token: str, since: int = 0, exclude: Iterable[int] = (), *, pids: Iterable[int] | None = None
) -> set[int]:
    """Live processes whose environment holds ``CONTEXT_ENV=token``.

    Reads ``/proc/<pid>/environ`` - the environment the process was *exec'd*
    with - of pids >= ``since`` (see :class:`ProcTable` for that bound), or
    of ``pids`` when given, other than ours and ``exclude``. So it finds what
    a binary worker and its descendants inherit; a process that only changed
    ``os.environ`` (a function worker) passes the token on to what it execs,
    not to its own entry.
    Processes of other users are unreadable and skipped. Empty without
    ``/proc``. Costs about one ``open``+``read`` per scanned process.
    """
    needle = f"\0{CONTEXT_ENV}={token}\0".encode()
    skip = {os.getpid(), *exclude}
    found: set[int] = set()
    for pid in proc_pids(since) if pids is None else pids:
        if pid in skip:
            continue
        data = _read_all(f"/proc/{pid}/environ")
        # A zombie's environ reads empty: nothing to signal there.
        if data is not None and needle in b"\0" + data + b"\0":
            found.add(pid)
    return found


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


def _is_process(pid: int) -> bool:
    """Whether ``pid`` is a process (a thread group's leader), not another thread."""
    raw = read_proc_file(pid, "status")
    if raw is None:
        return False
    for line in raw.splitlines():
        if line.startswith(b"Tgid:"):
            return line[5:].strip() == str(pid).encode()
    return False


def open_exit_fd(pid: int) -> int | None:
    """Return a pidfd for ``pid`` (readable once it exits) or ``None``."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd


class ProcTable:
    """A snapshot of ``/proc``: parent and process-group of processes.

    Only processes with a pid of at least ``since`` are read: descendants of
    a worker are born after it, so this skips the rest of the machine (a full
    scan costs ~20 us per process); once the pid counter wrapped around, the
    low pids handed out since are read too (:func:`proc_pids`). When at most
    :data:`PROBE_SPAN` pids were handed out since, those are read one by one
    and ``/proc`` is not listed.

    ``alone``: live processes born at or after ``since`` (the workers). Where
    the pids are read one by one and no other process turns up among them,
    these are :attr:`alone` and their own entries are not read.

    Empty where there is no ``/proc`` (macOS): callers then rely on process
    groups alone.
    """

    def __init__(self, since: int = 0, alone: Collection[int] = ()) -> None:
        self.children: dict[int, list[int]] = {}
        self.groups: dict[int, list[int]] = {}
        self.stats: dict[int, ProcStat] = {}
        #: live processes known to have nothing below them (see ``alone``)
        self.alone: frozenset[int] = frozenset()
        # Few pids handed out since the first worker (the common case at
        # close(): the workers, a few helpers): each is tried in turn, no
        # listing of /proc - most of a scan's cost. Tried pids may be thread
        # ids, which /proc answers for as if processes, though never lists.
        last = last_pid() if since > 1 else 0
        probed = 0 <= last - since < PROBE_SPAN
        known = set(alone) if probed else set()
        pids = range(since, last + 1) if probed else proc_pids(since)
        for pid in pids:
            if pid not in known:
                self._read(pid, probed)
        if known and not self.stats:
            # No process but those was born since the first of them: none has
            # a descendant, alive or re-parented away. Their own stats are
            # not read: the first read of a new process's /proc entry costs
            # ~30 us (its inode is made), a third of a small group's close().
            self.alone = frozenset(known)
            return
        for pid in known:
            self._read(pid, probed)

    def _read(self, pid: int, probed: bool) -> None:
        stat = read_stat(pid)
        if stat is None or (probed and stat.num_threads > 1 and not _is_process(pid)):
            return
        self.stats[pid] = stat
        self.children.setdefault(stat.ppid, []).append(pid)
        self.groups.setdefault(stat.pgid, []).append(pid)

    def may_have_escaped(self, pid: int) -> bool:
        """Whether a descendant of ``pid`` may live outside its tree (re-parented
        away - a double-forked daemon - where only the context token finds it).

        ``False`` only when ``pid`` and every process of :meth:`tree` were
        read and none may have lost a child
        (:attr:`ProcStat.may_have_lost_children`): nothing in the tree ever
        died, so nothing below it was ever re-parented away; or when ``pid``
        is :attr:`alone`.
        """
        if pid in self.alone:
            return False
        for p in (pid, *self.tree(pid)):
            stat = self.stats.get(p)
            if stat is None or stat.may_have_lost_children:
                return True
        return False

    def tree(self, pid: int) -> set[int]:
        """Descendants of ``pid`` and members of its process group, minus ``pid``.

        Members of the group are found even after ``pid`` itself was reaped
        and they were re-parented.
        """
        found: set[int] = set(self.groups.get(pid, ()))
        stack = [pid, *found]
        while stack:
            for child in self.children.get(stack.pop(), ()):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        found.discard(pid)
        return found


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_tree(pid: int, sig: int, *, leader_alive: bool, extra: Iterable[int] = ()) -> None:
    """Send ``sig`` to a worker, its process group and the given descendants.

    ``killpg`` is only used while the group leader is not yet reaped: a
    process-group id stays pinned while its leader exists (even as a zombie),
    but once the leader is reaped and the group empties the number may be
    recycled, and ``killpg`` could hit an unrelated group.
    """
    if leader_alive:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            _kill(pid, sig)
        except PermissionError:
            # The child has not called setpgid() yet (fork start method race):
            # signal it alone; it joins its own group right after.
            _kill(pid, sig)
        except OSError as exc:  # pragma: no cover - defensive
            if exc.errno != errno.ESRCH:
                raise
    for d in extra:
        _kill(d, sig)
