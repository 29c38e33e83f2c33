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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "ProcTable",
    "open_exit_fd",
    "signal_tree",
]


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
    scan costs ~20 us per process). The price, documented: a descendant born
    after the pid counter wrapped around *and* outside the worker's process
    group is not seen (group members are still signalled through ``killpg``).

    Empty where there is no ``/proc`` (macOS): callers then rely on process
    groups alone.
    """

    def __init__(self, since: int = 0) -> None:
        self.children: dict[int, list[int]] = {}
        self.groups: dict[int, list[int]] = {}
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for entry in entries:
            if not entry.isdigit() or int(entry) < since:
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            # The command name may hold spaces and parentheses: split after the last ')'.
            fields = stat[stat.rfind(b")") + 2 :].split()
            if len(fields) < 3:
                continue
            pid = int(entry)
            self.children.setdefault(int(fields[1]), []).append(pid)
            self.groups.setdefault(int(fields[2]), []).append(pid)

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
