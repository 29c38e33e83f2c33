"""The agent's warm start: its zygote, and a fresh store for every attempt.

With ``preload`` the agent's Python workers are forked from one zygote
(``_workers/_warm.py``), kept across attempts: a restart forks workers that
already imported torch. On one node (the static rendezvous), the agent also
hosts each attempt's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``, as
torchrun's agent does), but unlike torchrun's it is a new store for every
attempt - no key of a failed attempt (gloo's peer addresses) is read by the
next one - and its listening socket is bound by the agent *before* any worker
starts: a worker's connect never meets a closed port, so torch's connect
retry (and its back-off, 0.25 s and more) never runs. The store itself is a
process forked from the zygote (torch is imported there), started before the
workers and stopped when the attempt ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING

from ._env import shared_env

if TYPE_CHECKING:
    from .._workers._forks import ZygoteWorker
    from .._workers._preload import Preload
    from .._workers._warm import Zygote
    from ._env import GroupAssignment

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


class WarmStart:
    """One agent's zygote (``preload``) and the store of its current attempt."""

    def __init__(self, preload: Preload | None, local_world_size: int) -> None:
        self.preload = preload
        self._nproc = local_world_size
        self._store: tuple[ZygoteWorker, int] | None = None
        self._stores = True  # off after a store failed

    @property
    def names(self) -> list[str] | None:
        """``start_processes(preload=...)`` for the attempts (the same zygote)."""
        return None if self.preload is None else list(self.preload.now)

    def zygote(self) -> Zygote | None:
        """The zygote the agent's workers fork from (the one ``start_processes`` finds)."""
        if self.preload is None:
            return None
        from .._workers._warm import zygote_for

        return zygote_for(self.preload, shared_env(self._nproc, os.environ))

    async def assignment(self, a: GroupAssignment) -> GroupAssignment:
        """``a``, with a fresh store of the agent's own where the workers' rank 0 would host one."""
        if a.use_agent_store or a.group_world_size != 1 or not self._stores:
            return a
        z = self.zygote()
        if z is None or not await z.ready() or not z.torch_distributed:
            return a
        from .._workers._forks import start_store

        try:
            sock = _listen(a.master_port)
        except OSError as exc:
            log.info("store: port %d not bound (%s); rank 0 hosts it", a.master_port, exc)
            return a
        with sock:
            got = await start_store(z, sock.fileno(), a.master_addr, a.master_port, STORE_TIMEOUT)
        if got is None:
            return a
        self._store = got
        return dataclasses.replace(a, use_agent_store=True)

    async def started(self) -> None:
        """The attempt's workers all run: the zygote may import its later modules now."""
        z = self.zygote() if self.preload is not None and self.preload.later else None
        if z is not None:
            await z.import_later()

    async def attempt_ended(self) -> None:
        """Stop the attempt's store (its keys go with it)."""
        got, self._store = self._store, None
        if got is None:
            return
        import anyio

        handle, stop = got
        died_early = not handle.alive
        os.close(stop)
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(STORE_STOP_GRACE) as scope:
                await handle.exited.wait()
            if scope.cancelled_caught:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(handle.pid, signal.SIGKILL)
                await handle.exited.wait()
        handle.release()
        if died_early:
            self._stores = False
            log.warning(
                "the attempt's store (pid %d) ended early (exit status %s); later attempts "
                "let worker rank 0 host it",
                handle.pid,
                handle.returncode,
            )
