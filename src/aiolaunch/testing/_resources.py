"""This process's open fds and signal handlers."""

from __future__ import annotations

import contextlib
import os
import signal

from .._workers._proc import HAVE_PROC, fd_target
from .._workers._proc import open_fds as _proc_fds

__all__ = ["SIGNALS", "open_fds", "signal_state"]

SIGNALS = tuple(
    sig
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)
    if isinstance(sig, signal.Signals)
)


def open_fds() -> dict[int, str]:
    """This process's open fds and what they point to: ``{fd: target}``."""
    fds: dict[int, str] = {}
    if not HAVE_PROC:  # pragma: no cover - macOS
        for name in os.listdir("/dev/fd"):
            with contextlib.suppress(OSError):  # the fd of the listing itself
                fds[int(name)] = _fd_kind(int(name))
        return fds
    for fd in _proc_fds() or ():
        target = fd_target(fd)
        if target is not None:  # else: the fd of the listing itself, closed by now
            fds[fd] = target
    return fds


def _fd_kind(fd: int) -> str:  # pragma: no cover - macOS
    import stat

    mode = os.fstat(fd).st_mode
    for test, kind in ((stat.S_ISFIFO, "pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "file")):
        if test(mode):
            return kind
    return "other"


def signal_state() -> dict[str, object]:
    """The handler of each of :data:`SIGNALS`, and the wakeup fd."""
    state: dict[str, object] = {sig.name: signal.getsignal(sig) for sig in SIGNALS}
    try:
        # set_wakeup_fd() both reads and sets: put the old value straight back.
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
    except ValueError:  # not the main thread (pytest-xdist worker threads, etc.)
        wakeup = None
    state["wakeup_fd"] = wakeup
    return state
