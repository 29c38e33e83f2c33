"""The zygote's spares: children forked ahead of the requests, and how many to keep.

A fork of a torch-sized process takes 10-25 ms: a restart whose ranks were
forked one after the other would pay that per rank. So, once idle, the
zygote forks as many children as the largest burst of requests so far (at
first, the group size the supervisor announced; at most
:data:`MAX_SPARES`), each waiting on a socket of its own; a request is then
handed to one (:meth:`Spares.hand`), which becomes the worker at once.

Standard library only, like everything in this folder.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

from ._wire import Fork, receive, send

if TYPE_CHECKING:
    import socket

__all__ = ["MAX_SPARES", "Spares"]

#: the most spares a zygote keeps
MAX_SPARES = 16


class Spares:
    """The spares waiting for a request (the zygote's end of each one's socket)."""

    def __init__(self, want: int) -> None:
        self._waiting: list[tuple[int, socket.socket]] = []  # (pid, our end of its socket)
        #: how many to keep: the largest burst so far
        self.want = min(want, MAX_SPARES)
        self._burst = 0  # requests since the zygote was last idle

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def short(self) -> bool:
        """Fewer than :attr:`want` are waiting."""
        return len(self._waiting) < self.want

    def counted(self) -> None:
        """One more request in this burst."""
        self._burst += 1
        self.want = min(max(self.want, self._burst), MAX_SPARES)

    def idle(self) -> None:
        """The zygote is idle: the next request starts a new burst."""
        self._burst = 0

    def stop(self) -> None:
        """Keep none from now on (forking is no longer safe)."""
        self.want = 0

    def add(self, pid: int, ours: socket.socket) -> None:
        self._waiting.append((pid, ours))

    def hand(self, req: Fork, fds: list[int]) -> int | None:
        """Hand ``req`` and its fds to the first spare still alive: its pid; ``None``: none left."""
        while self._waiting:
            pid, sock = self._waiting.pop(0)
            try:
                send(sock, req, fds)
            except OSError:
                continue  # it died: the next one
            finally:
                sock.close()
            return pid
        return None

    def drop(self) -> None:
        """Kill every spare waiting (they lack a module imported since they were forked)."""
        for pid, sock in self._waiting:
            sock.close()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover
                pass
        self._waiting.clear()

    def forget(self) -> None:
        """In a new child: close the zygote's ends (the spares are not its own)."""
        for _, sock in self._waiting:
            sock.close()


def wait_for_request(theirs: socket.socket) -> tuple[Fork, list[int]]:
    """In a spare: block until handed a request; exit when dropped or the zygote is gone."""
    got = receive(theirs)
    if got is None or not isinstance(got[0], Fork):
        os._exit(0)
    theirs.close()
    return got[0], got[1]
