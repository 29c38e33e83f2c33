"""The zygote process: imports the preload modules once, then forks Python workers.

Started by the supervisor (:mod:`._warm`) as ``python -c "...main()" CTL
STATUS LIFELINE NOW LATER``. It imports the modules of ``NOW`` (comma
separated), says ``ready``, and serves fork requests on the ``CTL`` socket
until its EOF (the supervisor closed it, or died: even a SIGKILLed
supervisor takes its zygote along). Between requests, once it has forked at
least once and sat idle for a moment (or when the supervisor says its
workers all started: ``later``), it imports the modules of ``LATER``
(torch's lazily imported parts: a restart then skips them too), then forks
spare children that wait for the next requests (:class:`_Server`).

What it must never do, and checks before every fork (:func:`fork_hazard`):
run a second thread (an OpenMP pool: the first parallel op of a forked child
would hang) or initialise CUDA (a CUDA context never survives a fork). It
runs no op itself; a preload module that does either at import time makes it
refuse to fork, and the supervisor starts those workers the ordinary way.

Its messages, and their one codec, are :mod:`._wire`'s: requests
:class:`~._wire.Fork` and :class:`~._wire.Later`; replies
:class:`~._wire.Ready`, :class:`~._wire.Failed` (a preload import),
:class:`~._wire.Loaded` (a later import), :class:`~._wire.Forked` /
:class:`~._wire.Refused` (one per request, in order), :class:`~._wire.Spare`
(a child forked ahead) and :class:`~._wire.Exited` (a child's raw wait
status; the zygote is the parent and reaps it).

Imports only the standard library and aiolaunch's light modules: the
workers inherit every module it holds.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from ._proc import library_loaded, open_fds, thread_ids
from ._wire import (
    Exited,
    Failed,
    Fork,
    Forked,
    FunctionJob,
    Later,
    Loaded,
    Ready,
    Refused,
    Spare,
    receive,
    send,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = [
    "LOAD_TIME_NAMES",
    "LOAD_TIME_PREFIXES",
    "fork_hazard",
    "load_time_items",
    "main",
]

#: idle time (seconds) after a request before a LATER import or a spare fork
IDLE = 0.1
#: the most spares a zygote keeps
MAX_SPARES = 16

#: Environment variables read when the interpreter starts or a preloaded
#: library loads (the interpreter's, glibc's, OpenMP's, BLAS's, torch's). A
#: worker is forked only if its environment agrees with the zygote's on all
#: of them; else it is started the ordinary way, where they take effect.
LOAD_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "TORCH_",
    "PYTORCH_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
)
LOAD_TIME_NAMES = frozenset({"LANG", "LANGUAGE"})


def load_time_items(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """The ``(name, value)`` pairs of ``env`` that are read at load time."""
    return frozenset(
        (k, v) for k, v in env.items() if k in LOAD_TIME_NAMES or k.startswith(LOAD_TIME_PREFIXES)
    )


# -- fork safety ----------------------------------------------------------------
def _threads() -> int:
    tids = thread_ids()
    if tids is None:  # pragma: no cover - no procfs
        import threading

        return threading.active_count()
    return len(tids)


def _probe_fork() -> None:
    # A fork runs the pthread_atfork handlers: OpenBLAS (imported by numpy,
    # which torch imports) stops its thread pool there and starts it again
    # only at its next call, which the zygote never makes.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitpid(pid, 0)


def _cuda_loaded() -> bool:
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None:
        try:
            if cuda.is_initialized():
                return True
        except Exception:  # pragma: no cover - a broken torch
            return True
    # The CUDA driver is loaded by the first CUDA call, not by torch's
    # import; torch.cuda.is_available() loads it unless
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 (set in the zygote's environment).
    return library_loaded(b"/libcuda.so")


def fork_hazard() -> str | None:
    """Why a fork of this process now could give a broken child; ``None``: safe."""
    n = _threads()
    if n > 1:
        _probe_fork()
        n = _threads()
        if n > 1:
            return (
                f"{n} threads run in the zygote (a preloaded module started a thread "
                "or ran a parallel op at import)"
            )
    if _cuda_loaded():
        return "CUDA was initialised in the zygote (a preloaded module touched the GPU)"
    return None


# -- the process ------------------------------------------------------------------
def _close_inherited(keep: set[int]) -> None:
    # As Popen(close_fds=True): a worker starts with no fd the supervisor
    # happened to leave inheritable.
    for fd in open_fds():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _import_error(exc: BaseException) -> str:
    """The traceback of a failed import, from the module's own frames on."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename.startswith("<frozen")
        or (
            os.path.basename(tb.tb_frame.f_code.co_filename) in ("_zygote.py", "__init__.py")
            and "importlib" in tb.tb_frame.f_code.co_filename + tb.tb_frame.f_code.co_name
        )
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _signal_state() -> dict[int, Any]:
    state: dict[int, Any] = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            state[sig] = signal.getsignal(sig)
        except (OSError, ValueError):  # pragma: no cover
            pass
    return state


