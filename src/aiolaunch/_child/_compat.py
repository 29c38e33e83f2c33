"""The CPython internals a worker relies on, each behind one function.

The worker side's ``_compat`` (the supervisor's is ``aiolaunch._compat``).

A forked child resets asyncio's running loop (before 3.12), runs the first
steps of the interpreter's exit itself, and lists the ``weakref.finalize``
objects that exit would run; a function worker's fds travel through
multiprocessing's ``DupFd`` while it is spawned. Each access is here, with a
test in ``tests/test_compat.py``, so that a CPython change breaks one small
function. Standard library only, like everything in this folder.

Every function was checked on CPython 3.10, 3.11, 3.12 and 3.13.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["clear_running_loop", "dup_fd_for_child", "exit_finalizers", "exit_steps"]


def dup_fd_for_child(fd: int) -> Any:
    """What to pickle so that the process being spawned receives a copy of
    ``fd``: the spawning ``Popen``'s ``DupFd`` (an inherited fd under fork, a
    passed one under forkserver, a kept-open one under spawn). Only callable
    while a process is being spawned (from ``__reduce__``); unpickle the result
    with its ``detach()``.

    :raises RuntimeError: no process is being spawned in this thread.
    """
    from multiprocessing import context

    popen = context.get_spawning_popen()
    if popen is None:
        raise RuntimeError("a file descriptor can only be pickled while spawning a process")
    return popen.DupFd(popen.duplicate_for_child(fd))


# -- asyncio -----------------------------------------------------------------


def clear_running_loop() -> None:
    """Forget the running loop this thread inherited through ``fork()``: before
    3.12 a forked child still sees its parent's running loop
    (``asyncio.events._set_running_loop(None)``)."""
    import asyncio.events

    asyncio.events._set_running_loop(None)


def exit_steps() -> None:
    """The first steps of the interpreter's exit (``Py_FinalizeEx``), run now.

    Join the non-daemon threads (``threading._shutdown``), then run the
    ``atexit`` callbacks (``atexit._run_exitfuncs``, which empties the list:
    the interpreter would not run them twice). For a worker forked from the
    zygote that ends without tearing the zygote's modules down.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    import atexit

    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()


def exit_finalizers() -> list[Any]:
    """The live ``weakref.finalize`` objects that would run at exit (``finalize._registry``)."""
    import weakref

    registry = getattr(weakref.finalize, "_registry", {})
    return [f for f in registry if f.atexit]
