"""Binary workers: asyncio subprocesses in their own process group.

No ``preexec_fn``: that would force CPython's slow ``fork()`` path (and run
Python in the child), costing milliseconds per worker in a large supervisor.
Process groups come from ``process_group=0`` (``start_new_session`` before
Python 3.11) and supervisor-death protection from the guardian
(``_guardian``), so spawning stays on the ``vfork`` path.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

from ._guardian import GUARDIAN_ENV, guardian
from ._handle import WorkerHandle

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["BinaryWorker", "spawn_binary"]


class _ExitProtocol(asyncio.SubprocessProtocol):
    # The transport owns no pipes (we pass our own fds), so process_exited()
    # fires on the exit itself: asyncio's Process.wait() would instead wait
    # for every pipe to close (CPython gh-119710).
    def __init__(self, handle: BinaryWorker) -> None:
        self.handle = handle
        self.transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def process_exited(self) -> None:
        assert self.transport is not None
        rc = self.transport.get_returncode()
        self.handle._set_exited(rc if rc is not None else -1)


class BinaryWorker(WorkerHandle):
    def __init__(self, local_rank: int) -> None:
        super().__init__(local_rank)
        self.transport: asyncio.SubprocessTransport | None = None

    def release(self) -> None:
        if self.transport is not None and self.returncode is not None:
            self.transport.close()
            self.transport = None
            g = guardian()
            if g is not None:
                g.unwatch(self.pid)


async def spawn_binary(
    local_rank: int,
    argv: Sequence[str],
    env: dict[str, str],
    stdout: int | None,
    stderr: int | None,
) -> BinaryWorker:
    """Start one binary worker; ``stdout``/``stderr`` are fds, DEVNULL or None (inherit)."""
    loop = asyncio.get_running_loop()
    handle = BinaryWorker(local_rank)
    group: dict[str, Any] = (
        {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    )
    g = guardian()
    if g is not None:
        # Set before the fork: a worker the supervisor dies too early to
        # register (or its setsid'd descendant) is still found by the guardian.
        env = {**env, GUARDIAN_ENV: g.token}
    transport, _ = await loop.subprocess_exec(
        lambda: _ExitProtocol(handle),
        *argv,
        stdin=None,
        stdout=stdout,
        stderr=stderr,
        env=env,
        close_fds=True,
        **group,
    )
    handle.transport = transport
    handle.pid = transport.get_pid()
    if g is not None:
        g.watch(handle.pid)
    return handle
