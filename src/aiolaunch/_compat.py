"""Every use of CPython internals and version differences, each behind one function.

aiolaunch relies on a few private details of :mod:`asyncio` (a task's
pending cancellations before 3.11; its signal internals are
``_signals/_compat.py``'s) and of :mod:`multiprocessing` (a process's
``_popen``, the ``_children`` registry, the spawn preparation data, the
resource tracker's and forkserver's pid and fd), and ``os.environ``'s encoded
mapping. What a worker needs of them is in ``_child/_compat.py``. Keeping
each access here means a CPython change breaks one small function with a
test (``tests/test_compat.py``), not the supervisor;
where it can, a function degrades to "not found" rather than raising when the
detail is missing.

Every function was checked on CPython 3.10, 3.11, 3.12 and 3.13.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterator
    from multiprocessing.process import BaseProcess

__all__ = [
    "environ_data",
    "forget_child",
    "multiprocessing_helpers",
    "process_popen",
    "spawn_without_main",
    "task_cancelling",
    "task_uncancel",
]


def task_cancelling(task: asyncio.Task[Any] | None) -> int:
    """Pending cancellation requests of ``task`` (``Task.cancelling()``; 0 before 3.11)."""
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if callable(cancelling) else 0


def task_uncancel(task: asyncio.Task[Any] | None) -> None:
    """Withdraw one cancellation request of ``task`` that was handled (3.11+; no-op before).

    Needed after catching a ``CancelledError`` to go on with cleanup: anyio's
    cancel scopes read ``Task.cancelling()`` to tell their own cancellations
    from outside ones.
    """
    uncancel = getattr(task, "uncancel", None)
    if callable(uncancel):
        uncancel()


# -- os ----------------------------------------------------------------------


def environ_data() -> dict[Any, Any] | None:
    """The encoded mapping behind ``os.environ`` (``os.environ._data``, a dict
    of bytes -> bytes on POSIX, updated by every change made through
    ``os.environ``), or ``None`` where it is missing (checked on 3.10-3.13).

    Comparing it to an earlier copy tells, in one C-level dict comparison,
    whether the environment changed - without decoding every variable.
    """
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else None


# -- multiprocessing ---------------------------------------------------------


def process_popen(process: BaseProcess) -> Any:
    """The ``Popen`` object of a started ``multiprocessing`` process
    (``Process._popen``): its ``poll()`` reaps the process and returns the exit
    code without blocking, or ``None`` while it runs."""
    return process._popen  # type: ignore[attr-defined]


def forget_child(process: BaseProcess) -> None:
    """Take a started process out of ``multiprocessing.process._children``:
    multiprocessing then neither reaps it in its ``_cleanup()`` nor joins it at
    interpreter exit - its owner reaps it."""
    import multiprocessing.process

    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.discard(process)


def multiprocessing_helpers() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` of ``multiprocessing``'s per-interpreter helpers that
    are running now: the resource tracker and the forkserver. Imports nothing
    (a helper that was never imported was never started)."""
    pids: set[int] = set()
    fds: set[int] = set()
    tracker = getattr(
        sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None
    )
    forkserver = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    for obj, pid_attr, fd_attr in (
        (tracker, "_pid", "_fd"),
        (forkserver, "_forkserver_pid", "_forkserver_alive_fd"),
    ):
        pid, fd = getattr(obj, pid_attr, None), getattr(obj, fd_attr, None)
        if isinstance(pid, int):
            pids.add(pid)
        if isinstance(fd, int):
            fds.add(fd)
    return pids, fds


_prep_state = threading.local()
_prep_lock = threading.Lock()


def _install_prep_filter() -> None:
    # Installed once and left in place: a wrapper that filters only while the
    # calling thread is inside spawn_without_main(). Swapping the module
    # global for the duration of a spawn instead would also strip __main__
    # from a spawn that another thread (a user's ProcessPoolExecutor) makes
    # at the same moment, whose children then cannot unpickle its functions.
    import multiprocessing.spawn

    with _prep_lock:
        original = multiprocessing.spawn.get_preparation_data
        if getattr(original, "_aiolaunch_filter", False):
            return

        @functools.wraps(original)
        def get_preparation_data(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            if getattr(_prep_state, "active", 0):
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        get_preparation_data._aiolaunch_filter = True  # type: ignore[attr-defined]
        multiprocessing.spawn.get_preparation_data = get_preparation_data


@contextlib.contextmanager
def spawn_without_main() -> Iterator[None]:
    """Processes this thread spawns meanwhile (``spawn``/``forkserver``) do not
    re-import the parent's ``__main__`` (slow: a training script imports torch;
    aiolaunch's entrypoints travel by value). Spawns of other threads at the
    same moment are unaffected. Re-entrant."""
    _install_prep_filter()
    depth = getattr(_prep_state, "active", 0)
    _prep_state.active = depth + 1
    try:
        yield
    finally:
        _prep_state.active = depth
