"""Warm start, supervisor side: :class:`Zygote`, one running zygote process.

A zygote (:mod:`._zygote`) imports the preload modules once and forks Python
workers from that state. One per supervisor process and ``(preload,
load-time environment)`` (:func:`zygote_for`), started on first use and kept
for the supervisor's lifetime - as the guardian and multiprocessing's
forkserver are - so every attempt of an agent and every ``start_processes``
call with the same preload reuses it. It dies with the supervisor (EOF on
its control socket; the guardian has its group and token too).

Exit statuses: the zygote is the workers' parent; it reaps them and reports
each raw wait status. Each worker also reports its own exit code on the
status socket just before it ends, which is what the supervisor uses if the
zygote died first (SIGKILLed mid-run: the workers it forked keep running,
their exits are seen through pidfds, and a new zygote replaces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any, Protocol

from .._child._zygote import load_time_items
from .._types import PerProcess
from .._workers import keep_for_life
from .._workers._guardian import GUARDIAN_ENV, current_guardian, guardian
from .._workers._proc import children
from ._channel import Channel, frame
from ._preload import Preload, supported

if TYPE_CHECKING:
    from collections.abc import Mapping


class Forked(Protocol):
    """What a zygote needs of a worker handle (``_forks.Forked``)."""

    pid: int

    def forked(self, zygote: Zygote) -> None: ...
    def exited_with(self, rc: int) -> None: ...
    def orphaned(self) -> None: ...
    def rebind(self) -> None: ...


__all__ = ["Zygote", "close_zygotes", "zygote_for", "zygote_helpers"]

log = logging.getLogger("aiolaunch.warm")

_CODE = "from aiolaunch._child._zygote import main; main()"


class Zygote:
    """One zygote process: start, readiness, fork requests, exit reports.

    ``state``: ``"starting"`` -> ``"ready"``, or ``"unusable"`` (no longer
    safe to fork: :attr:`why`), ``"failed"`` (a preload import), ``"dead"``.
    """

    def __init__(
        self, preload: Preload, env: Mapping[str, str], *, wait: bool = True, spares: int = 0
    ) -> None:
        self.preload = preload
        #: whether spawns wait for its imports (False: a replacement, used once ready)
        self.wait = wait
        self.load_env = load_time_items(env)
        self.state = "starting"
        self.why = ""
        self.failed_module: str | None = None
        self.torch_distributed = False
        #: live forked workers by pid, and the exit codes they reported themselves
        self.workers: dict[int, Forked] = {}
        self.reported: dict[int, int] = {}
        #: children forked ahead, waiting for a request (long-lived, as the zygote)
        self.spares: set[int] = set()
        self._warned: set[str] = set()
        self._pending: list[tuple[asyncio.Future[int | None], Forked | None]] = []
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pid, self.pidfd, ctl, self.status = _start(preload, dict(env), spares)
        self.ctl = Channel(ctl, self._dispatch)
        self.ctl.on_eof = lambda: self._died("its control socket closed")

    def fds(self) -> set[int]:
        """The fds this object holds (the leak check's long-lived ones)."""
        return {fd for fd in (self.ctl.sock.fileno(), self.status.fileno(), self.pidfd) if fd >= 0}

    def close(self) -> None:
        """Stop the zygote now (SIGKILL) and reap it; its workers are not touched."""
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._died("closed")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.status.fileno())
        self.status.close()

    # -- the loop ---------------------------------------------------------------
    def _bind(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return True
        old = self._loop
        if old is not None and old.is_running() and not old.is_closed():
            return False  # busy in another thread's loop: start workers the ordinary way
        if old is not None and not old.is_closed():
            old.remove_reader(self.status.fileno())
            if self.pidfd >= 0:
                old.remove_reader(self.pidfd)
        self.ctl.unbind()
        self._loop = loop
        self._ready = loop.create_future()
        if self.state != "starting":
            self._ready.set_result(None)
        loop.add_reader(self.status.fileno(), self._on_status)
        if self.pidfd >= 0:
            self.ctl.bind(loop)
            loop.add_reader(self.pidfd, self._died, "it exited")
        for w in self.workers.values():
            w.rebind()
        return True

    def _on_status(self) -> None:
        from .._child._forked import STATUS

        while True:
            try:
                data = self.status.recv(STATUS.size)
            except OSError:  # BlockingIOError: all read
                return
            if len(data) == STATUS.size:
                pid, code = STATUS.unpack(data)
                if pid in self.workers:
                    self.reported[pid] = code

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        log.debug("zygote %d: %s", self.pid, msg)
        if op == "spare":
            self.spares.add(msg["pid"])
        elif op == "exited":
            self.spares.discard(msg["pid"])
            worker = self.workers.pop(msg["pid"], None)
            self.reported.pop(msg["pid"], None)
            if worker is not None:
                worker.exited_with(os.waitstatus_to_exitcode(msg["status"]))
        elif op in ("forked", "refused"):
            fut, worker = self._pending.pop(0)
            pid = msg.get("pid")
            self.spares.discard(pid)
            if worker is not None and pid is not None:
                worker.pid = pid
                self.workers[pid] = worker
                worker.forked(self)
            if op == "refused":
                self._unusable(msg["reason"])
            if not fut.done():
                fut.set_result(pid)
        elif op == "ready":
            self.torch_distributed = bool(msg["torch_distributed"])
            self.state = "ready"
            if msg["hazard"]:
                self._unusable(msg["hazard"])
            self._set_ready()
        elif op == "failed":
            self.state, self.failed_module = "failed", msg["module"]
            self.why = f"importing {msg['module']!r} failed in the zygote:\n{msg['error']}"
            self._set_ready()
        elif op == "loaded" and msg.get("error"):
            self.warn(f"the zygote could not import {msg['module']!r}:\n{msg['error']}")

    def _set_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _unusable(self, why: str) -> None:
        if self.state in ("starting", "ready"):
            self.state, self.why = "unusable", why
        self.warn(f"{why}; starting workers the ordinary way")

    def warn(self, text: str) -> None:
        """Log ``text`` once per zygote (the one-line warning of a fallback)."""
        if text not in self._warned:
            self._warned.add(text)
            log.warning("aiolaunch: preload %s: %s", ",".join(self.preload.now), text)

    def _died(self, why: str) -> None:
        if self.pidfd < 0:
            return  # reaped already
        if self.state != "failed":
            self.state, self.why = "dead", f"the zygote (pid {self.pid}) died: {why}"
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.pidfd)
        self.ctl.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)  # it exited, or closed its socket as it exits
        os.close(self.pidfd)
        self.pidfd = -1
        g = current_guardian()
        if g is not None:
            g.unwatch(self.pid)
        for fut, _ in self._pending:
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()
        self._set_ready()
        for worker in list(self.workers.values()):
            worker.orphaned()  # watched through its pidfd from now on
        if why != "closed" and self.state == "dead":
            self.warn(f"{self.why}; its workers run on, a new zygote starts for later ones")

    # -- requests -------------------------------------------------------------------
    async def ready(self, wait: bool | None = None) -> bool:
        """Wait until the zygote imported its modules; ``False``: start workers the ordinary way.

        A replacement zygote (``wait=False`` at its start) is not waited for
        unless ``wait=True``: ``False`` while it imports.

        :raises ImportError: a preload module failed to import (the message
            names it and holds its traceback).
        """
        if not self._bind():
            return False
        assert self._ready is not None
        if not (self.wait if wait is None else wait) and not self._ready.done():
            return False
        await self._ready
        if self.state == "failed":
            raise ImportError(
                f"preload: {self.why}(to start workers without the zygote: --no-preload, "
                "or preload=False)",
                name=self.failed_module,
            )
        return self.state == "ready"

    def refusal(self, env: Mapping[str, str]) -> str | None:
        """Why a worker with environment ``env`` cannot be forked from this zygote."""
        if self.state != "ready":
            return self.why
        mine, theirs = dict(self.load_env), dict(load_time_items(env))
        for name in sorted(set(mine) | set(theirs)):
            if mine.get(name) != theirs.get(name):
                return (
                    f"{name}={theirs.get(name)!r} in the worker's environment but "
                    f"{mine.get(name)!r} in the zygote's (read when a library loads)"
                )
        return None

    async def fork(
        self, req: dict[str, Any], fds: dict[str, int], worker: Forked | None
    ) -> int | None:
        """Ask for a fork; the pid, or ``None`` (refused, or the zygote is gone)."""
        if not await self.ready():
            return None
        assert self._loop is not None and self.ctl.lock is not None
        request = frame({**req, "op": "fork", "fds": list(fds)})
        fut: asyncio.Future[int | None] = self._loop.create_future()
        async with self.ctl.lock:
            if self.state != "ready":
                return None
            self._pending.append((fut, worker))
            try:
                await self.ctl.send(request, list(fds.values()))
            except OSError:
                self._died("its control socket broke")
        return await fut

    async def import_later(self) -> None:
        """Tell the zygote to import its LATER modules now (the workers all started)."""
        if self.state != "ready" or not self.preload.later or not self._bind():
            return
        assert self.ctl.lock is not None
        async with self.ctl.lock:
            try:
                await self.ctl.send(frame({"op": "later"}), [])
            except OSError:
                self._died("its control socket broke")

    def __repr__(self) -> str:
        return (
            f"<Zygote pid={self.pid} preload={','.join(self.preload.now)} state={self.state}"
            f" workers={len(self.workers)}>"
        )


