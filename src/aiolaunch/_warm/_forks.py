"""Workers forked from a zygote: their handle, and the three requests.

- :func:`spawn_script`: a Python command line (what the CLI runs,
  ``python -u -m aiolaunch._child._bootstrap script.py ARGS``) forked instead of
  exec'd; ``None`` for a command line the zygote cannot run the same way.
- :func:`fork_function`: a function worker (instead of multiprocessing).
- :func:`start_store`: a TCPStore host on a listening socket the supervisor
  bound (the agent's per-attempt store).

Each returns ``None`` where the worker cannot be forked faithfully (the
zygote is not clean, or the worker's load-time environment differs from the
zygote's), after a one-line warning: the caller starts it the ordinary way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from .._child._bootstrap import BOOTSTRAP
from .._workers._fds import close_fd
from .._workers._guardian import GUARDIAN_ENV, current_guardian, guardian
from .._workers._handle import WorkerHandle

if TYPE_CHECKING:
    from .._workers._function import ResultReader
    from ._zygote import Zygote

__all__ = ["ZygoteWorker", "fork_function", "script_form", "spawn_script", "start_store"]


class ZygoteWorker(WorkerHandle):
    """A worker forked from a zygote (whose child it is: the zygote reports its exit)."""

    def __init__(
        self, local_rank: int, *, result: ResultReader | None = None, session: bool = True
    ) -> None:
        super().__init__(local_rank)
        #: a function worker (its return value on ``result``) records its exceptions
        self.records_exceptions = result is not None
        self._session = session  # leads its own session: watched by the guardian
        self._zygote_pid = 0
        # Opened at the fork: read only if the zygote dies before the worker.
        self._pidfd: int | None = None
        self._watching = False
        self._result = result
        self._zygote: Zygote | None = None

    def forked(self, zygote: Zygote) -> None:
        """Called when the zygote answered with our pid (before any exit report)."""
        self._zygote = zygote
        self._zygote_pid = zygote.pid
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(self.pid)
        if self._session:
            g = guardian()
            if g is not None:
                g.watch(self.pid)

    def exited_with(self, rc: int) -> None:
        """The exit status, as the zygote (or the worker itself) reported it."""
        if self._result is not None:
            from .._workers._function import settle_result

            settle_result(self, self._result, rc)
            self._result = None
        self.set_exited(rc)
        self._close_pidfd()

    def orphaned(self) -> None:
        """The zygote died first: see the exit through the pidfd from now on."""
        if self.alive:
            self.rebind()

    def rebind(self) -> None:
        """(Re)register the pidfd reader on the running loop, once orphaned."""
        zygote = self._zygote
        if zygote is None or zygote.state != "dead" or self._pidfd is None:
            return
        if self._watching:
            return
        self._watching = True
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_orphan_exit)

    def _on_orphan_exit(self) -> None:
        assert self._zygote is not None
        self._zygote.workers.pop(self.pid, None)
        rc = self._zygote.reported.pop(self.pid, None)
        if rc is None:
            rc = 255
            self.fail(
                f"local rank {self.local_rank} (pid {self.pid}) exited with an unknown "
                f"status: the zygote that forked it (pid {self._zygote_pid}) died first"
            )
        self.exited_with(rc)

    def _close_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is None:
            return
        if self._watching:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            self._watching = False
        close_fd(fd)

    def release(self) -> None:
        if self.returncode is None:
            return
        self._close_pidfd()
        if self._result is not None:
            self._result.close()
            self._result = None
        if self._session:
            g = current_guardian()
            if g is not None:
                g.unwatch(self.pid)


def _ignored_signals() -> list[int]:
    out: list[int] = []
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ):
            continue
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(sig) is signal.SIG_IGN:
                out.append(sig)
    return out


def _std_fds(stdout: int | None, stderr: int | None) -> dict[str, int]:
    """fds 0/1/2 of the worker: the given ones, else the supervisor's (what a spawn inherits)."""
    fds: dict[str, int] = {}
    for name, fd, given in (("stdin", 0, None), ("stdout", 1, stdout), ("stderr", 2, stderr)):
        if given is not None:
            fds[name] = given
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue  # closed here: closed there
        fds[name] = fd
    return fds


def _common(env: dict[str, str]) -> dict[str, Any]:
    g = guardian()
    if g is not None:
        env = {**env, GUARDIAN_ENV: g.token}
    return {"env": env, "cwd": os.getcwd(), "ignored": _ignored_signals()}