class _Server:
    """The zygote's request loop. :meth:`serve` returns only in a forked child.

    *Spares*: once idle, the zygote forks (while it is safe to) as many
    children as the largest burst of requests so far (at most
    :data:`MAX_SPARES`); each waits on a socket of its own for its request.
    A restart then hands its ranks to spares instead of forking them one
    after the other (a fork of a torch-sized process takes 10-25 ms). Spares
    made before a LATER import are dropped: they lack the module.
    """

    def __init__(
        self, ctl: socket.socket, status_fd: int, lifeline_fd: int, spares: int = 0
    ) -> None:
        self.ctl = ctl
        self.status_fd = status_fd
        self.lifeline_fd = lifeline_fd
        self.signals = _signal_state()
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.spares: list[tuple[int, socket.socket]] = []  # (pid, our end of its socket)
        # spares to keep: the largest burst so far (at first, the group size
        # the supervisor expects: they are forked at once, ahead of its requests)
        self.want = min(spares, MAX_SPARES)
        self.burst = 0  # requests since the zygote was last idle
        self.later: list[str] = []
        self.poll = select.poll()
        self.poll.register(ctl, select.POLLIN)
        self.forked = False

    def serve(self, later: list[str]) -> Callable[[], None]:
        self.later = later
        while True:
            short = len(self.spares) < self.want
            if short and not self.forked:
                timeout: int | None = 0  # the first group's spares: now, requests first
            elif self.forked and (self.later or short):
                timeout = int(IDLE * 1000)
            else:
                timeout = None
            events = self.poll.poll(timeout)
            if not events:
                job = self._idle()
                if job is not None:
                    return job
                continue
            for fd, _ in events:
                if fd == self.ctl.fileno():
                    got = receive(self.ctl)
                    if got is None:
                        os._exit(0)  # the supervisor closed the zygote, or died
                    msg, fds = got
                    if isinstance(msg, Later):  # the workers started: import now
                        self._import_later()
                        continue
                    job = self._request(msg, fds)
                    if job is not None:
                        return job
                else:
                    self._reap(fd)

    def _idle(self) -> Callable[[], None] | None:
        self.burst = 0
        if self.later and self.forked:
            self._import_later()
            return None
        return self._spare()

    def _import_later(self) -> None:
        import importlib

        while self.later:
            name = self.later.pop(0)
            error = None
            try:
                importlib.import_module(name)
            except BaseException as exc:
                error = _import_error(exc)
            gc.freeze()
            send(self.ctl, Loaded(name, error))
        for pid, sock in self.spares:  # made without the module
            sock.close()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover
                pass
        self.spares.clear()

    def _spare(self) -> Callable[[], None] | None:
        if fork_hazard() is not None:
            self.want = 0  # the next request is refused, with the reason
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._forget()
            got = receive(theirs)  # blocks until it is handed a worker
            if got is None or not isinstance(got[0], Fork):
                os._exit(0)  # dropped, or the zygote is gone
            theirs.close()
            return self._become(got[0], got[1])
        theirs.close()
        self._watch(pid)
        self.spares.append((pid, ours))
        send(self.ctl, Spare(pid))
        return None

    def _reap(self, pidfd: int) -> None:
        pid = self.children[pidfd]
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # pragma: no cover - reaped elsewhere
            got, status = pid, 255 << 8
        if got == 0:  # pragma: no cover - readable means exited
            return
        self.poll.unregister(pidfd)
        os.close(pidfd)
        del self.children[pidfd]
        send(self.ctl, Exited(pid, status))

    def _watch(self, pid: int) -> None:
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.poll.register(pidfd, select.POLLIN)

    def _request(self, req: object, fds: list[int]) -> Callable[[], None] | None:
        if not isinstance(req, Fork):
            for fd in fds:
                os.close(fd)
            return None
        self.burst += 1
        self.want = min(max(self.want, self.burst), MAX_SPARES)
        pid = self._hand_to_spare(req, fds)
        if pid is None:
            hazard = fork_hazard()
            if hazard is not None:
                for fd in fds:
                    os.close(fd)
                send(self.ctl, Refused(hazard))
                return None
            pid = os.fork()
            if pid == 0:
                self._forget()
                return self._become(req, fds)
            self._watch(pid)
        self.forked = True
        if isinstance(req.job, FunctionJob):
            try:
                os.setpgid(pid, pid)  # as the child will: no window where it shares ours
            except OSError:
                pass
        for fd in fds:
            os.close(fd)
        send(self.ctl, Forked(pid))
        return None

    def _hand_to_spare(self, req: Fork, fds: list[int]) -> int | None:
        while self.spares:
            pid, sock = self.spares.pop(0)
            try:
                send(sock, req, fds)  # checked for safety when it was forked
            except OSError:
                continue  # it died: the next one, or a fork
            finally:
                sock.close()
            return pid
        return None

    def _forget(self) -> None:
        """In a new child: close what only the zygote may hold."""
        for pidfd in self.children:
            os.close(pidfd)
        for _, sock in self.spares:
            sock.close()
        self.ctl.close()

    def _become(self, req: Fork, fds: list[int]) -> Callable[[], None]:
        from ._forked import ChildContext, become

        ctx = ChildContext(
            status_fd=self.status_fd, lifeline_fd=self.lifeline_fd, signals=self.signals
        )
        return become(req, fds, ctx)


