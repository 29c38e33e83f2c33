"""The agent's warm start: its zygote, and a fresh store for every attempt.

With ``preload`` the agent's Python workers are forked from one zygote
(``_warm/_zygote.py``), kept across attempts: a restart forks workers that
already imported torch. On one node (the static rendezvous), the agent also
hosts each attempt's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``, as
torchrun's agent does), but unlike torchrun's it is a new store for every
attempt - no key of a failed attempt (gloo's peer addresses) is read by the
next one - and its listening socket is bound by the agent *before* any worker
starts: a worker's connect never meets a closed port, so torch's connect
retry (and its back-off, 0.25 s and more) never runs.

The store is a process forked from the zygote (torch is imported there).
Where the port is the agent's to choose (no ``--master-port``), the next
attempt's store is started while the current attempt runs, on a port the
kernel picks: a restart neither forks a store nor waits for the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING

from .._warm._preload import resolve_preload, workers_folder
from ._env import shared_env

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._warm._forks import ZygoteWorker
    from .._warm._preload import Preload
    from .._warm._zygote import Zygote
    from ._env import GroupAssignment
    from ._rendezvous import Rendezvous
    from ._spec import WorkerSpec

__all__ = ["WarmStart"]

log = logging.getLogger("aiolaunch.agent")

#: the store's own timeout (torch's default process-group timeout)
STORE_TIMEOUT = 1800.0
#: how long a stopped store may take to exit before it is killed
STORE_STOP_GRACE = 5.0


def _listen(port: int) -> socket.socket:
    """A listening TCP socket on every address, as TCPStore's own server binds."""
    if socket.has_dualstack_ipv6():
        with contextlib.suppress(OSError):
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=socket.SOMAXCONN
            )
    return socket.create_server(("", port), backlog=socket.SOMAXCONN)


@dataclasses.dataclass
class _Store:
    handle: ZygoteWorker
    stop: int  # closing it stops the store
    port: int


class WarmStart:
    """One agent's zygote (``preload``) and the stores of its attempts.

    :param auto_port: whether the master port is the agent's to choose (the
        static rendezvous without a fixed port): then the next store waits
        ready on a port of its own.
    """

    def __init__(
        self, preload: Preload | None, local_world_size: int, auto_port: Callable[[], bool]
    ) -> None:
        self.preload = preload
        self._nproc = local_world_size
        self._auto_port = auto_port
        self._store: _Store | None = None  # the current attempt's
        self._next: _Store | None = None  # ready for the next attempt
        self._stopping: list[_Store] = []
        self._stores = True  # off after a store failed
        self._task: asyncio.Future[None] | None = None  # started()'s work

    @classmethod
    def for_agent(cls, preload: object, spec: WorkerSpec, rdzv: Rendezvous) -> WarmStart:
        """An agent's: ``preload`` as the agent got it (checked here); the port
        is the agent's when the spec fixes none and the rendezvous lets it."""
        return cls(
            # a script's folder (the workers' sys.path[0]), as start_processes finds it
            resolve_preload(preload, folder=workers_folder(spec.entrypoint, spec.args)),
            spec.local_world_size,
            auto_port=lambda: spec.master_port is None and getattr(rdzv, "auto_port", False),
        )

    @property
    def names(self) -> list[str] | None:
        """``start_processes(preload=...)`` for the attempts (the same zygote)."""
        return None if self.preload is None else list(self.preload.now)

    def zygote(self) -> Zygote | None:
        """The zygote the agent's workers fork from (the one ``start_processes`` finds)."""
        if self.preload is None:
            return None
        from .._warm._zygote import zygote_for

        return zygote_for(self.preload, shared_env(self._nproc, os.environ))

    async def _start_store(self, host: str, port: int) -> _Store | None:
        z = self.zygote()
        if z is None or not self._stores or not await z.ready() or not z.torch_distributed:
            return None
        from .._warm._forks import start_store

        try:
            sock = _listen(port)
        except OSError as exc:
            log.info("store: port %d not bound (%s); worker rank 0 hosts it", port, exc)
            return None
        with sock:
            port = sock.getsockname()[1]
            got = await start_store(z, sock.fileno(), host, port, STORE_TIMEOUT)
        return None if got is None else _Store(got[0], got[1], port)

    async def assignment(self, a: GroupAssignment) -> GroupAssignment:
        """``a``, with a fresh store of the agent's own where worker rank 0 would host one."""
        if a.use_agent_store or a.group_world_size != 1:
            return a
        store, self._next = self._next, None
        if store is not None and (not self._auto_port() or not store.handle.alive):
            self._stopping.append(store)  # not usable: the port is fixed, or it died
            store = None
        if store is None:
            await self._reap(wait=True)  # a fixed port is free again once they are gone
            store = await self._start_store(a.master_addr, a.master_port)
        if store is None:
            return a
        self._store = store
        return dataclasses.replace(a, master_port=store.port, use_agent_store=True)

    def started(self, master_addr: str) -> None:
        """The attempt's workers all run: start the next store, then the later imports.

        Returns at once; the work runs in a task that :meth:`attempt_ended` awaits.
        """
        if self.preload is not None:
            self._task = asyncio.ensure_future(self._prepare(master_addr))

    async def _prepare(self, master_addr: str) -> None:
        z = self.zygote()
        if z is None:
            return
        if self._store is not None and self._next is None and self._auto_port():
            self._next = await self._start_store(master_addr, 0)
        await z.import_later()

    async def attempt_ended(self) -> None:
        """Stop the attempt's store (its keys go with it)."""
        task, self._task = self._task, None
        if task is not None:
            import anyio

            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
        store, self._store = self._store, None
        if store is None:
            return
        if not store.handle.alive:
            self._stores = False
            log.warning(
                "the attempt's store (pid %d) ended early (exit status %s); later attempts "
                "let worker rank 0 host it",
                store.handle.pid,
                store.handle.returncode,
            )
        self._stopping.append(store)
        await self._reap(wait=not self._auto_port())

    async def aclose(self) -> None:
        """Stop every store (the run is over)."""
        await self.attempt_ended()
        for store in (self._store, self._next):
            if store is not None:
                self._stopping.append(store)
        self._store = self._next = None
        await self._reap(wait=True)

    async def _reap(self, *, wait: bool) -> None:
        """Stop the stores of :attr:`_stopping`; with ``wait``, until they are gone."""
        import anyio

        for store in self._stopping:
            if store.stop >= 0:
                os.close(store.stop)  # EOF: the store exits
                store.stop = -1
        if not wait:
            for store in [s for s in self._stopping if not s.handle.alive]:
                store.handle.release()
                self._stopping.remove(store)
            return
        stopping, self._stopping = self._stopping, []
        with anyio.CancelScope(shield=True):
            for store in stopping:
                with anyio.move_on_after(STORE_STOP_GRACE) as scope:
                    await store.handle.exited.wait()
                if scope.cancelled_caught:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(store.handle.pid, signal.SIGKILL)
                    await store.handle.exited.wait()
                store.handle.release()
