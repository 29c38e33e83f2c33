"""Warm start, supervisor side: :class:`Zygote`, the supervisor's handle on one zygote process.

A zygote (:mod:`aiolaunch._child._zygote`) imports the preload modules once
and forks Python workers from that state. Which zygote serves which call,
and for how long, is :mod:`._registry`'s. A zygote dies with the supervisor
(EOF on its control socket; the guardian has its group and token too).

Exit statuses: the zygote is the workers' parent; it reaps them and reports
each raw wait status. The supervisor sees each exit itself through the
worker's pidfd and reads the status the kernel keeps for the zygote
(:mod:`._exits`); each worker also reports its own exit code on the status
socket just before it ends, which is what the supervisor uses if the zygote
died first (SIGKILLed mid-run: the workers it forked keep running, and a new
zygote replaces it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
from typing import TYPE_CHECKING, Protocol

from .._child._wire import (
    Exited,
    Failed,
    Fork,
    Forked,
    Later,
    Loaded,
    Ready,
    Refused,
    Spare,
)
from .._workers._guardian import current_guardian
from ._channel import Channel
from ._exits import SelfReports, zombie_status
from ._image import Image
from ._start import start_zygote

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._child._wire import Job, Message
    from ._preload import Preload


class ForkedWorker(Protocol):
    """What a zygote needs of a worker handle (``_forks.ZygoteWorker``)."""

    pid: int

    def forked(self, zygote: Zygote) -> None: ...
    def exited_with(self, rc: int) -> None: ...
    def orphaned(self) -> None: ...
    def rebind(self) -> None: ...


__all__ = ["Zygote", "ZygoteState"]

log = logging.getLogger("aiolaunch.warm")


class ZygoteState(enum.Enum):
    """Where a zygote is in its life, as the supervisor knows it (:attr:`Zygote.state`)."""

    #: The process was spawned and imports its NOW modules: requests wait
    #: for its :class:`~aiolaunch._child._wire.Ready` (a replacement's do not).
    STARTING = "starting"
    #: Its :class:`~aiolaunch._child._wire.Ready` came without a hazard: it
    #: serves fork requests.
    READY = "ready"
    #: It said forking is no longer safe (a hazard in its ``Ready``, or a
    #: :class:`~aiolaunch._child._wire.Refused`): workers start the ordinary
    #: way; :attr:`Zygote.why` says why. It stays up for the workers it forked.
    UNUSABLE = "unusable"
    #: A NOW module raised at import (:class:`~aiolaunch._child._wire.Failed`):
    #: :meth:`Zygote.ready` raises ImportError. Final.
    FAILED = "failed"
    #: The process is gone (it exited, was killed, its control socket closed,
    #: or :meth:`Zygote.close`): its orphans are watched through their pidfds,
    #: a new zygote starts for later requests (:func:`zygote_for`). Final.
    DEAD = "dead"


class _Pending:
    """The fork requests the zygote has not answered yet: it answers them in order."""

    def __init__(self) -> None:
        self._waiting: list[tuple[asyncio.Future[int | None], ForkedWorker | None]] = []

    def add(self, fut: asyncio.Future[int | None], worker: ForkedWorker | None) -> None:
        self._waiting.append((fut, worker))

    def answer(self, pid: int | None) -> ForkedWorker | None:
        """The oldest request's answer (``None``: refused); its worker.

        Its requester resumes on a later turn of the loop: after the caller
        bound the worker to ``pid``.
        """
        fut, worker = self._waiting.pop(0)
        if not fut.done():
            fut.set_result(pid)
        return worker

    def answer_all(self, pid: int | None) -> None:
        """The zygote is gone: every request waiting gets ``pid``."""
        while self._waiting:
            self.answer(pid)


class Zygote:
    """One zygote process: start, readiness, fork requests, exit reports.

    The one owner of its table of forked workers (:attr:`workers`, and the
    exit codes they reported themselves, :attr:`reports`): a worker leaves
    it through the zygote's exit report, :meth:`exit_seen` or
    :meth:`orphan_exited`.
    """

    def __init__(
        self, preload: Preload, env: Mapping[str, str], *, wait: bool = True, spares: int = 0
    ) -> None:
        self.preload = preload
        #: whether spawns wait for its imports (False: a replacement, used once ready)
        self.wait = wait
        #: what its workers inherit, and which workers may be forked from it
        self.image = Image(env)
        self.state = ZygoteState.STARTING
        self.why = ""
        self.failed_module: str | None = None
        self.torch_distributed = False
        #: live forked workers by pid
        self.workers: dict[int, ForkedWorker] = {}
        #: children forked ahead, waiting for a request (long-lived, as the zygote)
        self.spares: set[int] = set()
        self._warned: set[str] = set()
        self._pending = _Pending()
        self._ready: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pid, self.pidfd, ctl, status = start_zygote(preload, dict(env), spares)
        #: the exit codes the workers reported themselves
        self.reports = SelfReports(status, lambda pid: pid in self.workers)
        self.ctl = Channel(ctl, self._dispatch)
        self.ctl.on_eof = lambda: self._died("its control socket closed")

    def fds(self) -> set[int]:
        """The fds this object holds (the leak check's long-lived ones)."""
        fds = (self.ctl.sock.fileno(), self.reports.sock.fileno(), self.pidfd)
        return {fd for fd in fds if fd >= 0}

    def close(self) -> None:
        """Stop the zygote now (SIGKILL) and reap it; its workers are not touched."""
        if self.pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._died("closed")
        self.reports.close()

    # -- the loop ---------------------------------------------------------------
    def _bind(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return True
        old = self._loop
        if old is not None and old.is_running() and not old.is_closed():
            return False  # busy in another thread's loop: start workers the ordinary way
        if old is not None and not old.is_closed() and self.pidfd >= 0:
            old.remove_reader(self.pidfd)
        self.ctl.unbind()
        self._loop = loop
        self._ready = loop.create_future()
        if self.state is not ZygoteState.STARTING:
            self._ready.set_result(None)
        self.reports.bind(loop)
        if self.pidfd >= 0:
            self.ctl.bind(loop)
            loop.add_reader(self.pidfd, self._died, "it exited")
        for w in self.workers.values():
            w.rebind()
        return True

    def _dispatch(self, msg: Message) -> None:
        log.debug("zygote %d: %s", self.pid, msg)
        match msg:
            case Spare(pid):
                self.spares.add(pid)
            case Exited(pid, status):
                self.spares.discard(pid)
                worker = self.workers.pop(pid, None)
                self.reports.forget(pid)
                if worker is not None:
                    worker.exited_with(os.waitstatus_to_exitcode(status))
            case Forked(pid):
                self.spares.discard(pid)
                worker = self._pending.answer(pid)
                if worker is not None:
                    worker.pid = pid
                    self.workers[pid] = worker
                    worker.forked(self)
            case Refused(reason):
                self._unusable(reason)
                self._pending.answer(None)
            case Ready(_pid, hazard, torch_distributed, provenance):
                self.torch_distributed = torch_distributed
                self.image.imported(provenance)
                self.state = ZygoteState.READY
                if hazard:
                    self._unusable(hazard)
                self._set_ready()
            case Failed(module, error):
                self.state, self.failed_module = ZygoteState.FAILED, module
                self.why = f"importing {module!r} failed in the zygote:\n{error}"
                self._set_ready()
            case Loaded(module, error, provenance):
                self.image.imported(provenance)
                if error:
                    self.warn(f"the zygote could not import {module!r}:\n{error}")
            case _:
                pass

    def exit_seen(self, pid: int, pidfd: int) -> int | None:
        """The exit code of a worker whose pidfd turned readable, if it can be known now.

        While the zygote lives, the kernel keeps the status for it until it
        reaps the worker: read then, the exit is known at once even while
        the zygote is busy (importing, forking spares). ``None``: the zygote
        reaped it already (its report is on the way), or the status read 0
        without the worker's own report of 0 to vouch for it. The worker
        leaves the table when its code is returned.
        """
        code = zombie_status(pid, pidfd)
        if code is None or (code == 0 and self.reports.peek(pid) != 0):
            return None
        self.workers.pop(pid, None)
        self.reports.forget(pid)
        return code

    def orphan_exited(self, pid: int) -> int | None:
        """A worker whose exit the zygote will never report (it died first) exited.

        Drops it from the table; returns the exit code it reported itself,
        or ``None`` if it reported none (killed by a signal).
        """
        self.workers.pop(pid, None)
        return self.reports.take(pid)

    def _set_ready(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _unusable(self, why: str) -> None:
        if self.state in (ZygoteState.STARTING, ZygoteState.READY):
            self.state, self.why = ZygoteState.UNUSABLE, why
        self.warn(f"{why}; starting workers the ordinary way")

    def warn(self, text: str) -> None:
        """Log ``text`` once per zygote (the one-line warning of a fallback)."""
        if text not in self._warned:
            self._warned.add(text)
            log.warning("aiolaunch: preload %s: %s", ",".join(self.preload.now), text)

    def _died(self, why: str) -> None:
        if self.pidfd < 0:
            return  # reaped already
        if self.state is not ZygoteState.FAILED:
            self.state, self.why = ZygoteState.DEAD, f"the zygote (pid {self.pid}) died: {why}"
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
        self._pending.answer_all(None)
        self._set_ready()
        for worker in list(self.workers.values()):
            worker.orphaned()  # watched through its pidfd from now on
        if why != "closed" and self.state is ZygoteState.DEAD:
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
        if self.state is ZygoteState.FAILED:
            raise ImportError(
                f"preload: {self.why}(to start workers without the zygote: --no-preload, "
                "or preload=False)",
                name=self.failed_module,
            )
        return self.state is ZygoteState.READY

    def refusal(self, env: Mapping[str, str]) -> str | None:
        """Why a worker with environment ``env`` cannot be forked from this zygote."""
        if self.state is not ZygoteState.READY:
            return self.why
        return self.image.refusal(env)

    async def fork(
        self,
        job: Job,
        fds: dict[str, int],
        env: dict[str, str],
        ignored: list[int],
        worker: ForkedWorker | None,
    ) -> int | None:
        """Ask for a fork of ``job`` with ``fds``, environment ``env`` and the
        ``ignored`` signals; the pid, or ``None`` (refused, or the zygote is gone)."""
        if not await self.ready():
            return None
        assert self._loop is not None and self.ctl.lock is not None
        request = Fork(job, tuple(fds), env, os.getcwd(), tuple(ignored))
        fut: asyncio.Future[int | None] = self._loop.create_future()
        async with self.ctl.lock:
            if self.state is not ZygoteState.READY:
                return None
            self._pending.add(fut, worker)
            try:
                await self.ctl.send(request, list(fds.values()))
            except OSError:
                self._died("its control socket broke")
        return await fut

    async def import_later(self) -> None:
        """Tell the zygote to import its LATER modules now (the workers all started)."""
        if self.state is not ZygoteState.READY or not self.preload.later or not self._bind():
            return
        assert self.ctl.lock is not None
        async with self.ctl.lock:
            try:
                await self.ctl.send(Later(), [])
            except OSError:
                self._died("its control socket broke")

    def __repr__(self) -> str:
        return (
            f"<Zygote pid={self.pid} preload={','.join(self.preload.now)} state={self.state.value}"
            f" workers={len(self.workers)}>"
        )
