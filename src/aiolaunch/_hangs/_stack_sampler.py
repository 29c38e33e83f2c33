"""Periodic stack samples: the dump signal at a low rate, cheap enough for 64 ranks.

The same signals and files as :func:`aiolaunch._hangs._stacks.dump_stacks` (which
serves explicit dumps: ``ctx.dump_stacks()``, ``aiolaunch stacks``, a
stall), minus what a sample does not need: no ``stacks-<n>.txt`` files, no
py-spy for workers that did not register (they keep the CPU rule), and no
per-sample setup. A rank's registration (its marker and start time) is
checked once per pid; ``/proc/<pid>/status`` (for ``SigCgt``: a worker that
exec'd lost its handler, and the signal would kill it) and the dump file stay
open and are re-read with ``pread``. A thread dump is complete once it ends
with the main thread's outermost frame (or has not grown for 0.2 s); an
asyncio rank idle in its loop gets the task signal too, as in a dump.

Measured at 64 idle bootstrap workers, one sample a second: see
``benchmarks/bench_forensics.py`` (``sampling``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING

from .._workers._proc import ProcFile, parse_sigmasks
from ._dump_text import idle_loop_text
from ._stacks import (
    DUMP_SIGNAL,
    TASKS_SIGNAL,
    collect_dumps,
    registered,
    tasks_done,
    thread_dump_done,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["StackSampler"]


class _Target:
    """One sampled worker: its ``status`` (held open) and its dump file."""

    __slots__ = ("dump_fd", "pid", "status")

    def __init__(self, pid: int, status: ProcFile, dump_fd: int) -> None:
        self.pid, self.status, self.dump_fd = pid, status, dump_fd

    def handles(self, sig: int) -> bool:
        raw = self.status.read()
        return raw is not None and parse_sigmasks(raw, sig).get(b"SigCgt", False)

    def size(self) -> int:
        try:
            return os.fstat(self.dump_fd).st_size
        except OSError:
            return -1

    def read(self, offset: int, size: int) -> str:
        try:
            return os.pread(self.dump_fd, size - offset, offset).decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        self.status.close()
        with contextlib.suppress(OSError):
            os.close(self.dump_fd)


class StackSampler:
    """Stack samples of one group's workers (see the module docstring)."""

    def __init__(self, directory: str, lock: asyncio.Lock | None = None) -> None:
        self.directory = directory
        # Shared with the explicit dumps (StackDumper): a worker appends every
        # answer to one file, read from an offset - one round at a time.
        self._lock = lock or asyncio.Lock()
        self._targets: dict[int, _Target] = {}  # by pid
        #: bytes each rank wrote into its dump file at the last sample (the
        #: caller discounts them from the rank's output)
        self.wrote: dict[int, int] = {}

    def close(self) -> None:
        """Close every held fd. Idempotent."""
        for t in self._targets.values():
            t.close()
        self._targets.clear()

    def forget(self, pid: int) -> None:
        """A worker exited: close its fds."""
        t = self._targets.pop(pid, None)
        if t is not None:
            t.close()

    def _target(self, pid: int) -> _Target | None:
        t = self._targets.get(pid)
        if t is not None:
            return t
        if registered(self.directory, pid) is not None:
            # Not registered (a binary; or its bootstrap is still starting):
            # never signalled; its marker is looked for again next time (one
            # failed open).
            return None
        status = ProcFile(pid, "status")
        if status.read() is None:  # gone already
            status.close()
            return None
        try:
            path = os.path.join(self.directory, f"{pid}.txt")
            dump_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            status.close()
            return None
        t = self._targets[pid] = _Target(pid, status, dump_fd)
        return t

    async def sample(self, pids: Mapping[int, int], timeout: float) -> dict[int, str]:
        """``{rank: dump text}`` of the registered workers among ``pids``
        (``{rank: pid}``); ranks without a sample are left out."""
        async with self._lock:
            return await self._sample(pids, timeout)

    async def _sample(self, pids: Mapping[int, int], timeout: float) -> dict[int, str]:
        targets = {}
        for rank, pid in pids.items():
            t = self._target(pid)
            if t is not None and t.handles(DUMP_SIGNAL):
                targets[rank] = t
        self.wrote = {}
        deadline = time.monotonic() + timeout
        texts = await collect_dumps(targets, DUMP_SIGNAL, deadline, thread_dump_done, self.wrote)
        idle = {
            r: targets[r]
            for r, text in texts.items()
            if idle_loop_text(text) and targets[r].handles(TASKS_SIGNAL)
        }
        if idle:
            bound = min(deadline, time.monotonic() + 1.0)
            tasks = await collect_dumps(idle, TASKS_SIGNAL, bound, tasks_done, self.wrote)
            for rank, text in tasks.items():
                if tasks_done(text):
                    texts[rank] += text
        return {r: t for r, t in texts.items() if t}
