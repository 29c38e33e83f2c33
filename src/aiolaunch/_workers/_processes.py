"""Processes as the supervisor handles them: exit fds, process trees, tagged descendants.

Supervisor code never branches on ``sys.platform``; it calls these functions,
each of which degrades to a documented no-op where the OS lacks the feature
(``/proc`` itself is read through :mod:`._proc`).

- :func:`open_exit_fd` - a ``pidfd`` (Linux >= 5.3) that becomes readable when
  the process exits, or ``None``.
- :class:`ProcTable` and :func:`signal_tree` - a worker's process group *and*
  every descendant found in ``/proc`` (so grandchildren that called
  ``setsid()`` are reached too, as long as their parent chain is intact when
  we look).
- :func:`find_tagged` - descendants that left the tree (double-forked
  daemons), by the context token they inherited (:data:`CONTEXT_ENV`).
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from ._proc import ProcStat, environ, is_process, last_pid, proc_pids, read_stat

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

__all__ = [
    "CONTEXT_ENV",
    "PROBE_SPAN",
    "ProcTable",
    "find_tagged",
    "new_context_token",
    "open_exit_fd",
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
        data = environ(pid)
        # A zombie's environ reads empty: nothing to signal there.
        if data is not None and needle in b"\0" + data + b"\0":
            found.add(pid)
    return found


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
        if stat is None or (probed and stat.num_threads > 1 and not is_process(pid)):
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