def script_form(argv: list[str], env: dict[str, str]) -> dict[str, Any] | None:
    """How the zygote runs the Python command line ``argv``; ``None``: it cannot.

    Accepted: ``python [-u] -m aiolaunch._child._bootstrap [-m] TARGET ARGS`` (the
    CLI's; stack dumps registered), ``python [-u] script.py ARGS`` and
    ``python [-u] -m module ARGS``, where ``python`` is this interpreter.
    """
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    rest = list(argv[1:])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    if rest and rest[0] == "-u":
        unbuffered = True
        rest = rest[1:]
    if not rest:
        return None
    bootstrap = False
    if rest[0] == "-m" and len(rest) >= 2 and rest[1] == BOOTSTRAP:
        bootstrap = True
        rest = rest[2:]
    if not rest or (rest[0].startswith("-") and rest[0] != "-m") or rest == ["-m"]:
        return None
    return {"argv": rest, "unbuffered": unbuffered, "bootstrap": bootstrap, "orig_argv": argv}


async def spawn_script(
    zygote: Zygote,
    local_rank: int,
    argv: list[str],
    env: dict[str, str],
    stdout: int | None,
    stderr: int | None,
) -> ZygoteWorker | None:
    """Fork the Python command line ``argv`` from ``zygote``; ``None``: spawn it instead."""
    form = script_form(argv, env)
    if form is None or not await zygote.ready():
        return None
    why = zygote.refusal(env)
    if why is not None:
        zygote.warn(f"rank {local_rank} starts the ordinary way: {why}")
        return None
    handle = ZygoteWorker(local_rank)
    pid = await zygote.fork(
        {"job": "script", **_common(env), **form}, _std_fds(stdout, stderr), handle
    )
    return handle if pid is not None else None


async def fork_function(
    zygote: Zygote,
    *,
    local_rank: int,
    name: str,
    fn: bytes,
    args: bytes,
    env: dict[str, str],
    stdout: int | None,
    stderr: int | None,
    error_file: str,
) -> ZygoteWorker | None:
    """Fork a function worker from ``zygote``; ``None``: start it the ordinary way."""
    from .._workers._function import ResultReader

    if not await zygote.ready():
        return None
    full = {**os.environ, **env}
    why = zygote.refusal(full)
    if why is not None:
        zygote.warn(f"rank {local_rank} starts the ordinary way: {why}")
        return None
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
        result_r, result_w = os.pipe()
        always_cleanup.callback(close_fd, result_w)
        pipe = os.fdopen(result_r, "rb", buffering=0)
        cleanup_on_fail.callback(pipe.close)
        reader = ResultReader()
        await loop.connect_read_pipe(lambda: reader, pipe)  # the transport owns result_r
        cleanup_on_fail.callback(reader.close)
        handle = ZygoteWorker(local_rank, result=reader, session=False)
        req = {
            "job": "function",
            **_common(full),
            "rank": local_rank,
            "fn": fn,
            "args": args,
            "error_file": error_file,
            "sys_argv": list(sys.argv),
            "sys_path": list(sys.path),
            "supervisor_pid": os.getpid(),
            "process_name": f"{name}{local_rank}",
        }
        fds = {**_std_fds(stdout, stderr), "result": result_w}
        if await zygote.fork(req, fds, handle) is None:
            return None
        cleanup_on_fail.pop_all()
    return handle


async def start_store(
    zygote: Zygote, listen_fd: int, host: str, port: int, timeout: float
) -> tuple[ZygoteWorker, int] | None:
    """Fork a TCPStore host on ``listen_fd``: ``(handle, stop fd)``; closing the fd stops it."""
    if not await zygote.ready() or not zygote.torch_distributed:
        return None
    handle = ZygoteWorker(-1)
    with contextlib.ExitStack() as always_cleanup, contextlib.ExitStack() as cleanup_on_fail:
        stop_r, stop_w = os.pipe()
        always_cleanup.callback(close_fd, stop_r)
        cleanup_on_fail.callback(close_fd, stop_w)
        null = os.open(os.devnull, os.O_RDONLY)
        always_cleanup.callback(close_fd, null)
        fds = {**_std_fds(None, None), "stdin": null, "listen": listen_fd, "stop": stop_r}
        req = {"job": "store", **_common(dict(os.environ)), "host": host, "port": port}
        req["timeout"] = timeout
        if await zygote.fork(req, fds, handle) is None:
            return None
        cleanup_on_fail.pop_all()
    return handle, stop_w
