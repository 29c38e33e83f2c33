"""Binary workers: asyncio subprocesses in their own process group."""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import TYPE_CHECKING

from ._handle import WorkerHandle
from ._proc import binary_preexec

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
    kind = "binary"

    def __init__(self, local_rank: int) -> None:
        super().__init__(local_rank)
        self.transport: asyncio.SubprocessTransport | None = None

    def release(self) -> None:
        if self.transport is not None and self.returncode is not None:
            self.transport.close()
            self.transport = None


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
    transport, _ = await loop.subprocess_exec(
        lambda: _ExitProtocol(handle),
        *argv,
        stdin=None,
        stdout=stdout,
        stderr=stderr,
        env=env,
        close_fds=True,
        preexec_fn=binary_preexec(os.getpid()),
    )
    handle.transport = transport
    handle.pid = transport.get_pid()
    return handle


DEVNULL = subprocess.DEVNULL