def _start(
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


_ZYGOTES: PerProcess[dict[tuple[Preload, frozenset[tuple[str, str]]], Zygote]] = PerProcess(dict)


def zygote_for(
    preload: Preload, extra_env: Mapping[str, str] | None = None, *, spares: int = 0
) -> Zygote | None:
    """This process's zygote for ``preload`` and the environment ``os.environ | extra_env``.

    ``spares``: a new zygote forks that many children ahead, ready for the
    first group's workers (its size).

    Started now (without waiting for its imports) if there is none yet.
    One that died (killed) is replaced, but the workers of the call that
    finds it dead do not wait for the new one: they start the ordinary way,
    later ones fork from it once it is ready. ``None`` where zygotes are not
    supported (not Linux, no pidfds).
    """
    if not supported():
        return None
    env = {**os.environ, **(extra_env or {})}
    key = (preload, load_time_items(env))
    zygotes = _ZYGOTES.get()
    z = zygotes.get(key)
    if z is None:
        z = zygotes[key] = Zygote(preload, env, spares=spares)
    elif z.state == "dead":
        if not z.workers:  # its orphans still need it (their self-reported statuses)
            z.close()
        z = zygotes[key] = Zygote(preload, env, wait=False)
    return z


def close_zygotes() -> None:
    """Stop every zygote of this process (the CLI, once its run is over)."""
    zygotes = _ZYGOTES.peek()
    if zygotes:
        for z in zygotes.values():
            z.close()
        zygotes.clear()


def zygote_helpers() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` of this process's zygotes: long-lived by design."""
    pids: set[int] = set()
    fds: set[int] = set()
    for z in (_ZYGOTES.peek() or {}).values():
        if z.pidfd >= 0:
            pids.add(z.pid)
            # Its spares: the children that are no worker (the zygote may have
            # forked one the supervisor has not heard of yet).
            pids |= (set(children(z.pid)) or z.spares) - set(z.workers)
        fds |= z.fds()
    return pids, fds


keep_for_life(zygote_helpers)
