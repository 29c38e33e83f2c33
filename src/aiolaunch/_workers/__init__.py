"""Process launching (private).

The small interface the contexts use is :class:`._handle.WorkerHandle` - one
running worker: ``pid``, ``returncode`` (``None`` while alive), an ``exited``
event set the moment the exit is known, and ``signal_tree()``. Binary workers
(``_binary``) are asyncio subprocesses; function workers (``_function``) are
multiprocessing children. Neither waits on pipe EOF to notice an exit.

``_workers`` never imports ``_logs`` or the wings built on it (warm start
registers its long-lived zygotes here instead: :func:`keep_for_life`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["keep_for_life", "long_lived_helpers"]

_KEPT: list[Callable[[], tuple[set[int], set[int]]]] = []


def keep_for_life(helpers: Callable[[], tuple[set[int], set[int]]]) -> None:
    """Count ``helpers()``'s ``(pids, fds)`` among what this process keeps for its
    lifetime (the zygotes of warm start register theirs where they are made)."""
    if helpers not in _KEPT:
        _KEPT.append(helpers)


def long_lived_helpers() -> tuple[set[int], set[int]]:
    """``(pids, fds)`` that this process keeps until it exits, by design: the
    guardian process and its pipe, the lifeline pipe, and what was registered
    with :func:`keep_for_life` (the zygotes and their sockets). Only those
    already made in this process (a forked child has none of its parent's);
    makes nothing.
    """
    from ._guardian import current_guardian
    from ._lifeline import current_lifeline_fds

    pids: set[int] = set()
    fds = set(current_lifeline_fds() or ())
    for helpers in _KEPT:
        more_pids, more_fds = helpers()
        pids |= more_pids
        fds |= more_fds
    guard = current_guardian()
    if guard is not None:
        pids.add(guard.pid)
        fds.add(guard.fd)
    return pids, fds
