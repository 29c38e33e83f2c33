"""This process's open fds and signal handlers."""

from __future__ import annotations

import os
import signal

from ._processes import HAVE_PROC

__all__ = ["SIGNALS", "open_fds", "signal_state"]

SIGNALS = tuple(
    sig
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)
    if isinstance(sig, signal.Signals)
)

_FD_DIR = "/proc/self/fd" if HAVE_PROC else "/dev/fd"


def open_fds() -> dict[int, str]:
    """This process's open fds and what they point to: ``{fd: target}``."""
    fds: dict[int, str] = {}
    for name in os.listdir(_FD_DIR):
        fd = int(name)
        try:
            target = os.readlink(f"{_FD_DIR}/{fd}") if HAVE_PROC else _fd_kind(fd)
        except OSError:  # the fd of the listing itself, closed by now
            continue
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
