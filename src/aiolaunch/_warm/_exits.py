"""How the supervisor learns a forked worker's exit status, besides the zygote's report.

The zygote is the forked workers' parent: it reaps each and reports its raw
wait status (:class:`~aiolaunch._child._wire.Exited`). But the supervisor
holds a pidfd of each forked worker and sees the exit itself, at once, while
the zygote may be busy (importing its LATER modules, forking spares): the
status is then read from the kernel, which keeps it for the parent until
the zygote reaps the worker (:func:`zombie_status`). Each worker also
reports its own exit code on the zygote's status socket just before it ends
(``_child/_forked.py``): :class:`SelfReports` reads those. They vouch for a
zombie's 0 (the kernel shows 0 too where it keeps the status from us), and
they are what the supervisor has when the zygote died first (SIGKILLed
mid-run: the workers it forked run on, and init reaps them).
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

from .._workers._proc import read_stat

if TYPE_CHECKING:
    import asyncio
    import socket
    from collections.abc import Callable

__all__ = ["SelfReports", "zombie_status"]


def zombie_status(pid: int, pidfd: int) -> int | None:
    """The exit code of ``pid`` (whose ``pidfd`` is readable), read while it is a zombie.

    As :func:`os.waitstatus_to_exitcode` gives it: ``-N`` for signal ``N``.
    ``None`` once its parent reaped it (``/proc/<pid>`` is then gone, or
    another process's), or where ``/proc`` does not say. A 0 may also mean
    that the kernel keeps the status from us (a worker that made itself
    non-dumpable): the caller checks it against the worker's own report.
    """
    stat = read_stat(pid)
    if stat is None or stat.state != "Z" or stat.exit_status < 0:
        return None
    try:
        # Not reaped now, so not reaped when the entry was read: it was ours.
        signal.pidfd_send_signal(pidfd, 0)
    except OSError:
        return None
    return os.waitstatus_to_exitcode(stat.exit_status)


class SelfReports:
    """The exit codes forked workers report themselves, read off the status socket.

    The socket is drained on the event loop as reports come (a full one
    would block a worker's last write); a report is kept while ``wanted``
    says its pid is a live worker, until :meth:`take` or :meth:`forget`.
    """

    def __init__(self, sock: socket.socket, wanted: Callable[[int], bool]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._wanted = wanted
        self._codes: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the socket on ``loop`` from now on (and no longer on the previous one)."""
        self.unbind()
        self._loop = loop
        loop.add_reader(self.sock.fileno(), self.drain)

    def unbind(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed() and self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())

    def close(self) -> None:
        self.unbind()
        self.sock.close()

    def drain(self) -> None:
        """Read every report waiting in the socket."""
        from .._child._forked import STATUS

        while True:
            try:
                data = self.sock.recv(STATUS.size)
            except OSError:  # BlockingIOError: all read
                return
            if len(data) == STATUS.size:
                pid, code = STATUS.unpack(data)
                if self._wanted(pid):
                    self._codes[pid] = code

    def take(self, pid: int) -> int | None:
        """The code ``pid`` reported (reading what waits first), or ``None``: none."""
        self.drain()
        return self._codes.pop(pid, None)

    def peek(self, pid: int) -> int | None:
        """As :meth:`take`, keeping the report."""
        self.drain()
        return self._codes.get(pid)

    def forget(self, pid: int) -> None:
        self._codes.pop(pid, None)
