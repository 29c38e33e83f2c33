"""The worker side of stack dumps: install the dump handler (see :mod:`._stacks`).

Imported by every Python worker before its program starts (the function-worker
bootstrap and ``python -m aiolaunch._bootstrap``), so it imports only ``os``
and ``signal``: asyncio alone would add ~50 ms to each worker's start.
"""

from __future__ import annotations

import os
import signal

__all__ = ["DUMP_SIGNAL", "STACKS_DIR_ENV", "register", "start_time"]

#: The signal workers register for stack dumps (SIGRTMIN+5 on Linux).
DUMP_SIGNAL: int = getattr(signal, "SIGRTMIN", 34) + 5
#: Environment variable naming the folder of dumps and markers.
STACKS_DIR_ENV = "AIOLAUNCH_STACKS_DIR"

_keep: list[object] = []  # the dump file: faulthandler only borrows its fd


def start_time(pid: int) -> str | None:
    """The process start time in clock ticks since boot: with the pid, one process."""
    from ._workers._proc import read_stat

    stat = read_stat(pid)
    return None if stat is None else str(stat.starttime)


def register(directory: str | None = None) -> bool:
    """Make this process dump its stacks on :data:`DUMP_SIGNAL`; ``False`` if it can't.

    Called in the worker. ``directory`` defaults to ``$AIOLAUNCH_STACKS_DIR``;
    without either nothing happens. Never raises: a worker must start even
    where dumps are impossible.
    """
    directory = directory or os.environ.get(STACKS_DIR_ENV)
    if not directory:
        return False
    try:
        import faulthandler

        pid = os.getpid()
        path = os.path.join(directory, f"{pid}.txt")
        try:
            out = open(path, "ab", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            # The supervisor makes the folder as start_processes returns; a
            # worker can get here first.
            os.makedirs(directory, mode=0o700, exist_ok=True)
            out = open(path, "ab", buffering=0)  # noqa: SIM115
        faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)
        _keep[:] = [out]
        marker = os.path.join(directory, f"{pid}.ok")
        with open(marker + ".tmp", "w") as f:
            f.write(start_time(pid) or "")
        os.replace(marker + ".tmp", marker)  # atomic: never a half-written marker
    except (OSError, ValueError, RuntimeError, AttributeError):
        return False
    return True
