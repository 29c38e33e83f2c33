"""Starting a zygote process: its command line, fds, environment and session.

The zygote (:mod:`aiolaunch._child._zygote`) is spawned (``posix_spawn``,
not forked: nothing of the supervisor's state goes with it) with its
control socket, its status socket and the lifeline's read end as fds 3, 4
and 5, in a session of its own, with the guardian's token in its
environment and the guardian watching it: a SIGKILLed supervisor takes it
along.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from .._workers._guardian import GUARDIAN_ENV, guardian

if TYPE_CHECKING:
    from ._preload import Preload

__all__ = ["SET_BY_US", "start_zygote"]

#: variables the zygote's environment holds for its own sake, not the workers'
SET_BY_US = frozenset({GUARDIAN_ENV, "PYTORCH_NVML_BASED_CUDA_CHECK"})

_CODE = "from aiolaunch._child._zygote import main; main()"


def start_zygote(
    preload: Preload, env: dict[str, str], spares: int
) -> tuple[int, int, socket.socket, socket.socket]:
    """Start a zygote process: ``(pid, pidfd, control socket, status socket)``.

    ``spares``: children to fork ahead as soon as the imports are done (the
    size of the first group).
    """
    from .._workers._lifeline import lifeline_fds

    g = guardian()
    if g is not None:
        env[GUARDIAN_ENV] = g.token
    # The zygote must never initialise CUDA; this keeps a preloaded
    # module's torch.cuda.is_available() from doing it (NVML instead).
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    code = _CODE
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if here not in sys.path[1:]:  # aiolaunch was put on sys.path, not in the environment
        code = f"import sys; sys.path.insert(0, {here!r}); {_CODE}"
    if preload.folder:  # the workers' sys.path[0] (`python -c` has the current folder)
        code = f"import sys; sys.path[0] = {preload.folder!r}; {code}"
    now, later = ",".join(preload.now), ",".join(preload.later)
    argv = [sys.executable, "-c", code, "3", "4", "5", now, later, str(spares)]
    with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
        ctl, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        status, status_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for sock in (ctl, status):
            cleanup_on_fail.callback(sock.close)
        for sock in (ctl_child, status_child):
            always_cleanup.callback(sock.close)
        # fds 3, 4, 5 of the zygote, from copies above any of those numbers
        sources = (ctl_child.fileno(), status_child.fileno(), lifeline_fds()[0])
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in sources]
        for fd in high:
            always_cleanup.callback(os.close, fd)
        pid = os.posix_spawn(
            sys.executable,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, fd, n) for n, fd in zip((3, 4, 5), high, strict=True)
            ],
            setsid=True,  # as workers: no terminal, not in our group
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),  # as Popen(restore_signals)
        )
        cleanup_on_fail.pop_all()
    if g is not None:
        g.watch(pid)
    status.setblocking(False)
    return pid, os.pidfd_open(pid), ctl, status