def main() -> None:
    """Run the zygote (``sys.argv``: CTL STATUS LIFELINE NOW LATER SPARES)."""
    ctl_fd, status_fd, lifeline_fd = (int(a) for a in sys.argv[1:4])
    now = [m for m in sys.argv[4].split(",") if m]
    later = [m for m in sys.argv[5].split(",") if m]
    spares = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    _close_inherited({ctl_fd, status_fd, lifeline_fd})
    os.set_inheritable(status_fd, False)  # workers keep them; what they exec does not
    os.set_inheritable(lifeline_fd, False)
    ctl = socket.socket(fileno=ctl_fd)
    gc.disable()  # no collection makes holes in pages the workers share
    # What every forked worker runs first: imported once, here.
    import cloudpickle  # noqa: F401

    from . import _bootstrap, _dump_handler, _error_file, _forked, _function  # noqa: F401

    for name in now:
        import importlib

        try:
            importlib.import_module(name)
        except BaseException as exc:
            send(ctl, Failed(name, _import_error(exc)))
            os._exit(1)
    gc.freeze()
    server = _Server(ctl, status_fd, lifeline_fd, spares)
    send(ctl, Ready(os.getpid(), fork_hazard(), "torch.distributed" in sys.modules))
    job = server.serve(later)
    job()  # in a forked worker: never returns (SystemExit ends the interpreter)
