"""Process launching (private).

The small interface the contexts use is :class:`._handle.WorkerHandle` - one
running worker: ``pid``, ``returncode`` (``None`` while alive), an ``exited``
event set the moment the exit is known, and ``signal_tree()``. Binary workers
(``_binary``) are asyncio subprocesses; function workers (``_function``) are
multiprocessing children. Neither waits on pipe EOF to notice an exit.

This ``__init__`` imports nothing: ``_child`` runs inside every function
worker and must stay cheap to import. ``_workers`` never imports ``_logs``.
"""

from __future__ import annotations

__all__ = ["long_lived_helpers"]


def long_lived_helpers() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` that this process keeps until it exits, by design: the
    guardian process and its pipe, the lifeline pipe, the zygotes (warm
    start) and their sockets. Only those already made in this process (a
    forked child has none of its parent's); makes nothing.
    """
    from .._warm._registry import zygote_helpers
    from ._guardian import current_guardian
    from ._lifeline import current_lifeline_fds

    pids, fds = zygote_helpers()
    fds |= set(current_lifeline_fds() or ())
    guard = current_guardian()
    if guard is not None:
        pids.add(guard.pid)
        fds.add(guard.fd)
    return pids, fds
