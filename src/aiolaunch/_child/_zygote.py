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

What it must never do, and checks before every fork
(:func:`._safety.fork_hazard`): run a second thread (an OpenMP pool: the
first parallel op of a forked child would hang) or initialise CUDA (a CUDA
context never survives a fork). It runs no op itself; a preload module that
does either at import time makes it refuse to fork, and the supervisor
starts those workers the ordinary way.

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

import contextlib
import fcntl
import gc
import importlib
import os
import select
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from ._proc import open_fds
from ._provenance import EnvReads, Provenance, module_files
from ._safety import fork_hazard
from ._spares import Spares, wait_for_request
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
    from collections.abc import Callable, Iterator

__all__ = ["main"]

#: idle time (seconds) after a request before a LATER import or a spare fork
IDLE = 0.1


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

    *Spares* (:mod:`._spares`): once idle, the zygote forks (while it is
    safe to) children that wait for the next requests.

    *LATER imports* take a second or more (torch._dynamo) and cannot be
    interrupted, and a fork in the middle of one would give a child with
    half-run modules. So the spares are forked first, and while a module
    imports, the control socket raises SIGIO (``O_ASYNC``), whose handler
    runs between the import's bytecodes (:meth:`_serve_importing`): a
    request is handed to a spare at once - a failure in the first seconds
    restarts as fast as a later one - or, with no spare left, forked once
    the import is done. Spares that outlive the import are dropped then:
    they lack the module.
    """

    def __init__(
        self, ctl: socket.socket, status_fd: int, lifeline_fd: int, spares: int = 0
    ) -> None:
        self.ctl = ctl
        self.status_fd = status_fd
        self.lifeline_fd = lifeline_fd
        self.signals = _signal_state()
        self.children: dict[int, int] = {}  # pidfd -> pid
        # at first, as many as the group size the supervisor expects: forked
        # at once, ahead of its requests
        self.spares = Spares(spares)
        self.later: list[str] = []
        self.later_asked = False  # the supervisor said its workers all started
        self.poll = select.poll()
        self.poll.register(ctl, select.POLLIN)
        self.forked = False
        # requests that came during an import with no spare left: forked after it
        self.deferred: list[tuple[Fork, list[int]]] = []
        self._serving = False  # in _serve_importing (a signal handler: no re-entry)

    def serve(self, later: list[str]) -> Callable[[], None]:
        self.later = later
        while True:
            events = self.poll.poll(self._timeout())
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
                        self.later_asked = True
                        continue
                    job = self._request(msg, fds)
                    if job is not None:
                        return job
                else:
                    self._reap(fd)

    def _timeout(self) -> int | None:
        """How long the loop waits for a request before :meth:`_idle` (ms; ``None``: for ever)."""
        if self.later and self.later_asked:
            return 0  # the spares, then the import: now, requests first
        if not self.forked:
            return 0 if self.spares.short else None  # the first group's: now, requests first
        return int(IDLE * 1000) if self.later or self.spares.short else None

    def _idle(self) -> Callable[[], None] | None:
        self.spares.idle()
        if self.spares.short:
            return self._spare()  # before a LATER import too: they serve the requests meanwhile
        if self.later and (self.forked or self.later_asked):
            self._import_later()
            return self._run_deferred()
        return None

    def _import_later(self) -> None:
        while self.later:
            name = self.later.pop(0)
            error = None
            with self._served(), EnvReads() as reads:
                try:
                    importlib.import_module(name)
                except BaseException as exc:
                    error = _import_error(exc)
            gc.freeze()
            send(self.ctl, Loaded(name, error, Provenance(module_files(), reads.seen)))
        self.spares.drop()  # made without the module

    @contextlib.contextmanager
    def _served(self) -> Iterator[None]:
        """Serve the control socket from SIGIO while the body runs (an import)."""
        fd = self.ctl.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        old = signal.signal(signal.SIGIO, self._serve_importing)
        signal.siginterrupt(signal.SIGIO, False)  # SA_RESTART: the import's own calls go on
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
        try:
            self._serve_importing()  # what came before the signal was armed
            yield
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # no SIGIO from here on (its default kills)
            signal.signal(signal.SIGIO, old)

    def _serve_importing(self, *_: object) -> None:
        """During an import: hand each request that waits to a spare, or defer it.

        A signal handler: it runs between two bytecodes of the import, in the
        main thread. It never forks, never imports, never raises (into the
        import), and is not re-entered; a request that comes while it runs
        is read by its next turn of the loop.
        """
        if self._serving:
            return
        try:
            while select.select([self.ctl], [], [], 0)[0]:
                self._serving = True
                try:
                    got = receive(self.ctl)
                    if got is None:
                        os._exit(0)  # the supervisor closed the zygote, or died
                    msg, fds = got
                    if isinstance(msg, Later):
                        continue  # importing already
                    if not isinstance(msg, Fork):
                        _close(fds)
                        continue
                    self.spares.counted()
                    if self.deferred or not self._handed(msg, fds):
                        self.deferred.append((msg, fds))  # in order, after the import
                finally:
                    self._serving = False
        except BaseException:  # pragma: no cover - the socket broke: the supervisor is gone
            os._exit(0)

    def _run_deferred(self) -> Callable[[], None] | None:
        while self.deferred:
            req, fds = self.deferred.pop(0)
            job = self._place(req, fds)
            if job is not None:
                return job
        return None

    def _spare(self) -> Callable[[], None] | None:
        if fork_hazard() is not None:
            self.spares.stop()  # the next request is refused, with the reason
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            self._forget()
            return self._become(*wait_for_request(theirs))
        theirs.close()
        self._watch(pid)
        self.spares.add(pid, ours)
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
            _close(fds)
            return None
        self.spares.counted()
        return self._place(req, fds)

    def _place(self, req: Fork, fds: list[int]) -> Callable[[], None] | None:
        """Hand ``req`` to a spare, or fork it; the job in the forked child."""
        if self._handed(req, fds):
            return None
        hazard = fork_hazard()
        if hazard is not None:
            _close(fds)
            send(self.ctl, Refused(hazard))
            return None
        pid = os.fork()
        if pid == 0:
            self._forget()
            return self._become(req, fds)
        self._watch(pid)
        self._answer(req, pid, fds)
        return None

    def _handed(self, req: Fork, fds: list[int]) -> bool:
        """Hand ``req`` to a spare (checked for safety when it was forked), if one is left."""
        pid = self.spares.hand(req, fds)
        if pid is None:
            return False
        self._answer(req, pid, fds)
        return True

    def _answer(self, req: Fork, pid: int, fds: list[int]) -> None:
        self.forked = True
        if isinstance(req.job, FunctionJob):
            try:
                os.setpgid(pid, pid)  # as the child will: no window where it shares ours
            except OSError:
                pass
        _close(fds)
        send(self.ctl, Forked(pid))

    def _forget(self) -> None:
        """In a new child: close what only the zygote may hold."""
        for pidfd in self.children:
            os.close(pidfd)
        self.spares.forget()
        for _, fds in self.deferred:
            _close(fds)
        self.ctl.close()

    def _become(self, req: Fork, fds: list[int]) -> Callable[[], None]:
        from ._forked import ChildContext, become

        ctx = ChildContext(
            status_fd=self.status_fd, lifeline_fd=self.lifeline_fd, signals=self.signals
        )
        return become(req, fds, ctx)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


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

    with EnvReads() as reads:
        for name in now:
            try:
                importlib.import_module(name)
            except BaseException as exc:
                send(ctl, Failed(name, _import_error(exc)))
                os._exit(1)
    gc.freeze()
    server = _Server(ctl, status_fd, lifeline_fd, spares)
    provenance = Provenance(module_files(), reads.seen)
    send(ctl, Ready(os.getpid(), fork_hazard(), "torch.distributed" in sys.modules, provenance))
    job = server.serve(later)
    job()  # in a forked worker: never returns (SystemExit ends the interpreter)
